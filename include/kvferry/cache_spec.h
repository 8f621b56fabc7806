// kvferry: the geometry of one worker's paged KV cache.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"

namespace kvferry {

/// Element type of the cache. Numeric values are stable (they appear in hashes and on the wire).
enum class DType : std::uint8_t {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kInt8 = 3,
  kInt32 = 4,
  kInt64 = 5,
};

/// Bytes per element: 2, 2, 4, 1, 4, 8.
std::int64_t DTypeSize(DType dtype);
/// Canonical short name: "fp16", "bf16", "fp32", "int8", "int32", "int64".
const char* DTypeName(DType dtype);
/// Accepts the canonical names and the torch spellings ("float16", "half", "bfloat16", "float32",
/// "float", with or without a "torch." prefix).
Result<DType> ParseDType(std::string_view name);

/// The attention cache shape of a layer.
enum class CacheKind : std::uint8_t {
  /// Multi-head / grouped-query attention: parts K and V, heads split across TP ranks.
  kMha = 0,
  /// Multi-head latent attention: a latent part and a rope part of different widths, replicated
  /// on every TP rank.
  kMla = 1,
  /// Sparse MLA: latent, rope and indexer parts, replicated on every TP rank.
  kSparseMla = 2,
  /// MLA with latent and rope fused in one row per token (vLLM's
  /// `(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)` tensor): one part whose
  /// `fields` name the two widths, replicated on every TP rank.
  kMlaFused = 3,
  /// Recurrent state of a Mamba or linear-attention layer (vLLM's MambaSpec: Mamba 1 and 2, gated
  /// delta net): per request one state block, holding the state as of the request's last
  /// computed token, not one row per token. Its parts (vLLM's conv-state sub-projections Q, K,
  /// V or x, B, C, and the SSM state) lie side by side in one page per block (block_strides),
  /// each with its own element type (PartSpec::dtype) and each split across TP along its outer
  /// axis (PartSpec::num_heads: channels or heads), never replicated.
  kState = 4,
};
/// "mha", "mla", "sparse_mla", "mla_fused", "state"
const char* CacheKindName(CacheKind kind);
/// The names above; also "gqa", "sfa", "mamba".
Result<CacheKind> ParseCacheKind(std::string_view name);
/// Number of parts a layer of this kind has: 2, 2, 3, 1; kState: 0, any from 1 to
/// kMaxStateParts.
std::size_t CacheKindParts(CacheKind kind);
inline constexpr std::size_t kMaxStateParts = 8;

/// Which axis is outermost inside one block of one part.
enum class BlockLayout : std::uint8_t {
  /// [tokens][heads][head_dim]: vLLM's and vllm-ascend's default.
  kTokenMajor = 0,
  /// [heads][tokens][head_dim]: a run of heads is one contiguous byte range, so TP combinations
  /// that slice heads can be served with one read per block.
  kHeadMajor = 1,
};
const char* BlockLayoutName(BlockLayout layout);  // "token_major", "head_major"
Result<BlockLayout> ParseBlockLayout(std::string_view name);

/// One part of a layer (K, V, latent, rope, indexer).
struct PartSpec {
  std::string name;
  /// Model-wide KV heads of this part, before any TP split. For MLA kinds the part is replicated
  /// on every rank and this is its head count on each rank (usually 1).
  std::int64_t num_heads = 0;
  std::int64_t head_dim = 0;
  /// kState only: the part's element type where it is not the cache's (vLLM's MambaSpec.dtypes:
  /// an fp32 SSM state beside a bf16 conv state). In the compatibility hash when set.
  std::optional<DType> dtype{};

  friend bool operator==(const PartSpec&, const PartSpec&) = default;
};

struct LayerSpec {
  CacheKind kind = CacheKind::kMha;
  std::vector<PartSpec> parts;
  /// kMlaFused only (required there, empty for every other kind): the widths of the fields
  /// packed side by side in each row of its one part, {kv_lora_rank, qk_rope_head_dim}, summing
  /// to the part's head_dim. Part of the compatibility hash: 512+64 and 448+128 rows do not mix.
  std::vector<std::int64_t> fields;

