// The scheduler side, rule by rule (DESIGN.md rules 1-4).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "connector/load_runner.h"
#include "kvferry/connector.h"

namespace kvferry {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

KvTransferParams CompleteRemotePrefill() {
  KvTransferParams p;
  p.do_remote_prefill = true;
  p.remote_block_ids = std::vector<std::int64_t>{7, 8, 9};
  p.remote_engine_id = "prefill-0";
  p.remote_host = "127.0.0.1";
  p.remote_port = 5557;
  p.remote_tp_size = 2;
  p.remote_request_id = "p-req-1";
  return p;
}

using Matched = std::pair<std::int64_t, bool>;

Scheduler DecodeScheduler() { return Scheduler({Role::kDecode, "decode-0"}); }

TEST(SchedulerRule1, LoadsPromptMinusComputedAsynchronously) {
  Scheduler s = DecodeScheduler();
  KvTransferParams p = CompleteRemotePrefill();
  EXPECT_EQ(s.GetNumNewMatchedTokens(p, 100, 0), Matched(100, true));
  EXPECT_EQ(s.GetNumNewMatchedTokens(p, 100, 32), Matched(68, true));
  EXPECT_EQ(s.GetNumNewMatchedTokens(p, 100, 100), Matched(0, false));
  EXPECT_EQ(s.GetNumNewMatchedTokens(p, 100, 120), Matched(0, false));
  p.do_remote_prefill = false;
  EXPECT_EQ(s.GetNumNewMatchedTokens(p, 100, 0), Matched(0, false));
}

TEST(SchedulerRule2, CompleteParamsAreQueuedOnceAndTheFlagCleared) {
  Scheduler s = DecodeScheduler();
  KvTransferParams p = CompleteRemotePrefill();
  const std::vector<std::int64_t> local = {3, 4, 5};
  ASSERT_TRUE(s.UpdateStateAfterAlloc("d-req-1", p, local).ok());
  EXPECT_FALSE(p.do_remote_prefill) << "not loaded twice";
  ASSERT_TRUE(s.UpdateStateAfterAlloc("d-req-1", p, local).ok());  // a second call queues nothing
  ConnectorMetadata m = s.BuildConnectorMeta();
  ASSERT_EQ(m.loads.size(), 1u);
  const LoadSpec& l = m.loads[0];
  EXPECT_EQ(l.request_id, "d-req-1");
  EXPECT_THAT(l.local_block_ids, ElementsAre(3, 4, 5));
  EXPECT_THAT(l.remote_block_ids, ElementsAre(7, 8, 9));
  EXPECT_EQ(l.remote_engine_id, "prefill-0");
  EXPECT_EQ(l.remote_port, 5557);
  EXPECT_EQ(l.remote_tp_size, 2);
  EXPECT_EQ(l.remote_request_id, "p-req-1");
}

TEST(SchedulerRule2, ZeroNewBlocksStillQueueALoadThatNotifies) {
  Scheduler s = DecodeScheduler();
  KvTransferParams p = CompleteRemotePrefill();
  ASSERT_TRUE(s.UpdateStateAfterAlloc("d-req", p, {}).ok());
  ConnectorMetadata m = s.BuildConnectorMeta();
  ASSERT_EQ(m.loads.size(), 1u);
  EXPECT_TRUE(m.loads[0].local_block_ids.empty());
}

TEST(SchedulerRule2, IncompleteParamsAreRejectedClearlyAndNothingIsQueued) {
  Scheduler s = DecodeScheduler();
  KvTransferParams p = CompleteRemotePrefill();
  p.remote_host.reset();
  p.remote_tp_size.reset();
  Status st = s.UpdateStateAfterAlloc("d-req-2", p, std::vector<std::int64_t>{1});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("request d-req-2"));
  EXPECT_THAT(st.message(), HasSubstr("lack remote_host, remote_tp_size"));
  EXPECT_FALSE(p.do_remote_prefill);
  EXPECT_TRUE(s.BuildConnectorMeta().loads.empty());
  KvTransferParams bad_port = CompleteRemotePrefill();
  bad_port.remote_port = 70000;
  EXPECT_EQ(s.UpdateStateAfterAlloc("d-req-3", bad_port, {}).code(), StatusCode::kInvalidArgument);
}

