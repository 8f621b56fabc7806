// The connector end to end: a prefill instance in another process (connector_peer), decode
// workers in this one, real listeners and transports, every byte checked, and every test ending
// with zero holds and zero allocated blocks on both sides.
#include "kvferry/connector.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "common/clock.h"
#include "common/ports.h"
#include "common/subprocess.h"
#include "connector_harness.h"
#include "device/device.h"
#include "kv_test_cache.h"
#include "sidechannel/client.h"
#include "sidechannel/listener.h"
#include "tests/test_timing.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using testing::BytesRead;
using testing::DecodeInstance;
using testing::ExpectNothingLeft;
using testing::FreeBasePort;
using ::testing::HasSubstr;
using testing::Params;
using testing::PrefillProcess;
using testing::TakeTransfers;

// Runs requests of several sizes through prefill TP p -> decode TP d and checks every byte, and
// that each rank lists each load once among its transfers, with the bytes it read.
void TransferAndVerify(const std::string& kind, int p, int d) {
  PrefillProcess prefill(kind, p, "prefill-0", 60000);
  DecodeInstance decode(kind, d);
  int n = 0;
  for (int blocks : {1, 5, 12}) {
    const std::string req = "req-" + std::to_string(n++);
    const Params params = prefill.Hold(req, blocks);
    ASSERT_EQ(params.blocks.size(), static_cast<std::size_t>(blocks));
    const std::uint64_t read_before = BytesRead(decode, d);
    ASSERT_TRUE(decode.Load(req, prefill, params).ok());
    ASSERT_TRUE(decode.WaitReceived(req, {}, milliseconds(10000))) << req;
    EXPECT_TRUE(decode.Errors(req).empty()) << decode.Errors(req).front().status.ToString();
    EXPECT_EQ(decode.Mismatches(req), 0) << req;
    const auto transfers = TakeTransfers(decode, d);
    ASSERT_EQ(transfers.size(), 1u) << req;
    EXPECT_EQ(transfers.begin()->first, req);
    EXPECT_EQ(transfers.begin()->second.first, d) << req << ": one record per decode rank";
    EXPECT_EQ(transfers.begin()->second.second, BytesRead(decode, d) - read_before) << req;
    EXPECT_GT(transfers.begin()->second.second, 0u) << req;
    EXPECT_TRUE(prefill.WaitLine("FREED " + req, milliseconds(5000))) << req;
    decode.Free(req);
  }
  ExpectNothingLeft(prefill, decode);
}

TEST(ConnectorTest, MhaTp1To1) { TransferAndVerify("mha", 1, 1); }
TEST(ConnectorTest, MhaTp2To2) { TransferAndVerify("mha", 2, 2); }
TEST(ConnectorTest, MlaTp2To1) { TransferAndVerify("mla", 2, 1); }
TEST(ConnectorTest, MlaTp1To2) { TransferAndVerify("mla", 1, 2); }
TEST(ConnectorTest, MhaHeadMajorTp1To2UsesHeadSlices) { TransferAndVerify("mha_head_major", 1, 2); }

// MLA 1 -> 2: the single prefill rank has two readers; it must not free after the first.
TEST(ConnectorTest, PrefillRankWaitsForAllItsReaders) {
  PrefillProcess prefill("mla", 1, "prefill-0", 60000);
  DecodeInstance decode("mla", 2);
  const Params params = prefill.Hold("req-a", 6);
  ASSERT_TRUE(decode.Load("req-a", prefill, params, 0, {0}).ok());
  ASSERT_TRUE(decode.WaitReceived("req-a", {0}, milliseconds(10000)));
  // Decode rank 0's finished notice, sent here as its notifier sends it (same reader identity, so
  // the two count once): its ack means the prefill rank has handled it, and the hold must still
  // be there, waiting for decode rank 1.
  sidechannel::Client client(sidechannel::ClientOptions{});
  Result<wire::Message> ack =
      client.Call(prefill.endpoint(), wire::FinishedNotice{{"decode-0", 0, 0}, {"req-a"}, 2},
                  DeadlineAfter(milliseconds(2000)));
  ASSERT_TRUE(ack.ok()) << ack.status().ToString();
  ASSERT_TRUE(std::holds_alternative<wire::Ack>(*ack));
  EXPECT_EQ(prefill.Stats(), "STATS holds=1 allocated=6") << "freed while a reader had not read";
  EXPECT_FALSE(prefill.HasLine("RELEASED 0 req-a")) << "freed while a reader had not read";
  // Now the second reader, decode rank 1, reads the same blocks, which are still intact.
  ConnectorMetadata meta;
  meta.loads.push_back({"req-a", decode.LocalBlocks("req-a"), params.blocks, "prefill-0",
                        "127.0.0.1", params.port, params.tp, "req-a", ""});
  decode.worker(1).StartLoadKv(meta);
  ASSERT_TRUE(decode.WaitReceived("req-a", {0, 1}, milliseconds(10000)));
  EXPECT_EQ(decode.Mismatches("req-a"), 0);
  EXPECT_TRUE(prefill.WaitLine("FREED req-a", milliseconds(5000)));
  decode.Free("req-a");
  ExpectNothingLeft(prefill, decode);
}

