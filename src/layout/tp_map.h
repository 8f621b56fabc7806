// Which prefill TP ranks a decode TP rank reads, which bytes of each block, and how many readers
// every prefill rank waits for before it frees a request's blocks (DESIGN rules 8 and 10).
// Pure functions of the cache geometry and the two TP sizes.
#pragma once

#include <cstdint>
#include <vector>

#include "kvferry/cache_spec.h"
#include "kvferry/status.h"

namespace kvferry {

/// A byte range copied from one prefill block of a part into one decode block of the same part.
/// Offsets are relative to the start of the block on each side.
struct BlockSlice {
  std::int64_t remote_offset = 0;
  std::int64_t local_offset = 0;
  std::int64_t length = 0;
  /// True when the slice is the whole block on both sides, so adjacent blocks merge into one read.
  bool whole_block = false;

  friend bool operator==(const BlockSlice&, const BlockSlice&) = default;
};

/// One prefill rank a decode rank reads from, with one slice per part (index = part index).
struct TpSource {
  int prefill_rank = 0;
  std::vector<BlockSlice> part_slices;

  friend bool operator==(const TpSource&, const TpSource&) = default;
};

/// The prefill ranks decode rank `decode_rank` of `decode_tp` reads, in ascending rank order,
/// given a prefill TP size `prefill_tp`. `geometry` supplies the model-level shape (kind, parts,
/// tokens per block, dtype, layout); its own TP fields are ignored.
///
/// MLA kinds are replicated: decode rank r reads the whole block from prefill rank
/// r % prefill_tp. MHA: every head the decode rank holds is read from a prefill rank that holds
/// it; with equal TP sizes that is the same rank and the whole block. Unequal MHA TP sizes need
/// head slices, which are one byte range per block only in the head-major layout; in the
/// token-major layout such a combination returns NotSupported naming it and why.
Result<std::vector<TpSource>> PlanTpSources(const CacheSpec& geometry, int prefill_tp,
                                            int decode_tp, int decode_rank);

/// How many decode ranks read from prefill rank `prefill_rank`: the number of finished notices
/// it must receive before it frees a request's blocks. Zero means nobody reads this rank's copy
/// (possible when the decode TP is smaller), and it may free at once.
Result<int> ExpectedReaders(const CacheSpec& geometry, int prefill_tp, int decode_tp,
                            int prefill_rank);

}  // namespace kvferry
