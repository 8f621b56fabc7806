// The wire form of a worker's KV cache groups (cache_codec.h).
#include "wire/cache_codec.h"

#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "wire/messages.h"

namespace kvferry::wire {
void PackCacheSpec(Packer& pk, const CacheSpec& spec) {
  // Optional keys are sent only when they carry something, so packed unfused caches encode as
  // they always did.
  const bool strided = !spec.options().block_strides.empty();
  const bool fused = !spec.fields().empty();
  const bool staged = spec.first_layer() != 0 || spec.options().model_layers != 0;
  const bool grouped = spec.blocks_per_id() != 1;
  const bool windowed = spec.sliding_window() != 0;
  pk.pack_map(9 + (strided ? 1 : 0) + (fused ? 1 : 0) + (staged ? 2 : 0) + (grouped ? 1 : 0) +
              (windowed ? 1 : 0));
  PackStr(pk, "kind");
  PackStr(pk, CacheKindName(spec.kind()));
  PackStr(pk, "layers");
  pk.pack_uint32(static_cast<std::uint32_t>(spec.num_layers()));
  PackStr(pk, "parts");
  pk.pack_array(static_cast<std::uint32_t>(spec.num_parts()));
  for (const PartSpec& p : spec.parts()) {
    // A state part's own element type (kind "state", which an older peer refuses by name).
    pk.pack_map(p.dtype ? 4 : 3);
    PackStr(pk, "name");
    PackStr(pk, p.name);
    PackStr(pk, "heads");
    pk.pack_int64(p.num_heads);
    PackStr(pk, "dim");
    pk.pack_int64(p.head_dim);
    if (p.dtype) {
      PackStr(pk, "dtype");
      PackStr(pk, DTypeName(*p.dtype));
    }
  }
  PackStr(pk, "num_blocks");
  pk.pack_int64(spec.num_blocks());
  PackStr(pk, "tokens_per_block");
  pk.pack_int64(spec.tokens_per_block());
  PackStr(pk, "dtype");
  PackStr(pk, DTypeName(spec.dtype()));
  PackStr(pk, "layout");
  PackStr(pk, BlockLayoutName(spec.layout()));
  PackStr(pk, "tp_size");
  pk.pack_int32(spec.tp_size());
  PackStr(pk, "tp_rank");
  pk.pack_int32(spec.tp_rank());
  if (strided) {
    PackStr(pk, "block_strides");
    PackIds(pk, spec.options().block_strides);
  }
  if (fused) {
    PackStr(pk, "fields");
    PackIds(pk, spec.fields());
  }
  if (staged) {
    PackStr(pk, "first_layer");
    pk.pack_int32(spec.first_layer());
    PackStr(pk, "model_layers");
    pk.pack_int32(spec.model_layers());
  }
  if (windowed) {
    PackStr(pk, "sliding_window");
    pk.pack_int64(spec.sliding_window());
  }
  if (grouped) {
    PackStr(pk, "blocks_per_id");
    pk.pack_int64(spec.blocks_per_id());
  }
}

Result<CacheSpec> DecodeCacheSpec(const MapView& parent, const char* key) {
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* v, parent.Require(key));
  KVFERRY_ASSIGN_OR_RETURN(MapView m, MapView::Of(*v, parent.At(key)));
  KVFERRY_ASSIGN_OR_RETURN(std::string kind_name, m.Str("kind", kMaxIdBytes));
  KVFERRY_ASSIGN_OR_RETURN(CacheKind kind, ParseCacheKind(kind_name));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t layers, m.Uint("layers", kMaxLayers));
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* parts_obj, m.Require("parts"));
  if (parts_obj->type != msgpack::type::ARRAY || parts_obj->via.array.size > 8) {
    return Status::InvalidArgument(m.At("parts") + ": expected an array of at most 8 parts");
  }
  LayerSpec layer;
  layer.kind = kind;
  KVFERRY_ASSIGN_OR_RETURN(layer.fields, OptionalInts(m, "fields", 8));
  for (std::uint32_t i = 0; i < parts_obj->via.array.size; ++i) {
    KVFERRY_ASSIGN_OR_RETURN(
        MapView pm,
        MapView::Of(parts_obj->via.array.ptr[i], m.At("parts") + "[" + std::to_string(i) + "]"));
    PartSpec part;
    KVFERRY_ASSIGN_OR_RETURN(part.name, pm.Str("name", kMaxIdBytes));
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t heads, pm.Uint("heads", kMaxI64));
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t dim, pm.Uint("dim", kMaxI64));
    part.num_heads = static_cast<std::int64_t>(heads);
    part.head_dim = static_cast<std::int64_t>(dim);
    if (pm.Find("dtype") != nullptr) {
      KVFERRY_ASSIGN_OR_RETURN(std::string part_dtype, pm.Str("dtype", kMaxIdBytes));
      KVFERRY_ASSIGN_OR_RETURN(part.dtype, ParseDType(part_dtype));
    }
    layer.parts.push_back(std::move(part));
  }
  CacheSpecOptions options;
  options.layers.assign(static_cast<std::size_t>(layers), layer);
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t blocks, m.Uint("num_blocks", kMaxI64));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t tpb, m.Uint("tokens_per_block", kMaxI64));
  options.num_blocks = static_cast<std::int64_t>(blocks);
  options.tokens_per_block = static_cast<std::int64_t>(tpb);
  KVFERRY_ASSIGN_OR_RETURN(std::string dtype, m.Str("dtype", kMaxIdBytes));
  KVFERRY_ASSIGN_OR_RETURN(options.dtype, ParseDType(dtype));
  KVFERRY_ASSIGN_OR_RETURN(std::string layout, m.Str("layout", kMaxIdBytes));
  KVFERRY_ASSIGN_OR_RETURN(options.layout, ParseBlockLayout(layout));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t tp_size, m.Uint("tp_size", kMaxTpSize));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t tp_rank, m.Uint("tp_rank", kMaxI32));
  options.tp_size = static_cast<int>(tp_size);
  options.tp_rank = static_cast<int>(tp_rank);
  KVFERRY_ASSIGN_OR_RETURN(options.block_strides, OptionalInts(m, "block_strides", 8));
  if (m.Find("first_layer") != nullptr) {  // a pipeline stage after the first
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t first, m.Uint("first_layer", 1 << 20));
    options.first_layer = static_cast<int>(first);
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t model, m.Uint("model_layers", 1 << 20));
    options.model_layers = static_cast<int>(model);
  }
  if (m.Find("sliding_window") != nullptr) {  // sliding-window attention
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t window,
                             m.Uint("sliding_window", std::uint64_t{1} << 40));
    options.sliding_window = static_cast<std::int64_t>(window);
  }
  if (m.Find("blocks_per_id") != nullptr) {  // kernel blocks smaller than the engine's
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t per_id,
                             m.Uint("blocks_per_id", static_cast<std::uint64_t>(kMaxBlocksPerId)));
    options.blocks_per_id = static_cast<std::int64_t>(per_id);
  }
  Result<CacheSpec> spec = CacheSpec::Create(std::move(options));
  if (!spec.ok()) return spec.status().WithContext(m.path());
  return spec;
}

