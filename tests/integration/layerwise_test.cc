// Layer-wise transfer end to end (DESIGN rule 16, docs/layerwise.md): a prefill instance in
// another process (connector_peer) that writes and announces its request one layer at a time, a
// decode instance here that reads each layer as it is announced, every byte checked, and every
// test ending with nothing held or allocated on either side. The prefill peer scrambles a
// request's blocks before it writes them, so a layer read before it was written fails the check.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "connector_harness.h"
#include "sidechannel/client.h"
#include "tests/test_timing.h"
#include "wire/messages.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using testing::DecodeInstance;
using testing::ExpectNothingLeft;
using ::testing::HasSubstr;
using testing::PrefillProcess;

// The specs of kv_test_cache.h: 2 layers, 4 tokens per block.
constexpr int kLayers = 2;

// Runs one request of `prompt` tokens through a layer-wise transfer, prefill TP p -> decode TP d,
// in `chunks` steps, checking that nothing is reported before the last layer is announced and
// that every byte arrives.
void LayerwiseTransfer(const std::string& kind, int p, int d, std::int64_t prompt, int chunks,
                       int prefix_hit_blocks = 0) {
  PrefillProcess prefill(kind, p, "prefill-0", 60000);
  DecodeInstance decode(kind, d);
  const std::string req = "req-lw";
  const std::string xfer = "xfer-1";
  // The decode leg first: it subscribes before the prefill has seen the request, so every layer
  // reaches it as a pushed announcement (SubscriberAfterTheHoldReadsItAll covers the reply).
  ASSERT_TRUE(decode.LoadLayerwise(req, xfer, prefill, p, prompt, prefix_hit_blocks).ok());
  // Each decode rank subscribes at every prefill rank it reads (rule 8): one, or p / d of them
  // for MHA with a smaller decode TP.
  ASSERT_TRUE(
      prefill.WaitSubscribed(static_cast<std::uint64_t>(d * (kind != "mla" && p > d ? p / d : 1))));
  std::vector<std::int64_t> blocks;
  const std::int64_t chunk = (prompt + chunks - 1) / chunks;
  for (std::int64_t first = 0; first < prompt; first += chunk) {
    const std::int64_t end = std::min(prompt, first + chunk);
    blocks = prefill.Step(req, xfer, first, end, prompt);
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_FALSE(decode.Reported(req)) << "reported before layer " << l << " of tokens [" << first
                                         << ", " << end << ") was announced";
      prefill.Layer(l);
    }
  }
  decode.SetRemoteBlocks(req, blocks);
  ASSERT_TRUE(decode.WaitReceived(req, {}, milliseconds(10000)));
  EXPECT_TRUE(decode.Errors(req).empty()) << decode.Errors(req).front().status.ToString();
  EXPECT_EQ(decode.Mismatches(req), 0);
  // The confirmation came before the hold: kept as an early notice, applied when it starts.
  prefill.Finish(req);
  EXPECT_TRUE(prefill.WaitLine("FREED " + req, milliseconds(5000)));
  decode.Free(req);
  ExpectNothingLeft(prefill, decode);
}

TEST(LayerwiseTest, MhaTp1To1) { LayerwiseTransfer("mha", 1, 1, 37, 1); }
TEST(LayerwiseTest, MhaTp2To2) { LayerwiseTransfer("mha", 2, 2, 37, 1); }
TEST(LayerwiseTest, MlaTp2To1) { LayerwiseTransfer("mla", 2, 1, 22, 1); }
TEST(LayerwiseTest, MlaTp1To2) { LayerwiseTransfer("mla", 1, 2, 22, 1); }
TEST(LayerwiseTest, HeadMajorTp1To2ReadsHeadSlices) {
  LayerwiseTransfer("mha_head_major", 1, 2, 30, 1);
}
TEST(LayerwiseTest, ChunkedPrefillReadsEachChunkAsItIsWritten) {
  LayerwiseTransfer("mha", 1, 1, 41, 3);  // chunks of 14 tokens: blocks straddle them
}
TEST(LayerwiseTest, DecodePrefixHitReadsOnlyTheTail) { LayerwiseTransfer("mha", 1, 1, 40, 2, 4); }

