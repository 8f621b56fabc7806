// The side channel over real ZeroMQ sockets on loopback.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "common/clock.h"
#include "common/ports.h"
#include "sidechannel/client.h"
#include "sidechannel/listener.h"
#include "sidechannel/notifier.h"
#include "sidechannel/zmq_util.h"
#include "tests/test_timing.h"

namespace kvferry::sidechannel {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;

// A port that was free a moment ago.
int FreePort() { return FreeLoopbackPorts(1); }

wire::AgentMetadata SampleMetadata() {
  CacheSpec cache = *CacheSpec::Mha(2, 8, 128, 64, 16, DType::kBFloat16, 2, 1);
  return wire::AgentMetadata{{{"prefill-0", 0, 1}, 2, "127.0.0.1", "1", "127.0.0.1", 2, {}, {}},
                             "tcp://127.0.0.1:1",
                             {{"tcp", {1, 2, 3}}},
                             cache,
                             cache.Hash(),
                             {}};
}

// Records what the handler saw; answers metadata requests with SampleMetadata and notices with
// an ack counting their ids. A handler can be made slow (delay_ms) or held inside until the test
// opens its gate (CloseGate / OpenGate; held at most 10 s, so a failing test cannot hang).
struct Recorder {
  std::mutex mu;
  std::vector<wire::Message> seen;
  std::atomic<int> delay_ms{0};
  std::condition_variable cv;
  int entered = 0;           // guarded by mu
  bool gate_closed = false;  // guarded by mu

  void CloseGate() {
    std::lock_guard<std::mutex> lock(mu);
    gate_closed = true;
  }
  void OpenGate() {
    {
      std::lock_guard<std::mutex> lock(mu);
      gate_closed = false;
    }
    cv.notify_all();
  }
  // Waits until `n` handler calls have started.
  bool WaitEntered(int n, milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, timeout, [&] { return entered >= n; });
  }

  RequestHandler Handler() {
    return [this](const wire::Message& m) -> wire::Message {
      {
        std::unique_lock<std::mutex> lock(mu);
        ++entered;
        cv.notify_all();
        cv.wait_for(lock, milliseconds(10000), [&] { return !gate_closed; });
      }
      if (delay_ms.load() > 0) std::this_thread::sleep_for(milliseconds(delay_ms.load()));
      {
        std::lock_guard<std::mutex> lock(mu);
        seen.push_back(m);
      }
      if (std::holds_alternative<wire::MetadataRequest>(m)) return SampleMetadata();
      if (const auto* f = std::get_if<wire::FinishedNotice>(&m)) {
        return wire::Ack{static_cast<std::uint32_t>(f->request_ids.size())};
      }
      return wire::Ack{1};
    };
  }
  std::size_t count() {
    std::lock_guard<std::mutex> lock(mu);
    return seen.size();
  }
};

struct Fixture {
  explicit Fixture(const std::string& secret = "") {
    ListenerOptions o;
    o.base_port = FreePort();
    o.secret = secret;
    Result<std::unique_ptr<Listener>> l = Listener::Start(o, recorder.Handler());
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    listener = std::move(l).value();
    ClientOptions co;
    co.secret = secret;
    co.attempt_timeout = milliseconds(1000);
    client = std::make_unique<Client>(co);
  }
  Recorder recorder;
  std::unique_ptr<Listener> listener;
  std::unique_ptr<Client> client;
};

TEST(SideChannelTest, HandshakeRoundTrip) {
  Fixture f("s3cret");
  Result<wire::Message> r =
      f.client->Call(f.listener->endpoint(), wire::MetadataRequest{{"decode-0", 0, 0}},
                     DeadlineAfter(milliseconds(3000)));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(std::holds_alternative<wire::AgentMetadata>(*r));
  EXPECT_EQ(std::get<wire::AgentMetadata>(*r), SampleMetadata());
  EXPECT_EQ(f.listener->Stats().handled, 1u);
}

TEST(SideChannelTest, ListenerPortFollowsRankPlacement) {
  ListenerOptions o;
  o.base_port = 6000;
  o.dp_rank = 2;
  o.tp_size = 4;
  o.tp_rank = 3;
  EXPECT_EQ(ListenerPort(o), 6000 + 2 * 4 + 3);
  // Pipeline stages of one DP rank take consecutive TP-size blocks (issue 28: stage 1 collided
  // with stage 0's ports on one host).
  o.pp_size = 2;
  o.pp_rank = 1;
  EXPECT_EQ(ListenerPort(o), 6000 + (2 * 2 + 1) * 4 + 3);
  o.pp_rank = 0;
  o.dp_rank = 0;
  o.tp_rank = 0;
  EXPECT_EQ(ListenerPort(o), 6000) << "stage 0 of DP rank 0 keeps the base port";
}

