// Small RAII and deadline-bounded helpers over POSIX TCP sockets.
#pragma once

#include <sys/socket.h>
#include <sys/uio.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "kvferry/status.h"
#include "kvferry/transport.h"

namespace kvferry::tcp {

/// Owns a file descriptor; closes it on destruction. Move-only.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void Reset();

 private:
  int fd_ = -1;
};

/// Listens on host:port (port 0: any free port). A busy port is Unavailable naming it.
Result<Fd> Listen(const std::string& host, std::uint16_t port, std::uint16_t* bound_port);

/// Called between waits; returning a non-OK Status aborts the transfer with it.
using StopCheck = std::function<Status()>;

/// Connects within the deadline; the socket is left non-blocking with TCP_NODELAY, keepalive and
/// TCP_USER_TIMEOUT set. `stop`, when given, is called every 50 ms while connecting.
Result<Fd> Connect(const std::string& host, std::uint16_t port, Deadline deadline,
                   std::chrono::milliseconds user_timeout, const StopCheck& stop = nullptr);

/// Sets TCP_NODELAY, keepalive and TCP_USER_TIMEOUT, and O_NONBLOCK.
void ConfigureStream(int fd, std::chrono::milliseconds user_timeout);

/// True for 127.0.0.0/8, ::1 and IPv4-mapped loopback.
bool IsLoopback(const sockaddr_storage& addr);

/// Sends or receives every byte of `iov` on a non-blocking socket, waiting at most 50 ms at a
/// time and calling `stop` between waits. EOF and resets are PeerDisconnected. Advances `iov`.
Status SendAll(int fd, iovec* iov, int iovcnt, const StopCheck& stop);
Status RecvAll(int fd, iovec* iov, int iovcnt, const StopCheck& stop, std::uint64_t* received);

}  // namespace kvferry::tcp