// The hold starts before the decode side has read everything (the decode leg came late): the
// reads that follow are of held blocks, and the readers' notices release the hold.
TEST(LayerwiseTest, SubscriberAfterTheHoldReadsItAll) {
  PrefillProcess prefill("mha", 2, "prefill-0", 60000);
  DecodeInstance decode("mha", 2);
  const std::vector<std::int64_t> blocks = prefill.Step("r", "x", 0, 25, 25);
  prefill.Layers(0, kLayers);
  prefill.Finish("r");
  ASSERT_TRUE(decode.LoadLayerwise("r", "x", prefill, 2, 25).ok());
  decode.SetRemoteBlocks("r", blocks);
  ASSERT_TRUE(decode.WaitReceived("r", {}, milliseconds(10000)));
  EXPECT_TRUE(decode.Errors("r").empty()) << decode.Errors("r").front().status.ToString();
  EXPECT_EQ(decode.Mismatches("r"), 0);
  EXPECT_TRUE(prefill.WaitLine("FREED r", milliseconds(5000)));
  decode.Free("r");
  ExpectNothingLeft(prefill, decode);
}

// Waits until `worker` has read some bytes: in a layer-wise load, those of a layer it heard of.
// (Not a count of progress messages: the prefill side coalesces a start and a layer into one
// push when they come close together, as they do on a loaded machine.)
bool WaitForBytesRead(Worker& worker) {
  const Deadline deadline = DeadlineAfter(milliseconds(5000));
  while (Clock::now() < deadline) {
    if (worker.Stats().bytes_read > 0) return true;
    std::this_thread::sleep_for(milliseconds(2));
  }
  return false;
}

// The load ends failed, at once and with its blocks, and asks for a recompute.
void ExpectFailedLoad(DecodeInstance& decode, const std::string& req, StatusCode code,
                      const std::string& message) {
  ASSERT_EQ(decode.Errors(req).size(), 1u);
  const LoadError& e = decode.Errors(req)[0];
  EXPECT_EQ(e.status.code(), code) << e.status.ToString();
  EXPECT_THAT(e.status.message(), HasSubstr(message));
  EXPECT_EQ(e.local_block_ids, decode.LocalBlocks(req));
  EXPECT_TRUE(e.recompute);
}

TEST(LayerwiseTest, PrefillAbortedMidLayersFailsTheLoadAtOnce) {
  PrefillProcess prefill("mha", 1, "prefill-0", 60000);
  DecodeInstance decode("mha", 1);
  ASSERT_TRUE(decode.LoadLayerwise("r", "x", prefill, 1, 30).ok());
  ASSERT_TRUE(prefill.WaitSubscribed(1));
  (void)prefill.Step("r", "x", 0, 30, 30);
  prefill.Layer(0);
  const auto aborted = Clock::now();
  prefill.Abort("r");
  ASSERT_TRUE(decode.WaitReceived("r", {}, milliseconds(5000)));
  EXPECT_LT(Clock::now() - aborted, milliseconds(2000) * testing::kTimingSlack);
  ExpectFailedLoad(decode, "r", StatusCode::kUnavailable, "aborted");
  decode.Free("r");
  ExpectNothingLeft(prefill, decode);
}

TEST(LayerwiseTest, PrefillLegThatNeverArrivesFailsAtTheStartDeadline) {
  PrefillProcess prefill("mha", 1, "prefill-0", 60000);
  DecodeInstance decode("mha", 1, "", milliseconds(20000), milliseconds(2000),
                        [](WorkerConfig& c) { c.layerwise_start_timeout = milliseconds(400); });
  const auto start = Clock::now();
  ASSERT_TRUE(decode.LoadLayerwise("r", "never", prefill, 1, 30).ok());
  ASSERT_TRUE(decode.WaitReceived("r", {}, milliseconds(5000)));
  const auto took = Clock::now() - start;
  EXPECT_GE(took, milliseconds(400));
  EXPECT_LT(took, milliseconds(2000) * testing::kTimingSlack);
  const Status& s = decode.Errors("r").at(0).status;
  // Whichever comes first: the decode side's own start deadline, or the prefill side telling it
  // that the subscription expired.
  EXPECT_TRUE(s.code() == StatusCode::kTimeout || s.code() == StatusCode::kUnavailable)
      << s.ToString();
  EXPECT_THAT(s.message(), ::testing::AnyOf(HasSubstr("did not start"), HasSubstr("never")));
  decode.Free("r");
  ExpectNothingLeft(prefill, decode);
}