// Issue 11, finding 6: remote_tp_size was only checked to be >= 1 (a worker then looped over every
// claimed rank), and remote_port + rank was never checked against 65535.
TEST(SchedulerRule14, RemoteRanksAreBoundedBeforeAnythingIsQueued) {
  Scheduler s = DecodeScheduler();
  KvTransferParams huge = CompleteRemotePrefill();
  huge.remote_tp_size = 1 << 30;
  Status st = s.UpdateStateAfterAlloc("d-huge", huge, std::vector<std::int64_t>{1});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("TP and PP sizes in 1..256"));
  KvTransferParams past_port = CompleteRemotePrefill();
  past_port.remote_port = 65535;
  past_port.remote_tp_size = 2;  // ranks at 65535 and 65536
  EXPECT_EQ(s.UpdateStateAfterAlloc("d-port", past_port, std::vector<std::int64_t>{1}).code(),
            StatusCode::kInvalidArgument);
  KvTransferParams last_port = CompleteRemotePrefill();
  last_port.remote_port = 65534;
  last_port.remote_tp_size = 2;
  EXPECT_TRUE(s.UpdateStateAfterAlloc("d-ok", last_port, std::vector<std::int64_t>{1}).ok());
  const ConnectorMetadata md = s.BuildConnectorMeta();
  ASSERT_EQ(md.loads.size(), 1u);
  EXPECT_EQ(md.loads[0].request_id, "d-ok");
  // Metadata claiming more ranks than kvferry allows does not decode.
  ConnectorMetadata forged = md;
  forged.loads[0].remote_tp_size = kMaxTpSize + 1;
  EXPECT_FALSE(ConnectorMetadata::Decode(forged.Encode()).ok());
}

TEST(SchedulerRule2, MissingRemoteRequestIdFallsBackToTheRequestId) {
  Scheduler s = DecodeScheduler();
  KvTransferParams p = CompleteRemotePrefill();
  p.remote_request_id.reset();
  ASSERT_TRUE(s.UpdateStateAfterAlloc("same-id", p, {}).ok());
  EXPECT_EQ(s.BuildConnectorMeta().loads[0].remote_request_id, "same-id");
}

TEST(SchedulerRule3, MetadataIsClearedAndRoundTrips) {
  Scheduler s({Role::kPrefill, "prefill-0", "127.0.0.1", 5557, 1, 4});
  KvTransferParams decode_params;
  decode_params.do_remote_decode = true;
  (void)s.RequestFinished("r1", decode_params, FinishReason::kLengthCapped,
                          std::vector<std::int64_t>{1, 2});
  ConnectorMetadata m = s.BuildConnectorMeta();
  ASSERT_EQ(m.holds.size(), 1u);
  EXPECT_TRUE(s.BuildConnectorMeta().holds.empty()) << "cleared";
  m.loads.push_back({"x", {1, 2}, {3, 4, 5}, "e", "h", 9, 2, "rx", ""});
  m.loads.push_back({"y", {1, 2}, {}, "e", "h", 9, 2, "xfer-y", "xfer-y"});
  m.holds.push_back({"z", 1000, "xfer-z"});
  m.saves.push_back({"w", "xfer-w", {7, 8}, 16, 30, 30});
  m.transfer_ends.push_back({"xfer-v", "aborted"});
  Result<ConnectorMetadata> back = ConnectorMetadata::Decode(m.Encode());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, m);
  EXPECT_FALSE(ConnectorMetadata::Decode(std::vector<std::uint8_t>{0x80}).ok());
  EXPECT_FALSE(
      ConnectorMetadata::Decode(std::vector<std::uint8_t>{0xdd, 0xff, 0xff, 0xff, 0xff}).ok());
}

