// Blocks of different token counts on the two sides (issue 28 item 5): PairTokenRuns and
// TokenRunByteRanges, checked against an oracle that places every (token, head, dim) element by
// the layout's definition, for both layouts, TP splits, strides and decode-side prefixes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>

#include "layout/block_runs.h"
#include "layout/tp_map.h"

namespace kvferry {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(PairTokenRunsTest, SixteenTokenBlocksFillThirtyTwoTokenOnes) {
  const std::vector<std::int64_t> remote = {7, 3, 9};  // tokens 0-15, 16-31, 32-47
  const std::vector<std::int64_t> local = {4, 5};      // tokens 0-31, 32-63
  Result<std::vector<TokenRun>> runs = PairTokenRuns({remote, 16, 10, 0}, {local, 32, 6, 0}, 0, 40);
  ASSERT_TRUE(runs.ok()) << runs.status().ToString();
  EXPECT_THAT(*runs, ElementsAre(TokenRun{7, 0, 4, 0, 16}, TokenRun{3, 0, 4, 16, 16},
                                 TokenRun{9, 0, 5, 0, 8}));
}

TEST(PairTokenRunsTest, ThirtyTwoTokenBlocksSplitIntoSixteenTokenOnesAfterAPrefix) {
  // The decode side had tokens 0-15 cached; it loads 16-49 into blocks of 16.
  const std::vector<std::int64_t> remote = {2, 8};  // tokens 0-31, 32-63
  const std::vector<std::int64_t> local = {11, 12, 13};
  Result<std::vector<TokenRun>> runs =
      PairTokenRuns({remote, 32, 10, 0}, {local, 16, 20, 16}, 16, 34);
  ASSERT_TRUE(runs.ok()) << runs.status().ToString();
  EXPECT_THAT(*runs, ElementsAre(TokenRun{2, 16, 11, 0, 16}, TokenRun{8, 0, 12, 0, 16},
                                 TokenRun{8, 16, 13, 0, 2}));
}

TEST(PairTokenRunsTest, BadInputIsRefusedNamingTheValue) {
  const std::vector<std::int64_t> remote = {1, 2};
  const std::vector<std::int64_t> local = {3, 3};
  EXPECT_THAT(PairTokenRuns({remote, 16, 4, 0}, {local, 16, 8, 0}, 0, 32).status().message(),
              HasSubstr("local block id 3 appears twice"));
  const std::vector<std::int64_t> out_of_range = {1, 4};
  EXPECT_THAT(PairTokenRuns({out_of_range, 16, 4, 0}, {remote, 16, 8, 0}, 0, 32).status().message(),
              HasSubstr("remote block id 4 at index 1 is outside [0, 4)"));
  EXPECT_THAT(PairTokenRuns({remote, 16, 4, 0}, {remote, 32, 8, 0}, 0, 33).status().message(),
              HasSubstr("remote blocks hold tokens [0, 32)"));
  EXPECT_THAT(PairTokenRuns({remote, 16, 4, 0}, {remote, 8, 8, 8}, 0, 16).status().message(),
              HasSubstr("local blocks hold tokens [8, 24)"));
  // A peer's block size is anything its byte counts allow: the token count must not overflow.
  EXPECT_THAT(PairTokenRuns({remote, std::int64_t{1} << 62, 4, 0}, {remote, 8, 8, 0}, 0, 16)
                  .status()
                  .message(),
              HasSubstr("hold more tokens than a load can count"));
  EXPECT_EQ(PairTokenRuns({remote, 0, 4, 0}, {remote, 8, 8, 0}, 0, 16).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(PairTokenRuns({remote, 16, 4, 0}, {remote, 8, 8, 0}, 0, -1).status().code(),
            StatusCode::kInvalidArgument);
}

// One side of the oracle: a cache of int32 elements, every part of every layer its own array.
struct Side {
  CacheSpec spec;
  std::vector<std::vector<std::int32_t>> parts;  // [layer * num_parts + part]

  static Side Make(const CacheSpec& spec, std::int32_t fill) {
    Side s{spec, {}};
    for (int l = 0; l < spec.num_layers(); ++l) {
      for (int p = 0; p < spec.num_parts(); ++p) {
        s.parts.emplace_back(static_cast<std::size_t>(spec.PartBytes(p) / 4), fill);
      }
    }
    return s;
  }
  // Element index of (block, slot, this rank's head h, dim) of part p, by the layout's definition.
  std::size_t Index(int p, std::int64_t block, std::int64_t slot, std::int64_t h,
                    std::int64_t dim) const {
    const std::int64_t heads = spec.LocalHeads(p);
    const std::int64_t hd = spec.parts()[static_cast<std::size_t>(p)].head_dim;
    const std::int64_t tpb = spec.tokens_per_block();
    const std::int64_t inner =
        spec.layout() == BlockLayout::kTokenMajor ? (slot * heads + h) * hd : (h * tpb + slot) * hd;
    return static_cast<std::size_t>(block * spec.BlockStride(p) / 4 + inner + dim);
  }
  std::vector<std::int32_t>& Part(int layer, int p) {
    return parts[static_cast<std::size_t>(layer * spec.num_parts() + p)];
  }
};

constexpr std::int64_t kBlocks = 16;  // enough for 100 tokens in blocks of 8

std::int32_t Value(int layer, int part, std::int64_t token, std::int64_t model_head,
                   std::int64_t dim) {
  return static_cast<std::int32_t>(((layer * 4 + part) * 4096 + token) * 256 + model_head * 16 +
                                   dim + 1);
}

CacheSpec Spec(BlockLayout layout, std::int64_t tpb, int tp, int rank, bool strided) {
  CacheSpecOptions o;
  LayerSpec layer{CacheKind::kMha, {{"k", 4, 4}, {"v", 4, 4}}, {}};
  o.layers = {layer, layer};
  o.num_blocks = kBlocks;
  o.tokens_per_block = tpb;
  o.dtype = DType::kInt32;
  o.layout = layout;
  o.tp_size = tp;
  o.tp_rank = rank;
  Result<CacheSpec> packed = CacheSpec::Create(o);
  EXPECT_TRUE(packed.ok()) << packed.status().ToString();
  if (strided) {
    // As a (num_blocks, 2, ...) tensor: a block of K and one of V, then the next block.
    o.block_strides = {2 * packed->BlockBytes(0), 2 * packed->BlockBytes(1)};
  }
  Result<CacheSpec> spec = CacheSpec::Create(o);
  EXPECT_TRUE(spec.ok()) << spec.status().ToString();
  return *spec;
}

struct Case {
  BlockLayout layout;
  std::int64_t remote_tpb;
  std::int64_t local_tpb;
  int remote_tp;
  int local_tp;
  bool remote_strided;
  bool local_strided;
};

// Every token of the load lands where the layout puts it on the decode rank, from the prefill
// rank holding its head; every byte is written once and nothing outside the load is touched.
void CheckCase(const Case& c, std::int64_t prompt, std::int64_t prefix, std::mt19937& rng) {
  const std::string where = std::string(BlockLayoutName(c.layout)) + " P" +
                            std::to_string(c.remote_tpb) + "x" + std::to_string(c.remote_tp) +
                            " -> D" + std::to_string(c.local_tpb) + "x" +
                            std::to_string(c.local_tp) + " prompt " + std::to_string(prompt) +
                            " prefix " + std::to_string(prefix);
  std::vector<std::int64_t> remote_ids(kBlocks);
  std::iota(remote_ids.begin(), remote_ids.end(), 0);
  std::shuffle(remote_ids.begin(), remote_ids.end(), rng);
  remote_ids.resize(static_cast<std::size_t>((prompt + c.remote_tpb - 1) / c.remote_tpb));
  std::vector<std::int64_t> local_ids(kBlocks);
  std::iota(local_ids.begin(), local_ids.end(), 0);
  if (rng() % 2 == 0) std::shuffle(local_ids.begin(), local_ids.end(), rng);  // else contiguous
  local_ids.resize(
      static_cast<std::size_t>((prompt + c.local_tpb - 1) / c.local_tpb - prefix / c.local_tpb));
  for (int d = 0; d < c.local_tp; ++d) {
    Side local = Side::Make(Spec(c.layout, c.local_tpb, c.local_tp, d, c.local_strided), -1);
    std::vector<std::vector<int>> writes;
    for (auto& part : local.parts) writes.emplace_back(part.size(), 0);
    Result<std::vector<TpSource>> sources = PlanTpSources(local.spec, c.remote_tp, c.local_tp, d);
    ASSERT_TRUE(sources.ok()) << sources.status().ToString();
    for (const TpSource& source : *sources) {
      Side remote = Side::Make(
          Spec(c.layout, c.remote_tpb, c.remote_tp, source.prefill_rank, c.remote_strided), 0);
      for (int l = 0; l < 2; ++l) {
        for (int p = 0; p < 2; ++p) {
          for (std::size_t i = 0; i < remote_ids.size(); ++i) {
            for (std::int64_t s = 0; s < c.remote_tpb; ++s) {
              for (std::int64_t h = 0; h < remote.spec.LocalHeads(p); ++h) {
                for (std::int64_t dim = 0; dim < 4; ++dim) {
                  const std::int64_t token = static_cast<std::int64_t>(i) * c.remote_tpb + s;
                  remote.Part(l, p)[remote.Index(p, remote_ids[i], s, h, dim)] =
                      Value(l, p, token, remote.spec.FirstLocalHead(p) + h, dim);
                }
              }
            }
          }
        }
      }
      Result<std::vector<TokenRun>> runs =
          PairTokenRuns({remote_ids, c.remote_tpb, kBlocks, 0},
                        {local_ids, c.local_tpb, kBlocks, prefix}, prefix, prompt - prefix);
      ASSERT_TRUE(runs.ok()) << where << ": " << runs.status().ToString();
      for (const ByteRange& r : TokenRunByteRanges(*runs, 0, 2, remote.spec, local.spec, source)) {
        const auto& from = remote.Part(r.layer, r.part);
        auto& to = local.Part(r.layer, r.part);
        auto& written = writes[static_cast<std::size_t>(r.layer * 2 + r.part)];
        for (std::int64_t i = 0; i < r.count; ++i) {
          const std::int64_t src = r.remote_offset + i * r.remote_step;
          const std::int64_t dst = r.local_offset + i * r.local_step;
          ASSERT_EQ(src % 4, 0) << where;
          ASSERT_EQ(dst % 4, 0) << where;
          ASSERT_LE(static_cast<std::size_t>((src + r.length) / 4), from.size()) << where;
          ASSERT_LE(static_cast<std::size_t>((dst + r.length) / 4), to.size()) << where;
          std::memcpy(&to[static_cast<std::size_t>(dst / 4)],
                      &from[static_cast<std::size_t>(src / 4)], static_cast<std::size_t>(r.length));
          for (std::int64_t b = 0; b < r.length / 4; ++b)
            ++written[static_cast<std::size_t>(dst / 4 + b)];
        }
      }
    }
    for (int l = 0; l < 2; ++l) {
      for (int p = 0; p < 2; ++p) {
        std::vector<int> expected_writes(local.Part(l, p).size(), 0);
        for (std::size_t j = 0; j < local_ids.size(); ++j) {
          for (std::int64_t s = 0; s < c.local_tpb; ++s) {
            const std::int64_t token = prefix + static_cast<std::int64_t>(j) * c.local_tpb + s;
            if (token >= prompt) continue;
            for (std::int64_t h = 0; h < local.spec.LocalHeads(p); ++h) {
              for (std::int64_t dim = 0; dim < 4; ++dim) {
                const std::size_t at = local.Index(p, local_ids[j], s, h, dim);
                ASSERT_EQ(local.Part(l, p)[at],
                          Value(l, p, token, local.spec.FirstLocalHead(p) + h, dim))
                    << where << " rank " << d << " layer " << l << " part " << p << " token "
                    << token << " head " << h << " dim " << dim;
                expected_writes[at] = 1;
              }
            }
          }
        }
        // Nothing outside the load's tokens is written (not even slots past the prompt), and
        // no element twice.
        const auto& written = writes[static_cast<std::size_t>(l * 2 + p)];
        for (std::size_t i = 0; i < written.size(); ++i) {
          ASSERT_LE(written[i], 1) << where << ": element " << i << " written twice";
          if (expected_writes[i] == 0) {
            ASSERT_EQ(written[i], 0) << where << ": element " << i << " outside the load written";
          }
        }
      }
    }
  }
}

TEST(TokenRunByteRangesTest, EveryTokenLandsWhereTheLayoutPutsIt) {
  std::mt19937 rng(28);
  for (BlockLayout layout : {BlockLayout::kTokenMajor, BlockLayout::kHeadMajor}) {
    for (auto [p_tpb, d_tpb] :
         {std::pair<std::int64_t, std::int64_t>{16, 32}, {32, 16}, {8, 32}, {16, 24}, {16, 16}}) {
      for (auto [p_tp, d_tp] : {std::pair{1, 1}, {2, 1}, {1, 2}, {2, 4}, {4, 2}}) {
        for (int strides = 0; strides < 4; ++strides) {
          const Case c{layout, p_tpb, d_tpb, p_tp, d_tp, (strides & 1) != 0, (strides & 2) != 0};
          for (std::int64_t prompt : {1, 33, 48, 100}) {
            for (std::int64_t prefix : {std::int64_t{0}, d_tpb}) {
              if (prefix >= prompt) continue;
              CheckCase(c, prompt, prefix, rng);
              if (::testing::Test::HasFatalFailure()) return;
            }
          }
        }
      }
    }
  }
}

TEST(TokenRunByteRangesTest, WholeTokensOfAdjacentBlocksAreOneRead) {
  // P 16 -> D 32, contiguous on both sides, packed, equal TP: one read per layer and part.
  const CacheSpec remote = Spec(BlockLayout::kTokenMajor, 16, 1, 0, false);
  const CacheSpec local = Spec(BlockLayout::kTokenMajor, 32, 1, 0, false);
  const std::vector<std::int64_t> remote_ids = {2, 3, 4, 5};
  const std::vector<std::int64_t> local_ids = {6, 7};
  Result<std::vector<TokenRun>> runs =
      PairTokenRuns({remote_ids, 16, 12, 0}, {local_ids, 32, 12, 0}, 0, 64);
  ASSERT_TRUE(runs.ok());
  Result<std::vector<TpSource>> sources = PlanTpSources(local, 1, 1, 0);
  ASSERT_TRUE(sources.ok());
  const std::vector<ByteRange> ranges =
      TokenRunByteRanges(*runs, 0, 2, remote, local, sources->front());
  ASSERT_EQ(ranges.size(), 4u);  // 2 layers x 2 parts
  EXPECT_EQ(ranges[0].length, 64 * 4 * 4 * 4);
  EXPECT_EQ(ranges[0].remote_offset, 2 * remote.BlockBytes(0));
  EXPECT_EQ(ranges[0].local_offset, 6 * local.BlockBytes(0));
}

}  // namespace
}  // namespace kvferry
