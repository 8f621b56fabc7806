// The prefill side's layer-wise table (DESIGN rule 16): announcements per layer group, chunked
// prefill, failures, subscriptions before the request arrives, and the caps on what peers fill.
#include "connector/layerwise_table.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvferry {
namespace {

using ::testing::HasSubstr;
using State = wire::Progress::State;

const wire::PeerRef kSelf{"prefill-0", 0, 1};
const Clock::time_point kT0{};

wire::Subscribe Sub(const std::string& transfer, std::uint32_t tp_rank = 0,
                    std::uint32_t wait_ms = 10000) {
  return {{"decode-0", 0, tp_rank},
          transfer,
          2,
          "tcp://127.0.0.1:" + std::to_string(7000 + tp_rank),
          wait_ms};
}

LayerwiseSave Save(const std::string& transfer, std::int64_t first, std::int64_t end,
                   std::int64_t prompt, const std::string& request = "req-1") {
  std::vector<std::int64_t> blocks;
  for (std::int64_t b = 0; b < (end + 15) / 16; ++b) blocks.push_back(100 + b);
  return {request, transfer, blocks, first, end, prompt};
}

LayerwiseLimits Limits(int layers, int per_notice = 1) {
  LayerwiseLimits l;
  l.group_layers = {layers};
  l.layers_per_notice = per_notice;
  l.max_waiting = 4;
  l.max_subscribers = 2;
  l.max_wait = std::chrono::milliseconds(5000);
  return l;
}

TEST(LayerwiseTableTest, AnnouncesEveryLayerGroupToEachSubscriber) {
  LayerwiseTable t(Limits(4, 2), kSelf);
  ASSERT_TRUE(t.Subscribe(Sub("x"), kT0).ok());
  ASSERT_TRUE(t.Subscribe(Sub("x", 1), kT0).ok());
  const std::vector<LayerwiseSave> saves = {Save("x", 0, 40, 40)};
  std::vector<ProgressPush> begun = t.Begin(saves[0], kT0);
  ASSERT_EQ(begun.size(), 2u);  // started: both subscribers hear of it
  EXPECT_EQ(begun[0].progress.state, State::kRunning);
  EXPECT_EQ(begun[0].progress.tokens_all, 0u);
  EXPECT_EQ(begun[0].progress.tokens_cur, 40u);
  EXPECT_EQ(begun[0].progress.block_ids, (std::vector<std::int64_t>{100, 101, 102}));
  EXPECT_TRUE(t.LayerWritten(saves, 0).empty());  // 2 layers per notice
  std::vector<ProgressPush> two = t.LayerWritten(saves, 1);
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[0].progress.layers_cur, 2u);
  EXPECT_GT(two[0].progress.seq, begun[0].progress.seq);
  EXPECT_THAT(two[0].endpoint, HasSubstr(":7000"));
  EXPECT_TRUE(t.LayerWritten(saves, 2).empty());
  std::vector<ProgressPush> last = t.LayerWritten(saves, 3);
  ASSERT_EQ(last.size(), 2u);
  EXPECT_TRUE(last[0].progress.complete());
  EXPECT_EQ(last[0].progress.tokens_all, 40u);
  EXPECT_EQ(last[0].progress.layers_cur, 0u);
}

TEST(LayerwiseTableTest, ChunkedPrefillNamesTheTokenRange) {
  LayerwiseTable t(Limits(2), kSelf);
  ASSERT_TRUE(t.Subscribe(Sub("x"), kT0).ok());
  const std::vector<LayerwiseSave> first = {Save("x", 0, 20, 50)};
  (void)t.Begin(first[0], kT0);
  (void)t.LayerWritten(first, 0);
  std::vector<ProgressPush> p = t.LayerWritten(first, 1);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].progress.tokens_all, 20u);
  EXPECT_FALSE(p[0].progress.complete());
  const std::vector<LayerwiseSave> second = {Save("x", 20, 50, 50)};
  p = t.Begin(second[0], kT0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].progress.tokens_all, 20u);
  EXPECT_EQ(p[0].progress.tokens_cur, 50u);
  EXPECT_EQ(p[0].progress.block_ids.size(), 4u);
  p = t.LayerWritten(second, 0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].progress.layers_cur, 1u);
  // A late announcement of the first chunk's layer changes nothing.
  EXPECT_TRUE(t.LayerWritten(first, 1).empty());
  p = t.LayerWritten(second, 1);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_TRUE(p[0].progress.complete());
}