TEST(ConnectorTest, DecodeSidePrefixHitReadsTheTail) {
  PrefillProcess prefill("mha", 1, "prefill-0", 60000);
  DecodeInstance decode("mha", 1);
  const Params params = prefill.Hold("req-p", 7);
  ASSERT_TRUE(decode.Load("req-p", prefill, params, /*prefix_hit_blocks=*/3).ok());
  ASSERT_TRUE(decode.WaitReceived("req-p", {}, milliseconds(10000)));
  EXPECT_EQ(decode.LocalBlocks("req-p").size(), 4u);
  EXPECT_TRUE(decode.Errors("req-p").empty());
  EXPECT_EQ(decode.Mismatches("req-p"), 0);
  EXPECT_TRUE(prefill.WaitLine("FREED req-p", milliseconds(5000)));
  decode.Free("req-p");
  ExpectNothingLeft(prefill, decode);
}

TEST(ConnectorTest, ZeroLocalBlocksStillNotifyAndFinish) {
  PrefillProcess prefill("mha", 2, "prefill-0", 60000);
  DecodeInstance decode("mha", 2);
  const Params params = prefill.Hold("req-z", 3);
  ASSERT_TRUE(decode.Load("req-z", prefill, params, /*prefix_hit_blocks=*/3).ok());
  ASSERT_TRUE(decode.WaitReceived("req-z", {}, milliseconds(10000)));
  EXPECT_TRUE(decode.Errors("req-z").empty());
  EXPECT_TRUE(prefill.WaitLine("FREED req-z", milliseconds(5000)));
  decode.Free("req-z");
  ExpectNothingLeft(prefill, decode);
}

// Issue 22 item 6: token-major MHA caches with unequal TP sizes, which vllm-ascend always has, move
// as strided reads (one piece per token slot of each block), both ways, over tcp, and the bytes
// read equal the bytes the decode ranks' blocks hold: nothing crosses the wire that is not needed.
// Before, every such load failed NotSupported and was recomputed.
void TokenMajorHeterogeneousTp(int p, int d) {
  PrefillProcess prefill("mha", p, "prefill-0", 60000);
  DecodeInstance decode("mha", d, "", milliseconds(10000), milliseconds(5000),
                        [](WorkerConfig& c) { c.transport.backend = "tcp"; });
  const Params params = prefill.Hold("req-s", 7);
  std::uint64_t before = 0;
  for (int r = 0; r < d; ++r) before += decode.worker(r).Stats().transport.bytes_read;
  ASSERT_TRUE(decode.Load("req-s", prefill, params).ok());
  ASSERT_TRUE(decode.WaitReceived("req-s", {}, milliseconds(10000)));
  EXPECT_TRUE(decode.Errors("req-s").empty()) << decode.Errors("req-s").front().status.ToString();
  EXPECT_EQ(decode.Mismatches("req-s"), 0);
  std::uint64_t read = 0, needed = 0;
  for (int r = 0; r < d; ++r) {
    read += decode.worker(r).Stats().transport.bytes_read;
    const CacheSpec spec = *testing::TestSpec("mha", d, r);
    for (int part = 0; part < spec.num_parts(); ++part) {
      needed += 7u * static_cast<std::uint64_t>(spec.num_layers() * spec.BlockBytes(part));
    }
  }
  EXPECT_EQ(read - before, needed) << "bytes read beyond the decode ranks' head slices";
  EXPECT_TRUE(prefill.WaitLine("FREED req-s", milliseconds(5000)));
  decode.Free("req-s");
  ExpectNothingLeft(prefill, decode);
}

