// From block id lists to the reads that move them: the tail rule, merged block runs, and the
// byte ranges of every run for every layer and part.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvferry/status.h"
#include "layout/tp_map.h"

namespace kvferry {

/// `count` blocks that are contiguous on both sides: remote blocks [remote_start, +count) go to
/// local blocks [local_start, +count).
struct BlockRun {
  std::int64_t remote_start = 0;
  std::int64_t local_start = 0;
  std::int64_t count = 0;

  friend bool operator==(const BlockRun&, const BlockRun&) = default;
};

/// DESIGN rule 8's tail rule: when the decode side allocated fewer blocks than the prefill side
/// sent (the decode side already holds a prefix), it reads the tail of the remote list. Returns
/// the remote ids to read, one per local id. More local than remote ids is InvalidArgument.
Result<std::span<const std::int64_t>> TailOfRemote(std::span<const std::int64_t> remote_ids,
                                                   std::span<const std::int64_t> local_ids);

/// The minimal list of runs pairing `remote_ids` (already cut by the tail rule) with `local_ids`
/// position by position, in order. Ids must lie in [0, num_blocks) of their side, the two lists
/// must have equal length, and no local id may repeat (two reads into one block).
Result<std::vector<BlockRun>> MergeBlockRuns(std::span<const std::int64_t> remote_ids,
                                             std::span<const std::int64_t> local_ids,
                                             std::int64_t remote_num_blocks,
                                             std::int64_t local_num_blocks);

/// One read: bytes [remote_offset, +length) of the remote part region into
/// [local_offset, +length) of the local part region, for one layer and part. Offsets are from
/// the part's base address on each side.
struct ByteRange {
  int layer = 0;
  int part = 0;
  std::int64_t remote_offset = 0;
  std::int64_t local_offset = 0;
  std::int64_t length = 0;
  /// A strided range: `count` pieces of `length`, piece i at remote_offset + i * remote_step and
  /// local_offset + i * local_step (a token-major head slice; BlockSlice).
  std::int64_t count = 1;
  std::int64_t remote_step = 0;
  std::int64_t local_step = 0;

  friend bool operator==(const ByteRange&, const ByteRange&) = default;
};

/// Block sizes of one part on each side (they differ when TP splits heads differently).
struct PartBlockBytes {
  std::int64_t remote = 0;
  std::int64_t local = 0;
};

/// Block sizes of one part on each side and the distance between the starts of consecutive
/// blocks on each side (CacheSpec::BlockStride; equal to the block size when packed).
struct PartBlockGeometry {
  std::int64_t remote = 0;
  std::int64_t local = 0;
  std::int64_t remote_stride = 0;
  std::int64_t local_stride = 0;
};

/// Block sizes and strides of every part, for reads from `remote` into `local` (the two specs
/// must have the same parts, which their equal compatibility hashes guarantee).
std::vector<PartBlockGeometry> PartBlockGeometryOf(const CacheSpec& remote, const CacheSpec& local);

/// The byte ranges of `runs` for `num_layers` layers, part by part, using the slice of every
/// block that `source` names. Whole-block slices of packed parts (stride = block size on both
/// sides) give one range per run; partial slices or strided parts give one range per block.
/// Ordered by layer, part, then run.
std::vector<ByteRange> RunByteRanges(std::span<const BlockRun> runs, int num_layers,
                                     std::span<const PartBlockGeometry> blocks,
                                     const TpSource& source);
/// The same for layers [first_layer, end_layer) only (layer-wise reads).
std::vector<ByteRange> RunByteRanges(std::span<const BlockRun> runs, int first_layer, int end_layer,
                                     std::span<const PartBlockGeometry> blocks,
                                     const TpSource& source);

/// Tokens contiguous inside one block on each side: slots [remote_slot, +count) of remote block
/// remote_block go to slots [local_slot, +count) of local block local_block. How blocks of
/// different token counts pair (16-token prefill blocks into 32-token decode ones, and back).
struct TokenRun {
  std::int64_t remote_block = 0;
  std::int64_t remote_slot = 0;
  std::int64_t local_block = 0;
  std::int64_t local_slot = 0;
  std::int64_t count = 0;

