// Regression tests for what an outside audit and a hostile client found (issue 11): a disconnect
// racing a submission, a starved tcp server, handshake errors of the wrong class, a region removal
// waiting for a slow client, oversized side-channel frames and refusals a skewed peer could not
// read. Each names the finding it guards.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include "common/clock.h"
#include "common/digest.h"
#include "common/ports.h"
#include "common/subprocess.h"
#include "kvferry/transport.h"
#include "sidechannel/auth.h"
#include "sidechannel/client.h"
#include "sidechannel/listener.h"
#include "sidechannel/zmq_util.h"
#include "tests/test_timing.h"
#include "transport/descriptor.h"
#include "transport/tcp/frames.h"
#include "transport/tcp/socket.h"
#include "transport/tcp/tcp_section.h"
#include "wire/messages.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using testing::kTimingSlack;

std::unique_ptr<Transport> MakeTransport(bool serve, int connections = 1) {
  TransportOptions o;
  o.backend = "tcp";
  o.serve = serve;
  o.backend_options["tcp.connections"] = std::to_string(connections);
  Result<std::unique_ptr<Transport>> t = CreateTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

// ---------------------------------------------------------------------------------------------
// Finding 1: TcpPeer::Start divided by the number of connections, which a concurrent Disconnect
// had just set to zero (SIGFPE). A batch started on a peer being disconnected must end
// PeerDisconnected (or Cancelled, when Disconnect found it running).

TEST(TransportRaceTest, DisconnectRacingSubmissionsEndsEveryBatchCleanly) {
  std::unique_ptr<Transport> server = MakeTransport(true);
  std::vector<std::uint8_t> remote(1 << 20, 0x5a);
  ASSERT_TRUE(server->RegisterMemory(0, remote.data(), remote.size()).ok());
  Result<std::vector<std::uint8_t>> desc = server->Descriptor();
  ASSERT_TRUE(desc.ok());

  std::unique_ptr<Transport> client = MakeTransport(false);
  constexpr int kSubmitters = 3;
  // Many small reads per batch: checking and pinning them widens the window between the
  // submission taking the peer and starting the batch on it, where the disconnect lands.
  constexpr std::uint64_t kSlice = 2048;
  std::vector<std::uint8_t> local(kSubmitters * kSlice);
  ASSERT_TRUE(client->RegisterMemory(100, local.data(), local.size()).ok());
  Result<PeerId> first = client->Connect(*desc, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(first.ok()) << first.status().ToString();

  std::atomic<PeerId> current{*first};
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> done{0}, disconnected{0}, cancelled{0}, unknown_peer{0};
  std::atomic<std::uint64_t> unexpected{0};
  std::vector<std::thread> submitters;
  for (int t = 0; t < kSubmitters; ++t) {
    submitters.emplace_back([&, t] {
      std::vector<ReadOp> ops;
      for (std::uint64_t i = 0; i < kSlice; ++i) {
        ops.push_back({reinterpret_cast<std::byte*>(local.data()) + t * kSlice + i, 0,
                       static_cast<std::uint64_t>(t) * kSlice + i, 1});
      }
      while (!stop.load()) {
        Result<BatchId> b = client->SubmitReads(current.load(), ops,
                                                DeadlineAfter(milliseconds(5000 * kTimingSlack)));
        if (!b.ok()) {
          // The peer was disconnected before the submission looked it up.
          if (b.status().code() == StatusCode::kPeerDisconnected) {
            unknown_peer.fetch_add(1);
          } else {
            unexpected.fetch_add(1);
            ADD_FAILURE() << b.status().ToString();
          }
          continue;
        }
        const BatchResult r = client->Wait(*b, DeadlineAfter(milliseconds(10000 * kTimingSlack)));
        if (r.state == BatchState::kDone) {
          done.fetch_add(1);
        } else if (r.state == BatchState::kCancelled) {
          cancelled.fetch_add(1);
        } else if (r.state == BatchState::kFailed &&
                   r.status.code() == StatusCode::kPeerDisconnected) {
          disconnected.fetch_add(1);
        } else {
          unexpected.fetch_add(1);
          ADD_FAILURE() << BatchStateName(r.state) << " " << r.status.ToString();
        }
        client->Release(*b);
      }
    });
  }
  const int rounds = 2000 / kTimingSlack;
  for (int i = 0; i < rounds; ++i) {
    Result<PeerId> next = client->Connect(*desc, DeadlineAfter(milliseconds(5000)));
    ASSERT_TRUE(next.ok()) << next.status().ToString();
    const PeerId old = current.exchange(*next);
    client->Disconnect(old);
  }
  // The last peer stays: on a slow (sanitized) build every batch may have met a disconnect
  // during the churn, so wait for one to complete on it before stopping.
  const Deadline settle = DeadlineAfter(milliseconds(30000 * kTimingSlack));
  while (done.load() == 0 && Clock::now() < settle) std::this_thread::sleep_for(milliseconds(5));
  stop.store(true);
  for (std::thread& t : submitters) t.join();
  EXPECT_EQ(unexpected.load(), 0u);
  EXPECT_GT(done.load(), 0u);
  std::cout << "rounds " << rounds << ": done " << done << ", peer disconnected " << disconnected
            << ", cancelled " << cancelled << ", unknown peer " << unknown_peer << "\n";
}

// ---------------------------------------------------------------------------------------------
// Finding 4: connections that never handshake were kept forever, and accept4 failing with
// EMFILE made the epoll loop spin at 100 % CPU. Now: a handshake deadline, the reserve-descriptor
// technique, connection caps.

std::uint64_t CpuTicks(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Fields after the command name (which may hold spaces) start after the last ')'.
  std::istringstream rest(text.substr(text.rfind(')') + 2));
  std::string field;
  std::uint64_t utime = 0, stime = 0;
  for (int i = 3; i <= 15; ++i) {
    rest >> field;
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return utime + stime;
}

TEST(TcpServerHostileTest, IdleConnectionsNeitherSpinNorStarveTheServer) {
  // The server runs with 256 descriptors and caps above that, so it runs out of descriptors.
  // Not under sanitizers: UBSan's vptr check probes memory through a pipe(), which fails when the
  // process is out of descriptors, and then reports every uncached virtual call as an "invalid
  // vptr" and aborts (a false positive of the checker). There the server gets enough descriptors
  // for the 1,000 idle connections; the handshake deadline and the CPU bound are still tested,
  // and the descriptor exhaustion is tested by the plain build (make test).
  constexpr int kHandshakeMs = 2000;
  const int descriptors = testing::kTimingSlack > 1 ? 4096 : 256;
  if (descriptors != 256) {
    std::cout << "NOTE: sanitizer build: the server runs with " << descriptors
              << " descriptors, so out-of-descriptors handling is not exercised here\n";
  }
  const std::string command =
      "ulimit -n " + std::to_string(descriptors) + " && exec " + std::string(KVFERRY_CLI_PATH) +
      " bench peer --backend tcp --bytes 1048576 --regions 1" +
      " --transport-opt tcp.handshake_timeout_ms=" + std::to_string(kHandshakeMs) +
      " --transport-opt tcp.max_connections=4096" +
      " --transport-opt tcp.max_connections_per_source=4096";
  Result<Subprocess> peer = Subprocess::Spawn({"/bin/sh", "-c", command});
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  Result<std::string> line = peer->ReadLine(std::chrono::seconds(30));
  ASSERT_TRUE(line.ok() && line->rfind("READY ", 0) == 0) << line.status().ToString();
  Result<std::vector<std::uint8_t>> desc = FromHex(line->substr(6));
  ASSERT_TRUE(desc.ok());
  Result<PeerDescriptor> decoded = DecodeDescriptor(*desc);
  ASSERT_TRUE(decoded.ok());
  Result<TcpEndpoint> endpoint = DecodeTcpSection(decoded->Section("tcp"));
  ASSERT_TRUE(endpoint.ok()) << endpoint.status().ToString();

  rlimit lim{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &lim), 0);
  if (lim.rlim_cur < 2048) {
    lim.rlim_cur = std::min<rlim_t>(lim.rlim_max, 4096);
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lim), 0);
  }
  ASSERT_GE(lim.rlim_cur, 1100u) << "this test needs 1,100 descriptors in the test process";

  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(endpoint->port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::vector<tcp::Fd> idle;
  for (int i = 0; i < 1000; ++i) {
    tcp::Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    ASSERT_TRUE(fd.valid());
    const int rc = connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
    ASSERT_TRUE(rc == 0 || errno == EINPROGRESS) << std::strerror(errno);
    idle.push_back(std::move(fd));
  }
  const Clock::time_point attacked = Clock::now();
  const std::uint64_t ticks_before = CpuTicks(peer->pid());

  // An authenticated client gets through once the idle ones are closed at their deadline.
  std::unique_ptr<Transport> client = MakeTransport(false);
  std::vector<std::uint8_t> local(4096);
  ASSERT_TRUE(client->RegisterMemory(100, local.data(), local.size()).ok());
  const Deadline give_up = attacked + milliseconds(kHandshakeMs + 1000 * kTimingSlack);
  std::optional<Clock::time_point> read_at;
  Status last;
  while (Clock::now() < give_up && !read_at) {
    Result<PeerId> p = client->Connect(*desc, std::min(give_up, DeadlineAfter(milliseconds(500))));
    if (!p.ok()) {
      last = p.status();
      std::this_thread::sleep_for(milliseconds(20));  // retry pacing, not synchronisation
      continue;
    }
    Result<BatchId> b = client->SubmitReads(
        *p, {{reinterpret_cast<std::byte*>(local.data()), 0, 0, local.size()}}, give_up);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    const BatchResult r = client->Wait(*b, give_up);
    if (r.state == BatchState::kDone) read_at = Clock::now();
    last = r.status;
    client->Release(*b);
    client->Disconnect(*p);
  }
  ASSERT_TRUE(read_at.has_value())
      << "no read within 1 s of the idle connections' deadline; last: " << last.ToString();
  std::cout << "authenticated read after "
            << std::chrono::duration_cast<milliseconds>(*read_at - attacked).count()
            << " ms (idle connections closed at " << kHandshakeMs << " ms)\n";

  // The server's CPU over 10 s with 1,000 hostile connections: idle, not spinning.
  std::this_thread::sleep_until(attacked + std::chrono::seconds(10));  // the measured window
  const double seconds = std::chrono::duration<double>(Clock::now() - attacked).count();
  const double used =
      static_cast<double>(CpuTicks(peer->pid()) - ticks_before) / sysconf(_SC_CLK_TCK);
  std::cout << "server CPU: " << used << " s over " << seconds << " s\n";
  EXPECT_LT(used / seconds, 0.05 * kTimingSlack);
  idle.clear();
  EXPECT_TRUE(peer->CloseAndWait(milliseconds(10000)).ok());
}

// ---------------------------------------------------------------------------------------------
// Finding 9: any failure reading the handshake result became Unauthenticated, which Connect
// treats as final. Only a refused proof is.

// A tcp server that says hello, takes the client's proof, and then `close_after_auth` hangs up
// (or says nothing).
class FakeServer {
 public:
  explicit FakeServer(bool close_after_auth) {
    std::uint16_t port = 0;
    Result<tcp::Fd> l = tcp::Listen("127.0.0.1", 0, &port);
    EXPECT_TRUE(l.ok());
    listener_ = std::move(l).value();
    port_ = port;
    thread_ = std::thread([this, close_after_auth] {
      pollfd p{listener_.get(), POLLIN, 0};
      if (poll(&p, 1, 10000) != 1) return;
      tcp::Fd conn(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      std::uint8_t hello[tcp::kHelloBytes] = {};
      tcp::PutU32(hello, tcp::kHelloMagic);
      tcp::PutU32(hello + 4, tcp::kVersion);
      (void)!send(conn.get(), hello, sizeof(hello), MSG_NOSIGNAL);
      std::uint8_t auth[tcp::kAuthBytes];
      std::size_t got = 0;
      while (got < sizeof(auth)) {
        pollfd c{conn.get(), POLLIN, 0};
        if (poll(&c, 1, 5000) != 1) return;
        const ssize_t n = recv(conn.get(), auth + got, sizeof(auth) - got, 0);
        if (n <= 0) return;
        got += static_cast<std::size_t>(n);
      }
      if (!close_after_auth) {
        pollfd c{conn.get(), POLLIN, 0};
        (void)poll(&c, 1, 5000);  // until the client gives up and closes
      }
    });
  }
  ~FakeServer() { thread_.join(); }
  std::vector<std::uint8_t> Descriptor() const {
    PeerDescriptor d;
    d.sections["tcp"] = EncodeTcpSection(TcpEndpoint{"127.0.0.1", port_, 42});
    d.regions.push_back({0, 4096, 4096, MemoryKind::Host()});
    return EncodeDescriptor(d);
  }

 private:
  tcp::Fd listener_;
  std::uint16_t port_ = 0;
  std::thread thread_;
};

TEST(TcpHandshakeTest, AServerThatHangsUpIsNotAnAuthenticationFailure) {
  FakeServer server(true);
  std::unique_ptr<Transport> client = MakeTransport(false);
  Result<PeerId> p = client->Connect(server.Descriptor(), DeadlineAfter(milliseconds(5000)));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kUnavailable) << p.status().ToString();
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("closed the connection"));
}