TEST(LayerwiseTest, PrefillStoppedMidLayersFailsAtTheProgressDeadline) {
  PrefillProcess prefill("mha", 1, "prefill-0", 60000);
  DecodeInstance decode("mha", 1, "", milliseconds(20000), milliseconds(2000),
                        [](WorkerConfig& c) { c.layerwise_progress_timeout = milliseconds(400); });
  ASSERT_TRUE(decode.LoadLayerwise("r", "x", prefill, 1, 30).ok());
  ASSERT_TRUE(prefill.WaitSubscribed(1));
  (void)prefill.Step("r", "x", 0, 30, 30);
  prefill.Layer(0);
  // Stopped once the decode side has heard of layer 0 and read it, so what the test sees is the
  // progress deadline, not a subscription that could not be made.
  ASSERT_TRUE(WaitForBytesRead(decode.worker(0)));
  prefill.Signal(SIGSTOP);
  const auto stopped = Clock::now();
  ASSERT_TRUE(decode.WaitReceived("r", {}, milliseconds(5000)));
  EXPECT_LT(Clock::now() - stopped, milliseconds(2000) * testing::kTimingSlack);
  // By the progress deadline, or sooner by the poll sent after half of it, which the stopped
  // process does not answer.
  ASSERT_EQ(decode.Errors("r").size(), 1u);
  const Status& s = decode.Errors("r")[0].status;
  EXPECT_THAT(s.message(),
              ::testing::AnyOf(HasSubstr("announced no progress"), HasSubstr("subscribing at")))
      << s.ToString();
  EXPECT_TRUE(decode.Errors("r")[0].recompute);
  prefill.Signal(SIGCONT);
  // The prefill instance goes on, holds the request, and the decode side's abort frees it.
  prefill.Layer(1);
  prefill.Finish("r");
  EXPECT_TRUE(prefill.WaitLine("FREED r", milliseconds(5000)));
  decode.Free("r");
  ExpectNothingLeft(prefill, decode);
}

TEST(LayerwiseTest, PrefillKilledMidLayersFailsTheLoad) {
  auto prefill = std::make_unique<PrefillProcess>("mha", 1, "prefill-0", 60000);
  DecodeInstance decode("mha", 1, "", milliseconds(20000), milliseconds(2000),
                        [](WorkerConfig& c) { c.layerwise_progress_timeout = milliseconds(1000); });
  ASSERT_TRUE(decode.LoadLayerwise("r", "x", *prefill, 1, 30).ok());
  ASSERT_TRUE(prefill->WaitSubscribed(1));
  (void)prefill->Step("r", "x", 0, 30, 30);
  prefill->Layer(0);
  const auto killed = Clock::now();
  prefill->Kill();
  ASSERT_TRUE(decode.WaitReceived("r", {}, milliseconds(5000)));
  EXPECT_LT(Clock::now() - killed, milliseconds(3000) * testing::kTimingSlack);
  ASSERT_EQ(decode.Errors("r").size(), 1u);
  EXPECT_TRUE(decode.Errors("r")[0].recompute);
  decode.Free("r");
  EXPECT_EQ(decode.allocated(), 0u);
  EXPECT_EQ(decode.loads_outstanding(), 0u);
}

// The engine aborts the decode request mid-layers: the load ends at once (Cancelled, nothing to
// recompute), and the prefill side frees the request as soon as it holds it, not by its lease.
TEST(LayerwiseTest, DecodeAbortMidLayersEndsAtOnceAndFreesThePrefillHold) {
  PrefillProcess prefill("mha", 1, "prefill-0", 60000);
  DecodeInstance decode("mha", 1);
  ASSERT_TRUE(decode.LoadLayerwise("r", "x", prefill, 1, 30).ok());
  ASSERT_TRUE(prefill.WaitSubscribed(1));
  (void)prefill.Step("r", "x", 0, 30, 30);
  prefill.Layer(0);
  const auto aborted = Clock::now();
  ASSERT_TRUE(decode.worker(0).AbortLoad("r", "the client went away").ok());
  ASSERT_TRUE(decode.WaitReceived("r", {}, milliseconds(5000)));
  EXPECT_LT(Clock::now() - aborted, milliseconds(1000) * testing::kTimingSlack);
  ASSERT_EQ(decode.Errors("r").size(), 1u);
  EXPECT_EQ(decode.Errors("r")[0].status.code(), StatusCode::kCancelled);
  EXPECT_FALSE(decode.Errors("r")[0].recompute);
  prefill.Layer(1);
  prefill.Finish("r");
  EXPECT_TRUE(prefill.WaitLine("FREED r", milliseconds(5000)))
      << "the hold waited for its lease (60 s) instead of the decode side's abort";
  decode.Free("r");
  ExpectNothingLeft(prefill, decode);
}

