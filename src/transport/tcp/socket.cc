#include "transport/tcp/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include "common/clock.h"
#include "common/errno_text.h"

namespace kvferry::tcp {

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    Reset();
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

void Fd::Reset() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

namespace {

struct Resolved {
  sockaddr_storage addr{};
  socklen_t len = 0;
};

Result<Resolved> Resolve(const std::string& host, std::uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return Status::InvalidArgument("cannot resolve host '" + host + "': " + gai_strerror(rc));
  }
  Resolved r;
  std::memcpy(&r.addr, res->ai_addr, res->ai_addrlen);
  r.len = res->ai_addrlen;
  freeaddrinfo(res);
  return r;
}

void SetNonBlocking(int fd) {
  const int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

}  // namespace

void ConfigureStream(int fd, std::chrono::milliseconds user_timeout) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle = 5;
  int interval = 1;
  int count = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  auto timeout = static_cast<unsigned int>(user_timeout.count());
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &timeout, sizeof(timeout));
  SetNonBlocking(fd);
}

Result<Fd> Listen(const std::string& host, std::uint16_t port, std::uint16_t* bound_port) {
  KVFERRY_ASSIGN_OR_RETURN(Resolved r, Resolve(host, port, true));
  Fd fd(socket(r.addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Status::Unavailable(std::string("socket: ") + ErrnoText(errno));
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd.get(), reinterpret_cast<const sockaddr*>(&r.addr), r.len) != 0) {
    const int err = errno;
    return Status::Unavailable("cannot listen on " + host + ":" + std::to_string(port) + ": " +
                               ErrnoText(err) +
                               (err == EADDRINUSE ? "; another process holds the port; choose "
                                                    "another tcp port (0 picks a free one)"
                                                  : ""));
  }
  if (listen(fd.get(), 128) != 0) {
    return Status::Unavailable(std::string("listen: ") + ErrnoText(errno));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len);
  *bound_port =
      ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                        : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  SetNonBlocking(fd.get());
  return fd;
}

Result<Fd> Connect(const std::string& host, std::uint16_t port, Deadline deadline,
                   std::chrono::milliseconds user_timeout, const StopCheck& stop) {
  KVFERRY_ASSIGN_OR_RETURN(Resolved r, Resolve(host, port, false));
  Fd fd(socket(r.addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Status::Unavailable(std::string("socket: ") + ErrnoText(errno));
  ConfigureStream(fd.get(), user_timeout);
  const std::string where = host + ":" + std::to_string(port);
  if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&r.addr), r.len) != 0) {
    if (errno != EINPROGRESS) {
      return Status::Unavailable("cannot connect to " + where + ": " + ErrnoText(errno));
    }
    pollfd p{fd.get(), POLLOUT, 0};
    int n = 0;
    for (;;) {
      n = poll(&p, 1, PollTimeoutMs(deadline, stop ? 50 : INT_MAX));
      if (n < 0 && errno == EINTR) continue;
      if (n != 0 || Expired(deadline)) break;
      if (stop) KVFERRY_RETURN_IF_ERROR(stop());
    }
    if (n == 0) return Status::Timeout("connecting to " + where + " timed out");
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (n < 0 || err != 0) {
      return Status::Unavailable("cannot connect to " + where + ": " +
                                 ErrnoText(err != 0 ? err : errno));
    }
  }
  return fd;
}

bool IsLoopback(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
    return (ntohl(a->sin_addr.s_addr) >> 24) == 127;
  }
  if (addr.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
    if (IN6_IS_ADDR_LOOPBACK(&a->sin6_addr)) return true;
    if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) return a->sin6_addr.s6_addr[12] == 127;
  }
  return false;
}

namespace {

// Drops the first `n` bytes of the iovec array.
void Advance(iovec*& iov, int& iovcnt, std::size_t n) {
  while (n > 0 && iovcnt > 0) {
    if (n >= iov->iov_len) {
      n -= iov->iov_len;
      ++iov;
      --iovcnt;
    } else {
      iov->iov_base = static_cast<char*>(iov->iov_base) + n;
      iov->iov_len -= n;
      n = 0;
    }
  }
  while (iovcnt > 0 && iov->iov_len == 0) {
    ++iov;
    --iovcnt;
  }
}

Status Transfer(int fd, iovec* iov, int iovcnt, const StopCheck& stop, bool sending,
                std::uint64_t* moved) {
  Advance(iov, iovcnt, 0);
  while (iovcnt > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<std::size_t>(std::min(iovcnt, IOV_MAX));
    const ssize_t n = sending ? sendmsg(fd, &msg, MSG_NOSIGNAL) : recvmsg(fd, &msg, 0);
    if (n > 0) {
      if (moved != nullptr) *moved += static_cast<std::uint64_t>(n);
      Advance(iov, iovcnt, static_cast<std::size_t>(n));
      // Checked on progress too, so that a cancel is seen within one call, not one response.
      if (iovcnt > 0) KVFERRY_RETURN_IF_ERROR(stop());
      continue;
    }
    if (n == 0 && !sending) {
      return Status::PeerDisconnected("the peer closed the connection");
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return Status::PeerDisconnected(std::string("connection to the peer failed: ") +
                                      ErrnoText(errno));
    }
    KVFERRY_RETURN_IF_ERROR(stop());
    pollfd p{fd, static_cast<short>(sending ? POLLOUT : POLLIN), 0};
    poll(&p, 1, 50);
  }
  return Status::Ok();
}

}  // namespace

Status SendAll(int fd, iovec* iov, int iovcnt, const StopCheck& stop) {
  return Transfer(fd, iov, iovcnt, stop, true, nullptr);
}

Status RecvAll(int fd, iovec* iov, int iovcnt, const StopCheck& stop, std::uint64_t* received) {
  return Transfer(fd, iov, iovcnt, stop, false, received);
}

}  // namespace kvferry::tcp
