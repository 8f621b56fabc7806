#include "kvferry/cache_spec.h"

#include <algorithm>
#include <cctype>
#include <optional>
#include <string>
#include <utility>

#include "common/checked_math.h"
#include "common/digest.h"
#include "layout/part_label.h"

namespace kvferry {
namespace {

std::string Lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

bool IsSplitAcrossTp(CacheKind kind) {
  return kind == CacheKind::kMha || kind == CacheKind::kState;
}

std::string JoinFields(const std::vector<std::int64_t>& fields) {
  std::string out;
  for (std::size_t i = 0; i < fields.size(); ++i) {
    if (i > 0) out += "+";
    out += std::to_string(fields[i]);
  }
  return out;
}

Status ValidateFields(int layer, const LayerSpec& spec) {
  const std::string label = "layer " + std::to_string(layer);
  if (spec.kind != CacheKind::kMlaFused) {
    if (spec.fields.empty()) return Status::Ok();
    return Status::InvalidArgument(label + " is " + CacheKindName(spec.kind) + " with fields [" +
                                   JoinFields(spec.fields) +
                                   "]; only mla_fused layers pack fields in one row");
  }
  std::int64_t sum = 0;
  bool positive = true;
  for (std::int64_t f : spec.fields) {
    positive = positive && f > 0 && f <= spec.parts.front().head_dim;
    if (positive) sum += f;
  }
  if (spec.fields.size() != 2 || !positive || sum != spec.parts.front().head_dim) {
    return Status::InvalidArgument(
        label +
        " is mla_fused and needs two positive fields (kv_lora_rank, qk_rope_head_dim) "
        "summing to its part's head_dim " +
        std::to_string(spec.parts.front().head_dim) + ", found [" + JoinFields(spec.fields) + "]");
  }
  return Status::Ok();
}

Status ValidateLayerAgainstFirst(int index, const LayerSpec& layer, const LayerSpec& first) {
  if (layer.kind != first.kind) {
    return Status::InvalidArgument(
        "layer " + std::to_string(index) + " is " + CacheKindName(layer.kind) + " but layer 0 is " +
        CacheKindName(first.kind) + "; kvferry needs every layer to share one cache shape");
  }
  if (layer.fields != first.fields) {
    return Status::InvalidArgument("layer " + std::to_string(index) + " has fields [" +
                                   JoinFields(layer.fields) + "] but layer 0 has [" +
                                   JoinFields(first.fields) +
                                   "]; kvferry needs every layer to share one cache shape");
  }
  for (std::size_t p = 0; p < layer.parts.size(); ++p) {
    const PartSpec& a = layer.parts[p];
    const PartSpec& b = first.parts[p];
    auto mismatch = [&](const char* field, const std::string& found, const std::string& want) {
      return Status::InvalidArgument(PartLabel(index, static_cast<int>(p), a) + " has " + field +
                                     " " + found + " but layer 0 has " + want +
                                     "; kvferry needs every layer to share one cache shape");
    };
    if (a.name != b.name) return mismatch("name", "'" + a.name + "'", "'" + b.name + "'");
    if (a.num_heads != b.num_heads) {
      return mismatch("num_heads", std::to_string(a.num_heads), std::to_string(b.num_heads));
    }
    if (a.head_dim != b.head_dim) {
      return mismatch("head_dim", std::to_string(a.head_dim), std::to_string(b.head_dim));
    }
    if (a.dtype != b.dtype) {
      return mismatch("dtype", a.dtype ? DTypeName(*a.dtype) : "the cache's",
                      b.dtype ? DTypeName(*b.dtype) : "the cache's");
    }
  }
  return Status::Ok();
}

Status ValidateTpSplit(CacheKind kind, const PartSpec& part, int tp_size) {
  const std::int64_t heads = part.num_heads;
  if (kind == CacheKind::kState && heads % tp_size != 0) {
    return Status::InvalidArgument("state part '" + part.name + "' has " + std::to_string(heads) +
                                   " along its TP-split axis, which TP size " +
                                   std::to_string(tp_size) +
                                   " does not divide (a state is split across TP ranks, never "
                                   "replicated)");
  }
  const bool ok = tp_size <= heads ? heads % tp_size == 0 : tp_size % heads == 0;
  if (!ok) {
    return Status::InvalidArgument("part '" + part.name + "' has " + std::to_string(heads) +
                                   " KV heads, which cannot be split across TP size " +
                                   std::to_string(tp_size) + ": one of them must divide the other");
  }
  return Status::Ok();
}

CacheSpecOptions Uniform(int num_layers, LayerSpec layer, std::int64_t num_blocks,
                         std::int64_t tokens_per_block, DType dtype, BlockLayout layout,
                         int tp_size, int tp_rank) {
  CacheSpecOptions o;
  o.layers.assign(static_cast<std::size_t>(std::max(num_layers, 0)), layer);
  o.num_blocks = num_blocks;
  o.tokens_per_block = tokens_per_block;
  o.dtype = dtype;
  o.layout = layout;
  o.tp_size = tp_size;
  o.tp_rank = tp_rank;
  return o;
}

}  // namespace

std::int64_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kInt8:
      return 1;
    case DType::kInt64:
      return 8;
  }
  return 1;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return "fp16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat32:
      return "fp32";
    case DType::kInt8:
      return "int8";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
  }
  return "unknown";
}