TEST(TcpHandshakeTest, AServerThatNeverAnswersTimesOutRetryably) {
  FakeServer server(false);
  std::unique_ptr<Transport> client = MakeTransport(false);
  Result<PeerId> p = client->Connect(server.Descriptor(), DeadlineAfter(milliseconds(300)));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kUnavailable) << p.status().ToString();
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("did not finish in time"));
}

// ---------------------------------------------------------------------------------------------
// Finding 8: DeregisterMemory waited, without bound, for responses a client that stopped reading
// kept pinned. Now the server drops such connections when their region is removed.

TEST(TcpServerHostileTest, DeregisterDoesNotWaitForAClientThatStoppedReading) {
  std::unique_ptr<Transport> server = MakeTransport(true);
  std::vector<std::uint8_t> region(32u << 20, 0x11);
  ASSERT_TRUE(server->RegisterMemory(0, region.data(), region.size()).ok());
  Result<PeerDescriptor> d = DecodeDescriptor(*server->Descriptor());
  ASSERT_TRUE(d.ok());
  Result<TcpEndpoint> endpoint = DecodeTcpSection(d->Section("tcp"));
  ASSERT_TRUE(endpoint.ok()) << endpoint.status().ToString();

  // A raw client: handshake (no secret: loopback), then four 8 MiB reads it never receives.
  Result<tcp::Fd> fd = tcp::Connect("127.0.0.1", endpoint->port, DeadlineAfter(milliseconds(5000)),
                                    milliseconds(60000));
  ASSERT_TRUE(fd.ok());
  const tcp::StopCheck forever = [] { return Status::Ok(); };
  std::uint8_t hello[tcp::kHelloBytes];
  iovec hv{hello, sizeof(hello)};
  std::uint64_t got = 0;
  ASSERT_TRUE(tcp::RecvAll(fd->get(), &hv, 1, forever, &got).ok());
  tcp::Nonce server_nonce{};
  std::memcpy(server_nonce.data(), hello + 8, tcp::kNonceBytes);
  const tcp::Nonce client_nonce = tcp::RandomNonce();
  std::uint8_t auth[tcp::kAuthBytes];
  tcp::PutU32(auth, tcp::kAuthMagic);
  tcp::PutU32(auth + 4, tcp::kVersion);
  std::memcpy(auth + 8, client_nonce.data(), tcp::kNonceBytes);
  const Sha256Digest mac = tcp::ClientMac("", server_nonce, client_nonce);
  std::memcpy(auth + 8 + tcp::kNonceBytes, mac.data(), mac.size());
  iovec av{auth, sizeof(auth)};
  ASSERT_TRUE(tcp::SendAll(fd->get(), &av, 1, forever).ok());
  for (std::uint64_t i = 0; i < 4; ++i) {
    std::uint8_t frame[tcp::kRequestHeaderBytes + tcp::kOpBytes];
    tcp::EncodeRequestHeader({1, i + 1}, frame);
    tcp::EncodeOp({0, i * (8u << 20), 8u << 20}, frame + tcp::kRequestHeaderBytes);
    iovec fv{frame, sizeof(frame)};
    ASSERT_TRUE(tcp::SendAll(fd->get(), &fv, 1, forever).ok());
  }
  // The server has queued responses once it counts their bytes as served.
  const Deadline queued = DeadlineAfter(milliseconds(5000 * kTimingSlack));
  while (server->Stats().bytes_served < (16u << 20) && Clock::now() < queued) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  ASSERT_GE(server->Stats().bytes_served, 16u << 20);

  std::future<Status> removed =
      std::async(std::launch::async, [&] { return server->DeregisterMemory(0); });
  const bool prompt =
      removed.wait_for(milliseconds(2000 * kTimingSlack)) == std::future_status::ready;
  if (!prompt) fd->Reset();  // unblock the old behaviour so that the test ends
  EXPECT_TRUE(prompt) << "DeregisterMemory waited for a client that stopped reading";
  EXPECT_TRUE(removed.get().ok());
}

