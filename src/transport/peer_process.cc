#include "transport/peer_process.h"

#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <climits>
#include <fstream>
#include <iterator>
#include <sstream>
#include <utility>

#include "common/errno_text.h"

namespace kvferry {

bool SameKernelAndPidNamespace(const HostIdentity& a, const HostIdentity& b) {
  return a.boot_id == b.boot_id && a.pid_namespace == b.pid_namespace;
}

Result<HostIdentity> LocalHostIdentity() {
  HostIdentity id;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  if (!(boot >> id.boot_id)) {
    return Status::Unavailable("cannot read /proc/sys/kernel/random/boot_id: is /proc mounted?");
  }
  struct stat st {};
  if (stat("/proc/self/ns/pid", &st) != 0) {
    return Status::Unavailable("cannot stat /proc/self/ns/pid: is /proc mounted?");
  }
  id.pid_namespace = st.st_ino;
  id.pid = getpid();
  return id;
}

// The command name (field 2) may hold spaces and parentheses, so fields are counted after the
// last ')'.
Result<std::uint64_t> ProcessStartTime(pid_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  std::ifstream file(path);
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (text.empty()) {
    return Status::PeerDisconnected("cannot read " + path + ": process " + std::to_string(pid) +
                                    " does not exist (any more)");
  }
  const std::size_t name_end = text.rfind(')');
  std::istringstream rest(name_end == std::string::npos ? std::string()
                                                        : text.substr(name_end + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i) {
    if (!(rest >> field)) {
      return Status::Internal(path + " has fewer than 22 fields; is /proc a procfs?");
    }
  }
  std::uint64_t ticks = 0;
  const auto [end, ec] = std::from_chars(field.data(), field.data() + field.size(), ticks);
  if (ec != std::errc() || end != field.data() + field.size()) {
    return Status::Internal(path + ": field 22 (start time) is '" + field + "', expected a number");
  }
  return ticks;
}

Result<PeerProcess> PeerProcess::Prove(const HostIdentity& self, const HostIdentity& peer,
                                       std::uint64_t start_time) {
  if (peer.pid <= 0 || peer.pid > INT_MAX) {
    return Status::InvalidArgument("the peer's pid is " + std::to_string(peer.pid) +
                                   ": expected the serving process's pid (1 to 2^31-1)");
  }
  if (!SameKernelAndPidNamespace(self, peer)) {
    return Status::Unavailable("the peer's pid cannot be proven from here: it runs on boot id " +
                               peer.boot_id + ", PID namespace " +
                               std::to_string(peer.pid_namespace) + ", this process on " +
                               self.boot_id + ", " + std::to_string(self.pid_namespace));
  }
  const auto pid = static_cast<pid_t>(peer.pid);
  // The pidfd first: once it is open, a start time that matches is the start time of the process
  // it names, and that process cannot be replaced at its pid behind it.
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) {
    const int err = errno;
    if (err == ESRCH) {
      return Status::PeerDisconnected("peer process " + std::to_string(pid) +
                                      " does not exist (any more): the peer exited; get a new "
                                      "descriptor");
    }
    return Status::Unavailable("pidfd_open(" + std::to_string(pid) + ") failed: " + ErrnoText(err) +
                               "; proving a same-host peer needs a pidfd (Linux 5.3 or later, "
                               "pidfd_open allowed by any seccomp filter, a free file "
                               "descriptor); read it over another backend (tcp)");
  }
  PeerProcess process(pid, pidfd);
  // PeerDisconnected when it is gone (Internal for a /proc that is not a procfs).
  KVFERRY_ASSIGN_OR_RETURN(const std::uint64_t start, ProcessStartTime(pid));
  if (start != start_time) {
    return Status::PeerDisconnected(
        "process " + std::to_string(pid) + " started at tick " + std::to_string(start) +
        " but the descriptor names a process started at tick " + std::to_string(start_time) +
        ": the peer exited and its pid names another process now; get a new descriptor");
  }
  // Still alive after the check, so the start time read was the proven process's own.
  if (!process.Alive()) return process.Gone("get a new descriptor");
  return process;
}

PeerProcess::PeerProcess(PeerProcess&& other) noexcept
    : pid_(other.pid_), pidfd_(std::exchange(other.pidfd_, -1)) {}

PeerProcess& PeerProcess::operator=(PeerProcess&& other) noexcept {
  if (this != &other) {
    if (pidfd_ >= 0) close(pidfd_);
    pid_ = other.pid_;
    pidfd_ = std::exchange(other.pidfd_, -1);
  }
  return *this;
}

PeerProcess::~PeerProcess() {
  if (pidfd_ >= 0) close(pidfd_);
}

bool PeerProcess::Alive() const {
  pollfd p{pidfd_, POLLIN, 0};
  return poll(&p, 1, 0) == 0;
}

Status PeerProcess::Gone(std::string_view consequence) const {
  return Status::PeerDisconnected("peer process " + std::to_string(pid_) + " exited; " +
                                  std::string(consequence));
}

}  // namespace kvferry
