#include "layout/tp_map.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tests/head_placement.h"

namespace kvferry {
namespace {

using ::testing::HasSubstr;

constexpr std::int64_t kTokens = 2;
constexpr std::int64_t kDim = 3;

// Value of model-wide head h, token t, element e: unique per (h, t, e).
std::int32_t Value(std::int64_t h, std::int64_t t, std::int64_t e) {
  return static_cast<std::int32_t>(h * 1000 + t * 10 + e);
}

// One block of one part as TP rank `rank` of `tp` stores it. Its heads come from the test's own
// placement oracle, not from SplitHeads, which the plans under test are built on.
std::vector<std::int32_t> MakeBlock(std::int64_t heads, int tp, int rank, BlockLayout layout) {
  const testing::OracleHeads hr = testing::OracleHeadsOfRank(heads, tp, rank);
  std::vector<std::int32_t> block(static_cast<std::size_t>(hr.count * kTokens * kDim));
  for (std::int64_t hl = 0; hl < hr.count; ++hl) {
    for (std::int64_t t = 0; t < kTokens; ++t) {
      for (std::int64_t e = 0; e < kDim; ++e) {
        const std::int64_t idx = layout == BlockLayout::kTokenMajor ? (t * hr.count + hl) * kDim + e
                                                                    : (hl * kTokens + t) * kDim + e;
        block[static_cast<std::size_t>(idx)] = Value(hr.first + hl, t, e);
      }
    }
  }
  return block;
}

// Exhaustive over prefill and decode TP 1..8 and several head counts, in both layouts: every
// plan rebuilds each decode rank's block byte for byte from the prefill ranks' blocks, writing
// every byte exactly once (token-major head slices as one piece per token slot); reader counts
// equal the plans' use of each prefill rank; only head counts TP cannot split are refused.
TEST(TpMapTest, ExhaustiveMhaPlansRebuildEveryDecodeBlock) {
  int supported = 0;
  int strided = 0;
  for (std::int64_t heads : {1, 2, 4, 8, 16}) {
    for (BlockLayout layout : {BlockLayout::kTokenMajor, BlockLayout::kHeadMajor}) {
      for (int p = 1; p <= 8; ++p) {
        for (int d = 1; d <= 8; ++d) {
          auto divisible = [&](int tp) { return tp <= heads ? heads % tp == 0 : tp % heads == 0; };
          CacheSpec geometry =
              *CacheSpec::Mha(1, heads, kDim, 1, kTokens, DType::kInt32, 1, 0, layout);
          if (!divisible(p) || !divisible(d)) {
            Result<std::vector<TpSource>> plan = PlanTpSources(geometry, p, d, 0);
            EXPECT_EQ(plan.status().code(), StatusCode::kNotSupported);
            continue;
          }
          std::map<int, int> uses;
          for (int r = 0; r < d; ++r) {
            Result<std::vector<TpSource>> plan = PlanTpSources(geometry, p, d, r);
            ASSERT_TRUE(plan.ok())
                << "heads " << heads << " p " << p << " d " << d << " r " << r << " "
                << BlockLayoutName(layout) << ": " << plan.status().ToString();
            ++supported;
            const std::vector<std::int32_t> want = MakeBlock(heads, d, r, layout);
            std::vector<std::int32_t> got(want.size(), -1);
            std::vector<int> writes(want.size() * sizeof(std::int32_t), 0);
            int previous = -1;
            for (const TpSource& s : *plan) {
              EXPECT_GT(s.prefill_rank, previous) << "sources sorted and unique";
              previous = s.prefill_rank;
              ++uses[s.prefill_rank];
              ASSERT_EQ(s.part_slices.size(), 2u);
              EXPECT_EQ(s.part_slices[0], s.part_slices[1]);  // K and V share the geometry
              const std::vector<std::int32_t> src = MakeBlock(heads, p, s.prefill_rank, layout);
              const BlockSlice& sl = s.part_slices[0];
              ASSERT_GE(sl.count, 1);
              if (sl.count > 1) {
                ++strided;
                EXPECT_EQ(layout, BlockLayout::kTokenMajor) << "head-major slices are one range";
                EXPECT_GE(sl.remote_step, sl.length);
                EXPECT_GE(sl.local_step, sl.length);
              }
              for (std::int64_t i = 0; i < sl.count; ++i) {
                const std::int64_t from = sl.remote_offset + i * sl.remote_step;
                const std::int64_t to = sl.local_offset + i * sl.local_step;
                ASSERT_GE(from, 0);
                ASSERT_LE(from + sl.length,
                          static_cast<std::int64_t>(src.size() * sizeof(std::int32_t)));
                ASSERT_LE(to + sl.length,
                          static_cast<std::int64_t>(got.size() * sizeof(std::int32_t)));
                std::memcpy(reinterpret_cast<char*>(got.data()) + to,
                            reinterpret_cast<const char*>(src.data()) + from,
                            static_cast<std::size_t>(sl.length));
                for (std::int64_t b = 0; b < sl.length; ++b) {
                  ++writes[static_cast<std::size_t>(to + b)];
                }
              }
            }
            EXPECT_EQ(got, want) << "heads " << heads << " p " << p << " d " << d << " r " << r;
            for (int w : writes) ASSERT_EQ(w, 1) << "every byte written exactly once";
          }
          for (int q = 0; q < p; ++q) {
            Result<int> readers = ExpectedReaders(geometry, p, d, q);
            ASSERT_TRUE(readers.ok());
            EXPECT_EQ(*readers, uses[q]) << "heads " << heads << " p " << p << " d " << d;
          }
        }
      }
    }
  }
  EXPECT_GT(supported, 0);
  EXPECT_GT(strided, 0);
}

// MLA is replicated: decode rank r reads the whole block of prefill rank r % p, and a prefill
// rank waits for every decode rank that maps to it (DESIGN rule 10), not just the first.
TEST(TpMapTest, ExhaustiveMlaReadsWholeBlocksFromRModP) {
  for (bool sparse : {false, true}) {
    CacheSpec geometry = sparse ? *CacheSpec::SparseMla(1, 512, 64, 128, 1, 16, DType::kBFloat16)
                                : *CacheSpec::Mla(1, 512, 64, 1, 16, DType::kBFloat16);
    for (int p = 1; p <= 8; ++p) {
      for (int d = 1; d <= 8; ++d) {
        for (int r = 0; r < d; ++r) {
          Result<std::vector<TpSource>> plan = PlanTpSources(geometry, p, d, r);
          ASSERT_TRUE(plan.ok());
          ASSERT_EQ(plan->size(), 1u);
          EXPECT_EQ(plan->front().prefill_rank, r % p);
          ASSERT_EQ(plan->front().part_slices.size(), sparse ? 3u : 2u);
          for (int part = 0; part < geometry.num_parts(); ++part) {
            const BlockSlice& sl = plan->front().part_slices[static_cast<std::size_t>(part)];
            EXPECT_TRUE(sl.whole_block);
            EXPECT_EQ(sl.length, geometry.BlockBytes(part));
          }
        }
        int total = 0;
        for (int q = 0; q < p; ++q) {
          int want = 0;
          for (int r = 0; r < d; ++r) want += (r % p == q) ? 1 : 0;
          Result<int> readers = ExpectedReaders(geometry, p, d, q);
          ASSERT_TRUE(readers.ok());
          EXPECT_EQ(*readers, want) << "p " << p << " d " << d << " q " << q;
          total += *readers;
        }
        EXPECT_EQ(total, d);
      }
    }
  }
}

// Token-major heterogeneous TP (issue 22 item 6): decode rank 1 of TP 4 holds heads [2, 4) of 8;
// prefill rank 0 of TP 2 holds [0, 4). Per token slot: 2 heads of 128 bf16 values, at head 2 of
// the remote token row (4 heads) and head 0 of the local one (2 heads): 16 pieces, one per slot.
TEST(TpMapTest, TokenMajorHeadSlicesAreOnePiecePerTokenSlot) {
  CacheSpec geometry = *CacheSpec::Mha(1, 8, 128, 1, 16, DType::kBFloat16);
  Result<std::vector<TpSource>> plan = PlanTpSources(geometry, 2, 4, 1);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_EQ(plan->size(), 1u);
  EXPECT_EQ((*plan)[0].prefill_rank, 0);
  EXPECT_EQ((*plan)[0].part_slices[0],
            (BlockSlice{2 * 256, 0, 2 * 256, false, 16, 4 * 256, 2 * 256}));
  // The other way, TP 4 -> 2: decode rank 0 holds [0, 4), read from prefill ranks 0 and 1.
  plan = PlanTpSources(geometry, 4, 2, 0);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->size(), 2u);
  EXPECT_EQ((*plan)[1].part_slices[0],
            (BlockSlice{0, 2 * 256, 2 * 256, false, 16, 2 * 256, 4 * 256}));
}

TEST(TpMapTest, RefusalNamesTheCombinationAndTheWayOut) {
  CacheSpec geometry = *CacheSpec::Mha(1, 8, 128, 1, 16, DType::kBFloat16);
  EXPECT_THAT(PlanTpSources(geometry, 3, 1, 0).status().message(),
              HasSubstr("cannot be split across TP size 3"));
  EXPECT_EQ(PlanTpSources(geometry, 2, 2, 2).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpectedReaders(geometry, 2, 2, -1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanTpSources(geometry, 0, 2, 0).status().code(), StatusCode::kInvalidArgument);
}

// Hand-computed placement tables (literal numbers, worked out from the definition on paper): which
// model heads each TP rank holds. SplitHeads, CacheSpec::FirstLocalHead/LocalHeads and the test
// oracle must all agree with them, so a placement bug that the plans share with SplitHeads (and
// that a byte oracle asking SplitHeads would share too) still fails here.
struct PlacementTable {
  std::int64_t heads;
  int tp;
  std::vector<std::pair<std::int64_t, std::int64_t>> first_and_count;  // per rank
};

TEST(TpMapTest, HeadPlacementMatchesHandWrittenTables) {
  const std::vector<PlacementTable> tables = {
      {8, 1, {{0, 8}}},
      {8, 2, {{0, 4}, {4, 4}}},
      {8, 4, {{0, 2}, {2, 2}, {4, 2}, {6, 2}}},
      {8, 8, {{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}, {6, 1}, {7, 1}}},
      // Fewer heads than ranks: each head on tp / heads consecutive ranks.
      {2, 4, {{0, 1}, {0, 1}, {1, 1}, {1, 1}}},
      {4, 8, {{0, 1}, {0, 1}, {1, 1}, {1, 1}, {2, 1}, {2, 1}, {3, 1}, {3, 1}}},
      {1, 2, {{0, 1}, {0, 1}}},
  };
  for (const PlacementTable& t : tables) {
    ASSERT_EQ(t.first_and_count.size(), static_cast<std::size_t>(t.tp));
    for (int r = 0; r < t.tp; ++r) {
      const auto [first, count] = t.first_and_count[static_cast<std::size_t>(r)];
      const std::string where = std::to_string(t.heads) + " heads, TP " + std::to_string(t.tp) +
                                ", rank " + std::to_string(r);
      const HeadRange split = SplitHeads(t.heads, t.tp, r);
      EXPECT_EQ(split.first, first) << where;
      EXPECT_EQ(split.count, count) << where;
      const testing::OracleHeads oracle = testing::OracleHeadsOfRank(t.heads, t.tp, r);
      EXPECT_EQ(oracle.first, first) << where << " (test oracle)";
      EXPECT_EQ(oracle.count, count) << where << " (test oracle)";
      for (BlockLayout layout : {BlockLayout::kTokenMajor, BlockLayout::kHeadMajor}) {
        Result<CacheSpec> spec =
            CacheSpec::Mha(1, t.heads, kDim, 1, kTokens, DType::kInt32, t.tp, r, layout);
        ASSERT_TRUE(spec.ok()) << where << ": " << spec.status().ToString();
        for (int part = 0; part < 2; ++part) {
          EXPECT_EQ(spec->FirstLocalHead(part), first) << where;
          EXPECT_EQ(spec->LocalHeads(part), count) << where;
          EXPECT_EQ(spec->BlockBytes(part), count * kTokens * kDim * 4) << where;
        }
      }
    }
  }
  // MLA is replicated: every rank holds the one latent and the one rope head, whole.
  for (int tp : {1, 2, 4}) {
    for (int r = 0; r < tp; ++r) {
      CacheSpec mla = *CacheSpec::Mla(1, 16, 4, 1, kTokens, DType::kInt32, tp, r);
      for (int part = 0; part < 2; ++part) {
        EXPECT_EQ(mla.FirstLocalHead(part), 0);
        EXPECT_EQ(mla.LocalHeads(part), 1);
      }
      EXPECT_EQ(mla.BlockBytes(0), 16 * kTokens * 4);
      EXPECT_EQ(mla.BlockBytes(1), 4 * kTokens * 4);
    }
  }
}

// One expected read of a decode rank, in heads: from `prefill_rank`, `heads` heads starting at its
// local head `remote_head`, into the decode rank's local head `local_head`.
struct ExpectedRead {
  int prefill_rank;
  std::int64_t remote_head;
  std::int64_t local_head;
  std::int64_t heads;
  bool whole;
};
struct PlanTable {
  std::int64_t heads;
  int prefill_tp;
  int decode_tp;
  BlockLayout layout;
  std::vector<std::vector<ExpectedRead>> reads;  // per decode rank, by ascending prefill rank
  std::vector<int> readers;                      // per prefill rank
};

TEST(TpMapTest, PlansMatchHandWrittenTables) {
  constexpr BlockLayout kHead = BlockLayout::kHeadMajor;
  constexpr BlockLayout kToken = BlockLayout::kTokenMajor;
  const std::vector<PlanTable> tables = {
      // 8 heads, 2 -> 4: decode rank r holds heads [2r, 2r + 2), the first or second half of
      // prefill rank r / 2's heads [4(r/2), 4(r/2) + 4).
      {8,
       2,
       4,
       kHead,
       {{{0, 0, 0, 2, false}}, {{0, 2, 0, 2, false}}, {{1, 0, 0, 2, false}}, {{1, 2, 0, 2, false}}},
       {2, 2}},
      // 8 heads, 4 -> 2: decode rank r holds heads [4r, 4r + 4): prefill ranks 2r and 2r + 1 each
      // give their two heads, into the first and the second half.
      {8,
       4,
       2,
       kHead,
       {{{0, 0, 0, 2, false}, {1, 0, 2, 2, false}}, {{2, 0, 0, 2, false}, {3, 0, 2, 2, false}}},
       {1, 1, 1, 1}},
      // 8 heads, 2 -> 2: the same rank, whole blocks, in either layout.
      {8, 2, 2, kToken, {{{0, 0, 0, 4, true}}, {{1, 0, 0, 4, true}}}, {1, 1}},
      // 8 heads, 1 -> 8: decode rank r reads head r of the single prefill rank.
      {8,
       1,
       8,
       kHead,
       {{{0, 0, 0, 1, false}},
        {{0, 1, 0, 1, false}},
        {{0, 2, 0, 1, false}},
        {{0, 3, 0, 1, false}},
        {{0, 4, 0, 1, false}},
        {{0, 5, 0, 1, false}},
        {{0, 6, 0, 1, false}},
        {{0, 7, 0, 1, false}}},
       {8}},
      // 2 heads, 2 -> 4: decode ranks 0, 1 hold head 0 (prefill rank 0's whole block), ranks 2, 3
      // head 1 (prefill rank 1's).
      {2,
       2,
       4,
       kToken,
       {{{0, 0, 0, 1, true}}, {{0, 0, 0, 1, true}}, {{1, 0, 0, 1, true}}, {{1, 0, 0, 1, true}}},
       {2, 2}},
      // 2 heads, 4 -> 2: prefill ranks 0, 1 hold head 0 and ranks 2, 3 head 1; decode rank r holds
      // head r and reads the replica r % 2 of it: prefill rank 0 for rank 0, 3 for rank 1.
      {2, 4, 2, kToken, {{{0, 0, 0, 1, true}}, {{3, 0, 0, 1, true}}}, {1, 0, 0, 1}},
  };
  constexpr std::int64_t kHeadBytes = kTokens * kDim * 4;
  for (const PlanTable& t : tables) {
    const std::string shape = std::to_string(t.heads) + " heads, prefill TP " +
                              std::to_string(t.prefill_tp) + " -> decode TP " +
                              std::to_string(t.decode_tp);
    CacheSpec geometry =
        *CacheSpec::Mha(1, t.heads, kDim, 1, kTokens, DType::kInt32, 1, 0, t.layout);
    ASSERT_EQ(t.reads.size(), static_cast<std::size_t>(t.decode_tp)) << shape;
    for (int r = 0; r < t.decode_tp; ++r) {
      Result<std::vector<TpSource>> plan = PlanTpSources(geometry, t.prefill_tp, t.decode_tp, r);
      ASSERT_TRUE(plan.ok()) << shape << ": " << plan.status().ToString();
      const std::vector<ExpectedRead>& want = t.reads[static_cast<std::size_t>(r)];
      ASSERT_EQ(plan->size(), want.size()) << shape << ", decode rank " << r;
      for (std::size_t i = 0; i < want.size(); ++i) {
        const TpSource& got = (*plan)[i];
        const std::string where =
            shape + ", decode rank " + std::to_string(r) + ", read " + std::to_string(i);
        EXPECT_EQ(got.prefill_rank, want[i].prefill_rank) << where;
        ASSERT_EQ(got.part_slices.size(), 2u) << where;
        for (const BlockSlice& sl : got.part_slices) {
          EXPECT_EQ(sl.remote_offset, want[i].remote_head * kHeadBytes) << where;
          EXPECT_EQ(sl.local_offset, want[i].local_head * kHeadBytes) << where;
          EXPECT_EQ(sl.length, want[i].heads * kHeadBytes) << where;
          EXPECT_EQ(sl.whole_block, want[i].whole) << where;
        }
      }
    }
    ASSERT_EQ(t.readers.size(), static_cast<std::size_t>(t.prefill_tp)) << shape;
    for (int q = 0; q < t.prefill_tp; ++q) {
      Result<int> readers = ExpectedReaders(geometry, t.prefill_tp, t.decode_tp, q);
      ASSERT_TRUE(readers.ok()) << shape;
      EXPECT_EQ(*readers, t.readers[static_cast<std::size_t>(q)])
          << shape << ", prefill rank " << q;
    }
  }
  // MLA, replicated: decode rank r reads prefill rank r % prefill_tp, whole blocks.
  CacheSpec mla = *CacheSpec::Mla(1, 16, 4, 1, kTokens, DType::kInt32);
  const std::vector<std::tuple<int, int, std::vector<int>, std::vector<int>>> mla_tables = {
      {2, 4, {0, 1, 0, 1}, {2, 2}},
      {4, 2, {0, 1}, {1, 1, 0, 0}},
      {1, 2, {0, 0}, {2}},
  };
  for (const auto& [p, d, sources, readers] : mla_tables) {
    for (int r = 0; r < d; ++r) {
      Result<std::vector<TpSource>> plan = PlanTpSources(mla, p, d, r);
      ASSERT_TRUE(plan.ok());
      ASSERT_EQ(plan->size(), 1u);
      EXPECT_EQ(plan->front().prefill_rank, sources[static_cast<std::size_t>(r)])
          << "MLA " << p << " -> " << d << ", decode rank " << r;
      EXPECT_EQ(plan->front().part_slices[0].length, 16 * kTokens * 4);
      EXPECT_EQ(plan->front().part_slices[1].length, 4 * kTokens * 4);
    }
    for (int q = 0; q < p; ++q) {
      EXPECT_EQ(*ExpectedReaders(mla, p, d, q), readers[static_cast<std::size_t>(q)])
          << "MLA " << p << " -> " << d << ", prefill rank " << q;
    }
  }
}

TEST(TpMapTest, DecodeTpSmallerThanPrefillLeavesUnreadRanksWithZeroReaders) {
  CacheSpec mla = *CacheSpec::Mla(1, 512, 64, 1, 16, DType::kBFloat16);
  EXPECT_EQ(*ExpectedReaders(mla, 4, 2, 3), 0);
  EXPECT_EQ(*ExpectedReaders(mla, 2, 4, 1), 2);
}

}  // namespace
}  // namespace kvferry