// A reader that confirms after the prefill request ended without a hold (aborted after the last
// layer was announced and read): its bytes may come from reused blocks, so the load fails.
TEST(LayerwiseTest, ConfirmationAfterTheRequestEndedWithoutAHoldIsRefused) {
  PrefillProcess prefill("mha", 1, "prefill-0", 60000);
  DecodeInstance decode("mha", 1);
  (void)prefill.Step("r", "x", 0, 12, 12);
  prefill.Layers(0, kLayers);
  prefill.Abort("r");  // ended, blocks freed
  // A reader that read it all before the abort now confirms: refused, its bytes are not safe.
  sidechannel::Client client(sidechannel::ClientOptions{});
  Result<wire::Message> confirm =
      client.Call(prefill.endpoint(), wire::FinishedNotice{{"decode-0", 0, 0}, {"x"}, 1},
                  DeadlineAfter(milliseconds(2000)));
  EXPECT_EQ(confirm.status().code(), StatusCode::kNotFound) << confirm.status().ToString();
  EXPECT_THAT(confirm.status().message(), HasSubstr("must not be used"));
  // A reader that subscribes only now is told the transfer ended.
  ASSERT_TRUE(decode.LoadLayerwise("r", "x", prefill, 1, 12).ok());
  ASSERT_TRUE(decode.WaitReceived("r", {}, milliseconds(5000)));
  ExpectFailedLoad(decode, "r", StatusCode::kUnavailable, "ended");
  decode.Free("r");
  ExpectNothingLeft(prefill, decode);
}

// Hostile input to the decode side's listener: announcements for transfers nobody here reads,
// from ranks the load does not read, duplicates and old ones, layers and blocks outside the
// caches, tokens going back, and a flood; each refused or dropped, the load unharmed.
TEST(LayerwiseHostileTest, BadAnnouncementsAreRefusedAndTheLoadCompletes) {
  PrefillProcess prefill("mha", 1, "prefill-0", 60000);
  DecodeInstance decode("mha", 1);
  ASSERT_TRUE(decode.LoadLayerwise("r", "x", prefill, 1, 30).ok());
  ASSERT_TRUE(prefill.WaitSubscribed(1));
  std::vector<std::int64_t> blocks = prefill.Step("r", "x", 0, 30, 30);
  prefill.Layer(0);
  // The real announcement taken first (its layer read): the old and duplicate announcements
  // below are older than it. Without this wait a push of seq 1 could arrive before it and be
  // taken as new (seen once under make test).
  ASSERT_TRUE(WaitForBytesRead(decode.worker(0))) << "layer 0 was announced and never read";
  sidechannel::Client client(sidechannel::ClientOptions{});
  const std::string endpoint = decode.worker(0).listener_endpoint();
  auto push = [&](const wire::Progress& p) {
    return client.Call(endpoint, p, DeadlineAfter(milliseconds(2000)));
  };
  wire::Progress good;
  good.from = {"prefill-0", 0, 0};
  good.transfer_id = "x";
  good.seq = 1000;
  good.state = wire::Progress::State::kRunning;
  good.prompt_tokens = 30;
  good.tokens_all = 0;
  good.tokens_cur = 30;
  good.layers_cur = 1;
  good.block_ids = blocks;

  wire::Progress p = good;
  p.transfer_id = "never-subscribed";
  EXPECT_EQ(push(p).status().code(), StatusCode::kNotFound);
  p = good;
  p.from.engine_id = "someone-else";
  EXPECT_EQ(push(p).status().code(), StatusCode::kInvalidArgument);
  p = good;
  p.from.tp_rank = 1;  // TP 1 -> 1 reads rank 0 only
  EXPECT_EQ(push(p).status().code(), StatusCode::kInvalidArgument);
  p = good;
  p.from.dp_rank = 1;  // the engine and TP rank the load reads, but another DP rank (issue 30)
  EXPECT_THAT(push(p).status().message(), HasSubstr("not from prefill-0/1/0"));
  p = good;
  p.layers_cur = kLayers;  // a layer the cache does not have
  EXPECT_THAT(push(p).status().message(), HasSubstr("layers written of a cache of 2"));
  p = good;
  p.block_ids.back() = 1 << 20;  // outside the prefill cache
  EXPECT_THAT(push(p).status().message(), HasSubstr("the prefill cache has"));
  p = good;
  p.block_ids.pop_back();  // fewer blocks than the tokens need
  EXPECT_EQ(push(p).status().code(), StatusCode::kInvalidArgument);
  p = good;
  p.prompt_tokens = 8;  // shorter than the blocks the decode side allocated
  EXPECT_EQ(push(p).status().code(), StatusCode::kInvalidArgument);
  // A duplicate or an older announcement changes nothing.
  p = good;
  p.seq = 1;
  Result<wire::Message> old = push(p);
  ASSERT_TRUE(old.ok()) << old.status().ToString();
  EXPECT_EQ(std::get<wire::Ack>(*old).count, 0u);
  // Tokens going back after a real announcement.
  p = good;
  p.seq = 1u << 30;
  p.tokens_cur = 4;
  p.block_ids.resize(1);
  EXPECT_EQ(push(p).status().code(), StatusCode::kInvalidArgument);
  // A flood of duplicates: each answered, none kept beyond the newest.
  p = good;
  p.seq = 1;
  for (int i = 0; i < 500; ++i) ASSERT_TRUE(push(p).ok());
  EXPECT_FALSE(decode.Reported("r")) << "a refused announcement made the load finish";
  // The real announcements still complete the load, every byte right.
  prefill.Layer(1);
  decode.SetRemoteBlocks("r", blocks);
  ASSERT_TRUE(decode.WaitReceived("r", {}, milliseconds(10000)));
  EXPECT_TRUE(decode.Errors("r").empty()) << decode.Errors("r").front().status.ToString();
  EXPECT_EQ(decode.Mismatches("r"), 0);
  prefill.Finish("r");
  EXPECT_TRUE(prefill.WaitLine("FREED r", milliseconds(5000)));
  decode.Free("r");
  ExpectNothingLeft(prefill, decode);
}