TEST(ConnectorTest, TokenMajorTp1To2ReadsStridedHeadSlices) { TokenMajorHeterogeneousTp(1, 2); }
TEST(ConnectorTest, TokenMajorTp2To1ReadsStridedHeadSlices) { TokenMajorHeterogeneousTp(2, 1); }

// The loads from the killed instance fail because its death is detected, not because a deadline
// passes: the transfer and handshake timeouts are 60 s here, and the failures must come within
// 5 s (25 s under sanitizers). Two detections are possible, depending on whether the worker dropped
// the dead agent before the loads started: a read on the cached agent fails PeerDisconnected at
// once (the peer process exited, or its connection closed); a fresh handshake finds nobody
// listening and fails Unavailable after its 3 attempts of notice_timeout (1 s) each.
TEST(ConnectorTest, PrefillKilledFailsExactlyItsRequestsWithTheirBlocks) {
  auto doomed = std::make_unique<PrefillProcess>("mha", 1, "prefill-doomed", 60000);
  PrefillProcess healthy("mha", 1, "prefill-ok", 60000);
  constexpr milliseconds kTimeout(60000);
  DecodeInstance decode("mha", 1, "", /*transfer_timeout=*/kTimeout,
                        /*handshake_timeout=*/kTimeout);
  // A first request establishes the handshake and the data-plane connection.
  const Params warm = doomed->Hold("req-warm", 2);
  ASSERT_TRUE(decode.Load("req-warm", *doomed, warm).ok());
  ASSERT_TRUE(decode.WaitReceived("req-warm", {}, milliseconds(10000)));
  decode.Free("req-warm");
  const Params a = doomed->Hold("req-a", 5);
  const Params b = doomed->Hold("req-b", 3);
  const Params c = healthy.Hold("req-c", 4);
  doomed->Kill();
  const auto killed = Clock::now();
  ASSERT_TRUE(decode.Load("req-a", *doomed, a).ok());
  ASSERT_TRUE(decode.Load("req-b", *doomed, b).ok());
  ASSERT_TRUE(decode.Load("req-c", healthy, c).ok());
  ASSERT_TRUE(decode.WaitReceived("req-a", {}, milliseconds(8000)));
  ASSERT_TRUE(decode.WaitReceived("req-b", {}, milliseconds(8000)));
  ASSERT_TRUE(decode.WaitReceived("req-c", {}, milliseconds(8000)));
  EXPECT_LT(Clock::now() - killed, milliseconds(5000) * testing::kTimingSlack)
      << "the death was not detected: the loads waited for a timeout (60 s)";
  ASSERT_EQ(decode.Errors("req-a").size(), 1u);
  ASSERT_EQ(decode.Errors("req-b").size(), 1u);
  for (const char* r : {"req-a", "req-b"}) {
    const Status& s = decode.Errors(r)[0].status;
    if (s.code() != StatusCode::kPeerDisconnected) {
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << r << ": " << s.ToString();
      EXPECT_THAT(s.message(), HasSubstr("unreachable")) << r;
    }
  }
  EXPECT_EQ(decode.Errors("req-a")[0].local_block_ids, decode.LocalBlocks("req-a"));
  EXPECT_EQ(decode.Errors("req-b")[0].local_block_ids, decode.LocalBlocks("req-b"));
  EXPECT_TRUE(decode.Errors("req-c").empty());
  // Only loads that ended done are listed among the transfers.
  const auto transfers = TakeTransfers(decode, 1);
  EXPECT_EQ(transfers.count("req-a") + transfers.count("req-b"), 0u);
  EXPECT_EQ(transfers.count("req-c"), 1u);
  // Failures by peer: both on the dead engine, none on the healthy one.
  const WorkerStats stats = decode.worker(0).Stats();
  EXPECT_EQ(stats.failures_by_peer.count("prefill-ok"), 0u);
  ASSERT_EQ(stats.failures_by_peer.count("prefill-doomed"), 1u);
  EXPECT_EQ(stats.failures_by_peer.at("prefill-doomed"), 2u);
  EXPECT_EQ(decode.Mismatches("req-c"), 0);
  EXPECT_TRUE(healthy.WaitLine("FREED req-c", milliseconds(5000)));
  for (const char* r : {"req-a", "req-b", "req-c"}) decode.Free(r);
  doomed.reset();
  ExpectNothingLeft(healthy, decode);
}