namespace kvferry {
namespace {

// Issue 29, state groups: a gated-delta-net layer's conv state Q, K, V channels and SSM state
// heads, each split across TP along its outer axis. Every decode rank's block is rebuilt from the
// prefill ranks' blocks, every byte once, for TP sizes 1, 2, 3, 4, 6 both ways (3 against 2 or 4:
// neither a multiple of the other, a share spanning two prefill ranks unevenly); reader counts
// equal the plans' use of each prefill rank; a part TP cannot split is refused, naming it.
CacheSpec StateSpec(int tp, int rank) {
  LayerSpec layer;
  layer.kind = CacheKind::kState;
  layer.parts = {{"conv_q", 12, 3}, {"conv_v", 24, 3}, {"ssm", 12, 6, DType::kFloat32}};
  CacheSpecOptions o;
  o.layers = {layer};
  o.num_blocks = 4;
  o.tokens_per_block = 4096;  // vLLM's block size of a Mamba group: max_model_len
  o.dtype = DType::kBFloat16;
  o.tp_size = tp;
  o.tp_rank = rank;
  Result<CacheSpec> s = CacheSpec::Create(o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return *s;
}

TEST(TpMapTest, StatePartsAreSlicedAlongTheirOuterAxisEveryWay) {
  for (int ptp : {1, 2, 3, 4, 6}) {
    for (int dtp : {1, 2, 3, 4, 6}) {
      std::map<int, int> uses;
      for (int d = 0; d < dtp; ++d) {
        const CacheSpec local = StateSpec(dtp, d);
        Result<std::vector<TpSource>> sources = PlanTpSources(local, ptp, dtp, d);
        ASSERT_TRUE(sources.ok()) << sources.status().ToString();
        for (int p = 0; p < local.num_parts(); ++p) {
          const std::int64_t unit =
              local.parts()[static_cast<std::size_t>(p)].head_dim * DTypeSize(local.PartDType(p));
          // Each byte of the decode block, written with the model-wide head it must hold.
          std::vector<std::int64_t> got(static_cast<std::size_t>(local.BlockBytes(p)), -1);
          for (const TpSource& s : *sources) {
            if (p == 0) ++uses[s.prefill_rank];
            const CacheSpec remote = StateSpec(ptp, s.prefill_rank);
            const BlockSlice& sl = s.part_slices[static_cast<std::size_t>(p)];
            for (std::int64_t b = 0; b < sl.length; ++b) {
              const std::int64_t head = remote.FirstLocalHead(p) + (sl.remote_offset + b) / unit;
              std::int64_t& at = got[static_cast<std::size_t>(sl.local_offset + b)];
              EXPECT_EQ(at, -1) << "written twice";
              at = head;
            }
          }
          for (std::int64_t b = 0; b < local.BlockBytes(p); ++b) {
            EXPECT_EQ(got[static_cast<std::size_t>(b)], local.FirstLocalHead(p) + b / unit)
                << "P" << ptp << " D" << dtp << " rank " << d << " part " << p << " byte " << b;
          }
        }
      }
      for (int q = 0; q < ptp; ++q) {
        Result<int> readers = ExpectedReaders(StateSpec(dtp, 0), ptp, dtp, q);
        ASSERT_TRUE(readers.ok());
        EXPECT_EQ(*readers, uses[q]) << "P" << ptp << " D" << dtp << " prefill rank " << q;
      }
    }
  }
  Status s = PlanTpSources(StateSpec(1, 0), 8, 1, 0).status();
  EXPECT_EQ(s.code(), StatusCode::kNotSupported);
  EXPECT_THAT(s.message(), HasSubstr("state part 'conv_q' has 12"));
}

}  // namespace
}  // namespace kvferry
