#include "transport/tcp/tcp_server.h"

#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "common/clock.h"
#include "common/errno_text.h"
#include "transport/tcp/frames.h"
#include "transport/tcp/tcp_server_loop.h"

namespace kvferry::tcp {
namespace {
std::uint64_t RandomInstance() {
  const Nonce n = RandomNonce();
  std::uint64_t v = 0;
  std::memcpy(&v, n.data(), sizeof(v));
  return v;
}
}  // namespace

Result<std::unique_ptr<TcpServer>> TcpServer::Start(RegionRegistry* registry,
                                                    const std::string& host, std::uint16_t port,
                                                    std::string secret, ServerCounters* counters,
                                                    ServerLimits limits) {
  std::uint16_t bound = 0;
  KVFERRY_ASSIGN_OR_RETURN(Fd listener, Listen(host, port, &bound));
  Fd epoll(epoll_create1(EPOLL_CLOEXEC));
  Fd wake(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!epoll.valid() || !wake.valid()) {
    return Status::Unavailable(std::string("epoll/eventfd: ") + ErrnoText(errno));
  }
  if (limits.max_connections == 0 || limits.max_connections_per_source == 0 ||
      limits.handshake_timeout.count() <= 0 || limits.idle_timeout.count() <= 0 ||
      limits.send_stall_timeout.count() <= 0) {
    return Status::InvalidArgument(
        "tcp server limits must be positive (connection caps, handshake, idle and send-stall "
        "timeouts)");
  }
  return std::unique_ptr<TcpServer>(new TcpServer(registry, std::move(listener), bound,
                                                  std::move(secret), counters, limits,
                                                  std::move(epoll), std::move(wake)));
}

TcpServer::TcpServer(RegionRegistry* registry, Fd listener, std::uint16_t port, std::string secret,
                     ServerCounters* counters, ServerLimits limits, Fd epoll, Fd wake)
    : registry_(registry),
      listener_(std::move(listener)),
      port_(port),
      instance_(RandomInstance()),
      secret_(std::move(secret)),
      counters_(counters),
      limits_(limits),
      epoll_(std::move(epoll)),
      wake_(std::move(wake)) {
  for (int fd : {listener_.get(), wake_.get()}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev);
  }
  thread_ = std::thread([this] { Run(); });
  pthread_setname_np(thread_.native_handle(), "kvferry-tcpsrv");
}

TcpServer::~TcpServer() {
  stopping_.store(true);
  const std::uint64_t one = 1;
  (void)!write(wake_.get(), &one, sizeof(one));
  thread_.join();
}

void TcpServer::Run() {
  ServerLoop loop(registry_, secret_, instance_, counters_, limits_, epoll_.get());
  std::vector<epoll_event> events(64);
  // Deadlines are checked at least this often while any connection is open.
  constexpr int kSweepMs = 100;
  bool accepting = true;
  Clock::time_point last_sweep = Clock::now();
  for (;;) {
    const int timeout = loop.empty() && accepting ? -1 : kSweepMs;
    const int n = epoll_wait(epoll_.get(), events.data(), static_cast<int>(events.size()), timeout);
    for (int i = 0; i < n; ++i) {
      const int fd = events[static_cast<std::size_t>(i)].data.fd;
      if (fd == wake_.get()) {
        std::uint64_t count = 0;
        (void)!read(wake_.get(), &count, sizeof(count));
        if (stopping_.load()) {
          loop.CloseAll();
          return;
        }
        for (RegionId region : TakeRevoked()) loop.Revoke(region);
      } else if (fd == listener_.get()) {
        if (!loop.Accept(fd)) {
          // Out of descriptors with no reserve: stop watching the listener until the next
          // sweep instead of spinning on it.
          epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, listener_.get(), nullptr);
          accepting = false;
        }
      } else {
        loop.Handle(fd, events[static_cast<std::size_t>(i)].events);
      }
    }
    if (Clock::now() - last_sweep >= std::chrono::milliseconds(kSweepMs)) {
      last_sweep = Clock::now();
      loop.Sweep();
      if (!accepting) {
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.fd = listener_.get();
        epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, listener_.get(), &ev);
        accepting = true;
      }
    }
  }
}

void TcpServer::RevokeRegion(RegionId region) {
  {
    MutexLock lock(revoke_mu_);
    revoked_.push_back(region);
  }
  const std::uint64_t one = 1;
  (void)!write(wake_.get(), &one, sizeof(one));
}

std::vector<RegionId> TcpServer::TakeRevoked() {
  MutexLock lock(revoke_mu_);
  std::vector<RegionId> out;
  out.swap(revoked_);
  return out;
}

}  // namespace kvferry::tcp