Result<DType> ParseDType(std::string_view name) {
  std::string n = Lower(name);
  if (n.rfind("torch.", 0) == 0) n = n.substr(6);
  if (n == "fp16" || n == "float16" || n == "half") return DType::kFloat16;
  if (n == "bf16" || n == "bfloat16") return DType::kBFloat16;
  if (n == "fp32" || n == "float32" || n == "float") return DType::kFloat32;
  if (n == "int8") return DType::kInt8;
  if (n == "int32") return DType::kInt32;
  if (n == "int64") return DType::kInt64;
  return Status::InvalidArgument("unknown dtype '" + std::string(name) +
                                 "': expected one of fp16, bf16, fp32, int8, int32, int64");
}

const char* CacheKindName(CacheKind kind) {
  switch (kind) {
    case CacheKind::kMha:
      return "mha";
    case CacheKind::kMla:
      return "mla";
    case CacheKind::kSparseMla:
      return "sparse_mla";
    case CacheKind::kMlaFused:
      return "mla_fused";
    case CacheKind::kState:
      return "state";
  }
  return "unknown";
}

Result<CacheKind> ParseCacheKind(std::string_view name) {
  const std::string n = Lower(name);
  if (n == "mha" || n == "gqa") return CacheKind::kMha;
  if (n == "mla") return CacheKind::kMla;
  if (n == "sparse_mla" || n == "sfa") return CacheKind::kSparseMla;
  if (n == "mla_fused") return CacheKind::kMlaFused;
  if (n == "state" || n == "mamba") return CacheKind::kState;
  return Status::InvalidArgument("unknown cache kind '" + std::string(name) +
                                 "': expected mha, mla, sparse_mla, mla_fused or state");
}

std::size_t CacheKindParts(CacheKind kind) {
  switch (kind) {
    case CacheKind::kSparseMla:
      return 3;
    case CacheKind::kMlaFused:
      return 1;
    case CacheKind::kMha:
    case CacheKind::kMla:
      return 2;
    case CacheKind::kState:
      return 0;
  }
  return 2;
}

const char* BlockLayoutName(BlockLayout layout) {
  return layout == BlockLayout::kHeadMajor ? "head_major" : "token_major";
}

Result<BlockLayout> ParseBlockLayout(std::string_view name) {
  const std::string n = Lower(name);
  if (n == "token_major") return BlockLayout::kTokenMajor;
  if (n == "head_major") return BlockLayout::kHeadMajor;
  return Status::InvalidArgument("unknown block layout '" + std::string(name) +
                                 "': expected token_major or head_major");
}

HeadRange SplitHeads(std::int64_t model_heads, int tp_size, int rank) {
  if (tp_size <= model_heads) {
    const std::int64_t per_rank = model_heads / tp_size;
    return {rank * per_rank, per_rank};
  }
  const std::int64_t replicas = tp_size / model_heads;
  return {rank / replicas, 1};
}