  friend bool operator==(const LayerSpec&, const LayerSpec&) = default;
};

/// Everything CacheSpec::Create validates.
struct CacheSpecOptions {
  /// One entry per attention layer; every layer must have the same kind and part shapes.
  std::vector<LayerSpec> layers;
  std::int64_t num_blocks = 0;
  std::int64_t tokens_per_block = 0;
  DType dtype = DType::kBFloat16;
  BlockLayout layout = BlockLayout::kTokenMajor;
  /// The TP group this cache belongs to: MHA heads are split across it.
  int tp_size = 1;
  int tp_rank = 0;
  /// Bytes from the start of one block of a part to the start of the next, one entry per part;
  /// empty means every part is packed (stride = BlockBytes). A stride larger than the block lets
  /// parts interleave block by block inside one tensor: vLLM's `(num_blocks, 2, block_size,
  /// heads, head_dim)` has stride 2 * BlockBytes for K and V, V's base one block after K's. Each
  /// stride must be at least BlockBytes(part) and a multiple of the element size. A property of
  /// this side's memory only: not in the compatibility hash, and the two sides of a transfer may
  /// use different strides.
  std::vector<std::int64_t> block_strides;
  /// The model-wide index of this cache's layer 0: a pipeline-parallel stage holds the model's
  /// layers [first_layer, first_layer + layers.size()). Not in the compatibility hash: a load
  /// reads each of its layers from a prefill stage that holds it (LayersHeld), so stages of
  /// unequal pipelines pair by layer ranges, and a stage never reads another stage's layers into
  /// its own.
  int first_layer = 0;
  /// The model's layer count, all stages together; 0 means first_layer + layers.size() (this
  /// cache holds the model's last layer: every cache without pipeline stages). In the hash, so
  /// caches of models with different depths never pair, whatever their stages.
  int model_layers = 0;
  /// Consecutive blocks of this cache that one engine block id names: vLLM's logical block of
  /// `blocks_per_id` kernel blocks (the tensor's blocks, smaller than the block size vLLM's
  /// scheduler counts in). Id b is blocks [b * blocks_per_id, (b + 1) * blocks_per_id); num_blocks
  /// must be a multiple. A property of this side's memory, like block_strides: not in the hash.
  std::int64_t blocks_per_id = 1;
  /// Sliding-window attention (vLLM's SlidingWindowSpec): each token attends to the last
  /// `sliding_window` tokens, so a load reads only the blocks holding the prompt's last
  /// `sliding_window` tokens (the decode side computes from there); the engine may have freed
  /// the others on either side. 0: full attention, every prompt token. In the hash.
  std::int64_t sliding_window = 0;
};

/// The largest CacheSpecOptions::blocks_per_id kvferry accepts, local or from a peer.
inline constexpr std::int64_t kMaxBlocksPerId = 1024;

/// SHA-256 digest of the fields both sides of a transfer must agree on.
using CompatibilityHash = std::array<std::uint8_t, 32>;

/// The validated geometry of one TP rank's KV cache: every layer holds `num_blocks` blocks per
/// part, each block `tokens_per_block` tokens of this rank's heads. Immutable value type;
/// thread-safe to share.
class CacheSpec {
 public:
  /// Validates: at least one layer; part count matching the kind; all sizes positive; every layer
  /// equal to layer 0; heads divisible across the TP group; fields present exactly for kMlaFused
  /// (two, summing to head_dim); block strides as documented on CacheSpecOptions; no 64-bit
  /// overflow in any byte count.
  static Result<CacheSpec> Create(CacheSpecOptions options);

  /// Shorthands for uniform models.
  static Result<CacheSpec> Mha(int num_layers, std::int64_t kv_heads, std::int64_t head_dim,
                               std::int64_t num_blocks, std::int64_t tokens_per_block, DType dtype,
                               int tp_size = 1, int tp_rank = 0,
                               BlockLayout layout = BlockLayout::kTokenMajor);
  static Result<CacheSpec> Mla(int num_layers, std::int64_t latent_dim, std::int64_t rope_dim,
                               std::int64_t num_blocks, std::int64_t tokens_per_block, DType dtype,
                               int tp_size = 1, int tp_rank = 0);
  static Result<CacheSpec> SparseMla(int num_layers, std::int64_t latent_dim, std::int64_t rope_dim,
                                     std::int64_t indexer_dim, std::int64_t num_blocks,
                                     std::int64_t tokens_per_block, DType dtype, int tp_size = 1,
                                     int tp_rank = 0);
  /// kMlaFused: one part "latent_rope" of head_dim latent_dim + rope_dim, fields {latent, rope}.
  static Result<CacheSpec> MlaFused(int num_layers, std::int64_t latent_dim, std::int64_t rope_dim,
                                    std::int64_t num_blocks, std::int64_t tokens_per_block,
                                    DType dtype, int tp_size = 1, int tp_rank = 0);