TEST(SideChannelTest, FinishedNoticesToOnePeerAreBatched) {
  Fixture f;
  std::mutex mu;
  std::multiset<std::string> acked;
  int failures = 0;
  FinishedNotifier notifier(
      f.client.get(), {"decode-0", 0, 1}, 2, {milliseconds(20), 4096, 2},
      [&](const std::string&, const std::vector<std::string>& ids, const Status& s) {
        std::lock_guard<std::mutex> lock(mu);
        if (!s.ok()) ++failures;
        acked.insert(ids.begin(), ids.end());
      });
  for (int i = 0; i < 200; ++i) {
    notifier.Finished(f.listener->endpoint(), "req-" + std::to_string(i),
                      DeadlineAfter(milliseconds(3000)));
  }
  notifier.Flush();
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(acked.size(), 200u);
  EXPECT_EQ(std::set<std::string>(acked.begin(), acked.end()).size(), 200u) << "each id once";
  EXPECT_LE(f.recorder.count(), 3u) << "200 notices should travel in a few messages";
  EXPECT_EQ(notifier.batches_sent(), f.recorder.count());
}

// Sends raw frames, as a broken or hostile peer would, and returns the decoded reply.
class RawPeer {
 public:
  explicit RawPeer(const std::string& endpoint) : socket_(ZMQ_DEALER) {
    EXPECT_TRUE(socket_.SetInt(ZMQ_RCVTIMEO, 2000).ok());
    EXPECT_TRUE(socket_.SetInt(ZMQ_SNDTIMEO, 2000).ok());
    EXPECT_EQ(zmq_connect(socket_.get(), endpoint.c_str()), 0);
  }
  // Returns the reply's body decoded, or the receive error.
  Result<wire::Message> Exchange(const std::vector<std::vector<std::uint8_t>>& frames) {
    std::vector<std::span<const std::uint8_t>> spans(frames.begin(), frames.end());
    KVFERRY_RETURN_IF_ERROR(SendFrames(socket_.get(), spans));
    std::vector<std::vector<std::uint8_t>> reply;
    bool truncated = false;
    KVFERRY_RETURN_IF_ERROR(RecvFrames(socket_.get(), &reply, 4, 1 << 20, &truncated));
    if (reply.size() != 2)
      return Status::Internal("reply has " + std::to_string(reply.size()) + " frames");
    return wire::Decode(reply[1]);
  }

 private:
  ZmqSocket socket_;
};

StatusCode ErrorCode(const Result<wire::Message>& r) {
  if (!r.ok() || !std::holds_alternative<wire::ErrorReply>(*r)) return StatusCode::kOk;
  return std::get<wire::ErrorReply>(*r).code;
}

std::vector<std::uint8_t> Signed(const std::string& secret, const std::vector<std::uint8_t>& body) {
  return SignMessage(secret, AuthKind::kRequest, body, {}, nullptr);
}