TEST(LayerwiseTableTest, SubscribingLateGetsTheProgressSoFar) {
  LayerwiseTable t(Limits(3), kSelf);
  const std::vector<LayerwiseSave> saves = {Save("x", 0, 16, 16)};
  EXPECT_TRUE(t.Begin(saves[0], kT0).empty());  // nobody to tell yet
  EXPECT_TRUE(t.LayerWritten(saves, 0).empty());
  Result<wire::Progress> p = t.Subscribe(Sub("x"), kT0);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->state, State::kRunning);
  EXPECT_EQ(p->layers_cur, 1u);
  EXPECT_EQ(p->from, kSelf);
}

TEST(LayerwiseTableTest, PrefillPrefixHitCountsAsWritten) {
  LayerwiseTable t(Limits(2), kSelf);
  ASSERT_TRUE(t.Subscribe(Sub("x"), kT0).ok());
  std::vector<ProgressPush> p = t.Begin(Save("x", 32, 40, 40), kT0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].progress.tokens_all, 32u);
}

TEST(LayerwiseTableTest, CompleteOnHoldAnnouncesEverythingOnce) {
  LayerwiseTable t(Limits(4), kSelf);
  ASSERT_TRUE(t.Subscribe(Sub("x"), kT0).ok());
  (void)t.Begin(Save("x", 0, 30, 30), kT0);
  std::vector<ProgressPush> p = t.Complete("x");
  ASSERT_EQ(p.size(), 1u);
  EXPECT_TRUE(p[0].progress.complete());
  EXPECT_TRUE(t.Complete("x").empty());
  t.Remove("x");
  Result<wire::Progress> late = t.Subscribe(Sub("x", 1), kT0);
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->state, State::kFailed);
  EXPECT_THAT(late->reason, HasSubstr("has ended"));
}

TEST(LayerwiseTableTest, ALateLayerOfAHeldTransferChangesNothing) {
  LayerwiseTable t(Limits(3), kSelf);
  ASSERT_TRUE(t.Subscribe(Sub("x"), kT0).ok());
  const std::vector<LayerwiseSave> saves = {Save("x", 0, 30, 30)};
  (void)t.Begin(saves[0], kT0);
  ASSERT_EQ(t.Complete("x").size(), 1u);
  // Announced by the device work after the hold: the transfer is complete already.
  EXPECT_TRUE(t.LayerWritten(saves, 0).empty());
  Result<wire::Progress> p = t.Subscribe(Sub("x", 1), kT0);
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->complete());
  EXPECT_EQ(p->layers_cur, 0u);
}

TEST(LayerwiseTableTest, HoldOfATransferNeverScheduledFailsIt) {
  LayerwiseTable t(Limits(2), kSelf);
  ASSERT_TRUE(t.Subscribe(Sub("x"), kT0).ok());
  std::vector<ProgressPush> p = t.Complete("x");
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].progress.state, State::kFailed);
  EXPECT_THAT(p[0].progress.reason, HasSubstr("RequestScheduled"));
  EXPECT_EQ(t.waiting(), 0u);
}

TEST(LayerwiseTableTest, FailureReachesSubscribersAndLaterOnes) {
  LayerwiseTable t(Limits(2), kSelf);
  ASSERT_TRUE(t.Subscribe(Sub("x"), kT0).ok());
  (void)t.Begin(Save("x", 0, 10, 10), kT0);
  std::vector<ProgressPush> p = t.Fail("x", "aborted by the client");
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].progress.state, State::kFailed);
  EXPECT_EQ(p[0].progress.reason, "aborted by the client");
  EXPECT_EQ(t.transfers(), 0u);
  EXPECT_EQ(t.Subscribe(Sub("x", 1), kT0)->state, State::kFailed);
  // The request computing again under the same id does not bring the transfer back.
  EXPECT_TRUE(t.Begin(Save("x", 0, 10, 10), kT0).empty());
  EXPECT_EQ(t.transfers(), 0u);
}