  const CacheSpecOptions& options() const { return options_; }
  int num_layers() const { return static_cast<int>(options_.layers.size()); }
  CacheKind kind() const { return options_.layers.front().kind; }
  /// The parts of every layer (they all agree).
  const std::vector<PartSpec>& parts() const { return options_.layers.front().parts; }
  /// kMlaFused: the widths packed in each row of its part (LayerSpec::fields); else empty.
  const std::vector<std::int64_t>& fields() const { return options_.layers.front().fields; }
  int num_parts() const { return static_cast<int>(parts().size()); }
  std::int64_t num_blocks() const { return options_.num_blocks; }
  std::int64_t tokens_per_block() const { return options_.tokens_per_block; }
  DType dtype() const { return options_.dtype; }
  BlockLayout layout() const { return options_.layout; }
  int tp_size() const { return options_.tp_size; }
  int tp_rank() const { return options_.tp_rank; }
  int first_layer() const { return options_.first_layer; }
  /// One past the model-wide index of this cache's last layer.
  int end_layer() const { return options_.first_layer + num_layers(); }
  /// CacheSpecOptions::model_layers, with 0 resolved.
  int model_layers() const {
    return options_.model_layers != 0 ? options_.model_layers : end_layer();
  }
  std::int64_t blocks_per_id() const { return options_.blocks_per_id; }
  /// CacheSpecOptions::sliding_window: 0 for full attention.
  std::int64_t sliding_window() const { return options_.sliding_window; }
  /// Tokens one engine block id holds: tokens_per_block * blocks_per_id.
  std::int64_t tokens_per_id() const { return options_.tokens_per_block * options_.blocks_per_id; }

  /// Heads of `part` this rank holds, and the model-wide index of the first.
  std::int64_t LocalHeads(int part) const;
  std::int64_t FirstLocalHead(int part) const;
  /// Whether a block holds one state (kState) rather than tokens_per_block tokens' rows.
  bool is_state() const { return kind() == CacheKind::kState; }
  /// The element type of `part`: PartSpec::dtype where set, else the cache's.
  DType PartDType(int part) const {
    return parts()[static_cast<std::size_t>(part)].dtype.value_or(options_.dtype);
  }
  /// Bytes of one block of one part on this rank.
  std::int64_t BlockBytes(int part) const { return block_bytes_[static_cast<std::size_t>(part)]; }
  /// Bytes from the start of one block of `part` to the start of the next.
  std::int64_t BlockStride(int part) const {
    return block_strides_[static_cast<std::size_t>(part)];
  }
  /// Extent of one part of one layer, from its base to the end of its last block:
  /// (num_blocks - 1) * BlockStride(part) + BlockBytes(part); num_blocks * BlockBytes(part) when
  /// packed. Interleaved parts' extents overlap; their blocks do not.
  std::int64_t PartBytes(int part) const { return part_bytes_[static_cast<std::size_t>(part)]; }
  /// Bytes of cache data on this rank: layers * num_blocks * the sum of BlockBytes.
  std::int64_t TotalBytes() const { return total_bytes_; }
  /// Alignment every part's base address must have: the largest element size of its parts.
  std::int64_t RequiredAlignment() const;

  /// Hash of the model-level geometry: kind, the model's layer count, parts (names, model-wide
  /// heads, dims), fused fields, sliding window, dtype and layout. Block counts, tokens per block,
  /// block strides, TP placement and the pipeline stage's layer range are not in it: two sides with
  /// different cache sizes, block sizes, memory layouts of whole blocks, TP or PP sizes can still
  /// exchange KV (token by token where the block sizes differ; layer by layer from the stages
  /// holding them where the PP sizes differ).
  CompatibilityHash Hash() const;
  /// The exact text that Hash() digests; also a readable one-line summary.
  std::string CanonicalText() const;

  friend bool operator==(const CacheSpec& a, const CacheSpec& b) {
    return a.options_.layers == b.options_.layers &&
           a.options_.num_blocks == b.options_.num_blocks &&
           a.options_.tokens_per_block == b.options_.tokens_per_block &&
           a.options_.dtype == b.options_.dtype && a.options_.layout == b.options_.layout &&
           a.options_.tp_size == b.options_.tp_size && a.options_.tp_rank == b.options_.tp_rank &&
           a.options_.first_layer == b.options_.first_layer &&
           a.model_layers() == b.model_layers() &&
           a.options_.blocks_per_id == b.options_.blocks_per_id &&
           a.options_.sliding_window == b.options_.sliding_window &&
           a.block_strides_ == b.block_strides_;
  }