TEST(SchedulerRule4, LengthCappedRemoteDecodeIsHeldWithParamsForTheDecodeSide) {
  Scheduler s({Role::kPrefill, "prefill-0", "10.0.0.1", 5557, /*dp_rank=*/1, /*tp_size=*/4,
               std::chrono::milliseconds(90000)});
  KvTransferParams in;
  in.do_remote_decode = true;
  const std::vector<std::int64_t> blocks = {11, 12, 13};
  Scheduler::FinishedResult r = s.RequestFinished("p-req", in, FinishReason::kLengthCapped, blocks);
  EXPECT_TRUE(r.delay_free);
  ASSERT_TRUE(r.params.has_value());
  EXPECT_TRUE(r.params->do_remote_prefill);
  EXPECT_FALSE(r.params->do_remote_decode);
  EXPECT_THAT(*r.params->remote_block_ids, ElementsAre(11, 12, 13));
  EXPECT_EQ(r.params->remote_engine_id, "prefill-0");
  EXPECT_EQ(r.params->remote_host, "10.0.0.1");
  EXPECT_EQ(r.params->remote_port, 5557 + 1 * 4);  // TP rank 0 of DP group 1
  EXPECT_EQ(r.params->remote_tp_size, 4);
  EXPECT_EQ(r.params->remote_request_id, "p-req");
  ConnectorMetadata m = s.BuildConnectorMeta();
  ASSERT_EQ(m.holds.size(), 1u);
  EXPECT_EQ(m.holds[0].request_id, "p-req");
  EXPECT_EQ(m.holds[0].lease_ms, 90000) << "a hold is bounded by its lease";
}

TEST(SchedulerRule4, DecodeRequestEndingUnscheduledTellsThePrefillSide) {
  Scheduler s = DecodeScheduler();
  KvTransferParams p = CompleteRemotePrefill();
  Scheduler::FinishedResult r = s.RequestFinished("gone", p, FinishReason::kAborted, {});
  EXPECT_FALSE(r.delay_free);
  ConnectorMetadata m = s.BuildConnectorMeta();
  ASSERT_EQ(m.loads.size(), 1u) << "a load of no blocks, which only notifies";
  EXPECT_TRUE(m.loads[0].local_block_ids.empty());
  EXPECT_EQ(m.loads[0].remote_request_id, *p.remote_request_id);
  // Once scheduled (the flag cleared), or without params, ending queues nothing.
  ASSERT_TRUE(s.UpdateStateAfterAlloc("done", p, std::vector<std::int64_t>{1}).ok());
  (void)s.BuildConnectorMeta();
  (void)s.RequestFinished("done", p, FinishReason::kStopped, std::vector<std::int64_t>{1});
  (void)s.RequestFinished("local", KvTransferParams{}, FinishReason::kAborted, {});
  EXPECT_TRUE(s.BuildConnectorMeta().loads.empty());
}

TEST(SchedulerRule4, OtherEndingsAreNotHeld) {
  Scheduler s({Role::kPrefill, "prefill-0"});
  KvTransferParams remote;
  remote.do_remote_decode = true;
  const std::vector<std::int64_t> blocks = {1};
  for (FinishReason why : {FinishReason::kStopped, FinishReason::kAborted, FinishReason::kError}) {
    Scheduler::FinishedResult r = s.RequestFinished("r", remote, why, blocks);
    EXPECT_FALSE(r.delay_free);
    EXPECT_FALSE(r.params.has_value());
  }
  KvTransferParams local_only;
  EXPECT_FALSE(s.RequestFinished("r", local_only, FinishReason::kLengthCapped, blocks).delay_free);
  // No blocks: nothing to hold, but the decode side still gets params (it finishes at once).
  Scheduler::FinishedResult empty = s.RequestFinished("e", remote, FinishReason::kLengthCapped, {});
  EXPECT_FALSE(empty.delay_free);
  EXPECT_TRUE(empty.params.has_value());
  EXPECT_TRUE(s.BuildConnectorMeta().holds.empty());
}

