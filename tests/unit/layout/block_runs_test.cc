#include "layout/block_runs.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

namespace kvferry {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(TailOfRemoteTest, TakesTheTailWhenTheDecodeSideHoldsAPrefix) {
  const std::vector<std::int64_t> remote = {10, 11, 12, 13, 14};
  const std::vector<std::int64_t> local = {7, 8};
  Result<std::span<const std::int64_t>> tail = TailOfRemote(remote, local);
  ASSERT_TRUE(tail.ok());
  EXPECT_THAT(std::vector<std::int64_t>(tail->begin(), tail->end()), ElementsAre(13, 14));
}

TEST(TailOfRemoteTest, ZeroLocalBlocksGivesAnEmptyList) {
  const std::vector<std::int64_t> remote = {1, 2};
  Result<std::span<const std::int64_t>> tail = TailOfRemote(remote, {});
  ASSERT_TRUE(tail.ok());
  EXPECT_TRUE(tail->empty());
}

TEST(TailOfRemoteTest, MoreLocalThanRemoteIsAnError) {
  const std::vector<std::int64_t> remote = {1};
  const std::vector<std::int64_t> local = {1, 2};
  EXPECT_THAT(TailOfRemote(remote, local).status().message(),
              HasSubstr("allocated 2 blocks but the prefill side sent only 1"));
}

TEST(MergeBlockRunsTest, MergesOnlyWhereBothSidesAreContiguous) {
  const std::vector<std::int64_t> remote = {4, 5, 6, 9, 10, 11};
  const std::vector<std::int64_t> local = {0, 1, 3, 4, 5, 6};
  Result<std::vector<BlockRun>> runs = MergeBlockRuns(remote, local, 16, 16);
  ASSERT_TRUE(runs.ok());
  EXPECT_THAT(*runs, ElementsAre(BlockRun{4, 0, 2}, BlockRun{6, 3, 1}, BlockRun{9, 4, 3}));
}

TEST(MergeBlockRunsTest, RejectsOutOfRangeAndDuplicateLocalIds) {
  const std::vector<std::int64_t> remote = {0, 1};
  EXPECT_THAT(MergeBlockRuns(remote, std::vector<std::int64_t>{0, 8}, 8, 8).status().message(),
              HasSubstr("local block id 8 at index 1 is outside [0, 8)"));
  EXPECT_THAT(
      MergeBlockRuns(std::vector<std::int64_t>{0, -1}, std::vector<std::int64_t>{0, 1}, 8, 8)
          .status()
          .message(),
      HasSubstr("remote block id -1"));
  EXPECT_THAT(MergeBlockRuns(remote, std::vector<std::int64_t>{3, 3}, 8, 8).status().message(),
              HasSubstr("appears twice"));
  EXPECT_THAT(MergeBlockRuns(remote, std::vector<std::int64_t>{3}, 8, 8).status().message(),
              HasSubstr("as many remote as local"));
}

// Property test: on random id lists the runs expand back to the same pairs, no two neighbouring
// runs could have been merged, and copying the byte ranges moves exactly what copying block by
// block (the naive version) moves.
TEST(MergeBlockRunsTest, RandomListsMatchTheNaiveCopy) {
  std::mt19937_64 rng(20261129);
  for (int iter = 0; iter < 500; ++iter) {
    const std::int64_t remote_blocks = 1 + static_cast<std::int64_t>(rng() % 40);
    const std::int64_t local_blocks = 1 + static_cast<std::int64_t>(rng() % 40);
    const std::int64_t n =
        static_cast<std::int64_t>(rng() % std::min(remote_blocks, local_blocks + 1));
    std::vector<std::int64_t> local(static_cast<std::size_t>(local_blocks));
    std::iota(local.begin(), local.end(), 0);
    std::shuffle(local.begin(), local.end(), rng);
    // Bias toward runs: sort a random prefix so contiguous stretches appear.
    std::sort(local.begin(),
              local.begin() + static_cast<std::ptrdiff_t>(rng() % (local.size() + 1)));
    local.resize(static_cast<std::size_t>(std::min<std::int64_t>(n, local_blocks)));
    std::vector<std::int64_t> remote;
    std::int64_t next = static_cast<std::int64_t>(rng() % remote_blocks);
    for (std::size_t i = 0; i < local.size() + rng() % 3; ++i) {
      remote.push_back(next);
      next = (rng() % 3 == 0) ? static_cast<std::int64_t>(rng() % remote_blocks)
                              : (next + 1) % remote_blocks;
    }
    Result<std::span<const std::int64_t>> tail = TailOfRemote(remote, local);
    ASSERT_TRUE(tail.ok());
    Result<std::vector<BlockRun>> runs = MergeBlockRuns(*tail, local, remote_blocks, local_blocks);
    ASSERT_TRUE(runs.ok()) << runs.status().ToString();

    std::vector<std::pair<std::int64_t, std::int64_t>> expanded;
    for (const BlockRun& r : *runs) {
      ASSERT_GT(r.count, 0);
      for (std::int64_t b = 0; b < r.count; ++b) {
        expanded.emplace_back(r.remote_start + b, r.local_start + b);
      }
    }
    ASSERT_EQ(expanded.size(), local.size());
    for (std::size_t i = 0; i < local.size(); ++i) {
      EXPECT_EQ(expanded[i].first, (*tail)[i]);
      EXPECT_EQ(expanded[i].second, local[i]);
    }
    for (std::size_t k = 1; k < runs->size(); ++k) {
      const BlockRun& a = (*runs)[k - 1];
      const BlockRun& b = (*runs)[k];
      EXPECT_FALSE(b.remote_start == a.remote_start + a.count &&
                   b.local_start == a.local_start + a.count)
          << "runs " << k - 1 << " and " << k << " could merge";
    }

    // Byte ranges for 2 layers, 2 parts of different block sizes, whole-block slices.
    const std::vector<PartBlockBytes> sizes = {{24, 24}, {8, 8}};
    TpSource whole{0, {{0, 0, 24, true}, {0, 0, 8, true}}};
    std::vector<std::uint8_t> src(static_cast<std::size_t>(remote_blocks * 24 * 4));
    for (auto& byte : src) byte = static_cast<std::uint8_t>(rng());
    auto part_base = [](std::int64_t blocks, int layer, int part) {
      // Layout of the test buffers: layer-major, then part; part 0 is 24 bytes a block, part 1
      // is 8.
      return (layer * 2 + part) * blocks * 24;
    };
    std::vector<std::uint8_t> got(static_cast<std::size_t>(local_blocks * 24 * 4), 0);
    std::vector<std::uint8_t> want = got;
    for (const ByteRange& br : RunByteRanges(*runs, 2, sizes, whole)) {
      std::memcpy(&got[static_cast<std::size_t>(part_base(local_blocks, br.layer, br.part) +
                                                br.local_offset)],
                  &src[static_cast<std::size_t>(part_base(remote_blocks, br.layer, br.part) +
                                                br.remote_offset)],
                  static_cast<std::size_t>(br.length));
    }
    for (int layer = 0; layer < 2; ++layer) {
      for (int part = 0; part < 2; ++part) {
        const std::int64_t bb = sizes[static_cast<std::size_t>(part)].local;
        for (std::size_t i = 0; i < local.size(); ++i) {
          std::memcpy(
              &want[static_cast<std::size_t>(part_base(local_blocks, layer, part) + local[i] * bb)],
              &src[static_cast<std::size_t>(part_base(remote_blocks, layer, part) +
                                            (*tail)[i] * bb)],
              static_cast<std::size_t>(bb));
        }
      }
    }
    ASSERT_EQ(got, want) << "iteration " << iter;
  }
}

TEST(RunByteRangesTest, PartialSlicesGiveOneRangePerBlock) {
  // Remote blocks of 64 bytes (4 heads), local blocks of 32 bytes (2 heads); the decode rank takes
  // heads 2..3 of the prefill rank: remote offset 32, local offset 0, 32 bytes.
  const std::vector<BlockRun> runs = {{5, 1, 2}};
  const std::vector<PartBlockBytes> sizes = {{64, 32}};
  TpSource slice{0, {{32, 0, 32, false}}};
  EXPECT_THAT(
      RunByteRanges(runs, 1, sizes, slice),
      ElementsAre(ByteRange{0, 0, 5 * 64 + 32, 32, 32}, ByteRange{0, 0, 6 * 64 + 32, 64, 32}));
}

TEST(RunByteRangesTest, WholeBlockRunIsOneRangePerLayerAndPart) {
  const std::vector<BlockRun> runs = {{3, 7, 4}};
  const std::vector<PartBlockBytes> sizes = {{100, 100}, {10, 10}};
  TpSource whole{0, {{0, 0, 100, true}, {0, 0, 10, true}}};
  EXPECT_THAT(RunByteRanges(runs, 2, sizes, whole),
              ElementsAre(ByteRange{0, 0, 300, 700, 400}, ByteRange{0, 1, 30, 70, 40},
                          ByteRange{1, 0, 300, 700, 400}, ByteRange{1, 1, 30, 70, 40}));
}

// Property test for strided parts: K and V interleaved block by block in one buffer on one side
// (vLLM's (num_blocks, 2, ...)), packed or differently strided on the other, whole blocks and
// head-major head slices. Every byte of every block lands where a naive per-block copy puts it,
// and no byte outside the destination blocks is written.
TEST(RunByteRangesTest, StridedPartsMatchTheNaiveCopy) {
  std::mt19937_64 rng(20261131);
  for (int iter = 0; iter < 400; ++iter) {
    const std::int64_t remote_blocks = 1 + static_cast<std::int64_t>(rng() % 12);
    const std::int64_t local_blocks = 1 + static_cast<std::int64_t>(rng() % 12);
    const int parts = 2;
    const int layers = 1 + static_cast<int>(rng() % 2);
    // Remote blocks hold 2 heads of 8 bytes, local blocks 1 or 2 heads (a head slice or whole).
    const bool slice = rng() % 2 == 0;
    const std::int64_t rb = 16;
    const std::int64_t lb = slice ? 8 : 16;
    // Stride in blocks: 1 = packed, 2 = interleaved K/V, 3 = interleaved with padding.
    const std::int64_t rs = rb * (1 + static_cast<std::int64_t>(rng() % 3));
    const std::int64_t ls = lb * (1 + static_cast<std::int64_t>(rng() % 3));
    const std::vector<PartBlockGeometry> geometry(parts, PartBlockGeometry{rb, lb, rs, ls});
    const std::int64_t head_offset = slice ? 8 * static_cast<std::int64_t>(rng() % 2) : 0;
    TpSource source{0, std::vector<BlockSlice>(parts, BlockSlice{head_offset, 0, lb, !slice})};

    // Each (layer, part) region: part p's block b at base + p * block + b * stride when
    // interleaved (stride >= 2 blocks), else parts one after the other.
    auto region = [&](std::int64_t blocks, std::int64_t bytes, std::int64_t stride) {
      return (blocks - 1) * stride + bytes + parts * bytes;
    };
    auto base = [&](int layer, int part, std::int64_t blocks, std::int64_t bytes,
                    std::int64_t stride) {
      const std::int64_t per_layer = region(blocks, bytes, stride) + (blocks * stride);
      return layer * per_layer +
             (stride >= 2 * bytes ? part * bytes : part * ((blocks - 1) * stride + bytes));
    };
    std::vector<std::uint8_t> src(
        static_cast<std::size_t>(layers * (region(remote_blocks, rb, rs) + remote_blocks * rs)));
    for (auto& byte : src) byte = static_cast<std::uint8_t>(rng());
    std::vector<std::uint8_t> got(
        static_cast<std::size_t>(layers * (region(local_blocks, lb, ls) + local_blocks * ls)), 0);
    std::vector<std::uint8_t> want = got;

    std::vector<std::int64_t> local(static_cast<std::size_t>(local_blocks));
    std::iota(local.begin(), local.end(), 0);
    std::shuffle(local.begin(), local.end(), rng);
    std::sort(local.begin(),
              local.begin() + static_cast<std::ptrdiff_t>(rng() % (local.size() + 1)));
    local.resize(static_cast<std::size_t>(rng() % (std::min(local_blocks, remote_blocks) + 1)));
    std::vector<std::int64_t> remote;
    for (std::size_t i = 0; i < local.size(); ++i) {
      remote.push_back(static_cast<std::int64_t>(rng() % remote_blocks));
    }
    Result<std::vector<BlockRun>> runs = MergeBlockRuns(remote, local, remote_blocks, local_blocks);
    ASSERT_TRUE(runs.ok()) << runs.status().ToString();

    for (const ByteRange& r : RunByteRanges(*runs, layers, geometry, source)) {
      ASSERT_LE(r.local_offset + r.length, (local_blocks - 1) * ls + lb) << "past the extent";
      std::memcpy(&got[static_cast<std::size_t>(base(r.layer, r.part, local_blocks, lb, ls) +
                                                r.local_offset)],
                  &src[static_cast<std::size_t>(base(r.layer, r.part, remote_blocks, rb, rs) +
                                                r.remote_offset)],
                  static_cast<std::size_t>(r.length));
    }
    for (int l = 0; l < layers; ++l) {
      for (int p = 0; p < parts; ++p) {
        for (std::size_t i = 0; i < local.size(); ++i) {
          std::memcpy(
              &want[static_cast<std::size_t>(base(l, p, local_blocks, lb, ls) + local[i] * ls)],
              &src[static_cast<std::size_t>(base(l, p, remote_blocks, rb, rs) + remote[i] * rs +
                                            head_offset)],
              static_cast<std::size_t>(lb));
        }
      }
    }
    ASSERT_EQ(got, want) << "iteration " << iter << " rs " << rs << " ls " << ls;
  }
}

TEST(RunByteRangesTest, StridedWholeBlocksAreOneRangePerBlock) {
  // Local K/V interleaved (stride 2 blocks), remote packed: a run of 2 cannot be one read.
  const std::vector<BlockRun> runs = {{3, 7, 2}};
  const std::vector<PartBlockGeometry> blocks = {{100, 100, 100, 200}};
  TpSource whole{0, {{0, 0, 100, true}}};
  EXPECT_THAT(RunByteRanges(runs, 1, blocks, whole),
              ElementsAre(ByteRange{0, 0, 300, 1400, 100}, ByteRange{0, 0, 400, 1600, 100}));
}

TEST(RunByteRangesTest, GeometryOfTwoSpecsCarriesBothStrides) {
  CacheSpecOptions o = CacheSpec::Mha(1, 2, 8, 4, 4, DType::kFloat16)->options();
  o.block_strides = {256, 256};
  CacheSpec local = *CacheSpec::Create(o);
  CacheSpec remote = *CacheSpec::Mha(1, 2, 8, 9, 4, DType::kFloat16);
  const std::vector<PartBlockGeometry> g = PartBlockGeometryOf(remote, local);
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[1].remote, 128);
  EXPECT_EQ(g[1].local, 128);
  EXPECT_EQ(g[1].remote_stride, 128);
  EXPECT_EQ(g[1].local_stride, 256);
}

