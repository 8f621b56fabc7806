// The decode side's layer-wise read plan (DESIGN rule 16): what to read after each announcement,
// the tail rule for decode-side prefix hits, partly written blocks read again, and announcements
// that contradict the request refused with the cursor unchanged.
#include "connector/layerwise_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvferry {
namespace {

using ::testing::HasSubstr;

wire::Progress Running(std::uint64_t all, std::uint64_t cur, std::uint32_t layers_cur,
                       std::uint64_t prompt, std::vector<std::int64_t> blocks) {
  wire::Progress p;
  p.from = {"prefill-0", 0, 0};
  p.transfer_id = "x";
  p.seq = 1;
  p.state = wire::Progress::State::kRunning;
  p.prompt_tokens = prompt;
  p.tokens_all = all;
  p.tokens_cur = cur;
  p.layers_cur = layers_cur;
  p.block_ids = std::move(blocks);
  return p;
}

const std::vector<std::int64_t> kLocal = {7, 8, 9};      // 3 blocks of 16 tokens
const std::vector<std::int64_t> kRemote = {40, 41, 42};  // 40 tokens

TEST(LayerwisePlanTest, ReadsEachLayerGroupAsAnnounced) {
  LayerwiseCursor c;
  auto r = PlanLayerwiseReads(Running(0, 40, 2, 40, kRemote), kLocal, 16, 4, 100, c);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 1u);
  EXPECT_EQ((*r)[0], (LayerGroupRead{0, 2, kRemote, kLocal}));
  r = PlanLayerwiseReads(Running(0, 40, 3, 40, kRemote), kLocal, 16, 4, 100, c);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->size(), 1u);
  EXPECT_EQ((*r)[0].first_layer, 2);
  EXPECT_EQ((*r)[0].end_layer, 3);
  EXPECT_FALSE(c.Done());
  r = PlanLayerwiseReads(Running(40, 40, 0, 40, kRemote), kLocal, 16, 4, 100, c);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->size(), 1u);
  EXPECT_EQ((*r)[0].first_layer, 3);
  EXPECT_EQ((*r)[0].end_layer, 4);
  EXPECT_TRUE(c.Done());
  // The same announcement again reads nothing.
  r = PlanLayerwiseReads(Running(40, 40, 0, 40, kRemote), kLocal, 16, 4, 100, c);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->empty());
}

TEST(LayerwisePlanTest, ChunksReadThePartlyWrittenBlockAgain) {
  LayerwiseCursor c;
  // Chunk 1: tokens [0, 20) in both layers: blocks 0 and 1 (block 1 half written).
  auto r = PlanLayerwiseReads(Running(20, 20, 0, 40, {40, 41}), kLocal, 16, 2, 100, c);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 1u);
  EXPECT_EQ((*r)[0], (LayerGroupRead{0, 2, {40, 41}, {7, 8}}));
  // Chunk 2, layer 0: tokens up to 40: block 1 again, then block 2.
  r = PlanLayerwiseReads(Running(20, 40, 1, 40, kRemote), kLocal, 16, 2, 100, c);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->size(), 1u);
  EXPECT_EQ((*r)[0], (LayerGroupRead{0, 1, {41, 42}, {8, 9}}));
  r = PlanLayerwiseReads(Running(40, 40, 0, 40, kRemote), kLocal, 16, 2, 100, c);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->size(), 1u);
  EXPECT_EQ((*r)[0], (LayerGroupRead{1, 2, {41, 42}, {8, 9}}));
  EXPECT_TRUE(c.Done());
}

TEST(LayerwisePlanTest, DecodePrefixHitReadsOnlyTheTail) {
  LayerwiseCursor c;
  const std::vector<std::int64_t> local = {9};  // the decode side holds blocks 0 and 1 already
  auto r = PlanLayerwiseReads(Running(40, 40, 0, 40, kRemote), local, 16, 1, 100, c);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->size(), 1u);
  EXPECT_EQ((*r)[0], (LayerGroupRead{0, 1, {42}, {9}}));
  // Announcements that cover only the prefix read nothing yet.
  LayerwiseCursor early;
  r = PlanLayerwiseReads(Running(0, 20, 1, 40, {40, 41}), local, 16, 2, 100, early);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->empty());
}

TEST(LayerwisePlanTest, ContradictionsAreRefusedAndChangeNothing) {
  LayerwiseCursor c;
  ASSERT_TRUE(PlanLayerwiseReads(Running(0, 40, 1, 40, kRemote), kLocal, 16, 2, 100, c).ok());
  const LayerwiseCursor before = c;
  struct Case {
    const char* what;
    wire::Progress p;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"prompt too short for the local blocks", Running(0, 16, 1, 16, {40}), "allocated 3"},
      {"another prompt length", Running(0, 40, 1, 44, kRemote), "an earlier one gave 40"},
      {"layers past the cache", Running(0, 40, 2, 40, kRemote), "cache of 2"},
      {"too few block ids", Running(0, 40, 1, 40, {40, 41}), "names 2 blocks"},
      {"too many block ids", Running(0, 40, 1, 40, {40, 41, 42, 43}), "names 4 blocks"},
      {"block outside the remote cache", Running(0, 40, 1, 40, {40, 41, 100}), "has 100 blocks"},
      {"tokens going back", Running(0, 20, 1, 40, kRemote), "earlier one announced 40"},
  };
  for (const Case& k : cases) {
    auto r = PlanLayerwiseReads(k.p, kLocal, 16, 2, 100, c);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << k.what;
    EXPECT_THAT(r.status().message(), HasSubstr(k.message)) << k.what;
    EXPECT_EQ(c.tokens_read, before.tokens_read) << k.what;
    EXPECT_EQ(c.prompt_tokens, before.prompt_tokens) << k.what;
  }
}

}  // namespace
}  // namespace kvferry
