#include "kvferry/cache_spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

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
  o.layers = {{CacheKind::kMha, {{"k", 8, 128}, {"v", 8, 128}}, {}},
              {CacheKind::kMha, {{"k", 8, 128}, {"v", 8, 64}}, {}}};
  o.num_blocks = 4;
  o.tokens_per_block = 16;
  Result<CacheSpec> spec = CacheSpec::Create(o);
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(spec.status().message(),
              HasSubstr("layer 1 part 1 ('v') has head_dim 64 but layer 0 has 128"));

  o.layers[1] = {CacheKind::kMla, {{"k", 8, 128}, {"v", 8, 128}}, {}};
  EXPECT_THAT(CacheSpec::Create(o).status().message(), HasSubstr("layer 1 is mla but layer 0"));
}

TEST(CacheSpecTest, RejectsWrongPartCountForKind) {
  CacheSpecOptions o;
  o.layers = {{CacheKind::kSparseMla, {{"latent", 1, 512}, {"rope", 1, 64}}, {}}};
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

// Issue 28: the model's depth is in the hash, a pipeline stage's layer range is not (loads read
// each layer from a stage holding it, LayersHeld, so unequal pipelines pair); a cache without
// stages keeps its layer count in the hash as before.
TEST(CacheSpecTest, HashCoversTheModelsDepthNotAStagesRange) {
  auto stage = [](int first_layer, int model_layers) {
    CacheSpecOptions o = CacheSpec::Mha(2, 8, 128, 10, 16, DType::kBFloat16)->options();
    o.first_layer = first_layer;
    o.model_layers = model_layers;
    return *CacheSpec::Create(o);
  };
  const CacheSpec whole = *CacheSpec::Mha(4, 8, 128, 10, 16, DType::kBFloat16);
  EXPECT_EQ(stage(0, 4).Hash(), stage(2, 4).Hash());
  EXPECT_EQ(stage(0, 4).Hash(), whole.Hash()) << "PP 2 pairs with PP 1";
  EXPECT_EQ(stage(2, 0).Hash(), whole.Hash()) << "the last stage's 0 is its end layer";
  EXPECT_NE(stage(0, 4).Hash(), stage(0, 6).Hash()) << "a 6-layer model's stage";
  EXPECT_EQ(stage(2, 4).end_layer(), 4);
  EXPECT_THAT(stage(2, 4).CanonicalText(), HasSubstr(" layers=4 "));
  EXPECT_FALSE(stage(0, 4) == stage(2, 4));
  CacheSpecOptions bad = stage(0, 4).options();
  bad.first_layer = -1;
  EXPECT_THAT(CacheSpec::Create(bad).status().message(), HasSubstr("first_layer -1"));
  bad = stage(2, 4).options();
  bad.model_layers = 3;
  EXPECT_THAT(CacheSpec::Create(bad).status().message(), HasSubstr("model_layers 3"));
}

TEST(CacheSpecTest, HashCoversModelShapeButNotPlacement) {
  auto spec = [](int tp, int rank, std::int64_t blocks, std::int64_t dim) {
    return *CacheSpec::Mha(4, 8, dim, blocks, 16, DType::kBFloat16, tp, rank);
  };
  EXPECT_EQ(spec(1, 0, 100, 128).Hash(), spec(4, 3, 999, 128).Hash());
  EXPECT_NE(spec(1, 0, 100, 128).Hash(), spec(1, 0, 100, 64).Hash());
  EXPECT_NE(CacheSpec::Mha(4, 8, 128, 10, 16, DType::kBFloat16)->Hash(),
            CacheSpec::Mha(4, 8, 128, 10, 16, DType::kFloat16)->Hash());
  // Block sizes may differ (whole-request loads pair tokens; issue 28 item 5).
  EXPECT_EQ(CacheSpec::Mha(4, 8, 128, 10, 16, DType::kBFloat16)->Hash(),
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

// --- Block strides: parts interleaved block by block in one tensor (vLLM's (num_blocks, 2, ...)).

CacheSpecOptions Interleaved(int layers, std::int64_t blocks, std::int64_t stride_blocks) {
  CacheSpecOptions o = CacheSpec::Mha(layers, 2, 8, blocks, 4, DType::kFloat16)->options();
  const std::int64_t block = 4 * 2 * 8 * 2;  // 128 bytes
  o.block_strides = {stride_blocks * block, stride_blocks * block};
  return o;
}

TEST(CacheSpecStrideTest, StridedPartsSpanTheirExtentAndKeepTheHash) {
  Result<CacheSpec> spec = CacheSpec::Create(Interleaved(3, 10, 2));
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  EXPECT_EQ(spec->BlockBytes(0), 128);
  EXPECT_EQ(spec->BlockStride(1), 256);
  EXPECT_EQ(spec->PartBytes(0), 9 * 256 + 128);
  EXPECT_EQ(spec->TotalBytes(), 3 * 2 * 10 * 128);  // data bytes, not extents
  CacheSpec packed = *CacheSpec::Mha(3, 2, 8, 10, 4, DType::kFloat16);
  EXPECT_EQ(packed.BlockStride(0), 128);
  EXPECT_EQ(packed.PartBytes(0), 10 * 128);
  EXPECT_EQ(spec->Hash(), packed.Hash());  // memory layout, not model geometry
  EXPECT_FALSE(*spec == packed);
}

TEST(CacheSpecStrideTest, RejectsStridesShorterThanABlockMisalignedOrMiscounted) {
  CacheSpecOptions o = Interleaved(1, 4, 2);
  o.block_strides = {127, 256};
  EXPECT_THAT(CacheSpec::Create(o).status().message(),
              HasSubstr("block stride 127 bytes; expected at least its block of 128"));
  o.block_strides = {257, 256};
  EXPECT_THAT(CacheSpec::Create(o).status().message(), HasSubstr("multiple of the element size 2"));
  o.block_strides = {256};
  EXPECT_THAT(CacheSpec::Create(o).status().message(), HasSubstr("one block stride per part (2)"));
}

TEST(CacheAddressesStrideTest, InterleavedPartsAreAcceptedAndSharedBytesRefused) {
  CacheSpec spec = *CacheSpec::Create(Interleaved(2, 4, 2));  // 128-byte blocks, stride 256
  // Layer 0: K at 0x1000, V one block later; layer 1 right after layer 0's tensor.
  EXPECT_TRUE(CacheAddresses::Create(spec, {{0x1000, 0x1080}, {0x1400, 0x1480}}).ok());
  // V starts half a block into K's first block.
  EXPECT_THAT(CacheAddresses::Create(spec, {{0x1000, 0x1040}, {0x1400, 0x1480}}).status().message(),
              HasSubstr("overlaps"));
  // V's block 0 is K's block 1.
  EXPECT_THAT(CacheAddresses::Create(spec, {{0x1000, 0x1100}, {0x1400, 0x1480}}).status().message(),
              HasSubstr("overlaps"));
  // Layer 1 interleaved into layer 0's tensor: its K block 0 is layer 0's V block 1.
  EXPECT_THAT(CacheAddresses::Create(spec, {{0x1000, 0x1080}, {0x1180, 0x1600}}).status().message(),
              HasSubstr("overlaps"));
  // Four parts sharing one tensor at stride 4 blocks would need stride 512; at 256 they collide.
  EXPECT_THAT(CacheAddresses::Create(spec, {{0x1000, 0x1080}, {0x1100, 0x1180}}).status().message(),
              HasSubstr("overlaps"));
}

// Property test: on random strides, block sizes and bases, CacheAddresses accepts exactly the
// placements where no byte belongs to two blocks (checked by marking every byte of every block).
TEST(CacheAddressesStrideTest, RandomPlacementsMatchAByteByByteCheck) {
  std::mt19937_64 rng(20261130);
  int accepted = 0;
  int refused = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const std::int64_t blocks = 1 + static_cast<std::int64_t>(rng() % 5);
    const std::int64_t dim = 1 + static_cast<std::int64_t>(rng() % 3);  // block = 4 * dim bytes
    CacheSpecOptions o = CacheSpec::Mha(2, 1, dim, blocks, 4, DType::kInt8)->options();
    const std::int64_t block = 4 * dim;
    const std::int64_t s0 = block * (1 + static_cast<std::int64_t>(rng() % 3));
    const std::int64_t s1 =
        rng() % 2 == 0 ? s0 : block * (1 + static_cast<std::int64_t>(rng() % 3));
    o.block_strides = {s0, s1};
    Result<CacheSpec> spec = CacheSpec::Create(o);
    ASSERT_TRUE(spec.ok()) << spec.status().ToString();
    std::vector<std::vector<std::uint64_t>> bases(2, std::vector<std::uint64_t>(2));
    for (auto& layer : bases) {
      for (auto& base : layer) base = 0x1000 + rng() % 160;
    }
    std::vector<int> owners(0x1000 + 160 + 3 * 12 * 5, 0);
    bool clash = false;
    for (int l = 0; l < 2; ++l) {
      for (int p = 0; p < 2; ++p) {
        for (std::int64_t b = 0; b < blocks; ++b) {
          for (std::int64_t i = 0; i < block; ++i) {
            const auto at = static_cast<std::size_t>(
                static_cast<std::int64_t>(
                    bases[static_cast<std::size_t>(l)][static_cast<std::size_t>(p)]) +
                b * spec->BlockStride(p) + i);
            clash = clash || owners[at] != 0;
            owners[at] = 1;
          }
        }
      }
    }
    Result<CacheAddresses> a = CacheAddresses::Create(*spec, bases);
    if (s0 == s1) {
      // Equal strides: the check is exact.
      ASSERT_EQ(a.ok(), !clash) << "iteration " << iter << ": " << a.status().ToString();
    } else {
      // Different strides: never accept a clash (extents must be disjoint, a stricter rule).
      ASSERT_TRUE(!a.ok() || !clash) << "iteration " << iter;
    }
    (a.ok() ? accepted : refused) += 1;
  }
  EXPECT_GT(accepted, 100);
  EXPECT_GT(refused, 100);
}

// --- Fused MLA: latent and rope side by side in one row.

TEST(CacheSpecFusedMlaTest, OnePartReplicatedWithTheSplitInTheHash) {
  Result<CacheSpec> spec = CacheSpec::MlaFused(61, 512, 64, 100, 16, DType::kBFloat16, 4, 3);
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  EXPECT_EQ(spec->kind(), CacheKind::kMlaFused);
  EXPECT_EQ(spec->num_parts(), 1);
  EXPECT_EQ(spec->LocalHeads(0), 1);
  EXPECT_EQ(spec->BlockBytes(0), 16 * 576 * 2);
  EXPECT_THAT(spec->CanonicalText(), HasSubstr("kind=mla_fused"));
  EXPECT_THAT(spec->CanonicalText(), HasSubstr("parts=latent_rope:1x576 fields=512+64"));
  EXPECT_NE(spec->Hash(), CacheSpec::MlaFused(61, 448, 128, 100, 16, DType::kBFloat16)->Hash());
  EXPECT_EQ(spec->Hash(), CacheSpec::MlaFused(61, 512, 64, 7, 16, DType::kBFloat16)->Hash());
  EXPECT_EQ(ParseCacheKind("mla_fused").value(), CacheKind::kMlaFused);
  EXPECT_EQ(CacheKindParts(CacheKind::kMlaFused), 1u);
  // Unfused specs keep the canonical text (and hash) they always had.
  EXPECT_THAT(CacheSpec::Mla(1, 512, 64, 4, 16, DType::kBFloat16)->CanonicalText(),
              ::testing::Not(HasSubstr("fields")));
}

TEST(CacheSpecFusedMlaTest, RejectsBadFieldsAndFieldsOnOtherKinds) {
  CacheSpecOptions o = CacheSpec::MlaFused(2, 512, 64, 4, 16, DType::kBFloat16)->options();
  for (auto& layer : o.layers) layer.fields = {500, 64};
  EXPECT_THAT(CacheSpec::Create(o).status().message(),
              HasSubstr("two positive fields (kv_lora_rank, qk_rope_head_dim) summing to its "
                        "part's head_dim 576, found [500+64]"));
  for (auto& layer : o.layers) layer.fields = {576};
  EXPECT_THAT(CacheSpec::Create(o).status().message(), HasSubstr("found [576]"));
  for (auto& layer : o.layers) layer.fields = {512, 64};
  o.layers[1].fields = {448, 128};
  EXPECT_THAT(CacheSpec::Create(o).status().message(),
              HasSubstr("layer 1 has fields [448+128] but layer 0 has [512+64]"));
  CacheSpecOptions mla = CacheSpec::Mla(1, 512, 64, 4, 16, DType::kBFloat16)->options();
  mla.layers[0].fields = {512, 64};
  EXPECT_THAT(CacheSpec::Create(mla).status().message(),
              HasSubstr("only mla_fused layers pack fields"));
}

// Issue 29, state groups (vLLM's MambaSpec): one state per block, parts of their own element types,
// split across TP along their outer axis and never replicated; the part types are in the hash.
TEST(CacheSpecTest, StateLayersHoldOneStatePerBlockWithTypesOfTheirOwn) {
  LayerSpec layer;
  layer.kind = CacheKind::kState;
  layer.parts = {{"conv", 32, 3}, {"ssm", 4, 16, DType::kFloat32}};
  CacheSpecOptions o;
  o.layers.assign(2, layer);
  o.num_blocks = 8;
  o.tokens_per_block = 1024;
  o.dtype = DType::kBFloat16;
  o.tp_size = 2;
  o.tp_rank = 1;
  Result<CacheSpec> s = CacheSpec::Create(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_TRUE(s->is_state());
  EXPECT_EQ(s->BlockBytes(0), 16 * 3 * 2);  // no token rows: one state
  EXPECT_EQ(s->BlockBytes(1), 2 * 16 * 4);
  EXPECT_EQ(s->FirstLocalHead(1), 2);
  EXPECT_EQ(s->RequiredAlignment(), 4);
  EXPECT_THAT(s->CanonicalText(), HasSubstr("kind=state"));
  EXPECT_THAT(s->CanonicalText(), HasSubstr("ssm:4x16/fp32"));
  CacheSpecOptions bf16 = o;
  bf16.layers.assign(2, layer);
  for (LayerSpec& l : bf16.layers) l.parts[1].dtype = DType::kBFloat16;
  EXPECT_NE(CacheSpec::Create(bf16)->Hash(), s->Hash());
  CacheSpecOptions odd = o;
  odd.tp_size = 8;
  odd.tp_rank = 0;
  EXPECT_THAT(CacheSpec::Create(odd).status().message(),
              HasSubstr("state part 'ssm' has 4 along its TP-split axis, which TP size 8"));
  CacheSpecOptions mha_typed = o;
  mha_typed.layers.assign(1, {CacheKind::kMha, {{"k", 2, 8, DType::kFloat32}, {"v", 2, 8}}, {}});
  EXPECT_THAT(CacheSpec::Create(mha_typed).status().message(),
              HasSubstr("only state parts have element types of their own"));
  CacheSpecOptions per_id = o;
  per_id.blocks_per_id = 2;
  EXPECT_THAT(CacheSpec::Create(per_id).status().message(), HasSubstr("one state per block id"));
  EXPECT_EQ(*ParseCacheKind("mamba"), CacheKind::kState);
}

}  // namespace
}  // namespace kvferry
