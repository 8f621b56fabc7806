#include "layout/tp_map.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <vector>

namespace kvferry {
namespace {

using ::testing::HasSubstr;

constexpr std::int64_t kTokens = 2;
constexpr std::int64_t kDim = 3;

// Value of model-wide head h, token t, element e: unique per (h, t, e).
std::int32_t Value(std::int64_t h, std::int64_t t, std::int64_t e) {
  return static_cast<std::int32_t>(h * 1000 + t * 10 + e);
}

// One block of one part as TP rank `rank` of `tp` stores it.
std::vector<std::int32_t> MakeBlock(std::int64_t heads, int tp, int rank, BlockLayout layout) {
  const HeadRange hr = SplitHeads(heads, tp, rank);
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

bool TokenMajorSupported(std::int64_t heads, int p, int d) {
  return p == d || (p >= heads && d >= heads);
}

// Exhaustive over prefill and decode TP 1..8 and several head counts, in both layouts: every
// supported plan rebuilds each decode rank's block byte for byte from the prefill ranks' blocks,
// writing every byte exactly once; reader counts equal the plans' use of each prefill rank; and
// exactly the combinations that need strided head slices in token-major layout are refused.
TEST(TpMapTest, ExhaustiveMhaPlansRebuildEveryDecodeBlock) {
  int supported = 0;
  int refused = 0;
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
          const bool expect_ok =
              layout == BlockLayout::kHeadMajor || TokenMajorSupported(heads, p, d);
          std::map<int, int> uses;
          for (int r = 0; r < d; ++r) {
            Result<std::vector<TpSource>> plan = PlanTpSources(geometry, p, d, r);
            ASSERT_EQ(plan.ok(), expect_ok)
                << "heads " << heads << " p " << p << " d " << d << " r " << r << " "
                << BlockLayoutName(layout) << ": " << plan.status().ToString();
            if (!plan.ok()) {
              EXPECT_EQ(plan.status().code(), StatusCode::kNotSupported);
              EXPECT_THAT(plan.status().message(),
                          HasSubstr("prefill TP " + std::to_string(p) + " and decode TP " +
                                    std::to_string(d)));
              ++refused;
              continue;
            }
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
              ASSERT_GE(sl.remote_offset, 0);
              ASSERT_LE(sl.remote_offset + sl.length,
                        static_cast<std::int64_t>(src.size() * sizeof(std::int32_t)));
              ASSERT_LE(sl.local_offset + sl.length,
                        static_cast<std::int64_t>(got.size() * sizeof(std::int32_t)));
              std::memcpy(reinterpret_cast<char*>(got.data()) + sl.local_offset,
                          reinterpret_cast<const char*>(src.data()) + sl.remote_offset,
                          static_cast<std::size_t>(sl.length));
              for (std::int64_t b = 0; b < sl.length; ++b) {
                ++writes[static_cast<std::size_t>(sl.local_offset + b)];
              }
            }
            EXPECT_EQ(got, want) << "heads " << heads << " p " << p << " d " << d << " r " << r;
            for (int w : writes) ASSERT_EQ(w, 1) << "every byte written exactly once";
          }
          if (!expect_ok) {
            EXPECT_EQ(ExpectedReaders(geometry, p, d, 0).status().code(),
                      StatusCode::kNotSupported);
            continue;
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
  EXPECT_GT(refused, 0);
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

TEST(TpMapTest, RefusalNamesTheCombinationAndTheWayOut) {
  CacheSpec geometry = *CacheSpec::Mha(1, 8, 128, 1, 16, DType::kBFloat16);
  Result<std::vector<TpSource>> plan = PlanTpSources(geometry, 2, 4, 1);
  ASSERT_EQ(plan.status().code(), StatusCode::kNotSupported);
  EXPECT_THAT(plan.status().message(), HasSubstr("MHA cache with 8 KV heads, prefill TP 2 and "
                                                 "decode TP 4"));
  EXPECT_THAT(plan.status().message(), HasSubstr("head_major"));
  EXPECT_THAT(PlanTpSources(geometry, 3, 1, 0).status().message(),
              HasSubstr("cannot be split across TP size 3"));
  EXPECT_EQ(PlanTpSources(geometry, 2, 2, 2).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpectedReaders(geometry, 2, 2, -1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanTpSources(geometry, 0, 2, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(TpMapTest, DecodeTpSmallerThanPrefillLeavesUnreadRanksWithZeroReaders) {
  CacheSpec mla = *CacheSpec::Mla(1, 512, 64, 1, 16, DType::kBFloat16);
  EXPECT_EQ(*ExpectedReaders(mla, 4, 2, 3), 0);
  EXPECT_EQ(*ExpectedReaders(mla, 2, 4, 1), 2);
}

}  // namespace
}  // namespace kvferry