TEST(LayerwiseTableTest, RecomputingEarlierTokensFailsTheTransfer) {
  LayerwiseTable t(Limits(1), kSelf);
  ASSERT_TRUE(t.Subscribe(Sub("x"), kT0).ok());
  const std::vector<LayerwiseSave> first = {Save("x", 0, 16, 32)};
  (void)t.Begin(first[0], kT0);
  (void)t.LayerWritten(first, 0);
  std::vector<ProgressPush> p = t.Begin(Save("x", 0, 16, 32), kT0);  // preempted, from 0
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].progress.state, State::kFailed);
  EXPECT_THAT(p[0].progress.reason, HasSubstr("preempted"));
}

TEST(LayerwiseTableTest, ATransferIdOfTwoRequestsFailsIt) {
  LayerwiseTable t(Limits(1), kSelf);
  ASSERT_TRUE(t.Subscribe(Sub("x"), kT0).ok());
  (void)t.Begin(Save("x", 0, 16, 32, "req-1"), kT0);
  std::vector<ProgressPush> p = t.Begin(Save("x", 16, 32, 32, "req-2"), kT0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].progress.state, State::kFailed);
  EXPECT_THAT(p[0].progress.reason, HasSubstr("unique"));
}

TEST(LayerwiseTableTest, WaitingSubscriptionsExpireAndAreCapped) {
  LayerwiseTable t(Limits(1), kSelf);
  // Clamped to max_wait (5 s) whatever the reader asks.
  ASSERT_TRUE(t.Subscribe(Sub("a", 0, 60000), kT0).ok());
  ASSERT_TRUE(t.Subscribe(Sub("b", 0, 1000), kT0).ok());
  ASSERT_TRUE(t.Subscribe(Sub("c"), kT0).ok());
  ASSERT_TRUE(t.Subscribe(Sub("d"), kT0).ok());
  Result<wire::Progress> refused = t.Subscribe(Sub("e"), kT0);
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(t.refused(), 1u);
  EXPECT_EQ(t.waiting(), 4u);
  // A second subscriber of a waiting transfer takes no new entry.
  ASSERT_TRUE(t.Subscribe(Sub("a", 1), kT0).ok());
  std::vector<ProgressPush> expired = t.Expire(kT0 + std::chrono::milliseconds(1001));
  ASSERT_EQ(expired.size(), 1u);  // b
  EXPECT_EQ(expired[0].progress.transfer_id, "b");
  EXPECT_EQ(expired[0].progress.state, State::kFailed);
  EXPECT_THAT(expired[0].progress.reason, HasSubstr("never arrived"));
  expired = t.Expire(kT0 + std::chrono::milliseconds(5001));
  EXPECT_EQ(expired.size(), 4u);  // a (two subscribers), c, d
  EXPECT_EQ(t.waiting(), 0u);
  EXPECT_EQ(t.transfers(), 0u);
}

TEST(LayerwiseTableTest, SubscribersPerTransferAreCapped) {
  LayerwiseTable t(Limits(1), kSelf);
  ASSERT_TRUE(t.Subscribe(Sub("x", 0), kT0).ok());
  ASSERT_TRUE(t.Subscribe(Sub("x", 1), kT0).ok());
  ASSERT_TRUE(t.Subscribe(Sub("x", 1), kT0).ok());  // the same reader again: replaced
  EXPECT_EQ(t.Subscribe(Sub("x", 2), kT0).status().code(), StatusCode::kResourceExhausted);
}

TEST(LayerwiseTableTest, UnsubscribingTheLastReaderOfAWaitingTransferForgetsIt) {
  LayerwiseTable t(Limits(1), kSelf);
  ASSERT_TRUE(t.Subscribe(Sub("x"), kT0).ok());
  t.Unsubscribe("x", ReaderKey(Sub("x").from));
  EXPECT_EQ(t.waiting(), 0u);
  EXPECT_EQ(t.transfers(), 0u);
  // A started transfer stays for its hold; it just tells nobody.
  ASSERT_TRUE(t.Subscribe(Sub("y"), kT0).ok());
  const std::vector<LayerwiseSave> saves = {Save("y", 0, 16, 16)};
  (void)t.Begin(saves[0], kT0);
  t.Unsubscribe("y", ReaderKey(Sub("y").from));
  EXPECT_EQ(t.transfers(), 1u);
  EXPECT_TRUE(t.LayerWritten(saves, 0).empty());
}