std::uint32_t CacheGroupsKeys(const CacheGroups& groups) { return groups.size() > 1 ? 2 : 1; }

void PackCacheGroups(Packer& pk, const CacheGroups& groups) {
  PackStr(pk, "cache");
  PackCacheSpec(pk, groups[0]);
  if (groups.size() == 1) return;
  PackStr(pk, "more_groups");
  pk.pack_array(static_cast<std::uint32_t>(groups.size() - 1));
  for (int g = 1; g < groups.size(); ++g) {
    pk.pack_map(1);
    PackStr(pk, "cache");
    PackCacheSpec(pk, groups[g]);
  }
}

Result<CacheGroups> DecodeCacheGroups(const MapView& m) {
  std::vector<CacheSpec> specs;
  KVFERRY_ASSIGN_OR_RETURN(CacheSpec first, DecodeCacheSpec(m, "cache"));
  specs.push_back(std::move(first));
  if (const msgpack::object* more = m.Find("more_groups")) {
    if (more->type != msgpack::type::ARRAY ||
        more->via.array.size > static_cast<std::uint32_t>(kMaxCacheGroups - 1)) {
      return Status::InvalidArgument(m.At("more_groups") + ": expected an array of at most " +
                                     std::to_string(kMaxCacheGroups - 1) + " cache groups");
    }
    for (std::uint32_t i = 0; i < more->via.array.size; ++i) {
      KVFERRY_ASSIGN_OR_RETURN(
          MapView g,
          MapView::Of(more->via.array.ptr[i], m.At("more_groups") + "[" + std::to_string(i) + "]"));
      KVFERRY_ASSIGN_OR_RETURN(CacheSpec spec, DecodeCacheSpec(g, "cache"));
      specs.push_back(std::move(spec));
    }
  }
  Result<CacheGroups> groups = CacheGroups::Create(std::move(specs));
  if (!groups.ok()) return groups.status().WithContext(m.path());
  return groups;
}

}  // namespace kvferry::wire
