#include "device/acl/acl_permit.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <random>

#include "common/errno_text.h"
#include "common/log.h"
#include "device/acl/acl_api.h"

namespace kvferry::device {
namespace {

// Request, version 1: "KVAP", u8 version, 65 bytes of key (NUL-terminated, NUL padded), i32 pid.
// Reply, version 1: "KVAR", u8 version, u8 StatusCode, u16 message length, message (<= 1000).
constexpr char kRequestMagic[4] = {'K', 'V', 'A', 'P'};
constexpr char kReplyMagic[4] = {'K', 'V', 'A', 'R'};
constexpr std::uint8_t kVersion = 1;
constexpr std::size_t kRequestSize = 4 + 1 + acl::kIpcKeyLength + sizeof(std::int32_t);
constexpr std::size_t kMaxMessage = 1000;
constexpr std::chrono::seconds kAnswerTime(1);  // per request, on the server

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// The address of the abstract socket `name`, and its length.
socklen_t AbstractAddress(std::string_view name, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  const std::size_t n = std::min(name.size(), sizeof(addr->sun_path) - 1);
  std::memcpy(addr->sun_path + 1, name.data(), n);  // sun_path[0] == 0: the abstract namespace
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

void SetTimeouts(int fd, std::chrono::microseconds t) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(t.count() / 1000000);
  tv.tv_usec = static_cast<suseconds_t>(t.count() % 1000000);
  (void)::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  (void)::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

void SendReply(int fd, const Status& s) {
  std::string text(s.message().substr(0, kMaxMessage));
  std::vector<char> msg(kReplyMagic, kReplyMagic + 4);
  msg.push_back(static_cast<char>(kVersion));
  msg.push_back(static_cast<char>(s.code()));
  const auto len = static_cast<std::uint16_t>(text.size());
  const auto* p = reinterpret_cast<const char*>(&len);
  msg.insert(msg.end(), p, p + sizeof(len));
  msg.insert(msg.end(), text.begin(), text.end());
  (void)::send(fd, msg.data(), msg.size(), MSG_NOSIGNAL);
}

RateLimitedCounter refusals;

}  // namespace

Result<std::unique_ptr<AclPermitServer>> AclPermitServer::Start(Permit permit,
                                                                bool host_pid_namespace) {
  std::unique_ptr<AclPermitServer> s(new AclPermitServer(std::move(permit), host_pid_namespace));
  std::random_device random;
  char suffix[24];
  std::snprintf(suffix, sizeof(suffix), "%08x%08x", random(), random());
  s->name_ = "kvferry-acl-permit-" + std::to_string(::getpid()) + "-" + suffix;
  s->listen_fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s->listen_fd_ < 0) {
    return Status::Unavailable("npu IPC permit socket: socket() failed: " + ErrnoText(errno));
  }
  sockaddr_un addr{};
  const socklen_t len = AbstractAddress(s->name_, &addr);
  if (::bind(s->listen_fd_, reinterpret_cast<const sockaddr*>(&addr), len) != 0 ||
      ::listen(s->listen_fd_, 64) != 0) {
    return Status::Unavailable("npu IPC permit socket \"" + s->name_ +
                               "\": bind/listen failed: " + ErrnoText(errno));
  }
  s->stop_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (s->stop_fd_ < 0) {
    return Status::Unavailable("npu IPC permit socket: eventfd failed: " + ErrnoText(errno));
  }
  s->thread_ = std::thread([raw = s.get()] { raw->Run(); });
  return s;
}

AclPermitServer::~AclPermitServer() {
  if (thread_.joinable()) {
    const std::uint64_t one = 1;
    (void)::write(stop_fd_, &one, sizeof(one));
    thread_.join();
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (stop_fd_ >= 0) ::close(stop_fd_);
}

void AclPermitServer::Run() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      Log().error("npu IPC permit socket {}: poll failed: {}; same-host readers now stage", name_,
                  ErrnoText(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int conn = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;  // the reader gave up meanwhile, or descriptors ran out (it retries)
    Fd fd(conn);
    Answer(fd.get());
  }
}

void AclPermitServer::Answer(int fd) const {
  SetTimeouts(fd, kAnswerTime);
  ucred cred{};
  socklen_t cred_len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0) return;
  char buf[kRequestSize + 1];
  const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
  const auto refuse = [&](const Status& s) {
    if (const std::uint64_t k = refusals.Hit()) {
      Log().warn("npu IPC: refused reader pid {} (uid {}) (#{}): {}", cred.pid, cred.uid, k,
                 s.message());
    }
    SendReply(fd, s);
  };
  if (n != static_cast<ssize_t>(kRequestSize) || std::memcmp(buf, kRequestMagic, 4) != 0 ||
      static_cast<std::uint8_t>(buf[4]) != kVersion ||
      strnlen(buf + 5, acl::kIpcKeyLength) == acl::kIpcKeyLength) {
    refuse(Status::InvalidArgument("expected a permit request (\"KVAP\" version 1, " +
                                   std::to_string(kRequestSize) + " bytes); found " +
                                   std::to_string(n) + " bytes"));
    return;
  }
  const std::string key(buf + 5);
  std::int32_t pid = 0;
  std::memcpy(&pid, buf + 5 + acl::kIpcKeyLength, sizeof(pid));
  if (cred.uid != ::geteuid()) {
    refuse(Status::Unauthenticated("the reader runs as uid " + std::to_string(cred.uid) +
                                   " and this exporter as uid " + std::to_string(::geteuid()) +
                                   ": NPU IPC is offered to processes of the same user only"));
    return;
  }
  if (pid <= 0) {
    refuse(Status::InvalidArgument("expected a positive bare tgid; found " + std::to_string(pid)));
    return;
  }
  if (host_pid_namespace_ && pid != cred.pid) {
    refuse(Status::Unauthenticated("the reader claims bare tgid " + std::to_string(pid) +
                                   " but is pid " + std::to_string(cred.pid) +
                                   " (both run in the host's pid namespace)"));
    return;
  }
  Status s = permit_(key, pid);
  if (!s.ok()) {
    refuse(s);
    return;
  }
  SendReply(fd, s);
}

Status RequestImportPermit(std::string_view socket_name, std::string_view key, std::int32_t pid,
                           Deadline deadline) {
  const std::string where = "the exporter's permit socket \"" + std::string(socket_name) + "\"";
  if (key.empty() || key.size() >= acl::kIpcKeyLength) {
    return Status::InvalidArgument("npu IPC: expected a key of 1 to 64 characters; found " +
                                   std::to_string(key.size()));
  }
  Fd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return Status::Unavailable("npu IPC: socket() failed: " + ErrnoText(errno));
  const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
  if (left.count() <= 0) return Status::Unavailable(where + ": the deadline had passed");
  SetTimeouts(fd.get(), left);
  sockaddr_un addr{};
  const socklen_t len = AbstractAddress(socket_name, &addr);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
    return Status::Unavailable(
        where + ": connect failed: " + ErrnoText(errno) +
        "; the exporter has exited, or runs in another network namespace (abstract unix "
        "sockets do not cross them): reads of it go over tcp");
  }
  char request[kRequestSize] = {};
  std::memcpy(request, kRequestMagic, 4);
  request[4] = static_cast<char>(kVersion);
  std::memcpy(request + 5, key.data(), key.size());
  std::memcpy(request + 5 + acl::kIpcKeyLength, &pid, sizeof(pid));
  if (::send(fd.get(), request, sizeof(request), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(sizeof(request))) {
    return Status::Unavailable(where + ": send failed: " + ErrnoText(errno));
  }
  char reply[8 + kMaxMessage + 1];
  const ssize_t n = ::recv(fd.get(), reply, sizeof(reply), 0);
  if (n < 0) {
    return Status::Unavailable(where + ": no answer by the deadline (" + ErrnoText(errno) + ")");
  }
  std::uint16_t msg_len = 0;
  if (n >= 8) std::memcpy(&msg_len, reply + 6, sizeof(msg_len));
  if (n < 8 || std::memcmp(reply, kReplyMagic, 4) != 0 ||
      static_cast<std::uint8_t>(reply[4]) != kVersion ||
      static_cast<std::size_t>(n) != 8u + msg_len) {
    return Status::Unavailable(where + ": expected a permit reply (\"KVAR\" version 1); found " +
                               std::to_string(n) + " bytes");
  }
  const auto code = static_cast<std::uint8_t>(reply[5]);
  if (code == static_cast<std::uint8_t>(StatusCode::kOk)) return Status::Ok();
  if (code > static_cast<std::uint8_t>(StatusCode::kUnauthenticated)) {
    return Status::Unavailable(where + ": a reply with unknown code " + std::to_string(code));
  }
  return Status(static_cast<StatusCode>(code),
                "the exporter refused: " + std::string(reply + 8, msg_len));
}

}  // namespace kvferry::device
