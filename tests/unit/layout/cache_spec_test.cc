#include "kvferry/cache_spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <limits>

namespace kvferry {
namespace {

using ::testing::HasSubstr;

TEST(CacheSpecTest, MhaBytesPerBlockSplitAcrossTp) {
  // 8 KV heads over TP 2: 4 heads per rank. 16 tokens * 4 heads * 128 dim * 2 bytes.
  Result<CacheSpec> spec = CacheSpec::Mha(32, 8, 128, 1000, 16, DType::kBFloat16, 2, 1);
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  EXPECT_EQ(spec->num_parts(), 2);
  EXPECT_EQ(spec->LocalHeads(0), 4);
  EXPECT_EQ(spec->FirstLocalHead(0), 4);
  EXPECT_EQ(spec->BlockBytes(0), 16 * 4 * 128 * 2);
  EXPECT_EQ(spec->PartBytes(1), 1000 * 16 * 4 * 128 * 2);
  EXPECT_EQ(spec->TotalBytes(), std::int64_t{32} * 2 * 1000 * 16 * 4 * 128 * 2);
  EXPECT_EQ(spec->RequiredAlignment(), 2);
}

TEST(CacheSpecTest, MhaHeadsReplicatedWhenTpExceedsHeads) {
  Result<CacheSpec> spec = CacheSpec::Mha(1, 2, 64, 8, 16, DType::kFloat16, 8, 5);
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->LocalHeads(0), 1);
  EXPECT_EQ(spec->FirstLocalHead(0), 1);  // ranks 4..7 hold head 1
}

TEST(CacheSpecTest, MlaPartsHaveDifferentWidthsAndAreReplicated) {
  Result<CacheSpec> spec = CacheSpec::Mla(61, 512, 64, 100, 128, DType::kBFloat16, 4, 3);
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->kind(), CacheKind::kMla);
  EXPECT_EQ(spec->BlockBytes(0), 128 * 512 * 2);
  EXPECT_EQ(spec->BlockBytes(1), 128 * 64 * 2);
  EXPECT_EQ(spec->LocalHeads(0), 1);
}

TEST(CacheSpecTest, SparseMlaHasThreeParts) {
  Result<CacheSpec> spec = CacheSpec::SparseMla(4, 512, 64, 128, 10, 128, DType::kBFloat16);
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->num_parts(), 3);
  EXPECT_EQ(spec->BlockBytes(2), 128 * 128 * 2);
}