// Hostile input to the prefill side: subscriptions to transfers it never started are capped and
// expire; a subscriber list per transfer is capped; progress messages are refused by a prefill.
TEST(LayerwiseHostileTest, SubscriptionsAPeerCanMakeAreBounded) {
  PrefillProcess prefill("mha", 1, "prefill-0", 60000);
  sidechannel::Client client(sidechannel::ClientOptions{});
  const std::string endpoint = prefill.endpoint();
  auto subscribe = [&](const std::string& xfer, std::uint32_t tp_rank) {
    return client.Call(
        endpoint, wire::Subscribe{{"decode-x", 0, tp_rank}, xfer, 256, "tcp://127.0.0.1:1", 60000},
        DeadlineAfter(milliseconds(2000)));
  };
  Result<wire::Message> first = subscribe("x-0", 0);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(std::get<wire::Progress>(*first).state, wire::Progress::State::kWaiting);
  // WorkerConfig's default cap: 4,096 waiting transfers, 256 subscribers per transfer.
  int refused = 0;
  for (int i = 1; i < 4200; ++i) {
    Result<wire::Message> r = subscribe("x-" + std::to_string(i), 0);
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
      ++refused;
    }
  }
  EXPECT_EQ(refused, 4200 - 4096);
  for (std::uint32_t rank = 1; rank < 256; ++rank) ASSERT_TRUE(subscribe("x-0", rank).ok());
  EXPECT_TRUE(subscribe("x-0", 255).ok()) << "the same reader again replaces its subscription";
  Result<wire::Message> over = client.Call(
      endpoint, wire::Subscribe{{"decode-y", 0, 0}, "x-0", 1, "tcp://127.0.0.1:1", 60000},
      DeadlineAfter(milliseconds(2000)));
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr("256 subscribers"));
  wire::Progress p;
  p.from = {"decode-x", 0, 0};
  p.transfer_id = "x-0";
  p.seq = 1;
  EXPECT_EQ(client.Call(endpoint, p, DeadlineAfter(milliseconds(2000))).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(prefill.Stats(), "STATS holds=0 allocated=0");
}

}  // namespace
}  // namespace kvferry