TEST(LayerwiseTableTest, LayersOutOfRangeAreIgnored) {
  LayerwiseTable t(Limits(2), kSelf);
  ASSERT_TRUE(t.Subscribe(Sub("x"), kT0).ok());
  const std::vector<LayerwiseSave> saves = {Save("x", 0, 16, 16)};
  (void)t.Begin(saves[0], kT0);
  EXPECT_TRUE(t.LayerWritten(saves, 2).empty());
  EXPECT_TRUE(t.LayerWritten(saves, -1).empty());
}

// KV cache groups (a hybrid model): the engine's layer index runs over group 0's layers, then
// group 1's; each group's count is announced as the model interleaves them, and the step is
// written when every group's last layer is.
TEST(LayerwiseTableTest, GroupsAreAnnouncedEachAsItsLayersAreWritten) {
  LayerwiseLimits limits = Limits(2);
  limits.group_layers = {2, 2, 1};  // full attention, a window, a state group
  LayerwiseTable t(limits, kSelf);
  wire::Subscribe sub = Sub("x");
  sub.groups = 3;
  ASSERT_TRUE(t.Subscribe(sub, kT0).ok());
  LayerwiseSave save = Save("x", 0, 40, 40);
  save.group_block_ids = {{kNoBlock, 201, 202}, {300}};
  const std::vector<LayerwiseSave> saves = {save};
  std::vector<ProgressPush> begun = t.Begin(save, kT0);
  ASSERT_EQ(begun.size(), 1u);
  EXPECT_EQ(begun[0].progress.group_layers_cur, (std::vector<std::uint32_t>{0, 0}));
  EXPECT_EQ(begun[0].progress.group_block_ids, save.group_block_ids);
  // Model order: full 0, window 0, full 1, window 1, then the state at the step's end.
  std::vector<ProgressPush> p = t.LayerWritten(saves, 0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].progress.layers_cur, 1u);
  p = t.LayerWritten(saves, 2);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].progress.group_layers_cur, (std::vector<std::uint32_t>{1, 0}));
  (void)t.LayerWritten(saves, 1);
  p = t.LayerWritten(saves, 3);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].progress.layers_cur, 2u);
  EXPECT_EQ(p[0].progress.group_layers_cur, (std::vector<std::uint32_t>{2, 0}));
  EXPECT_EQ(p[0].progress.tokens_all, 0u) << "the state group is not written yet";
  p = t.LayerWritten(saves, 4);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_TRUE(p[0].progress.complete());
  EXPECT_EQ(p[0].progress.layers_cur, 0u);
  EXPECT_EQ(p[0].progress.group_layers_cur, (std::vector<std::uint32_t>{0, 0}));
  EXPECT_TRUE(t.LayerWritten(saves, 5).empty()) << "past the last group's layers";
}

TEST(LayerwiseTableTest, AReaderOfAnotherGroupCountIsRefusedAndSoIsASaveOfOne) {
  LayerwiseLimits limits = Limits(2);
  limits.group_layers = {2, 2};
  LayerwiseTable t(limits, kSelf);
  // An older kvferry subscribes without `groups`: it would read group 0 alone.
  Result<wire::Progress> old = t.Subscribe(Sub("x"), kT0);
  EXPECT_EQ(old.status().code(), StatusCode::kNotSupported);
  EXPECT_THAT(old.status().message(), HasSubstr("has 2 KV cache group(s)"));
  EXPECT_EQ(t.transfers(), 0u) << "a refused subscription keeps nothing";
  wire::Subscribe sub = Sub("x");
  sub.groups = 2;
  ASSERT_TRUE(t.Subscribe(sub, kT0).ok());
  // An engine that names one group's blocks of a two-group cache fails the transfer.
  std::vector<ProgressPush> p = t.Begin(Save("x", 0, 40, 40), kT0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].progress.state, State::kFailed);
  EXPECT_THAT(p[0].progress.reason, HasSubstr("names blocks of 1 KV cache group(s)"));
}

}  // namespace
}  // namespace kvferry