TEST(SideChannelTest, MalformedInputGetsAnErrorReplyAndTheListenerGoesOn) {
  Fixture f;
  RawPeer raw(f.listener->endpoint());
  const std::vector<std::uint8_t> good = wire::Encode(wire::MetadataRequest{{"d", 0, 0}});
  // Each class of bad input, with the code it must be refused with.
  std::vector<std::pair<std::vector<std::vector<std::uint8_t>>, StatusCode>> cases;
  cases.push_back({{good}, StatusCode::kInvalidArgument});                        // one frame
  cases.push_back({{{1, 2, 3}, good}, StatusCode::kUnauthenticated});             // bad header
  cases.push_back({{Signed("", {0xc1}), {0xc1}}, StatusCode::kInvalidArgument});  // not msgpack
  std::vector<std::uint8_t> trailing = good;
  trailing.push_back(0);
  cases.push_back({{Signed("", trailing), trailing}, StatusCode::kInvalidArgument});
  const std::vector<std::uint8_t> deep(64, 0x91);
  cases.push_back({{Signed("", deep), deep}, StatusCode::kInvalidArgument});
  const std::vector<std::uint8_t> bomb = {0xdd, 0xff, 0xff, 0xff, 0xff};
  cases.push_back({{Signed("", bomb), bomb}, StatusCode::kInvalidArgument});
  const std::vector<std::uint8_t> ack = wire::Encode(wire::Ack{1});  // a reply type as a request
  cases.push_back({{Signed("", ack), ack}, StatusCode::kInvalidArgument});
  std::vector<std::uint8_t> wrong_type = good;
  wrong_type[wrong_type.size() - 1] = 0xc3;  // tp_rank: true instead of an integer
  cases.push_back({{Signed("", wrong_type), wrong_type}, StatusCode::kInvalidArgument});
  const std::vector<std::uint8_t> huge(wire::kMaxMessageBytes + 1, 0x90);
  cases.push_back({{Signed("", huge), huge}, StatusCode::kResourceExhausted});
  cases.push_back({{Signed("", good), good, good}, StatusCode::kResourceExhausted});  // 3 frames
  for (std::size_t i = 0; i < cases.size(); ++i) {
    Result<wire::Message> r = raw.Exchange(cases[i].first);
    ASSERT_TRUE(r.ok()) << "case " << i << ": " << r.status().ToString();
    EXPECT_EQ(ErrorCode(r), cases[i].second) << "case " << i;
    // The listener still answers a good request.
    Result<wire::Message> ok = raw.Exchange({Signed("", good), good});
    ASSERT_TRUE(ok.ok()) << "after case " << i;
    EXPECT_TRUE(std::holds_alternative<wire::AgentMetadata>(*ok)) << "after case " << i;
  }
  const ListenerStats s = f.listener->Stats();
  EXPECT_EQ(s.handled, cases.size());
  EXPECT_GE(s.malformed, 6u);
  EXPECT_GE(s.oversized, 2u);
  EXPECT_EQ(f.recorder.count(), cases.size()) << "no bad message reached the handler";
}

TEST(SideChannelTest, WrongSecretStaleTimestampAndReplayAreRefusedAndChangeNothing) {
  Fixture f("right");
  const wire::Message notice = wire::FinishedNotice{{"d", 0, 0}, {"req-1"}};
  // A client with the wrong secret.
  ClientOptions wrong;
  wrong.secret = "wrong";
  Client intruder(wrong);
  Result<wire::Message> r =
      intruder.Call(f.listener->endpoint(), notice, DeadlineAfter(milliseconds(3000)));
  EXPECT_EQ(r.status().code(), StatusCode::kUnauthenticated) << r.status().ToString();
  // No secret at all.
  Client anonymous(ClientOptions{});
  EXPECT_EQ(anonymous.Call(f.listener->endpoint(), notice, DeadlineAfter(milliseconds(3000)))
                .status()
                .code(),
            StatusCode::kUnauthenticated);

  RawPeer raw(f.listener->endpoint());
  const std::vector<std::uint8_t> body = wire::Encode(notice);
  AuthNonce n1{};
  n1[0] = 1;
  const auto stale =
      SignMessageAt("right", AuthKind::kRequest, body, {}, UnixMillis() - 120000, n1);
  EXPECT_EQ(ErrorCode(raw.Exchange({stale, body})), StatusCode::kUnauthenticated);
  // A captured good message works once; its replay is refused.
  const auto fresh = Signed("right", body);
  Result<wire::Message> first = raw.Exchange({fresh, body});
  ASSERT_TRUE(first.ok());
  EXPECT_TRUE(std::holds_alternative<wire::Ack>(*first));
  EXPECT_EQ(ErrorCode(raw.Exchange({fresh, body})), StatusCode::kUnauthenticated);
  // Its nonce signed again under a later timestamp (a valid MAC) is a replay too: a nonce is
  // accepted once, whatever its timestamp (docs/protocol.md).
  AuthNonce used{};
  std::memcpy(used.data(), fresh.data() + 12, used.size());
  const auto resigned =
      SignMessageAt("right", AuthKind::kRequest, body, {}, UnixMillis() + 1000, used);
  EXPECT_EQ(ErrorCode(raw.Exchange({resigned, body})), StatusCode::kUnauthenticated);
  EXPECT_EQ(f.recorder.count(), 1u) << "only the one authentic message reached the handler";
  EXPECT_EQ(f.listener->Stats().unauthenticated, 5u);
}