// A prefill instance killed and started again on the same ports, under a new engine id: the
// decode worker's cached agent for the old engine is stale. Loads naming the new engine read
// from it (the stale agent is dropped and a fresh handshake made), loads naming the old one are
// refused clearly, and neither disturbs the other. Before the fix a load naming the new engine
// failed with "is now engine prefill-old" (the stale agent was used until a read on it failed).
TEST(ConnectorTest, PrefillRestartedOnTheSamePortsServesItsNewLoadsAndRefusesTheOldOnes) {
  auto old = std::make_unique<PrefillProcess>("mha", 1, "prefill-old", 60000);
  const int port = old->base_port();
  DecodeInstance decode("mha", 1, "", milliseconds(10000), milliseconds(5000));
  const Params warm = old->Hold("req-warm", 2);
  ASSERT_TRUE(decode.Load("req-warm", *old, warm).ok());
  ASSERT_TRUE(decode.WaitReceived("req-warm", {}, milliseconds(10000)));
  ASSERT_TRUE(decode.Errors("req-warm").empty());
  decode.Free("req-warm");
  const Params stale = old->Hold("req-stale", 3);
  old->Kill();
  PrefillProcess fresh("mha", 1, "prefill-new", 60000, "", port);
  int n = 0;
  for (int round = 0; round < 2; ++round) {
    // The new engine's loads, before and after a load naming the old engine.
    const std::string req = "req-new-" + std::to_string(n++);
    const Params p = fresh.Hold(req, 4);
    ASSERT_TRUE(decode.Load(req, fresh, p).ok());
    ASSERT_TRUE(decode.WaitReceived(req, {}, milliseconds(10000)));
    EXPECT_TRUE(decode.Errors(req).empty()) << decode.Errors(req).front().status.ToString();
    EXPECT_EQ(decode.Mismatches(req), 0);
    EXPECT_TRUE(fresh.WaitLine("FREED " + req, milliseconds(5000)));
    decode.Free(req);
    if (round == 0) {
      ASSERT_TRUE(decode.Load("req-stale", *old, stale).ok());
      ASSERT_TRUE(decode.WaitReceived("req-stale", {}, milliseconds(10000)));
      ASSERT_EQ(decode.Errors("req-stale").size(), 1u);
      const Status& s = decode.Errors("req-stale")[0].status;
      EXPECT_THAT(s.message(), HasSubstr("prefill-new")) << s.ToString();
      EXPECT_THAT(s.message(), HasSubstr("prefill-old")) << s.ToString();
      EXPECT_EQ(decode.Errors("req-stale")[0].local_block_ids, decode.LocalBlocks("req-stale"));
      decode.Free("req-stale");
    }
  }
  // The old engine's handshake, the new one's; the refused load made none and left it cached.
  EXPECT_EQ(decode.worker(0).Stats().handshakes, 2u);
  old.reset();
  ExpectNothingLeft(fresh, decode);
}

// Issue 14: a decode instance whose KV caches are device memory (the sim device, whose
// addresses fault when host code touches them) loads from a prefill instance in host memory in
// another process: the worker reads over tcp (auto passes over shm, which reads host memory
// only), staged into the device; every byte checked after copying the caches back.
TEST(ConnectorDeviceTest, DecodeCachesInDeviceMemoryLoadEveryByte) {
  PrefillProcess prefill("mha", 2, "prefill-0", 60000);
  DecodeInstance decode("mha", 2, "", milliseconds(10000), milliseconds(5000), nullptr, "sim:0");
  for (const char* req : {"req-a", "req-b"}) {
    const Params p = prefill.Hold(req, req[4] == 'a' ? 6 : 3);
    ASSERT_TRUE(decode.Load(req, prefill, p).ok());
    ASSERT_TRUE(decode.WaitReceived(req, {}, milliseconds(15000)));
    EXPECT_TRUE(decode.Errors(req).empty()) << decode.Errors(req).front().status.ToString();
    EXPECT_TRUE(prefill.WaitLine(std::string("FREED ") + req, milliseconds(5000)));
  }
  decode.SyncFromDevice();
  for (const char* req : {"req-a", "req-b"}) {
    EXPECT_EQ(decode.Mismatches(req), 0) << req;
    decode.Free(req);
  }
  ExpectNothingLeft(prefill, decode);
}