Result<CacheSpec> CacheSpec::Create(CacheSpecOptions options) {
  const auto& layers = options.layers;
  if (layers.empty()) {
    return Status::InvalidArgument("cache spec has no layers: expected at least one");
  }
  if (options.num_blocks <= 0) {
    return Status::InvalidArgument("num_blocks must be positive, found " +
                                   std::to_string(options.num_blocks));
  }
  if (options.tokens_per_block <= 0) {
    return Status::InvalidArgument("tokens_per_block must be positive, found " +
                                   std::to_string(options.tokens_per_block));
  }
  if (options.tp_size <= 0 || options.tp_rank < 0 || options.tp_rank >= options.tp_size) {
    return Status::InvalidArgument("TP rank " + std::to_string(options.tp_rank) + " of size " +
                                   std::to_string(options.tp_size) +
                                   " is invalid: expected size >= 1 and 0 <= rank < size");
  }
  if (options.blocks_per_id < 1 || options.blocks_per_id > kMaxBlocksPerId ||
      options.num_blocks % options.blocks_per_id != 0) {
    return Status::InvalidArgument(
        "blocks_per_id " + std::to_string(options.blocks_per_id) + " with " +
        std::to_string(options.num_blocks) + " blocks is invalid: expected 1 to " +
        std::to_string(kMaxBlocksPerId) + " blocks per engine block id, dividing num_blocks");
  }
  if (options.first_layer < 0 ||
      options.first_layer > (1 << 20) - static_cast<std::int64_t>(layers.size())) {
    return Status::InvalidArgument("first_layer " + std::to_string(options.first_layer) +
                                   " is invalid: expected the model-wide index of this "
                                   "pipeline stage's first layer, 0 to 2^20 less its layers");
  }
  if (options.sliding_window < 0 || options.sliding_window > (std::int64_t{1} << 40)) {
    return Status::InvalidArgument("sliding_window " + std::to_string(options.sliding_window) +
                                   " is invalid: expected the window in tokens (0 for full "
                                   "attention), at most 2^40");
  }
  if (options.model_layers != 0 &&
      (options.model_layers < options.first_layer + static_cast<std::int64_t>(layers.size()) ||
       options.model_layers > (1 << 20))) {
    return Status::InvalidArgument(
        "model_layers " + std::to_string(options.model_layers) + " with layers [" +
        std::to_string(options.first_layer) + ", " +
        std::to_string(options.first_layer + static_cast<std::int64_t>(layers.size())) +
        ") is invalid: expected the model's layer count (all pipeline stages), at least the end "
        "of this cache's layers and at most 2^20, or 0");
  }
  const LayerSpec& first = layers.front();
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const LayerSpec& layer = layers[l];
    const int li = static_cast<int>(l);
    const bool state = layer.kind == CacheKind::kState;
    if (state && (layer.parts.empty() || layer.parts.size() > kMaxStateParts)) {
      return Status::InvalidArgument(
          "layer " + std::to_string(l) + " is a state layer and needs 1 to " +
          std::to_string(kMaxStateParts) + " parts, found " + std::to_string(layer.parts.size()));
    }
    if (!state && layer.parts.size() != CacheKindParts(layer.kind)) {
      return Status::InvalidArgument("layer " + std::to_string(l) + " is " +
                                     CacheKindName(layer.kind) + " and needs " +
                                     std::to_string(CacheKindParts(layer.kind)) + " parts, found " +
                                     std::to_string(layer.parts.size()));
    }
    for (std::size_t p = 0; p < layer.parts.size(); ++p) {
      const PartSpec& part = layer.parts[p];
      if (part.num_heads <= 0 || part.head_dim <= 0) {
        return Status::InvalidArgument(PartLabel(li, static_cast<int>(p), part) +
                                       " needs positive num_heads and head_dim, found " +
                                       std::to_string(part.num_heads) + " and " +
                                       std::to_string(part.head_dim));
      }
      if (part.dtype && !state) {
        return Status::InvalidArgument(PartLabel(li, static_cast<int>(p), part) + " is " +
                                       CacheKindName(layer.kind) + " with its own dtype " +
                                       DTypeName(*part.dtype) +
                                       "; only state parts have element types of their own");
      }
    }
    KVFERRY_RETURN_IF_ERROR(ValidateFields(li, layer));
    if (l > 0) KVFERRY_RETURN_IF_ERROR(ValidateLayerAgainstFirst(li, layer, first));
  }
  if (first.kind == CacheKind::kMha && first.parts[0].num_heads != first.parts[1].num_heads) {
    return Status::InvalidArgument(
        "MHA parts K and V must have the same number of KV heads, found " +
        std::to_string(first.parts[0].num_heads) + " and " +
        std::to_string(first.parts[1].num_heads));
  }
  if (IsSplitAcrossTp(first.kind)) {
    for (const PartSpec& part : first.parts) {
      KVFERRY_RETURN_IF_ERROR(ValidateTpSplit(first.kind, part, options.tp_size));
    }
  }

  if (first.kind == CacheKind::kState && options.blocks_per_id != 1) {
    return Status::InvalidArgument(
        "a state cache has one state per block id, found blocks_per_id " +
        std::to_string(options.blocks_per_id) + "; expected 1");
  }
  if (!options.block_strides.empty() && options.block_strides.size() != first.parts.size()) {
    return Status::InvalidArgument("expected one block stride per part (" +
                                   std::to_string(first.parts.size()) + "), found " +
                                   std::to_string(options.block_strides.size()) +
                                   "; leave block_strides empty for packed parts");
  }

  CacheSpec spec(std::move(options));
  // A state block holds one row per head; an attention block one per token and head.
  const std::int64_t rows = spec.is_state() ? 1 : spec.tokens_per_block();
  std::int64_t per_layer = 0;
  for (int p = 0; p < spec.num_parts(); ++p) {
    const PartSpec& part = spec.parts()[static_cast<std::size_t>(p)];
    const std::int64_t elem = DTypeSize(spec.PartDType(p));
    auto overflow = [&](const char* what) {
      return Status::InvalidArgument(std::string(what) + " of part '" + part.name +
                                     "' overflows 64 bits: " + spec.CanonicalText() +
                                     " with num_blocks " + std::to_string(spec.num_blocks()));
    };
    std::optional<std::int64_t> block = CheckedMul(rows, spec.LocalHeads(p));
    if (block) block = CheckedMul(*block, part.head_dim);
    if (block) block = CheckedMul(*block, elem);
    if (!block) return overflow("bytes per block");
    const std::int64_t stride = spec.options_.block_strides.empty()
                                    ? *block
                                    : spec.options_.block_strides[static_cast<std::size_t>(p)];
    if (stride < *block || stride % elem != 0) {
      return Status::InvalidArgument(
          "part '" + part.name + "' has block stride " + std::to_string(stride) +
          " bytes; expected at least its block of " + std::to_string(*block) +
          " bytes and a multiple of the element size " + std::to_string(elem) +
          " (blocks of one part must not overlap)");
    }
    std::optional<std::int64_t> whole = CheckedMul(*block, spec.num_blocks());
    if (!whole) return overflow("bytes per layer");
    std::optional<std::int64_t> extent = CheckedMul(stride, spec.num_blocks() - 1);
    if (extent) extent = CheckedAdd(*extent, *block);
    if (!extent) return overflow("extent");
    std::optional<std::int64_t> sum = CheckedAdd(per_layer, *whole);
    if (!sum) return overflow("bytes per layer");
    per_layer = *sum;
    spec.block_bytes_.push_back(*block);
    spec.block_strides_.push_back(stride);
    spec.part_bytes_.push_back(*extent);
  }
  std::optional<std::int64_t> total = CheckedMul(per_layer, spec.num_layers());
  if (!total) {
    return Status::InvalidArgument("total cache bytes overflow 64 bits: " + spec.CanonicalText());
  }
  spec.total_bytes_ = *total;
  return spec;
}