TEST(WorkerConfigTest, RoleAndRankTableEntryAreChecked) {
  WorkerConfig c;
  c.role = Role::kDecode;
  c.engine_id = "";
  EXPECT_EQ(Worker::Create(c).status().code(), StatusCode::kInvalidArgument);
  RankTableGenOptions gen;
  gen.hosts = {"127.0.0.1"};
  gen.devices_per_host = 2;
  gen.prefill_count = 1;
  gen.decode_count = 1;
  c.engine_id = "d";
  c.rank_table = *GenerateRankTable(gen);
  c.server_id = "127.0.0.2";  // not in the table
  c.base_port = 45000 + static_cast<int>(getpid() % 1000);
  Result<std::unique_ptr<Worker>> w = Worker::Create(c);
  EXPECT_EQ(w.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(w.status().message(),
              HasSubstr("no decode_device_list entry for TP rank 0 on server_id \"127.0.0.2\""));
  EXPECT_EQ(*ParseRole("kv_both"), Role::kBoth);
  EXPECT_EQ(ParseRole("kv_mixed").status().code(), StatusCode::kInvalidArgument);
}

// Pipeline parallelism: the prefill side names its PP size and the port of stage 0's TP rank 0;
// the decode side's load carries it, bounded with the ports it reaches.
TEST(SchedulerPipelineTest, PrefillNamesItsStagesAndLoadsCarryThem) {
  SchedulerConfig pc{Role::kPrefill, "prefill-0", "10.0.0.1", 5557, /*dp_rank=*/1,
                     /*tp_size=*/2};
  pc.pp_size = 3;
  Scheduler prefill(pc);
  KvTransferParams serve;
  serve.do_remote_decode = true;
  const std::vector<std::int64_t> blocks = {1};
  Scheduler::FinishedResult r =
      prefill.RequestFinished("p", serve, FinishReason::kLengthCapped, blocks);
  ASSERT_TRUE(r.params.has_value());
  EXPECT_EQ(r.params->remote_pp_size, 3);
  EXPECT_EQ(r.params->remote_port, 5557 + 1 * 3 * 2);
  Scheduler decode = DecodeScheduler();
  KvTransferParams p = *r.params;
  ASSERT_TRUE(decode.UpdateStateAfterAlloc("d", p, blocks).ok());
  ConnectorMetadata m = decode.BuildConnectorMeta();
  ASSERT_EQ(m.loads.size(), 1u);
  EXPECT_EQ(m.loads[0].remote_pp_size, 3);
  Result<ConnectorMetadata> back = ConnectorMetadata::Decode(m.Encode());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, m);
  KvTransferParams far = *r.params;
  far.remote_port = 65535 - 4;  // stage 2's TP rank 1 would be 65535 + 1
  EXPECT_EQ(decode.UpdateStateAfterAlloc("f", far, blocks).code(), StatusCode::kInvalidArgument);
}