// Strided head slices (token-major, TP 2 -> 1) into decode caches in device memory: the pieces
// land through the device layer (tcp's staging, or shm's lanes), every byte checked after copying
// the caches back.
TEST(ConnectorDeviceTest, TokenMajorTp2To1StridedReadsLandInDeviceMemory) {
  PrefillProcess prefill("mha", 2, "prefill-0", 60000);
  DecodeInstance decode("mha", 1, "", milliseconds(10000), milliseconds(5000), nullptr, "sim:0");
  const Params p = prefill.Hold("req-d", 5);
  ASSERT_TRUE(decode.Load("req-d", prefill, p).ok());
  ASSERT_TRUE(decode.WaitReceived("req-d", {}, milliseconds(15000)));
  EXPECT_TRUE(decode.Errors("req-d").empty()) << decode.Errors("req-d").front().status.ToString();
  EXPECT_TRUE(prefill.WaitLine("FREED req-d", milliseconds(5000)));
  decode.SyncFromDevice();
  EXPECT_EQ(decode.Mismatches("req-d"), 0);
  decode.Free("req-d");
  ExpectNothingLeft(prefill, decode);
}

// Typed cache parts: each part's size is checked against the spec, and one worker's parts are
// in one memory; nothing is registered on a refusal, so a correct call afterwards works.
TEST(ConnectorTest, TypedCachePartsAreCheckedBeforeAnythingIsRegistered) {
  CacheSpec spec = *testing::TestSpec("mha", 1, 0);
  testing::TestCache cache(spec);
  WorkerConfig c;
  c.role = Role::kDecode;
  c.engine_id = "decode-typed";
  c.base_port = FreeBasePort(1);
  Result<std::unique_ptr<Worker>> w = Worker::Create(c);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  std::vector<std::vector<KvCachePart>> parts;
  const std::vector<std::vector<std::uint64_t>> bases = cache.Bases();
  for (int l = 0; l < spec.num_layers(); ++l) {
    parts.emplace_back();
    for (int p = 0; p < spec.num_parts(); ++p) {
      parts.back().push_back({bases[static_cast<std::size_t>(l)][static_cast<std::size_t>(p)],
                              static_cast<std::uint64_t>(spec.PartBytes(p)), MemoryKind::Host()});
    }
  }
  auto short_part = parts;
  short_part[1][0].bytes -= 1;
  Status s = (*w)->RegisterKvCaches(spec, short_part);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("layer 1 part 0 is"));
  auto mixed = parts;
  mixed[0][1].memory = MemoryKind{"sim", 0};
  s = (*w)->RegisterKvCaches(spec, mixed);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("in one memory"));
  EXPECT_TRUE((*w)->RegisterKvCaches(spec, parts).ok());
  EXPECT_EQ((*w)->RegisterKvCaches(spec, parts).code(), StatusCode::kInvalidArgument);  // twice
}

TEST(ConnectorTest, HoldEndsOnLeaseExpiryWhenNoReaderComes) {
  PrefillProcess prefill("mha", 2, "prefill-0", /*lease_ms=*/400);
  DecodeInstance decode("mha", 2);
  prefill.Hold("req-orphan", 4);  // its decode side died before reading
  EXPECT_TRUE(prefill.WaitLine("FREED req-orphan", milliseconds(3000)));
  ExpectNothingLeft(prefill, decode);
}

