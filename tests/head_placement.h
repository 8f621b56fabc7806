// Which model-wide KV heads a TP rank holds, written from the definition for the byte oracles of
// the tests, independently of SplitHeads / CacheSpec::FirstLocalHead (the functions under test):
// if those placed heads wrongly, the transfer plans built from them would move the wrong bytes
// and an oracle that asked them where heads live would agree with the mistake.
//
// The definition (docs/connector.md, DESIGN rule 8): an MHA part's heads are dealt out to the TP
// ranks in equal runs of consecutive heads, so with at least as many heads as ranks model head h
// lives on rank h / (heads / tp); with fewer heads than ranks each head is replicated on
// tp / heads consecutive ranks, so head h lives on ranks [h * (tp / heads), (h + 1) * (tp /
// heads)). MLA parts are not split: every rank holds all of their heads.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <iostream>

#include "kvferry/cache_spec.h"

namespace kvferry::testing {

/// True when TP rank `rank` of `tp` holds model head `head` of an MHA part of `heads` heads.
inline bool RankHoldsHead(std::int64_t heads, int tp, int rank, std::int64_t head) {
  if (tp <= heads) return head / (heads / tp) == rank;
  const std::int64_t replicas = tp / heads;
  return head * replicas <= rank && rank < (head + 1) * replicas;
}

struct OracleHeads {
  std::int64_t first = 0;
  std::int64_t count = 0;
};

/// The heads rank `rank` holds, found by asking every head where it lives. Aborts (with the
/// shape) if they are not one run of consecutive heads: the definition never yields that.
inline OracleHeads OracleHeadsOfRank(std::int64_t heads, int tp, int rank) {
  OracleHeads out{-1, 0};
  for (std::int64_t h = 0; h < heads; ++h) {
    if (!RankHoldsHead(heads, tp, rank, h)) continue;
    if (out.first < 0) out.first = h;
    if (h != out.first + out.count) {
      std::cerr << "head placement oracle: rank " << rank << " of " << tp << " holds "
                << "non-consecutive heads of " << heads << "\n";
      std::abort();
    }
    ++out.count;
  }
  if (out.first < 0) out.first = 0;
  return out;
}

/// The heads of `part` that `spec`'s own TP rank holds (MLA parts: all of them).
inline OracleHeads OracleLocalHeads(const CacheSpec& spec, int part) {
  const std::int64_t heads = spec.parts()[static_cast<std::size_t>(part)].num_heads;
  if (spec.kind() != CacheKind::kMha) return {0, heads};
  return OracleHeadsOfRank(heads, spec.tp_size(), spec.tp_rank());
}

}  // namespace kvferry::testing
