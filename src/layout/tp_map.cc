#include "layout/tp_map.h"

#include <algorithm>
#include <string>

namespace kvferry {
namespace {

Status CheckTpSizes(const CacheSpec& geometry, int prefill_tp, int decode_tp) {
  if (prefill_tp <= 0 || decode_tp <= 0) {
    return Status::InvalidArgument("TP sizes must be positive, found prefill " +
                                   std::to_string(prefill_tp) + " and decode " +
                                   std::to_string(decode_tp));
  }
  if (geometry.is_state()) {
    for (const PartSpec& part : geometry.parts()) {
      for (int tp : {prefill_tp, decode_tp}) {
        if (part.num_heads % tp != 0) {
          return Status::NotSupported(
              "state part '" + part.name + "' has " + std::to_string(part.num_heads) +
              " along its TP-split axis, which TP size " + std::to_string(tp) +
              " does not divide: a state is split across TP ranks, never replicated");
        }
      }
    }
    return Status::Ok();
  }
  if (geometry.kind() != CacheKind::kMha) return Status::Ok();
  const std::int64_t heads = geometry.parts().front().num_heads;
  for (int tp : {prefill_tp, decode_tp}) {
    const bool ok = tp <= heads ? heads % tp == 0 : tp % heads == 0;
    if (!ok) {
      return Status::NotSupported("MHA cache with " + std::to_string(heads) +
                                  " KV heads cannot be split across TP size " + std::to_string(tp) +
                                  ": one of them must divide the other");
    }
  }
  return Status::Ok();
}

// Bytes of `heads` heads of one part inside a head-major block.
std::int64_t HeadBytes(const CacheSpec& g, int part, std::int64_t heads) {
  return heads * g.tokens_per_block() * g.parts()[static_cast<std::size_t>(part)].head_dim *
         DTypeSize(g.dtype());
}

// The prefill rank that serves head `head` to decode rank `decode_rank`. With replicated heads on
// the prefill side, decode ranks are spread over the replicas.
int PrefillRankForHead(std::int64_t heads, int prefill_tp, int decode_rank, std::int64_t head) {
  if (prefill_tp <= heads) return static_cast<int>(head / (heads / prefill_tp));
  const std::int64_t replicas = prefill_tp / heads;
  return static_cast<int>(head * replicas + decode_rank % replicas);
}

// A state group (kState): every part split evenly across both TP sizes (CheckTpSizes), so the
// prefill ranks that hold a decode rank's share are the same for every part; each part's share of
// a block is one contiguous range (its split axis is outermost, as vLLM's DS conv layout and SSM
// state have it), read from each of them.
std::vector<TpSource> PlanStateSources(const CacheSpec& g, int prefill_tp, int decode_tp,
                                       int decode_rank) {
  std::vector<TpSource> sources;
  // The prefill ranks holding the first and the last unit of the decode rank's share (every
  // part divides by both sizes, so its share's ends fall on these ranks for every part).
  const int first_q = decode_rank * prefill_tp / decode_tp;
  const int end_q = ((decode_rank + 1) * prefill_tp + decode_tp - 1) / decode_tp;
  for (int q = first_q; q < end_q; ++q) {
    TpSource source{q, {}};
    for (int p = 0; p < g.num_parts(); ++p) {
      const PartSpec& part = g.parts()[static_cast<std::size_t>(p)];
      const std::int64_t head = part.head_dim * DTypeSize(g.PartDType(p));
      const HeadRange mine = SplitHeads(part.num_heads, decode_tp, decode_rank);
      const HeadRange theirs = SplitHeads(part.num_heads, prefill_tp, q);
      const std::int64_t h = std::max(mine.first, theirs.first);
      const std::int64_t end = std::min(mine.first + mine.count, theirs.first + theirs.count);
      const bool whole =
          h == mine.first && h == theirs.first && end - h == mine.count && end - h == theirs.count;
      source.part_slices.push_back(
          {(h - theirs.first) * head, (h - mine.first) * head, (end - h) * head, whole, 1, 0, 0});
      if (p == 0) {
        source.remote_first_head = h - theirs.first;
        source.local_first_head = h - mine.first;
        source.heads = end - h;
      }
    }
    sources.push_back(std::move(source));
  }
  return sources;
}

}  // namespace

Result<std::vector<TpSource>> PlanTpSources(const CacheSpec& geometry, int prefill_tp,
                                            int decode_tp, int decode_rank) {
  KVFERRY_RETURN_IF_ERROR(CheckTpSizes(geometry, prefill_tp, decode_tp));
  if (decode_rank < 0 || decode_rank >= decode_tp) {
    return Status::InvalidArgument("decode rank " + std::to_string(decode_rank) +
                                   " is outside decode TP size " + std::to_string(decode_tp));
  }
  const int parts = geometry.num_parts();
  if (geometry.is_state()) return PlanStateSources(geometry, prefill_tp, decode_tp, decode_rank);
  if (geometry.kind() != CacheKind::kMha) {
    TpSource source{decode_rank % prefill_tp, {}};
    for (int p = 0; p < parts; ++p) {
      const std::int64_t bytes =
          HeadBytes(geometry, p, geometry.parts()[static_cast<std::size_t>(p)].num_heads);
      source.part_slices.push_back({0, 0, bytes, true, 1, 0, 0});
    }
    return std::vector<TpSource>{source};
  }

  const std::int64_t heads = geometry.parts().front().num_heads;
  const HeadRange mine = SplitHeads(heads, decode_tp, decode_rank);
  std::vector<TpSource> sources;
  std::int64_t h = mine.first;
  while (h < mine.first + mine.count) {
    const int q = PrefillRankForHead(heads, prefill_tp, decode_rank, h);
    const HeadRange theirs = SplitHeads(heads, prefill_tp, q);
    // Heads [h, end) all come from prefill rank q.
    const std::int64_t end = std::min(mine.first + mine.count, theirs.first + theirs.count);
    const bool whole = (h == mine.first && end == mine.first + mine.count && h == theirs.first &&
                        end == theirs.first + theirs.count);
    TpSource source{q, {}, h - theirs.first, h - mine.first, end - h};
    for (int p = 0; p < parts; ++p) {
      if (whole || geometry.layout() == BlockLayout::kHeadMajor) {
        source.part_slices.push_back({HeadBytes(geometry, p, h - theirs.first),
                                      HeadBytes(geometry, p, h - mine.first),
                                      HeadBytes(geometry, p, end - h), whole, 1, 0, 0});
        continue;
      }
      // Token-major: [token][head][dim]; heads [h, end) are one piece per token slot, a row of
      // the remote rank's heads apart on its side and of this rank's on ours.
      const std::int64_t head = HeadBytes(geometry, p, 1) / geometry.tokens_per_block();
      source.part_slices.push_back({(h - theirs.first) * head, (h - mine.first) * head,
                                    (end - h) * head, false, geometry.tokens_per_block(),
                                    theirs.count * head, mine.count * head});
    }
    sources.push_back(std::move(source));
    h = end;
  }
  std::sort(sources.begin(), sources.end(),
            [](const TpSource& a, const TpSource& b) { return a.prefill_rank < b.prefill_rank; });
  return sources;
}

Result<int> ExpectedReaders(const CacheSpec& geometry, int prefill_tp, int decode_tp,
                            int prefill_rank) {
  KVFERRY_RETURN_IF_ERROR(CheckTpSizes(geometry, prefill_tp, decode_tp));
  if (prefill_rank < 0 || prefill_rank >= prefill_tp) {
    return Status::InvalidArgument("prefill rank " + std::to_string(prefill_rank) +
                                   " is outside prefill TP size " + std::to_string(prefill_tp));
  }
  int readers = 0;
  for (int r = 0; r < decode_tp; ++r) {
    KVFERRY_ASSIGN_OR_RETURN(std::vector<TpSource> sources,
                             PlanTpSources(geometry, prefill_tp, decode_tp, r));
    for (const TpSource& s : sources) {
      if (s.prefill_rank == prefill_rank) ++readers;
    }
  }
  return readers;
}

}  // namespace kvferry