// ---------------------------------------------------------------------------------------------
// Side channel. Finding 5: ZeroMQ buffered frames up to 64 MiB from unauthenticated peers,
// eight times the protocol's limit. Finding 10: refusals were bound to a zero nonce, so a peer
// could not verify them (a skewed clock read as "authentication failed").

class SideChannelHostileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    sidechannel::ListenerOptions o;
    o.base_port = FreeLoopbackPorts(1);
    o.secret = kSecret;
    Result<std::unique_ptr<sidechannel::Listener>> l = sidechannel::Listener::Start(
        o, [](const wire::Message&) -> wire::Message { return wire::Ack{1}; });
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    listener_ = std::move(l).value();
  }

  sidechannel::ZmqSocket Dealer() {
    sidechannel::ZmqSocket s(ZMQ_DEALER);
    EXPECT_TRUE(s.SetInt(ZMQ_RCVTIMEO, 2000 * kTimingSlack).ok());
    EXPECT_EQ(zmq_connect(s.get(), listener_->endpoint().c_str()), 0);
    return s;
  }

  static constexpr const char* kSecret = "hardening-secret";
  std::unique_ptr<sidechannel::Listener> listener_;
};

TEST_F(SideChannelHostileTest, FramesAboveTheProtocolLimitDropTheConnectionUnbuffered) {
  sidechannel::ZmqSocket s = Dealer();
  ASSERT_EQ(zmq_socket_monitor(s.get(), "inproc://hardening-monitor", ZMQ_EVENT_DISCONNECTED), 0);
  sidechannel::ZmqSocket monitor(ZMQ_PAIR);
  ASSERT_EQ(zmq_connect(monitor.get(), "inproc://hardening-monitor"), 0);
  ASSERT_TRUE(monitor.SetInt(ZMQ_RCVTIMEO, 5000 * kTimingSlack).ok());

  const std::vector<std::uint8_t> header(sidechannel::kAuthHeaderBytes, 0);
  const std::vector<std::uint8_t> body(wire::kMaxMessageBytes + 1024, 0);
  ASSERT_TRUE(sidechannel::SendFrames(s.get(), {header, body}).ok());
  // No reply: the listener's ZeroMQ drops the connection when it reads the frame's size.
  std::vector<std::vector<std::uint8_t>> frames;
  bool truncated = false;
  EXPECT_FALSE(sidechannel::RecvFrames(s.get(), &frames, 2, 1 << 20, &truncated).ok())
      << "the listener answered a frame above the protocol limit, so it buffered it";
  zmq_msg_t event;
  zmq_msg_init(&event);
  ASSERT_GE(zmq_msg_recv(&event, monitor.get(), 0), 6) << "no disconnect seen";
  std::uint16_t id = 0;
  std::memcpy(&id, zmq_msg_data(&event), sizeof(id));
  zmq_msg_close(&event);
  EXPECT_EQ(id, ZMQ_EVENT_DISCONNECTED);
  zmq_socket_monitor(s.get(), nullptr, 0);

  // The listener serves others as before.
  sidechannel::ZmqSocket good = Dealer();
  const std::vector<std::uint8_t> request = wire::Encode(wire::MetadataRequest{{"decode-0", 0, 0}});
  sidechannel::AuthNonce nonce{};
  const std::vector<std::uint8_t> signed_header =
      sidechannel::SignMessage(kSecret, sidechannel::AuthKind::kRequest, request, {}, &nonce);
  ASSERT_TRUE(sidechannel::SendFrames(good.get(), {signed_header, request}).ok());
  ASSERT_TRUE(sidechannel::RecvFrames(good.get(), &frames, 2, 1 << 20, &truncated).ok());
  EXPECT_EQ(listener_->Stats().handled, 1u);
}

