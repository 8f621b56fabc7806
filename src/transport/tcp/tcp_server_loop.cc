#include "transport/tcp/tcp_server_loop.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <set>

#include "common/log.h"

namespace kvferry::tcp {
namespace {

constexpr std::size_t kMaxQueuedResponses = 16;  // per connection, before reading pauses
constexpr std::size_t kReadChunk = std::size_t{64} * 1024;

std::string SourceAddress(const sockaddr_storage& addr) {
  char text[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&addr)->sin_addr, text, sizeof(text));
  } else if (addr.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_addr, text,
              sizeof(text));
  }
  return text;
}

}  // namespace

ServerLoop::ServerLoop(RegionRegistry* registry, const std::string& secret, std::uint64_t instance,
                       ServerCounters* counters, const ServerLimits& limits, int epoll)
    : registry_(registry),
      secret_(secret),
      instance_(instance),
      counters_(counters),
      limits_(limits),
      epoll_(epoll),
      reserve_(open("/dev/null", O_RDONLY | O_CLOEXEC)) {}

bool ServerLoop::Accept(int listener) {
  for (;;) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    const int fd = accept4(listener, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        // Out of descriptors: give up the reserve one to take the connection off the backlog
        // and close it, then take the reserve back (the classic libev/nginx technique).
        counters_->accept_exhausted.fetch_add(1);
        if (!reserve_.valid()) return false;
        reserve_.Reset();
        const int victim = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
        // Counted before the close: whoever sees the close sees the count.
        RefuseConnection("out of file descriptors (raise the open-file limit, ulimit -n)");
        if (victim >= 0) close(victim);
        reserve_ = Fd(open("/dev/null", O_RDONLY | O_CLOEXEC));
        if (victim < 0) return false;
        continue;
      }
      return true;  // EAGAIN: the backlog is empty
    }
    if (secret_.empty() && !IsLoopback(addr)) {
      // Without a shared secret anyone who can reach the port could read the cache.
      RefuseConnection("a non-loopback client, and no secret is configured");
      close(fd);
      continue;
    }
    std::string source = SourceAddress(addr);
    if (conns_.size() >= limits_.max_connections) {
      RefuseConnection("the server has " + std::to_string(conns_.size()) +
                       " connections open, its cap");
      close(fd);
      continue;
    }
    std::size_t& from_source = per_source_[source];
    if (from_source >= limits_.max_connections_per_source) {
      RefuseConnection(source + " has " + std::to_string(from_source) +
                       " connections open, the per-source cap");
      close(fd);
      continue;
    }
    ++from_source;
    ConfigureStream(fd, std::chrono::milliseconds(5000));
    auto conn = std::make_unique<Connection>();
    conn->stage.CountIn(&counters_->staging_bytes);
    conn->fd = Fd(fd);
    conn->source = std::move(source);
    conn->accepted = Clock::now();
    conn->last_progress = conn->accepted;
    conn->server_nonce = RandomNonce();
    Response hello;
    hello.head.resize(kHelloBytes);
    PutU32(hello.head.data(), kHelloMagic);
    PutU32(hello.head.data() + 4, kVersion);
    std::memcpy(hello.head.data() + 8, conn->server_nonce.data(), kNonceBytes);
    conn->out.push_back(std::move(hello));
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT;
    ev.data.fd = fd;
    epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev);
    conn->want_write = true;
    conns_[fd] = std::move(conn);
    counters_->connections_open.store(conns_.size());
  }
}

void ServerLoop::Sweep() {
  const Clock::time_point now = Clock::now();
  std::vector<int> expired;
  for (const auto& [fd, c] : conns_) {
    if (c->phase == Phase::kAwaitAuth && now - c->accepted >= limits_.handshake_timeout) {
      counters_->handshake_timeouts.fetch_add(1);
      expired.push_back(fd);
    } else if (c->phase == Phase::kServing && c->out.empty() &&
               now - c->last_progress >= limits_.idle_timeout) {
      counters_->idle_closed.fetch_add(1);
      expired.push_back(fd);
    } else if (!c->out.empty() && now - c->last_progress >= limits_.send_stall_timeout) {
      counters_->stalled_closed.fetch_add(1);
      expired.push_back(fd);
    }
  }
  for (int fd : expired) Close(fd);
}

void ServerLoop::Revoke(RegionId region) {
  std::vector<int> holding;
  for (const auto& [fd, c] : conns_) {
    for (const Response& r : c->out) {
      bool pins = false;
      for (const RegionPin& p : r.pins) pins = pins || p.region() == region;
      if (pins) {
        holding.push_back(fd);
        break;
      }
    }
  }
  for (int fd : holding) Close(fd);
}

void ServerLoop::Handle(int fd, std::uint32_t events) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  Connection& c = *it->second;
  bool ok = true;
  if ((events & (EPOLLIN | EPOLLHUP | EPOLLERR)) != 0 && c.reading) ok = ReadSome(c);
  if (ok) ok = Parse(c);
  if (ok) ok = Flush(c);
  if (!ok || (c.phase == Phase::kClosing && c.out.empty())) {
    Close(fd);
    return;
  }
  UpdateInterest(c);
}