TEST(CacheSpecTest, EveryDtypeHasItsSize) {
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2);
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4);
  EXPECT_EQ(DTypeSize(DType::kInt8), 1);
  EXPECT_EQ(DTypeSize(DType::kInt32), 4);
  EXPECT_EQ(DTypeSize(DType::kInt64), 8);
  for (const char* name : {"fp16", "bf16", "fp32", "int8", "int32", "int64"}) {
    Result<DType> d = ParseDType(name);
    ASSERT_TRUE(d.ok()) << name;
    EXPECT_STREQ(DTypeName(*d), name);
  }
  EXPECT_EQ(*ParseDType("torch.bfloat16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("half"), DType::kFloat16);
  EXPECT_THAT(ParseDType("fp8").status().message(), HasSubstr("expected one of"));
}

TEST(CacheSpecTest, RejectsZeroAndNegativeSizes) {
  EXPECT_THAT(CacheSpec::Mha(0, 8, 128, 10, 16, DType::kBFloat16).status().message(),
              HasSubstr("no layers"));
  EXPECT_THAT(CacheSpec::Mha(1, 8, 128, 0, 16, DType::kBFloat16).status().message(),
              HasSubstr("num_blocks must be positive"));
  EXPECT_THAT(CacheSpec::Mha(1, 8, 128, 10, -1, DType::kBFloat16).status().message(),
              HasSubstr("tokens_per_block must be positive"));
  EXPECT_THAT(CacheSpec::Mha(1, 0, 128, 10, 16, DType::kBFloat16).status().message(),
              HasSubstr("positive num_heads and head_dim"));
  EXPECT_THAT(CacheSpec::Mla(1, 512, 0, 10, 16, DType::kBFloat16).status().message(),
              HasSubstr("positive num_heads and head_dim"));
  EXPECT_THAT(CacheSpec::Mha(1, 8, 128, 10, 16, DType::kBFloat16, 2, 2).status().message(),
              HasSubstr("TP rank 2 of size 2 is invalid"));
}

TEST(CacheSpecTest, RejectsLayersThatDisagree) {
  CacheSpecOptions o;
  o.layers = {{CacheKind::kMha, {{"k", 8, 128}, {"v", 8, 128}}},
              {CacheKind::kMha, {{"k", 8, 128}, {"v", 8, 64}}}};
  o.num_blocks = 4;
  o.tokens_per_block = 16;
  Result<CacheSpec> spec = CacheSpec::Create(o);
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(spec.status().message(),
              HasSubstr("layer 1 part 1 ('v') has head_dim 64 but layer 0 has 128"));

  o.layers[1] = {CacheKind::kMla, {{"k", 8, 128}, {"v", 8, 128}}};
  EXPECT_THAT(CacheSpec::Create(o).status().message(), HasSubstr("layer 1 is mla but layer 0"));
}

TEST(CacheSpecTest, RejectsWrongPartCountForKind) {
  CacheSpecOptions o;
  o.layers = {{CacheKind::kSparseMla, {{"latent", 1, 512}, {"rope", 1, 64}}}};
  o.num_blocks = 4;
  o.tokens_per_block = 16;
  EXPECT_THAT(CacheSpec::Create(o).status().message(), HasSubstr("needs 3 parts, found 2"));
}

TEST(CacheSpecTest, RejectsHeadsNotDivisibleByTp) {
  EXPECT_THAT(CacheSpec::Mha(1, 6, 128, 10, 16, DType::kBFloat16, 4, 0).status().message(),
              HasSubstr("cannot be split across TP size 4"));
}

TEST(CacheSpecTest, Rejects64BitOverflow) {
  const std::int64_t big = std::int64_t{1} << 40;
  Result<CacheSpec> per_block = CacheSpec::Mha(1, 8, big, 10, big, DType::kInt64);
  EXPECT_THAT(per_block.status().message(), HasSubstr("bytes per block"));
  Result<CacheSpec> per_layer = CacheSpec::Mha(1, 1, 1 << 20, big, 1 << 10, DType::kInt8);
  EXPECT_THAT(per_layer.status().message(), HasSubstr("bytes per layer"));
  Result<CacheSpec> total =
      CacheSpec::Mha(1 << 20, 1, 1 << 10, std::int64_t{1} << 30, 1 << 10, DType::kInt8);
  EXPECT_THAT(total.status().message(), HasSubstr("total cache bytes"));
}

TEST(CacheSpecTest, HashCoversModelShapeButNotPlacement) {
  auto spec = [](int tp, int rank, std::int64_t blocks, std::int64_t dim) {
    return *CacheSpec::Mha(4, 8, dim, blocks, 16, DType::kBFloat16, tp, rank);
  };
  EXPECT_EQ(spec(1, 0, 100, 128).Hash(), spec(4, 3, 999, 128).Hash());
  EXPECT_NE(spec(1, 0, 100, 128).Hash(), spec(1, 0, 100, 64).Hash());
  EXPECT_NE(CacheSpec::Mha(4, 8, 128, 10, 16, DType::kBFloat16)->Hash(),
            CacheSpec::Mha(4, 8, 128, 10, 16, DType::kFloat16)->Hash());
  EXPECT_NE(CacheSpec::Mha(4, 8, 128, 10, 16, DType::kBFloat16)->Hash(),
            CacheSpec::Mha(4, 8, 128, 10, 32, DType::kBFloat16)->Hash());
  EXPECT_NE(CacheSpec::Mha(4, 8, 128, 10, 16, DType::kBFloat16)->Hash(),
            CacheSpec::Mha(5, 8, 128, 10, 16, DType::kBFloat16)->Hash());
  EXPECT_NE(
      CacheSpec::Mha(4, 8, 128, 10, 16, DType::kBFloat16, 1, 0, BlockLayout::kHeadMajor)->Hash(),
      CacheSpec::Mha(4, 8, 128, 10, 16, DType::kBFloat16)->Hash());
  EXPECT_NE(CacheSpec::Mla(4, 512, 64, 10, 16, DType::kBFloat16)->Hash(),
            CacheSpec::Mla(4, 512, 32, 10, 16, DType::kBFloat16)->Hash());
}

TEST(CacheAddressesTest, AcceptsAlignedDisjointRegions) {
  CacheSpec spec = *CacheSpec::Mha(2, 1, 8, 4, 2, DType::kInt32);  // 64-byte blocks, 256/part
  Result<CacheAddresses> a = CacheAddresses::Create(spec, {{0x1000, 0x1100}, {0x1200, 0x1300}});
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->Base(1, 0), 0x1200u);
}

TEST(CacheAddressesTest, RejectsMisalignedNullOverlappingAndMiscounted) {
  CacheSpec spec = *CacheSpec::Mha(2, 1, 8, 4, 2, DType::kInt32);
  EXPECT_THAT(CacheAddresses::Create(spec, {{0x1000, 0x1102}, {0x1200, 0x1300}}).status().message(),
              HasSubstr("0x1102 is not aligned to 4 bytes"));
  EXPECT_THAT(CacheAddresses::Create(spec, {{0x1000, 0}, {0x1200, 0x1300}}).status().message(),
              HasSubstr("null base address"));
  EXPECT_THAT(CacheAddresses::Create(spec, {{0x1000, 0x10f0}, {0x1200, 0x1300}}).status().message(),
              HasSubstr("overlaps"));
  EXPECT_THAT(CacheAddresses::Create(spec, {{0x1000, 0x1100}}).status().message(),
              HasSubstr("for 2 layers, found 1"));
  EXPECT_THAT(CacheAddresses::Create(spec, {{0x1000}, {0x1200, 0x1300}}).status().message(),
              HasSubstr("expected 2 (one per part)"));
  EXPECT_THAT(CacheAddresses::Create(
                  spec, {{std::numeric_limits<std::uint64_t>::max() - 3, 0x1100}, {0x1200, 0x1300}})
                  .status()
                  .message(),
              HasSubstr("wraps around"));
}

}  // namespace
}  // namespace kvferry