 private:
  explicit CacheSpec(CacheSpecOptions options) : options_(std::move(options)) {}

  CacheSpecOptions options_;
  std::vector<std::int64_t> block_bytes_;
  std::vector<std::int64_t> block_strides_;
  std::vector<std::int64_t> part_bytes_;
  std::int64_t total_bytes_ = 0;
};

/// The largest TP size kvferry accepts anywhere, local or claimed by a peer: every loop over a
/// peer's ranks is bounded by it.
inline constexpr int kMaxTpSize = 256;

/// The most KV cache groups one worker's cache may have, local or claimed by a peer (vLLM's
/// hybrid models have two to four).
inline constexpr int kMaxCacheGroups = 16;

/// A block id that names no block: where the engine freed a block of a group, or never gave
/// one (vLLM's null block in a sliding-window group's table, outside the window). A load reads
/// nothing into or out of it.
inline constexpr std::int64_t kNoBlock = -1;

/// One worker's whole KV cache, as vLLM's KVCacheConfig has it: one or more KV cache groups,
/// each a CacheSpec of its own (kind, parts, sliding window, layers, block count and size) with a
/// block table of its own (a request has block ids per group). A uniform model is one group, and
/// a CacheSpec converts to it, so every API that takes a CacheSpec keeps its meaning. Groups are
/// ordered as the engine's (vLLM's kv_cache_groups); every group has this worker's TP rank and
/// size. Immutable value type.
class CacheGroups {
 public:
  /// Validates: 1 to kMaxCacheGroups groups, one TP rank and size.
  static Result<CacheGroups> Create(std::vector<CacheSpec> groups);
  CacheGroups(CacheSpec one);  // NOLINT(google-explicit-constructor): a uniform model

  int size() const { return static_cast<int>(groups_.size()); }
  const CacheSpec& operator[](int group) const { return groups_[static_cast<std::size_t>(group)]; }
  const std::vector<CacheSpec>& specs() const { return groups_; }
  /// One group: that group's CacheSpec::Hash, so a uniform cache hashes as it always did; several:
  /// the digest of CanonicalText. Covers every group's geometry and their order.
  CompatibilityHash Hash() const;
  /// One group: its CacheSpec::CanonicalText; several: "kvferry-groups-v2 n=<groups>" followed
  /// by " | " and each group's text, in order.
  std::string CanonicalText() const;
  /// Bytes of every group together.
  std::int64_t TotalBytes() const;

  friend bool operator==(const CacheGroups&, const CacheGroups&) = default;

 private:
  explicit CacheGroups(std::vector<CacheSpec> groups) : groups_(std::move(groups)) {}
  std::vector<CacheSpec> groups_;
};

/// Why two caches' hashes differ, for a refusal: the first difference ("KV cache group 1:
/// window=48 here, window=24 there", or the group counts), then both texts. Empty when their
/// hashes are equal.
std::string FirstDifference(const CacheGroups& ours, const CacheGroups& theirs);

/// Heads held by TP rank `rank` of `tp_size` for a part of `model_heads` heads that is split
/// across TP (MHA): the count and the first model-wide index. With fewer heads than ranks each
/// head is replicated on tp_size / model_heads consecutive ranks. Requires a valid combination
/// (one size divides the other), which CacheSpec::Create checks.
struct HeadRange {
  std::int64_t first = 0;
  std::int64_t count = 0;
};
HeadRange SplitHeads(std::int64_t model_heads, int tp_size, int rank);

/// The base address of every part of every layer of one registered cache, checked against its
/// spec: non-null, aligned to the element size, and no two blocks of different parts sharing a
/// byte. Parts with equal block strides may interleave (each block of one in the gap between
/// blocks of the other); parts with different strides must not share any byte of their extents.
class CacheAddresses {
 public:
  /// `bases[layer][part]`; each region is spec.PartBytes(part) long.
  static Result<CacheAddresses> Create(const CacheSpec& spec,
                                       std::vector<std::vector<std::uint64_t>> bases);

  std::uint64_t Base(int layer, int part) const {
    return bases_[static_cast<std::size_t>(layer)][static_cast<std::size_t>(part)];
  }

 private:
  explicit CacheAddresses(std::vector<std::vector<std::uint64_t>> bases)
      : bases_(std::move(bases)) {}
  std::vector<std::vector<std::uint64_t>> bases_;
};

}  // namespace kvferry