TEST(SideChannelTest, DeadPeerFailsInBoundedTimeWithoutDelayingOthers) {
  Fixture f;
  ClientOptions o;
  o.attempt_timeout = milliseconds(300);
  o.max_attempts = 2;
  Client client(o);
  const std::string dead = "tcp://127.0.0.1:" + std::to_string(FreePort());
  std::atomic<bool> dead_done{false};
  Status dead_status;
  const auto start = Clock::now();
  std::thread t([&] {
    dead_status =
        client.Call(dead, wire::MetadataRequest{{"d", 0, 0}}, DeadlineAfter(milliseconds(5000)))
            .status();
    dead_done.store(true);
  });
  // Meanwhile, a live peer answers promptly, several times.
  for (int i = 0; i < 5; ++i) {
    const auto call = Clock::now();
    Result<wire::Message> r =
        client.Call(f.listener->endpoint(), wire::MetadataRequest{{"d", 0, 0}},
                    DeadlineAfter(milliseconds(3000)));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_LT(Clock::now() - call, milliseconds(250) * testing::kTimingSlack);
  }
  t.join();
  EXPECT_TRUE(dead_status.code() == StatusCode::kUnavailable ||
              dead_status.code() == StatusCode::kTimeout)
      << dead_status.ToString();
  EXPECT_LT(Clock::now() - start, milliseconds(2000) * testing::kTimingSlack);
}

TEST(SideChannelTest, DeadlineBoundsACallToAFrozenHandler) {
  Fixture f;
  f.recorder.delay_ms.store(1500);
  const auto start = Clock::now();
  Result<wire::Message> r = f.client->Call(
      f.listener->endpoint(), wire::MetadataRequest{{"d", 0, 0}}, DeadlineAfter(milliseconds(400)));
  EXPECT_EQ(r.status().code(), StatusCode::kTimeout);
  EXPECT_LT(Clock::now() - start, milliseconds(900) * testing::kTimingSlack);
}

TEST(SideChannelTest, SlowHandlerDoesNotBlockTheListenerThread) {
  Fixture f;
  f.recorder.CloseGate();
  Status slow_status;
  std::thread slow([&] {
    slow_status = f.client
                      ->Call(f.listener->endpoint(), wire::MetadataRequest{{"d", 0, 0}},
                             DeadlineAfter(milliseconds(5000)))
                      .status();
  });
  // The handler is running (and stays inside until the gate opens) before the second peer calls.
  ASSERT_TRUE(f.recorder.WaitEntered(1, milliseconds(5000)));
  RawPeer raw(f.listener->endpoint());
  const auto start = Clock::now();
  EXPECT_EQ(ErrorCode(raw.Exchange({{1, 2, 3}, {4}})), StatusCode::kUnauthenticated);
  EXPECT_LT(Clock::now() - start, milliseconds(300) * testing::kTimingSlack)
      << "the listener waited for the handler";
  f.recorder.OpenGate();
  slow.join();
  EXPECT_TRUE(slow_status.ok()) << slow_status.ToString();
}

TEST(SideChannelTest, BusyPortNamesThePortAndTheSetting) {
  Fixture f;
  ListenerOptions o;
  const std::string ep = f.listener->endpoint();
  o.base_port = std::stoi(ep.substr(ep.rfind(':') + 1));
  Recorder r;
  Result<std::unique_ptr<Listener>> second = Listener::Start(o, r.Handler());
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr("port " + std::to_string(o.base_port) +
                                                   " (DP rank 0, pipeline stage 0 of 1"));
  EXPECT_THAT(second.status().message(), HasSubstr("is in use"));
  EXPECT_THAT(second.status().message(), HasSubstr("base port"));
  EXPECT_THAT(second.status().message(), HasSubstr("PP size"));
}

TEST(SideChannelTest, NoSecretMeansLoopbackOnlyUnlessAllowed) {
  ListenerOptions o;
  o.bind_host = "0.0.0.0";
  o.base_port = FreePort();
  Recorder r;
  Result<std::unique_ptr<Listener>> l = Listener::Start(o, r.Handler());
  EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(l.status().message(), HasSubstr("without a shared secret"));
  o.secret = "x";
  EXPECT_TRUE(Listener::Start(o, r.Handler()).ok());
}

}  // namespace
}  // namespace kvferry::sidechannel