// Ranks on several hosts: the prefill names each rank's host, the load carries them through the
// metadata, and a list of the wrong size is refused on either side, changing nothing.
TEST(SchedulerPipelineTest, RankHostsTravelFromThePrefillToTheLoad) {
  SchedulerConfig pc{Role::kPrefill, "prefill-0", "10.0.0.1", 5557, 0, /*tp_size=*/2};
  pc.pp_size = 2;
  Scheduler prefill(pc);
  const std::vector<std::string> hosts = {"10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"};
  const Status short_list = prefill.SetRankHosts({"10.0.0.1", "10.0.0.2"});
  EXPECT_EQ(short_list.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(short_list.message(), HasSubstr("PP 2 x TP 2 = 4"));
  EXPECT_EQ(prefill.SetRankHosts({"a", "", "b", "c"}).code(), StatusCode::kInvalidArgument);
  KvTransferParams serve;
  serve.do_remote_decode = true;
  const std::vector<std::int64_t> blocks = {1};
  EXPECT_FALSE(prefill.RequestFinished("p0", serve, FinishReason::kLengthCapped, blocks)
                   .params->remote_rank_hosts.has_value())
      << "a refused list changed the params";
  ASSERT_TRUE(prefill.SetRankHosts(hosts).ok());
  Scheduler::FinishedResult r =
      prefill.RequestFinished("p", serve, FinishReason::kLengthCapped, blocks);
  ASSERT_TRUE(r.params.has_value());
  EXPECT_EQ(r.params->remote_rank_hosts, hosts);

  Scheduler decode = DecodeScheduler();
  KvTransferParams p = *r.params;
  ASSERT_TRUE(decode.UpdateStateAfterAlloc("d", p, blocks).ok());
  ConnectorMetadata m = decode.BuildConnectorMeta();
  ASSERT_EQ(m.loads.size(), 1u);
  EXPECT_EQ(m.loads[0].remote_rank_hosts, hosts);
  EXPECT_EQ(m.loads[0].RankHost(1), "10.0.0.1");
  Result<ConnectorMetadata> back = ConnectorMetadata::Decode(m.Encode());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, m);
  ConnectorMetadata wrong = m;
  wrong.loads[0].remote_rank_hosts.pop_back();
  EXPECT_EQ(ConnectorMetadata::Decode(wrong.Encode()).status().code(),
            StatusCode::kInvalidArgument);

  KvTransferParams bad = *r.params;
  bad.remote_rank_hosts->pop_back();
  EXPECT_EQ(decode.UpdateStateAfterAlloc("b", bad, blocks).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(decode.BuildConnectorMeta().loads.empty());
  ASSERT_TRUE(prefill.SetRankHosts({}).ok());
  EXPECT_FALSE(prefill.RequestFinished("p2", serve, FinishReason::kLengthCapped, blocks)
                   .params->remote_rank_hosts.has_value());
}

// KV cache groups (issue 29): the prefill names every group's blocks, the decode side's load
// carries them through the metadata (kNoBlock included), and a group count the params do not
// have is refused with nothing queued.
TEST(SchedulerGroupsTest, EveryGroupsBlocksTravelAndACountMismatchIsRefused) {
  Scheduler prefill({Role::kPrefill, "prefill-0"});
  KvTransferParams serve;
  serve.do_remote_decode = true;
  const std::vector<std::vector<std::int64_t>> held = {{1, 2, 3}, {kNoBlock, 7, 8}};
  Scheduler::FinishedResult r =
      prefill.RequestFinishedAllGroups("p", serve, FinishReason::kLengthCapped, held);
  ASSERT_TRUE(r.params.has_value());
  EXPECT_TRUE(r.delay_free);
  EXPECT_EQ(r.params->remote_block_ids, held[0]);
  ASSERT_TRUE(r.params->remote_group_block_ids.has_value());
  EXPECT_EQ(*r.params->remote_group_block_ids, std::vector<std::vector<std::int64_t>>{held[1]});

  Scheduler decode = DecodeScheduler();
  KvTransferParams one_group = *r.params;
  const std::vector<std::int64_t> blocks = {4, 5, 6};
  const Status mismatch = decode.UpdateStateAfterAlloc("d0", one_group, blocks, 48, 48);
  EXPECT_EQ(mismatch.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(mismatch.message(), HasSubstr("name 2"));
  EXPECT_FALSE(one_group.do_remote_prefill) << "cleared: never loaded twice";
  EXPECT_TRUE(decode.BuildConnectorMeta().loads.empty());

  KvTransferParams p = *r.params;
  const std::vector<std::vector<std::int64_t>> local = {{4, 5, 6}, {kNoBlock, 9, 10}};
  ASSERT_TRUE(decode.UpdateStateAfterAllocAllGroups("d", p, local, 48, 48).ok());
  ConnectorMetadata m = decode.BuildConnectorMeta();
  ASSERT_EQ(m.loads.size(), 1u);
  EXPECT_EQ(m.loads[0].num_groups(), 2);
  EXPECT_EQ(m.loads[0].LocalIds(1), local[1]);
  EXPECT_EQ(m.loads[0].RemoteIds(1), held[1]);
  Result<ConnectorMetadata> back = ConnectorMetadata::Decode(m.Encode());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, m);
  // Ended before it was scheduled: a load of no blocks of every group still tells the prefill.
  KvTransferParams unscheduled = *r.params;
  (void)decode.RequestFinishedAllGroups("gone", unscheduled, FinishReason::kAborted,
                                        std::vector<std::vector<std::int64_t>>(2));
  ConnectorMetadata gone = decode.BuildConnectorMeta();
  ASSERT_EQ(gone.loads.size(), 1u);
  EXPECT_EQ(gone.loads[0].num_groups(), 2);
}

// kv_both (vLLM's KVTransferConfig): each request's params say which side it is.
TEST(SchedulerBothRoles, ServesAndLoadsByEachRequestsParams) {
  Scheduler s({Role::kBoth, "both-0", "10.0.0.1", 5557, 0, 2});
  KvTransferParams serve;
  serve.do_remote_decode = true;
  const std::vector<std::int64_t> blocks = {4, 5};
  Scheduler::FinishedResult held =
      s.RequestFinished("p", serve, FinishReason::kLengthCapped, blocks);
  EXPECT_TRUE(held.delay_free);
  ASSERT_TRUE(held.params.has_value());
  EXPECT_EQ(held.params->remote_engine_id, "both-0");
  KvTransferParams load = CompleteRemotePrefill();
  ASSERT_TRUE(s.UpdateStateAfterAlloc("d", load, blocks).ok());
  KvTransferParams gone = CompleteRemotePrefill();
  EXPECT_FALSE(s.RequestFinished("g", gone, FinishReason::kAborted, {}).delay_free);
  KvTransferParams layerwise = serve;
  layerwise.transfer_id = "xfer-b";
  s.RequestScheduled("lw", layerwise, blocks, 0, 8, 8);
  ConnectorMetadata m = s.BuildConnectorMeta();
  EXPECT_EQ(m.holds.size(), 1u);
  EXPECT_EQ(m.loads.size(), 2u) << "the load, and the notify-only load of the aborted request";
  EXPECT_EQ(m.saves.size(), 1u);
}

// Rule 16: layer-wise requests on both sides.
TEST(SchedulerLayerwiseTest, DecodeLegNeedsNoBlockIds) {
  Scheduler s({Role::kDecode, "decode-0", "127.0.0.1", 6000, 0, 1});
  KvTransferParams p;
  p.do_remote_prefill = true;
  p.transfer_id = "xfer-1";
  p.remote_engine_id = "prefill-0";
  p.remote_host = "10.0.0.1";
  p.remote_port = 5557;
  p.remote_tp_size = 2;
  ASSERT_TRUE(s.UpdateStateAfterAlloc("r1", p, std::vector<std::int64_t>{4, 5}).ok());
  ConnectorMetadata m = s.BuildConnectorMeta();
  ASSERT_EQ(m.loads.size(), 1u);
  EXPECT_EQ(m.loads[0].transfer_id, "xfer-1");
  EXPECT_EQ(m.loads[0].remote_request_id, "xfer-1");
  EXPECT_TRUE(m.loads[0].remote_block_ids.empty());
  EXPECT_EQ(m.loads[0].local_block_ids, (std::vector<std::int64_t>{4, 5}));
  // Still needs where to read from.
  KvTransferParams q;
  q.do_remote_prefill = true;
  q.transfer_id = "xfer-2";
  Status bad = s.UpdateStateAfterAlloc("r2", q, std::vector<std::int64_t>{1});
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), Not(HasSubstr("remote_block_ids")));
  EXPECT_THAT(bad.message(), HasSubstr("remote_engine_id"));
  q.do_remote_prefill = true;
  q.transfer_id = "";
  q.remote_engine_id = "e";
  q.remote_host = "h";
  q.remote_port = 1;
  q.remote_tp_size = 1;
  EXPECT_THAT(s.UpdateStateAfterAlloc("r3", q, std::vector<std::int64_t>{1}).message(),
              HasSubstr("transfer_id of 0 bytes"));
}

