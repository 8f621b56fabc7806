// Which prefill TP ranks a decode TP rank reads, which bytes of each block, and how many readers
// every prefill rank waits for before it frees a request's blocks (DESIGN rules 8 and 10).
// Pure functions of the cache geometry and the two TP sizes.
#pragma once

#include <cstdint>
#include <vector>

#include "kvferry/cache_spec.h"
#include "kvferry/status.h"

namespace kvferry {

/// The bytes copied from one prefill block of a part into one decode block of the same part:
/// `count` pieces of `length` bytes, piece i at remote_offset + i * remote_step of the remote
/// block and local_offset + i * local_step of the local one. One piece for whole blocks and
/// head-major head slices; one per token slot for token-major head slices (a token's heads are
/// adjacent, so a run of them is one piece per token). Offsets are from the start of the block.
struct BlockSlice {
  std::int64_t remote_offset = 0;
  std::int64_t local_offset = 0;
  std::int64_t length = 0;
  /// True when the slice is the whole block on both sides, so adjacent blocks merge into one read.
  bool whole_block = false;
  std::int64_t count = 1;
  std::int64_t remote_step = 0;
  std::int64_t local_step = 0;

  friend bool operator==(const BlockSlice&, const BlockSlice&) = default;
};

/// One prefill rank a decode rank reads from, with one slice per part (index = part index).
struct TpSource {
  int prefill_rank = 0;
  std::vector<BlockSlice> part_slices;
  /// The same read in heads, for reads between blocks of different token counts
  /// (TokenRunByteRanges): heads [remote_first_head, +heads) of the prefill rank's own heads of
  /// every part into [local_first_head, +heads) of this rank's. heads 0: every head of each part
  /// (the replicated kinds, whose parts may have different head counts).
  std::int64_t remote_first_head = 0;
  std::int64_t local_first_head = 0;
  std::int64_t heads = 0;

  friend bool operator==(const TpSource&, const TpSource&) = default;
};

/// The prefill ranks decode rank `decode_rank` of `decode_tp` reads, in ascending rank order,
/// given a prefill TP size `prefill_tp`. `geometry` supplies the model-level shape (kind, parts,
/// tokens per block, dtype, layout); its own TP fields are ignored.
///
/// MLA kinds are replicated: decode rank r reads the whole block from prefill rank
/// r % prefill_tp. MHA: every head the decode rank holds is read from a prefill rank that holds
/// it; with equal TP sizes that is the same rank and the whole block. Unequal MHA TP sizes need
/// head slices: one byte range per block in the head-major layout, one piece per token slot (a
/// strided read) in the token-major layout.
Result<std::vector<TpSource>> PlanTpSources(const CacheSpec& geometry, int prefill_tp,
                                            int decode_tp, int decode_rank);

/// How many decode ranks read from prefill rank `prefill_rank`: the number of finished notices
/// it must receive before it frees a request's blocks. Zero means nobody reads this rank's copy
/// (possible when the decode TP is smaller), and it may free at once.
Result<int> ExpectedReaders(const CacheSpec& geometry, int prefill_tp, int decode_tp,
                            int prefill_rank);

}  // namespace kvferry