  friend bool operator==(const TokenRun&, const TokenRun&) = default;
};

/// The cache blocks that engine block ids name, `blocks_per_id` consecutive ones each
/// (CacheSpecOptions::blocks_per_id): id b is blocks b * blocks_per_id + 0 .. blocks_per_id - 1.
/// Negative ids stay negative (PairTokenRuns refuses them).
std::vector<std::int64_t> CacheBlocksOfIds(std::span<const std::int64_t> ids,
                                           std::int64_t blocks_per_id);

/// One side's blocks of a request: ids[i] holds its tokens [first_token + i * tokens_per_block,
/// first_token + (i + 1) * tokens_per_block); ids lie in [0, num_blocks).
struct TokenBlocks {
  std::span<const std::int64_t> ids;
  std::int64_t tokens_per_block = 0;
  std::int64_t num_blocks = 0;
  std::int64_t first_token = 0;
};

/// Pairs tokens [first_token, first_token + num_tokens) of a request from `remote` into `local`,
/// one run wherever a block on either side begins or ends, in token order. InvalidArgument,
/// naming the value, when an id lies outside its cache, a local id repeats, a side starts after
/// `first_token` or has too few blocks for the tokens, or a count is not positive.
Result<std::vector<TokenRun>> PairTokenRuns(const TokenBlocks& remote, const TokenBlocks& local,
                                            std::int64_t first_token, std::int64_t num_tokens);

/// The byte ranges of `runs` for layers [first_layer, end_layer), part by part, reading the heads
/// `source` names (TpSource::heads) from a cache laid out as `remote` into one laid out as
/// `local` (the same parts, dtype and block layout; any tokens per block and strides). Token-major:
/// one range per run when whole tokens move, else a strided range of one piece per token;
/// head-major: one piece per head. Ranges adjacent on both sides are merged. Ordered by layer,
/// part, then run.
std::vector<ByteRange> TokenRunByteRanges(std::span<const TokenRun> runs, int first_layer,
                                          int end_layer, const CacheSpec& remote,
                                          const CacheSpec& local, const TpSource& source);

/// How one worker's cache is named in its transport (docs/transport.md, "Region ids"). Packed
/// parts (every stride equal to its block size): one region per layer and part, id
/// `layer * parts + part`, offset 0. Interleaved parts (some stride differs from its block size):
/// every part's stride must be the sum S of all parts' block sizes and part p must start
/// sum_{q<p} BlockBytes(q) after part 0 (vLLM's `(num_blocks, parts, ...)` tensors); the layer is
/// one region, id `layer * parts`, num_blocks * S bytes from part 0's base, and part p lies at
/// that offset inside it. Both sides compute this from a CacheSpec alone.
struct PartRegion {
  std::int64_t id = 0;
  std::int64_t offset = 0;  // of the part's base inside the region
};
/// Whether `spec`'s parts interleave (some block stride differs from its block size).
bool PartsInterleaved(const CacheSpec& spec);
/// The region holding part `part` of layer `layer`; requires CheckRegionLayout(spec) ok.
PartRegion RegionOfPart(const CacheSpec& spec, int layer, int part);
/// The same in KV cache group `group` of `caches`: each group's regions follow the earlier
/// groups' (docs/transport.md, "Region ids"), so a one-group cache numbers them as before.
PartRegion RegionOfPart(const CacheGroups& caches, int group, int layer, int part);
/// Bytes of the region of layer `layer` part `part`: PartBytes(part) when packed, the whole
/// interleaved layer (num_blocks * S) otherwise.
std::int64_t RegionBytes(const CacheSpec& spec, int part);
/// Ok when the spec's strides fit one of the two schemes above; else NotSupported naming them.
Status CheckRegionLayout(const CacheSpec& spec);
/// Ok when every interleaved layer's parts start where RegionOfPart places them; else
/// NotSupported naming the layer, the part and both offsets.
Status CheckRegionBases(const CacheSpec& spec,
                        const std::vector<std::vector<std::uint64_t>>& bases);

/// The same for packed parts on both sides (every stride equal to its block size).
std::vector<ByteRange> RunByteRanges(std::span<const BlockRun> runs, int num_layers,
                                     std::span<const PartBlockBytes> block_bytes,
                                     const TpSource& source);

}  // namespace kvferry