TEST_F(SideChannelHostileTest, APeerWithASkewedClockCanReadWhyItWasRefused) {
  sidechannel::ZmqSocket s = Dealer();
  const std::vector<std::uint8_t> request = wire::Encode(wire::MetadataRequest{{"decode-0", 0, 0}});
  sidechannel::AuthNonce nonce{};
  nonce[0] = 7;
  const std::vector<std::uint8_t> header =
      sidechannel::SignMessageAt(kSecret, sidechannel::AuthKind::kRequest, request, {},
                                 sidechannel::UnixMillis() - 31000, nonce);
  ASSERT_TRUE(sidechannel::SendFrames(s.get(), {header, request}).ok());
  std::vector<std::vector<std::uint8_t>> frames;
  bool truncated = false;
  ASSERT_TRUE(sidechannel::RecvFrames(s.get(), &frames, 2, 1 << 20, &truncated).ok());
  ASSERT_EQ(frames.size(), 2u);
  Result<sidechannel::AuthHeader> verified = sidechannel::VerifyMessage(
      kSecret, sidechannel::AuthKind::kReply, frames[0], frames[1], nonce, milliseconds(30000));
  ASSERT_TRUE(verified.ok()) << "the refusal is not bound to the request: "
                             << verified.status().ToString();
  Result<wire::Message> reply = wire::Decode(frames[1]);
  ASSERT_TRUE(reply.ok());
  const auto* err = std::get_if<wire::ErrorReply>(&*reply);
  ASSERT_NE(err, nullptr);
  EXPECT_EQ(err->code, StatusCode::kUnauthenticated);
  EXPECT_THAT(err->message, HasSubstr("from this host's clock"));
}