Result<CacheSpec> CacheSpec::Mha(int num_layers, std::int64_t kv_heads, std::int64_t head_dim,
                                 std::int64_t num_blocks, std::int64_t tokens_per_block,
                                 DType dtype, int tp_size, int tp_rank, BlockLayout layout) {
  LayerSpec layer;
  layer.kind = CacheKind::kMha;
  layer.parts = {{"k", kv_heads, head_dim}, {"v", kv_heads, head_dim}};
  return Create(Uniform(num_layers, std::move(layer), num_blocks, tokens_per_block, dtype, layout,
                        tp_size, tp_rank));
}

Result<CacheSpec> CacheSpec::Mla(int num_layers, std::int64_t latent_dim, std::int64_t rope_dim,
                                 std::int64_t num_blocks, std::int64_t tokens_per_block,
                                 DType dtype, int tp_size, int tp_rank) {
  LayerSpec layer;
  layer.kind = CacheKind::kMla;
  layer.parts = {{"latent", 1, latent_dim}, {"rope", 1, rope_dim}};
  return Create(Uniform(num_layers, std::move(layer), num_blocks, tokens_per_block, dtype,
                        BlockLayout::kTokenMajor, tp_size, tp_rank));
}

Result<CacheSpec> CacheSpec::SparseMla(int num_layers, std::int64_t latent_dim,
                                       std::int64_t rope_dim, std::int64_t indexer_dim,
                                       std::int64_t num_blocks, std::int64_t tokens_per_block,
                                       DType dtype, int tp_size, int tp_rank) {
  LayerSpec layer;
  layer.kind = CacheKind::kSparseMla;
  layer.parts = {{"latent", 1, latent_dim}, {"rope", 1, rope_dim}, {"indexer", 1, indexer_dim}};
  return Create(Uniform(num_layers, std::move(layer), num_blocks, tokens_per_block, dtype,
                        BlockLayout::kTokenMajor, tp_size, tp_rank));
}