TEST(SchedulerLayerwiseTest, PrefillQueuesSavesPerStepAndHoldsUnderTheTransferId) {
  Scheduler s({Role::kPrefill, "prefill-0", "10.0.0.1", 5557, 0, 2});
  KvTransferParams p;
  p.do_remote_decode = true;
  p.transfer_id = "xfer-1";
  const std::vector<std::int64_t> blocks = {10, 11, 12};
  s.RequestScheduled("r1", p, blocks, 0, 20, 40);
  // Not layer-wise: ignored.
  s.RequestScheduled("r2", KvTransferParams{}, blocks, 0, 20, 40);
  ConnectorMetadata m = s.BuildConnectorMeta();
  ASSERT_EQ(m.saves.size(), 1u);
  EXPECT_EQ(m.saves[0], (LayerwiseSave{"r1", "xfer-1", blocks, 0, 20, 40}));
  s.RequestScheduled("r1", p, blocks, 20, 30, 40);  // past the prompt: clamped to it
  m = s.BuildConnectorMeta();
  ASSERT_EQ(m.saves.size(), 1u);
  EXPECT_EQ(m.saves[0].first_token, 20);
  EXPECT_EQ(m.saves[0].end_token, 40);
  s.RequestScheduled("r1", p, blocks, 40, 1, 40);  // decoding: nothing of the prompt
  EXPECT_TRUE(s.BuildConnectorMeta().saves.empty());
  Scheduler::FinishedResult f = s.RequestFinished("r1", p, FinishReason::kLengthCapped, blocks);
  EXPECT_TRUE(f.delay_free);
  ASSERT_TRUE(f.params);
  EXPECT_EQ(f.params->remote_request_id, "xfer-1");
  EXPECT_EQ(f.params->remote_block_ids, blocks);
  m = s.BuildConnectorMeta();
  ASSERT_EQ(m.holds.size(), 1u);
  EXPECT_EQ(m.holds[0].request_id, "r1");
  EXPECT_EQ(m.holds[0].transfer_id, "xfer-1");
  EXPECT_TRUE(m.transfer_ends.empty());
}