// Finding 6: the side-channel client kept idle sockets for every endpoint it ever called.
TEST(SideChannelClientTest, IdleSocketsAreKeptForABoundedNumberOfEndpoints) {
  std::vector<std::unique_ptr<sidechannel::Listener>> listeners;
  for (int i = 0; i < 3; ++i) {
    sidechannel::ListenerOptions o;
    o.base_port = FreeLoopbackPorts(1);
    Result<std::unique_ptr<sidechannel::Listener>> l = sidechannel::Listener::Start(
        o, [](const wire::Message&) -> wire::Message { return wire::Ack{1}; });
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    listeners.push_back(std::move(l).value());
  }
  sidechannel::ClientOptions co;
  co.max_idle_endpoints = 2;
  sidechannel::Client client(co);
  for (const auto& l : listeners) {
    Result<wire::Message> r = client.Call(l->endpoint(), wire::MetadataRequest{{"d", 0, 0}},
                                          DeadlineAfter(milliseconds(5000)));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  const sidechannel::ClientStats s = client.Stats();
  EXPECT_EQ(s.idle_endpoints, 2u);
  EXPECT_EQ(s.idle_sockets, 2u);
  // The least recently used endpoint was dropped; calling it again works and evicts the next.
  ASSERT_TRUE(client
                  .Call(listeners[0]->endpoint(), wire::MetadataRequest{{"d", 0, 0}},
                        DeadlineAfter(milliseconds(5000)))
                  .ok());
  EXPECT_EQ(client.Stats().idle_endpoints, 2u);
}

}  // namespace
}  // namespace kvferry
