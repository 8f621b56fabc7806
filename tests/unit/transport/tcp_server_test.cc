// The tcp backend's server driven by a raw client that speaks the frames of docs/transport.md:
// handshake outcomes, request handling, caps and deadlines, region revocation.
#include "transport/tcp/tcp_server.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "tests/test_timing.h"
#include "transport/tcp/frames.h"

namespace kvferry::tcp {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;
using kvferry::testing::kTimingSlack;

constexpr char kSecret[] = "unit-test-secret";
constexpr RegionId kRegion = 1;
// Generous bounds for events that should come within milliseconds; only a broken server gets
// near them.
const auto kEventDeadline = 10s * kTimingSlack;

Deadline After(std::chrono::milliseconds ms) { return Clock::now() + ms; }

// Waits until `done()` holds or the deadline passes; polls state the server updates (its
// counters), the only signal it gives for a connection it closed without a byte.
bool WaitUntil(const std::function<bool()>& done, Deadline deadline) {
  while (!done()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

enum class RecvResult { kOk, kEof, kTimeout, kError };

// A blocking client socket; every wait goes through poll with a deadline.
class RawClient {
 public:
  // `rcvbuf` > 0 shrinks the receive buffer before connecting (the window is fixed then).
  explicit RawClient(std::uint16_t port, int rcvbuf = 0) : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    if (rcvbuf > 0) setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawClient() { Close(); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const { return connected_; }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

  bool Send(const void* data, std::size_t n, Deadline deadline) {
    const auto* p = static_cast<const std::uint8_t*>(data);
    while (n > 0) {
      pollfd pfd{fd_, POLLOUT, 0};
      if (poll(&pfd, 1, PollTimeoutMs(deadline, 1000)) <= 0) {
        if (Clock::now() >= deadline) return false;
        continue;
      }
      const ssize_t sent = send(fd_, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (sent < 0) {
        if (errno == EAGAIN || errno == EINTR) continue;
        return false;
      }
      p += sent;
      n -= static_cast<std::size_t>(sent);
    }
    return true;
  }
  bool Send(const std::vector<std::uint8_t>& bytes) {
    return Send(bytes.data(), bytes.size(), After(kEventDeadline));
  }

  RecvResult RecvExact(void* data, std::size_t n, Deadline deadline) {
    auto* p = static_cast<std::uint8_t*>(data);
    while (n > 0) {
      pollfd pfd{fd_, POLLIN, 0};
      const int ready = poll(&pfd, 1, PollTimeoutMs(deadline, 1000));
      if (ready <= 0) {
        if (Clock::now() >= deadline) return RecvResult::kTimeout;
        continue;
      }
      const ssize_t got = recv(fd_, p, n, MSG_DONTWAIT);
      if (got == 0) return RecvResult::kEof;
      if (got < 0) {
        if (errno == EAGAIN || errno == EINTR) continue;
        return errno == ECONNRESET ? RecvResult::kEof : RecvResult::kError;
      }
      p += got;
      n -= static_cast<std::size_t>(got);
    }
    return RecvResult::kOk;
  }
  std::vector<std::uint8_t> Recv(std::size_t n) {
    std::vector<std::uint8_t> out(n);
    if (RecvExact(out.data(), n, After(kEventDeadline)) != RecvResult::kOk) out.clear();
    return out;
  }

  // Reads and discards until the server closes the connection (EOF or reset); false at the
  // deadline. `discarded` counts the bytes that came before the end.
  bool WaitClosed(Deadline deadline, std::size_t* discarded = nullptr) {
    std::vector<std::uint8_t> sink(1 << 20);
    std::size_t total = 0;
    for (;;) {
      pollfd pfd{fd_, POLLIN, 0};
      if (poll(&pfd, 1, PollTimeoutMs(deadline, 1000)) <= 0) {
        if (Clock::now() >= deadline) return false;
        continue;
      }
      const ssize_t got = recv(fd_, sink.data(), sink.size(), MSG_DONTWAIT);
      if (got == 0 || (got < 0 && errno == ECONNRESET)) break;
      if (got < 0) {
        if (errno == EAGAIN || errno == EINTR) continue;
        return false;
      }
      total += static_cast<std::size_t>(got);
    }
    if (discarded != nullptr) *discarded = total;
    return true;
  }

 private:
  int fd_;
  bool connected_ = false;
};

struct ResultFrame {
  std::uint32_t magic = 0;
  std::uint32_t status = 0;
  Sha256Digest mac{};
};

struct Response {
  ResponseHeader header;
  std::vector<std::uint8_t> payload;
};

class TcpServerTest : public ::testing::Test {
 protected:
  // Limits for tests that do not exercise a deadline: long enough never to fire.
  static ServerLimits Relaxed() {
    ServerLimits limits;
    limits.handshake_timeout = 30s;
    limits.idle_timeout = 30s;
    limits.send_stall_timeout = 30s;
    limits.max_connections = 4;
    limits.max_connections_per_source = 2;
    return limits;
  }

  void Start(ServerLimits limits, std::size_t region_bytes = std::size_t{1} << 20) {
    region_.resize(region_bytes);
    for (std::size_t i = 0; i < region_.size(); ++i) {
      region_[i] = static_cast<std::uint8_t>((i * 131 + (i >> 16) * 7 + 3) & 0xff);
    }
    ASSERT_TRUE(registry_.Add(kRegion, region_.data(), region_.size()).ok());
    Result<std::unique_ptr<TcpServer>> server =
        TcpServer::Start(&registry_, "127.0.0.1", 0, kSecret, &counters_, limits);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(*server);
  }

  Nonce ReadHello(RawClient& c) {
    std::vector<std::uint8_t> hello = c.Recv(kHelloBytes);
    Nonce nonce{};
    EXPECT_EQ(hello.size(), kHelloBytes) << "no hello frame";
    if (hello.size() != kHelloBytes) return nonce;
    EXPECT_EQ(GetU32(hello.data()), kHelloMagic);
    EXPECT_EQ(GetU32(hello.data() + 4), kVersion);
    std::memcpy(nonce.data(), hello.data() + 8, kNonceBytes);
    return nonce;
  }

  static Nonce SendAuth(RawClient& c, const Nonce& server_nonce, const std::string& secret,
                        std::uint32_t magic = kAuthMagic, std::uint32_t version = kVersion) {
    const Nonce client_nonce = RandomNonce();
    std::vector<std::uint8_t> auth(kAuthBytes);
    PutU32(auth.data(), magic);
    PutU32(auth.data() + 4, version);
    std::memcpy(auth.data() + 8, client_nonce.data(), kNonceBytes);
    const Sha256Digest mac = ClientMac(secret, server_nonce, client_nonce);
    std::memcpy(auth.data() + 8 + kNonceBytes, mac.data(), mac.size());
    EXPECT_TRUE(c.Send(auth));
    return client_nonce;
  }

  static ResultFrame ReadResult(RawClient& c) {
    ResultFrame r;
    std::vector<std::uint8_t> bytes = c.Recv(kResultBytes);
    EXPECT_EQ(bytes.size(), kResultBytes) << "no result frame";
    if (bytes.size() != kResultBytes) return r;
    r.magic = GetU32(bytes.data());
    r.status = GetU32(bytes.data() + 4);
    std::memcpy(r.mac.data(), bytes.data() + 8, r.mac.size());
    return r;
  }

  // A full, successful handshake, checking the server's proof.
  void Handshake(RawClient& c) {
    ASSERT_TRUE(c.connected());
    const Nonce server_nonce = ReadHello(c);
    const Nonce client_nonce = SendAuth(c, server_nonce, kSecret);
    const ResultFrame r = ReadResult(c);
    ASSERT_EQ(r.magic, kResultMagic);
    ASSERT_EQ(r.status, 0u);
    EXPECT_TRUE(
        DigestEquals(r.mac, ServerMac(kSecret, server_nonce, client_nonce, server_->instance())));
  }

  static std::vector<std::uint8_t> Request(std::uint64_t id, const std::vector<WireOp>& ops) {
    std::vector<std::uint8_t> out(kRequestHeaderBytes + ops.size() * kOpBytes);
    EncodeRequestHeader({static_cast<std::uint32_t>(ops.size()), id}, out.data());
    for (std::size_t i = 0; i < ops.size(); ++i) {
      EncodeOp(ops[i], out.data() + kRequestHeaderBytes + i * kOpBytes);
    }
    return out;
  }

  static Response ReadResponse(RawClient& c) {
    Response r;
    std::uint8_t head[kResponseHeaderBytes];
    EXPECT_EQ(c.RecvExact(head, sizeof(head), After(kEventDeadline)), RecvResult::kOk);
    Result<ResponseHeader> h =
        ParseResponseHeader(std::span<const std::uint8_t, kResponseHeaderBytes>(head));
    EXPECT_TRUE(h.ok()) << h.status().ToString();
    if (!h.ok()) return r;
    r.header = *h;
    r.payload = c.Recv(h->payload_length);
    EXPECT_EQ(r.payload.size(), h->payload_length);
    return r;
  }

  std::vector<std::uint8_t> Bytes(std::size_t offset, std::size_t length) const {
    return {region_.begin() + static_cast<std::ptrdiff_t>(offset),
            region_.begin() + static_cast<std::ptrdiff_t>(offset + length)};
  }

  // One good read on `c`: the exact bytes come back.
  void ExpectRead(RawClient& c, std::uint64_t id, std::size_t offset, std::size_t length) {
    ASSERT_TRUE(c.Send(Request(id, {{kRegion, offset, length}})));
    Response r = ReadResponse(c);
    EXPECT_EQ(r.header.status, 0u);
    EXPECT_EQ(r.header.request_id, id);
    EXPECT_TRUE(r.payload == Bytes(offset, length)) << "payload differs from the region's bytes";
  }

  // Removes the region within the deadline; on failure closes the server (releasing every pin)
  // so that the removal ends and the test reports instead of hanging.
  bool RemoveWithin(std::chrono::milliseconds bound,
                    const std::function<void(RegionId)>& revoke = nullptr) {
    auto removal =
        std::async(std::launch::async, [&] { return registry_.Remove(kRegion, revoke); });
    const bool in_time = removal.wait_for(bound) == std::future_status::ready;
    if (!in_time) server_.reset();
    EXPECT_TRUE(removal.get().ok());
    return in_time;
  }

  std::vector<std::uint8_t> region_;
  RegionRegistry registry_;
  ServerCounters counters_;
  std::unique_ptr<TcpServer> server_;  // last: stopped before what it uses
};

TEST_F(TcpServerTest, HandshakeThenReadsReturnTheExactBytes) {
  Start(Relaxed());
  RawClient c(server_->port());
  Handshake(c);
  ExpectRead(c, 1, 1000, 5000);
  // Several ops in one request: one response with their bytes in order.
  ASSERT_TRUE(c.Send(Request(2, {{kRegion, 70000, 300}, {kRegion, 0, 100}})));
  Response r = ReadResponse(c);
  EXPECT_EQ(r.header.status, 0u);
  EXPECT_EQ(r.header.request_id, 2u);
  std::vector<std::uint8_t> expected = Bytes(70000, 300);
  const std::vector<std::uint8_t> second = Bytes(0, 100);
  expected.insert(expected.end(), second.begin(), second.end());
  EXPECT_TRUE(r.payload == expected);
  // The whole region, last byte included.
  ExpectRead(c, 3, 0, region_.size());
  EXPECT_EQ(counters_.bytes_served.load(), 5000u + 400u + region_.size());
  EXPECT_EQ(counters_.refused.load(), 0u);
}

TEST_F(TcpServerTest, WrongSecretGetsUnauthenticatedThenClose) {
  Start(Relaxed());
  RawClient c(server_->port());
  const Nonce server_nonce = ReadHello(c);
  SendAuth(c, server_nonce, "another secret");
  const ResultFrame r = ReadResult(c);
  EXPECT_EQ(r.magic, kResultMagic);
  EXPECT_EQ(r.status, static_cast<std::uint32_t>(StatusCode::kUnauthenticated));
  EXPECT_EQ(r.mac, Sha256Digest{});  // no proof for a client that gave none
  std::size_t extra = 0;
  EXPECT_TRUE(c.WaitClosed(After(kEventDeadline), &extra));
  EXPECT_EQ(extra, 0u);
  EXPECT_GE(counters_.refused.load(), 1u);
}

TEST_F(TcpServerTest, AuthForAnotherVersionGetsNotSupportedThenClose) {
  Start(Relaxed());
  RawClient c(server_->port());
  const Nonce server_nonce = ReadHello(c);
  SendAuth(c, server_nonce, kSecret, kAuthMagic, 2);
  const ResultFrame r = ReadResult(c);
  EXPECT_EQ(r.magic, kResultMagic);
  EXPECT_EQ(r.status, static_cast<std::uint32_t>(StatusCode::kNotSupported));
  EXPECT_TRUE(c.WaitClosed(After(kEventDeadline)));
}

TEST_F(TcpServerTest, AuthWithBadMagicGetsInvalidArgumentThenClose) {
  Start(Relaxed());
  RawClient c(server_->port());
  const Nonce server_nonce = ReadHello(c);
  SendAuth(c, server_nonce, kSecret, kRequestMagic);
  const ResultFrame r = ReadResult(c);
  EXPECT_EQ(r.magic, kResultMagic);
  EXPECT_EQ(r.status, static_cast<std::uint32_t>(StatusCode::kInvalidArgument));
  EXPECT_TRUE(c.WaitClosed(After(kEventDeadline)));
}

TEST_F(TcpServerTest, OpOfBadLengthGetsAnErrorResponseAndTheConnectionStays) {
  Start(Relaxed());
  RawClient c(server_->port());
  Handshake(c);
  for (std::uint64_t length : {std::uint64_t{0}, kMaxRequestBytes + 1}) {
    SCOPED_TRACE("op length " + std::to_string(length));
    ASSERT_TRUE(c.Send(Request(7, {{kRegion, 0, length}})));
    Response r = ReadResponse(c);
    EXPECT_EQ(r.header.status, static_cast<std::uint32_t>(StatusCode::kInvalidArgument));
    EXPECT_EQ(r.header.request_id, 7u);
    EXPECT_LE(r.payload.size(), kMaxErrorBytes);
    EXPECT_THAT(std::string(r.payload.begin(), r.payload.end()), HasSubstr("expected 1 to"));
    ExpectRead(c, 8, 10, 20);
  }
  EXPECT_EQ(counters_.bytes_served.load(), 40u);
}

TEST_F(TcpServerTest, OpOutsideTheRegionGetsAnErrorResponseAndTheConnectionStays) {
  Start(Relaxed());
  RawClient c(server_->port());
  Handshake(c);
  // The second op runs past the end; nothing of the first is sent either.
  ASSERT_TRUE(c.Send(Request(11, {{kRegion, 0, 10}, {kRegion, region_.size() - 10, 11}})));
  Response r = ReadResponse(c);
  EXPECT_EQ(r.header.status, static_cast<std::uint32_t>(StatusCode::kInvalidArgument));
  EXPECT_EQ(r.header.request_id, 11u);
  EXPECT_THAT(std::string(r.payload.begin(), r.payload.end()), HasSubstr("outside region"));
  ASSERT_TRUE(c.Send(Request(12, {{99, 0, 10}})));
  r = ReadResponse(c);
  EXPECT_EQ(r.header.status, static_cast<std::uint32_t>(StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(r.payload.begin(), r.payload.end()), HasSubstr("not registered"));
  ExpectRead(c, 13, region_.size() - 10, 10);
  EXPECT_EQ(counters_.bytes_served.load(), 10u);
  // The refused requests left no pin behind: the region is removed at once.
  EXPECT_TRUE(RemoveWithin(kEventDeadline));
}

TEST_F(TcpServerTest, MalformedRequestHeaderClosesTheConnection) {
  Start(Relaxed());
  RawClient c(server_->port());
  Handshake(c);
  std::vector<std::uint8_t> bad = Request(1, {{kRegion, 0, 10}});
  PutU32(bad.data(), kResponseMagic);
  ASSERT_TRUE(c.Send(bad));
  std::size_t extra = 0;
  EXPECT_TRUE(c.WaitClosed(After(kEventDeadline), &extra));
  EXPECT_EQ(extra, 0u);  // no response for a frame that cannot be trusted
  EXPECT_TRUE(
      WaitUntil([&] { return counters_.connections_open.load() == 0; }, After(kEventDeadline)));
}

TEST_F(TcpServerTest, PerSourceCapClosesTheNextConnectionAtOnce) {
  ServerLimits limits = Relaxed();
  limits.max_connections = 4;
  limits.max_connections_per_source = 2;
  Start(limits);
  RawClient a(server_->port());
  RawClient b(server_->port());
  ReadHello(a);  // accepted: each got its hello
  ReadHello(b);
  RawClient refused(server_->port());
  std::size_t extra = 0;
  EXPECT_TRUE(refused.WaitClosed(After(kEventDeadline), &extra));
  EXPECT_EQ(extra, 0u);  // not even a hello
  EXPECT_EQ(counters_.connections_refused.load(), 1u);
  EXPECT_EQ(counters_.connections_open.load(), 2u);
  // A slot freed by a client that left is taken by the next one.
  a.Close();
  ASSERT_TRUE(
      WaitUntil([&] { return counters_.connections_open.load() == 1; }, After(kEventDeadline)));
  RawClient next(server_->port());
  Handshake(next);
  ExpectRead(next, 1, 0, 64);
  EXPECT_EQ(counters_.connections_refused.load(), 1u);
}

TEST_F(TcpServerTest, TotalCapClosesTheNextConnectionAtOnce) {
  ServerLimits limits = Relaxed();
  limits.max_connections = 2;
  limits.max_connections_per_source = 8;
  Start(limits);
  RawClient a(server_->port());
  RawClient b(server_->port());
  ReadHello(a);
  ReadHello(b);
  RawClient refused(server_->port());
  std::size_t extra = 0;
  EXPECT_TRUE(refused.WaitClosed(After(kEventDeadline), &extra));
  EXPECT_EQ(extra, 0u);
  EXPECT_EQ(counters_.connections_refused.load(), 1u);
  EXPECT_EQ(counters_.connections_open.load(), 2u);
}

TEST_F(TcpServerTest, HandshakeDeadlineClosesAClientThatNeverAuthenticates) {
  ServerLimits limits = Relaxed();
  limits.handshake_timeout = 200ms;
  Start(limits);
  const Clock::time_point start = Clock::now();
  RawClient c(server_->port());
  ReadHello(c);
  EXPECT_TRUE(c.WaitClosed(After(kEventDeadline)));
  EXPECT_GE(Clock::now() - start, limits.handshake_timeout);
  EXPECT_EQ(counters_.handshake_timeouts.load(), 1u);
  EXPECT_EQ(counters_.idle_closed.load(), 0u);
}

TEST_F(TcpServerTest, IdleDeadlineClosesAnAuthenticatedIdleConnection) {
  ServerLimits limits = Relaxed();
  limits.idle_timeout = 300ms;
  Start(limits);
  RawClient c(server_->port());
  Handshake(c);
  const Clock::time_point before_last_read = Clock::now();
  ExpectRead(c, 1, 0, 100);
  EXPECT_TRUE(c.WaitClosed(After(kEventDeadline)));
  EXPECT_GE(Clock::now() - before_last_read, limits.idle_timeout);
  EXPECT_EQ(counters_.idle_closed.load(), 1u);
  EXPECT_EQ(counters_.handshake_timeouts.load(), 0u);
  EXPECT_EQ(counters_.stalled_closed.load(), 0u);
}

// Asks for the whole 32 MiB region in four 8 MiB requests and never reads: far more than the
// socket buffers hold, so the server's responses stop making progress.
constexpr std::size_t kBigRegion = std::size_t{32} << 20;
constexpr std::size_t kBigRead = std::size_t{8} << 20;

void RequestWholeRegionWithoutReading(RawClient& c) {
  for (std::uint64_t i = 0; i < kBigRegion / kBigRead; ++i) {
    std::vector<std::uint8_t> req(kRequestHeaderBytes + kOpBytes);
    EncodeRequestHeader({1, 100 + i}, req.data());
    EncodeOp({kRegion, i * kBigRead, kBigRead}, req.data() + kRequestHeaderBytes);
    ASSERT_TRUE(c.Send(req));
  }
}

TEST_F(TcpServerTest, SendStallClosesAClientThatStopsReadingAndReleasesItsPins) {
  ServerLimits limits = Relaxed();
  limits.send_stall_timeout = 300ms;
  Start(limits, kBigRegion);
  RawClient c(server_->port(), /*rcvbuf=*/4096);
  Handshake(c);
  const Clock::time_point before_requests = Clock::now();
  RequestWholeRegionWithoutReading(c);
  ASSERT_TRUE(
      WaitUntil([&] { return counters_.stalled_closed.load() == 1; }, After(kEventDeadline)));
  EXPECT_GE(Clock::now() - before_requests, limits.send_stall_timeout);
  EXPECT_EQ(counters_.idle_closed.load(), 0u);
  // Its responses' pins went with the connection.
  EXPECT_TRUE(RemoveWithin(kEventDeadline));
}

TEST_F(TcpServerTest, RevokeRegionClosesConnectionsWithQueuedResponsesFromIt) {
  ServerLimits limits = Relaxed();  // send stall 30 s: only the revocation can end this
  Start(limits, kBigRegion);
  std::vector<std::uint8_t> other(4096, std::uint8_t{0x5a});
  ASSERT_TRUE(registry_.Add(2, other.data(), other.size()).ok());
  RawClient bystander(server_->port());
  Handshake(bystander);
  RawClient slow(server_->port(), /*rcvbuf=*/4096);
  Handshake(slow);
  RequestWholeRegionWithoutReading(slow);
  // Every response is queued (bytes_served counts them when queued), pinning the region.
  ASSERT_TRUE(WaitUntil([&] { return counters_.bytes_served.load() == kBigRegion; },
                        After(kEventDeadline)));
  const Clock::time_point start = Clock::now();
  EXPECT_TRUE(RemoveWithin(kEventDeadline, [&](RegionId id) { server_->RevokeRegion(id); }));
  EXPECT_LT(Clock::now() - start, limits.send_stall_timeout);
  EXPECT_TRUE(slow.WaitClosed(After(kEventDeadline)));
  EXPECT_EQ(counters_.stalled_closed.load(), 0u);
  // A connection that pinned nothing of it is untouched.
  ASSERT_TRUE(bystander.Send(Request(5, {{2, 0, 4096}})));
  Response r = ReadResponse(bystander);
  EXPECT_EQ(r.header.status, 0u);
  EXPECT_EQ(r.payload, other);
  // Deregistered before `other` is freed (the contract): Remove waits for the server to drop its
  // pin, after its last sendmsg from it returned. (Without this ASan saw its sendmsg interceptor
  // read the freed bytes after the client had already received them.)
  EXPECT_TRUE(registry_.Remove(2).ok());
}

}  // namespace
}  // namespace kvferry::tcp