TEST(SchedulerLayerwiseTest, AHybridsSavesNameEveryGroupsBlocksAndRoundTrip) {
  Scheduler s({Role::kPrefill, "prefill-0", "10.0.0.1", 5557, 0, 1});
  KvTransferParams p;
  p.do_remote_decode = true;
  p.transfer_id = "xfer-h";
  // Full attention, a sliding window whose first block was freed, a state group.
  const std::vector<std::vector<std::int64_t>> groups = {{10, 11, 12}, {kNoBlock, 21, 22}, {30}};
  s.RequestScheduledAllGroups("r1", p, groups, 0, 40, 40);
  ConnectorMetadata m = s.BuildConnectorMeta();
  ASSERT_EQ(m.saves.size(), 1u);
  EXPECT_EQ(m.saves[0].block_ids, groups[0]);
  EXPECT_EQ(m.saves[0].group_block_ids,
            (std::vector<std::vector<std::int64_t>>{groups[1], groups[2]}));
  Result<ConnectorMetadata> back = ConnectorMetadata::Decode(m.Encode());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, m);
}

TEST(SchedulerLayerwiseTest, PrefillEndsTheTransferOfARequestItDoesNotHold) {
  Scheduler s({Role::kPrefill, "prefill-0", "10.0.0.1", 5557, 0, 1});
  KvTransferParams p;
  p.do_remote_decode = true;
  p.transfer_id = "xfer-1";
  const std::vector<std::int64_t> blocks = {10};
  for (FinishReason reason : {FinishReason::kAborted, FinishReason::kStopped, FinishReason::kError,
                              FinishReason::kPreempted}) {
    Scheduler::FinishedResult f = s.RequestFinished("r1", p, reason, blocks);
    EXPECT_FALSE(f.delay_free);
    EXPECT_FALSE(f.params.has_value());
    ConnectorMetadata m = s.BuildConnectorMeta();
    EXPECT_TRUE(m.holds.empty());
    ASSERT_EQ(m.transfer_ends.size(), 1u);
    EXPECT_EQ(m.transfer_ends[0].transfer_id, "xfer-1");
    EXPECT_THAT(m.transfer_ends[0].reason, HasSubstr("without holding"));
    if (reason == FinishReason::kPreempted) {
      EXPECT_THAT(m.transfer_ends[0].reason, HasSubstr("(preempted)"));
    }
  }
  // Preempted: computed tokens go back to 0.
  s.RequestScheduled("r2", p, blocks, 0, 16, 32);
  s.RequestScheduled("r2", p, blocks, 16, 16, 32);
  s.RequestScheduled("r2", p, blocks, 0, 16, 32);
  ConnectorMetadata m = s.BuildConnectorMeta();
  EXPECT_EQ(m.saves.size(), 2u);
  ASSERT_EQ(m.transfer_ends.size(), 1u);
  EXPECT_THAT(m.transfer_ends[0].reason, HasSubstr("preempted"));
}

// Issue 28 item 5: the tokens a load brings travel with it, so blocks of different sizes pair.
TEST(SchedulerBlockSizes, TheLoadCarriesItsTokensThroughTheMetadata) {
  Scheduler s = DecodeScheduler();
  KvTransferParams p = CompleteRemotePrefill();
  const std::vector<std::int64_t> local = {3, 4};
  // vLLM: a 100-token prompt, 32 tokens in the decode side's prefix cache, 68 external.
  ASSERT_TRUE(s.UpdateStateAfterAlloc("d-req", p, local, 68, 100).ok());
  ConnectorMetadata m = s.BuildConnectorMeta();
  ASSERT_EQ(m.loads.size(), 1u);
  EXPECT_EQ(m.loads[0].first_token, 32);
  EXPECT_EQ(m.loads[0].num_tokens, 68);
  Result<ConnectorMetadata> back = ConnectorMetadata::Decode(m.Encode());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->loads, m.loads);
  // Without them (the older call) the fields stay unknown, on the wire too.
  KvTransferParams q = CompleteRemotePrefill();
  ASSERT_TRUE(s.UpdateStateAfterAlloc("d-old", q, local).ok());
  Result<ConnectorMetadata> old = ConnectorMetadata::Decode(s.BuildConnectorMeta().Encode());
  ASSERT_TRUE(old.ok());
  EXPECT_EQ(old->loads[0].num_tokens, -1);
  EXPECT_EQ(old->loads[0].first_token, -1);
  KvTransferParams bad = CompleteRemotePrefill();
  Status st = s.UpdateStateAfterAlloc("d-bad", bad, local, 101, 100);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("101 external tokens of a 100-token prompt"));
  EXPECT_FALSE(bad.do_remote_prefill);
  EXPECT_TRUE(s.BuildConnectorMeta().loads.empty());
}