void ServerLoop::CloseAll() {
  while (!conns_.empty()) Close(conns_.begin()->first);
}

bool ServerLoop::ReadSome(Connection& c) {
  const std::size_t old = c.in.size();
  c.in.resize(old + kReadChunk);
  const ssize_t n = recv(c.fd.get(), c.in.data() + old, kReadChunk, 0);
  if (n > 0) {
    c.in.resize(old + static_cast<std::size_t>(n));
    c.last_progress = Clock::now();
    return true;
  }
  c.in.resize(old);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
  return false;  // EOF or error: the client went away
}

bool ServerLoop::Parse(Connection& c) {
  std::size_t used = 0;
  bool ok = true;
  while (ok && c.phase != Phase::kClosing) {
    const std::span<const std::uint8_t> rest(c.in.data() + used, c.in.size() - used);
    std::size_t consumed = 0;
    if (c.phase == Phase::kAwaitAuth) {
      if (rest.size() < kAuthBytes) break;
      ok = Authenticate(c, rest.first<kAuthBytes>());
      consumed = kAuthBytes;
    } else {
      if (c.out.size() >= kMaxQueuedResponses) {
        c.reading = false;  // backpressure: resume once responses drain
        break;
      }
      if (rest.size() < kRequestHeaderBytes) break;
      Result<RequestHeader> h = ParseRequestHeader(rest.first<kRequestHeaderBytes>());
      if (!h.ok()) {
        Refuse(h.status());
        return false;
      }
      const std::size_t frame = kRequestHeaderBytes + h->op_count * kOpBytes;
      if (rest.size() < frame) break;
      ok = Serve(c, *h, rest.subspan(kRequestHeaderBytes, h->op_count * kOpBytes));
      consumed = frame;
    }
    used += consumed;
  }
  c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(used));
  if (c.out.size() < kMaxQueuedResponses) c.reading = true;
  // A client that sends more than one maximal frame without us consuming it is broken.
  if (c.in.size() > kRequestHeaderBytes + kMaxOpsPerRequest * kOpBytes + kReadChunk) {
    Refuse(Status::InvalidArgument("client sent more unread request bytes than allowed"));
    return false;
  }
  return ok;
}

bool ServerLoop::Authenticate(Connection& c, std::span<const std::uint8_t, kAuthBytes> in) {
  if (GetU32(in.data()) != kAuthMagic || GetU32(in.data() + 4) != kVersion) {
    // Answered with a result frame naming the reason, then closed (docs/transport.md).
    const bool magic = GetU32(in.data()) == kAuthMagic;
    Refuse(magic ? Status::NotSupported("handshake for tcp protocol version " +
                                        std::to_string(GetU32(in.data() + 4)) +
                                        "; this server speaks version 1")
                 : Status::InvalidArgument("handshake does not start with the auth magic"));
    Response result;
    result.head.assign(kResultBytes, 0);
    PutU32(result.head.data(), kResultMagic);
    PutU32(result.head.data() + 4,
           static_cast<std::uint32_t>(magic ? StatusCode::kNotSupported
                                            : StatusCode::kInvalidArgument));
    c.out.push_back(std::move(result));
    c.phase = Phase::kClosing;
    return true;
  }
  Nonce client{};
  std::memcpy(client.data(), in.data() + 8, kNonceBytes);
  Sha256Digest mac{};
  std::memcpy(mac.data(), in.data() + 8 + kNonceBytes, mac.size());
  const bool good = DigestEquals(mac, ClientMac(secret_, c.server_nonce, client));
  Response result;
  result.head.resize(kResultBytes);
  PutU32(result.head.data(), kResultMagic);
  PutU32(result.head.data() + 4,
         good ? 0u : static_cast<std::uint32_t>(StatusCode::kUnauthenticated));
  if (good) {
    const Sha256Digest proof = ServerMac(secret_, c.server_nonce, client, instance_);
    std::memcpy(result.head.data() + 8, proof.data(), proof.size());
    c.phase = Phase::kServing;
  } else {
    Refuse(Status::Unauthenticated("a client failed authentication: the shared secrets differ"));
    c.phase = Phase::kClosing;
  }
  c.out.push_back(std::move(result));
  return true;
}