Result<CacheSpec> CacheSpec::MlaFused(int num_layers, std::int64_t latent_dim,
                                      std::int64_t rope_dim, std::int64_t num_blocks,
                                      std::int64_t tokens_per_block, DType dtype, int tp_size,
                                      int tp_rank) {
  LayerSpec layer;
  layer.kind = CacheKind::kMlaFused;
  layer.parts = {{"latent_rope", 1, latent_dim + rope_dim}};
  layer.fields = {latent_dim, rope_dim};
  return Create(Uniform(num_layers, std::move(layer), num_blocks, tokens_per_block, dtype,
                        BlockLayout::kTokenMajor, tp_size, tp_rank));
}

std::int64_t CacheSpec::LocalHeads(int part) const {
  const PartSpec& p = parts()[static_cast<std::size_t>(part)];
  if (!IsSplitAcrossTp(kind())) return p.num_heads;
  return SplitHeads(p.num_heads, tp_size(), tp_rank()).count;
}

std::int64_t CacheSpec::FirstLocalHead(int part) const {
  const PartSpec& p = parts()[static_cast<std::size_t>(part)];
  if (!IsSplitAcrossTp(kind())) return 0;
  return SplitHeads(p.num_heads, tp_size(), tp_rank()).first;
}

std::string CacheSpec::CanonicalText() const {
  // v2: tokens per block left the hash (whole-request loads pair blocks of any sizes by token;
  // layer-wise ones check the sizes at the handshake), so a v1 peer differs in the first word.
  // v3: a pipeline stage's layer range left it too (loads read each layer from a stage holding
  // it); the model's layer count stays.
  std::string out = "kvferry-cache-v3 kind=";
  out += CacheKindName(kind());
  out += " layers=" + std::to_string(model_layers());
  out += " dtype=";
  out += DTypeName(dtype());
  out += " layout=";
  out += BlockLayoutName(layout());
  out += " parts=";
  for (std::size_t i = 0; i < parts().size(); ++i) {
    const PartSpec& p = parts()[i];
    if (i > 0) out += ",";
    out += p.name + ":" + std::to_string(p.num_heads) + "x" + std::to_string(p.head_dim);
    // Only state parts have types of their own.
    if (p.dtype) out += std::string("/") + DTypeName(*p.dtype);
  }
  // Only fused layers carry fields, so every other spec keeps the hash it always had.
  if (!fields().empty()) {
    out += " fields=";
    out += JoinFields(fields());
  }
  // Likewise only sliding-window layers name their window.
  if (sliding_window() != 0) out += " window=" + std::to_string(sliding_window());
  return out;
}

std::int64_t CacheSpec::RequiredAlignment() const {
  std::int64_t out = DTypeSize(options_.dtype);
  for (int p = 0; p < num_parts(); ++p) out = std::max(out, DTypeSize(PartDType(p)));
  return out;
}

CompatibilityHash CacheSpec::Hash() const { return Sha256(CanonicalText()); }

}  // namespace kvferry