TEST(ConnectorTest, LeaseRenewalsKeepAHoldAndAbortEndsItEarly) {
  PrefillProcess prefill("mha", 1, "prefill-0", /*lease_ms=*/300);
  DecodeInstance decode("mha", 1);
  prefill.Hold("req-slow", 2);
  sidechannel::Client client(sidechannel::ClientOptions{});
  const std::string endpoint = prefill.endpoint();
  for (int i = 0; i < 8; ++i) {  // a slow but alive decode side, renewing for 800 ms
    Result<wire::Message> r =
        client.Call(endpoint, wire::LeaseRenewal{{"decode-0", 0, 0}, {"req-slow"}, 300},
                    DeadlineAfter(milliseconds(1000)));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    std::this_thread::sleep_for(milliseconds(100));
  }
  EXPECT_FALSE(prefill.HasLine("FREED req-slow")) << "a renewed hold was released";
  const auto abort_at = Clock::now();
  ASSERT_TRUE(client
                  .Call(endpoint,
                        wire::AbortNotice{{"decode-0", 0, 0}, {"req-slow"}, "client gone"},
                        DeadlineAfter(milliseconds(1000)))
                  .ok());
  EXPECT_TRUE(prefill.WaitLine("FREED req-slow", milliseconds(2000)));
  EXPECT_LT(Clock::now() - abort_at, milliseconds(250) * testing::kTimingSlack)
      << "abort did not free early";
  ExpectNothingLeft(prefill, decode);
}

TEST(ConnectorTest, EarlyFinishedNoticeIsKept) {
  PrefillProcess prefill("mha", 1, "prefill-0", 60000);
  DecodeInstance decode("mha", 1);
  sidechannel::Client client(sidechannel::ClientOptions{});
  const std::string endpoint = prefill.endpoint();
  // The notice for the request arrives before the prefill side registers its hold.
  ASSERT_TRUE(client
                  .Call(endpoint, wire::FinishedNotice{{"decode-0", 0, 0}, {"req-early"}, 1},
                        DeadlineAfter(milliseconds(1000)))
                  .ok());
  prefill.Hold("req-early", 2);
  EXPECT_TRUE(prefill.WaitLine("FREED req-early", milliseconds(2000)));
  ExpectNothingLeft(prefill, decode);
}

TEST(ConnectorTest, ForgedNoticesWithoutTheSecretChangeNothing) {
  PrefillProcess prefill("mha", 1, "prefill-0", 60000, "the-secret");
  DecodeInstance decode("mha", 1, "the-secret");
  prefill.Hold("req-s", 3);
  sidechannel::Client intruder(sidechannel::ClientOptions{});  // no secret
  const std::string endpoint = prefill.endpoint();
  EXPECT_EQ(intruder
                .Call(endpoint, wire::AbortNotice{{"x", 0, 0}, {"req-s"}, "forged"},
                      DeadlineAfter(milliseconds(1000)))
                .status()
                .code(),
            StatusCode::kUnauthenticated);
  EXPECT_EQ(intruder
                .Call(endpoint, wire::FinishedNotice{{"x", 0, 0}, {"req-s"}, 1},
                      DeadlineAfter(milliseconds(1000)))
                .status()
                .code(),
            StatusCode::kUnauthenticated);
  // The refusals came from the listener before any handler ran, so nothing is still in flight:
  // the hold is there now (Stats reads the workers' holds directly).
  EXPECT_EQ(prefill.Stats(), "STATS holds=1 allocated=3");
  EXPECT_FALSE(prefill.HasLine("FREED req-s"));
  // The real decode side, with the secret, still reads it, and then it is freed.
  Params params = prefill.Hold("req-t", 2);
  ASSERT_TRUE(decode.Load("req-t", prefill, params).ok());
  ASSERT_TRUE(decode.WaitReceived("req-t", {}, milliseconds(10000)));
  EXPECT_EQ(decode.Mismatches("req-t"), 0);
  EXPECT_TRUE(prefill.WaitLine("FREED req-t", milliseconds(5000)));
  decode.Free("req-t");
  sidechannel::ClientOptions with_secret;
  with_secret.secret = "the-secret";
  sidechannel::Client owner(with_secret);
  ASSERT_TRUE(owner
                  .Call(endpoint, wire::AbortNotice{{"decode-0", 0, 0}, {"req-s"}, "done"},
                        DeadlineAfter(milliseconds(1000)))
                  .ok());
  EXPECT_TRUE(prefill.WaitLine("FREED req-s", milliseconds(2000)));
  ExpectNothingLeft(prefill, decode);
}

}  // namespace
}  // namespace kvferry