bool ServerLoop::Serve(Connection& c, const RequestHeader& h, std::span<const std::uint8_t> ops) {
  Response r;
  std::uint64_t total = 0;
  Status status;
  for (std::uint32_t i = 0; i < h.op_count && status.ok(); ++i) {
    Result<WireOp> op = ParseOp(ops.subspan(i * kOpBytes).first<kOpBytes>());
    if (!op.ok()) {
      Refuse(op.status());
      return false;  // malformed frame: close this connection only
    }
    if (Status length = CheckOpLength(*op); !length.ok()) {
      status = length.WithContext("op " + std::to_string(i));
      break;
    }
    RegionPin pin;
    Result<std::byte*> where = registry_->PinRange(op->region, op->offset, op->length, &pin);
    if (!where.ok()) {
      status = where.status();
      break;
    }
    total += op->length;
    if (total > kMaxRequestBytes) {
      status = Status::InvalidArgument("read request asks for more than " +
                                       std::to_string(kMaxRequestBytes) + " bytes");
      break;
    }
    if (!pin.kind().is_host()) {
      Result<device::Device*> dev = device::ProcessDevice(pin.kind().ToString());
      if (!dev.ok()) {
        status = dev.status().WithContext("op " + std::to_string(i));
        break;
      }
      r.body_dev.resize(r.body.size());
      r.body_dev.push_back(*dev);
    } else if (!r.body_dev.empty()) {
      r.body_dev.push_back(nullptr);
    }
    r.body.push_back({*where, op->length});
    r.pins.push_back(std::move(pin));
  }
  r.head.resize(kResponseHeaderBytes);
  if (!status.ok()) {
    // Refused before any byte moves; the connection stays usable.
    Refuse(status);
    r.body.clear();
    r.body_dev.clear();
    r.pins.clear();
    const std::string text(status.message().substr(0, kMaxErrorBytes));
    EncodeResponseHeader({static_cast<std::uint32_t>(status.code()), h.request_id, text.size()},
                         r.head.data());
    r.head.insert(r.head.end(), text.begin(), text.end());
  } else {
    EncodeResponseHeader({0, h.request_id, total}, r.head.data());
    counters_->bytes_served.fetch_add(total);
  }
  r.serial = c.next_serial++;
  c.out.push_back(std::move(r));
  return true;
}

bool ServerLoop::Flush(Connection& c) {
  while (!c.out.empty()) {
    Response& r = c.out.front();
    std::vector<iovec> iov;
    if (r.head_sent < r.head.size()) {
      iov.push_back({r.head.data() + r.head_sent, r.head.size() - r.head_sent});
    }
    for (std::size_t i = r.body_index; i < r.body.size() && iov.size() < IOV_MAX; ++i) {
      const std::size_t skip = i == r.body_index ? r.body_offset : 0;
      if (r.body_dev.empty() || r.body_dev[i] == nullptr) {
        iov.push_back({static_cast<char*>(r.body[i].iov_base) + skip, r.body[i].iov_len - skip});
        continue;
      }
      // Device memory: one staged chunk at a time, from the front of what is left.
      if (i != r.body_index) break;
      const StagedBody cur{r.serial, r.body, r.body_dev};
      StagedBody after;
      if (c.out.size() > 1 && !c.out[1].body_dev.empty()) {
        after = {c.out[1].serial, c.out[1].body, c.out[1].body_dev};
      }
      Result<std::span<const std::byte>> staged =
          c.stage.Bytes(cur, i, skip, after.serial != 0 ? &after : nullptr);
      if (!staged.ok()) {
        Refuse(staged.status().WithContext("staging " + r.body_dev[i]->name() +
                                           " memory to send; closing the connection"));
        return false;
      }
      iov.push_back({const_cast<std::byte*>(staged->data()), staged->size()});
      break;
    }
    if (iov.empty()) {
      c.out.pop_front();
      continue;
    }
    msghdr msg{};
    msg.msg_iov = iov.data();
    msg.msg_iovlen = iov.size();
    const ssize_t n = sendmsg(c.fd.get(), &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
        c.want_write = true;
        return true;
      }
      return false;
    }
    c.last_progress = Clock::now();
    auto left = static_cast<std::size_t>(n);
    const std::size_t from_head = std::min(left, r.head.size() - r.head_sent);
    r.head_sent += from_head;
    left -= from_head;
    while (left > 0) {
      const std::size_t rest = r.body[r.body_index].iov_len - r.body_offset;
      if (left >= rest) {
        left -= rest;
        ++r.body_index;
        r.body_offset = 0;
      } else {
        r.body_offset += left;
        left = 0;
      }
    }
    if (r.head_sent == r.head.size() && r.body_index == r.body.size()) c.out.pop_front();
  }
  c.want_write = false;
  return true;
}

void ServerLoop::UpdateInterest(Connection& c) {
  epoll_event ev{};
  ev.events = (c.reading ? EPOLLIN : 0u) | (c.want_write ? EPOLLOUT : 0u);
  ev.data.fd = c.fd.get();
  epoll_ctl(epoll_, EPOLL_CTL_MOD, c.fd.get(), &ev);
}

void ServerLoop::Close(int fd) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr);
  auto src = per_source_.find(it->second->source);
  if (src != per_source_.end() && --src->second == 0) per_source_.erase(src);
  conns_.erase(it);  // releases the pins of unsent responses
  counters_->connections_open.store(conns_.size());
}

void ServerLoop::RefuseConnection(const std::string& why) {
  counters_->connections_refused.fetch_add(1);
  Refuse(Status::ResourceExhausted("closed a new connection: " + why));
}

void ServerLoop::Refuse(const Status& s) {
  const std::uint64_t n = counters_->refused.fetch_add(1) + 1;
  // Rate-limited: the first ten, then every thousandth.
  if (n <= 10 || n % 1000 == 0) Log().warn("tcp server: refused request #{}: {}", n, s.ToString());
}

}  // namespace kvferry::tcp