TEST(SchedulerBlockSizes, TokensOfALoadFromItsCountsOrItsBlocks) {
  LoadSpec load;
  load.request_id = "r";
  load.remote_block_ids = {1, 2, 3, 4, 5};  // 5 blocks of 16: tokens 0-79
  load.local_block_ids = {8, 9};
  load.first_token = 32;
  load.num_tokens = 40;
  EXPECT_EQ(*TokensOfLoad(load, 16, 32), (TokenSpan{32, 40}));
  EXPECT_THAT(TokensOfLoad(load, 16, 64).status().message(),
              HasSubstr("a load starts at a block of this side (a multiple of 64)"));
  // Only block ids, decode blocks of 32 = 2 prefill blocks: ceil(5 / 2) = 3 decode blocks, the
  // last 2 of them loaded (the first was cached): tokens 32-79.
  load.first_token = -1;
  load.num_tokens = -1;
  EXPECT_EQ(*TokensOfLoad(load, 16, 32), (TokenSpan{32, 48}));
  load.local_block_ids = {7, 8, 9, 10};
  EXPECT_THAT(TokensOfLoad(load, 16, 32).status().message(),
              HasSubstr("allocated 4 blocks but the prefill side's 5 fill only 3"));
  // Decode blocks smaller than the prefill's cannot be placed by block ids alone.
  Status st = TokensOfLoad(load, 32, 16).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("blocks hold 32 tokens and this side's 16"));
  EXPECT_THAT(st.message(), HasSubstr("num_external_tokens"));
}

// Issue 29, state groups: vLLM's token rule for Mamba / linear-attention models, as NixlConnector
// has it (vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py,
// _truncate_mamba_request_for_prefill: the prefill side drops the last prompt token;
// _get_remote_prefill_token_count: the decode side loads num_prompt_tokens - 1 and computes
// the last one from the loaded state). The load's tokens end one before the prompt's.
TEST(SchedulerStateGroups, PrefillComputesAndALoadBringsThePromptLessItsLastToken) {
  SchedulerConfig dc{Role::kDecode, "decode-0"};
  dc.state_groups = true;
  Scheduler d(dc);
  KvTransferParams p = CompleteRemotePrefill();
  EXPECT_EQ(d.GetNumNewMatchedTokens(p, 100, 0), Matched(99, true));
  EXPECT_EQ(d.GetNumNewMatchedTokens(p, 100, 32), Matched(67, true));
  EXPECT_EQ(d.GetNumNewMatchedTokens(p, 1, 0), Matched(1, true));  // nothing to drop
  ASSERT_TRUE(d.UpdateStateAfterAlloc("d-req", p, std::vector<std::int64_t>{3, 4}, 99, 100).ok());
  ConnectorMetadata m = d.BuildConnectorMeta();
  ASSERT_EQ(m.loads.size(), 1u);
  EXPECT_EQ(m.loads[0].first_token, 0);
  EXPECT_EQ(m.loads[0].num_tokens, 99);
  SchedulerConfig pc{Role::kPrefill, "prefill-0"};
  pc.state_groups = true;
  Scheduler prefill(pc);
  KvTransferParams remote_decode;
  remote_decode.do_remote_decode = true;
  EXPECT_EQ(prefill.PrefillTokens(remote_decode, 100), 99);
  EXPECT_EQ(prefill.PrefillTokens(KvTransferParams{}, 100), 100);  // not a P/D request
  EXPECT_EQ(Scheduler({Role::kPrefill, "p"}).PrefillTokens(remote_decode, 100), 100);
}

}  // namespace
}  // namespace kvferry