// docs/transport.md, "Region ids": packed specs keep one region per layer and part; interleaved
// ones get one region per layer with each part at its offset inside every block.
TEST(RegionOfPartTest, PackedPartsKeepOneRegionPerLayerAndPart) {
  CacheSpec spec = *CacheSpec::Mha(3, 2, 8, 4, 4, DType::kFloat16);
  EXPECT_FALSE(PartsInterleaved(spec));
  EXPECT_TRUE(CheckRegionLayout(spec).ok());
  EXPECT_EQ(RegionOfPart(spec, 2, 1).id, 5);
  EXPECT_EQ(RegionOfPart(spec, 2, 1).offset, 0);
  EXPECT_EQ(RegionBytes(spec, 1), spec.PartBytes(1));
}

TEST(RegionOfPartTest, InterleavedPartsShareTheLayersRegion) {
  CacheSpecOptions o = CacheSpec::Mha(3, 2, 8, 4, 4, DType::kFloat16)->options();
  o.block_strides = {256, 256};  // (num_blocks, 2, 4 tokens, 2 heads, 8) fp16: 128-byte blocks
  CacheSpec spec = *CacheSpec::Create(o);
  EXPECT_TRUE(PartsInterleaved(spec));
  ASSERT_TRUE(CheckRegionLayout(spec).ok());
  EXPECT_EQ(RegionOfPart(spec, 2, 0).id, 4);
  EXPECT_EQ(RegionOfPart(spec, 2, 1).id, 4);
  EXPECT_EQ(RegionOfPart(spec, 2, 0).offset, 0);
  EXPECT_EQ(RegionOfPart(spec, 2, 1).offset, 128);
  EXPECT_EQ(RegionBytes(spec, 0), 4 * 256);
  // The last V block ends exactly at the region's end.
  EXPECT_EQ(RegionOfPart(spec, 0, 1).offset + spec.PartBytes(1), RegionBytes(spec, 1));
  const std::uint64_t base = 0x10000;
  EXPECT_TRUE(CheckRegionBases(spec, {{base, base + 128},
                                      {base + 4096, base + 4096 + 128},
                                      {base + 8192, base + 8192 + 128}})
                  .ok());
  Status wrong = CheckRegionBases(
      spec,
      {{base + 128, base}, {base + 4096, base + 4096 + 128}, {base + 8192, base + 8192 + 128}});
  EXPECT_EQ(wrong.code(), StatusCode::kNotSupported);
  EXPECT_THAT(std::string(wrong.message()), HasSubstr("layer 0 part 1"));
}

TEST(RegionOfPartTest, StridesThatAreNotOneBlockOfEveryPartAreRefused) {
  CacheSpecOptions o = CacheSpec::Mha(1, 2, 8, 4, 4, DType::kFloat16)->options();
  o.block_strides = {384, 256};  // one part's stride not the other's: no scheme names it
  Status s = CheckRegionLayout(*CacheSpec::Create(o));
  EXPECT_EQ(s.code(), StatusCode::kNotSupported);
  EXPECT_THAT(std::string(s.message()), HasSubstr("256"));
  // A page that ends in padding (vLLM's Mamba pages, page_size_padded) is one region per layer,
  // the parts at their offsets in it.
  o.block_strides = {384, 384};
  const CacheSpec padded = *CacheSpec::Create(o);
  ASSERT_TRUE(CheckRegionLayout(padded).ok());
  EXPECT_EQ(RegionOfPart(padded, 0, 1).offset, 128);
  EXPECT_EQ(RegionBytes(padded, 0), 4 * 384);
}

}  // namespace
}  // namespace kvferry
