// Who a serving process is, and the one proof that a same-host peer's pid still names the process
// that wrote its descriptor (docs/transport.md, "The peer-process proof"). The backends that read
// or watch a peer through its pid (shm, ucx) share it, so that they follow one rule; shm adds its
// instance-nonce check on top.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "kvferry/status.h"

namespace kvferry {

/// Same boot id and PID namespace means a peer's PID names a process on this kernel. A decoded
/// section always has pid > 0.
struct HostIdentity {
  std::string boot_id;
  std::uint64_t pid_namespace = 0;
  std::int64_t pid = 0;

  friend bool operator==(const HostIdentity&, const HostIdentity&) = default;
};

/// Whether `a` and `b` name processes on one kernel and in one PID namespace, where a pid means
/// the same process to both.
bool SameKernelAndPidNamespace(const HostIdentity& a, const HostIdentity& b);

/// This process's identity: /proc/sys/kernel/random/boot_id, the inode of /proc/self/ns/pid, and
/// getpid().
Result<HostIdentity> LocalHostIdentity();

/// Field 22 of /proc/PID/stat: the process's start time in clock ticks since boot.
/// PeerDisconnected when the process does not exist (any more).
Result<std::uint64_t> ProcessStartTime(pid_t pid);

/// A same-host peer process, proven to be the one that wrote its descriptor and held through a
/// pidfd, which becomes readable when that very process exits (a pid reused later cannot fool
/// it). Move-only; closes its pidfd when destroyed. Const members are thread-safe.
class PeerProcess {
 public:
  /// The proof, one rule for every backend: `peer` (from the peer's descriptor, on this kernel and
  /// PID namespace as `self`) names a process whose start time equals `start_time` (from the same
  /// descriptor), checked through a pidfd opened first and found alive after the check, so the
  /// pidfd names the very process that wrote the descriptor. The pidfd is required.
  ///  - InvalidArgument: a pid that is not in 1..2^31-1.
  ///  - Unavailable: `peer` is on another kernel or PID namespace than `self`; or pidfd_open
  ///    failed other than with ESRCH (Linux before 5.3, a seccomp filter, no file descriptor
  ///    left), naming the error: a preference list goes on to its next backend.
  ///  - PeerDisconnected: no process has that pid any more, or the one that has it started at
  ///    another time, or it exited during the proof: the peer is gone; get a new descriptor.
  static Result<PeerProcess> Prove(const HostIdentity& self, const HostIdentity& peer,
                                   std::uint64_t start_time);

  PeerProcess(PeerProcess&& other) noexcept;
  PeerProcess& operator=(PeerProcess&& other) noexcept;
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;
  ~PeerProcess();

  pid_t pid() const { return pid_; }
  /// The pidfd that holds the process (pidfd_getfd of its descriptors); owned by this object.
  int pidfd() const { return pidfd_; }
  /// True while the proven process lives (its pidfd is not readable). Does not block.
  bool Alive() const;
  /// PeerDisconnected: "peer process <pid> exited; <consequence>".
  Status Gone(std::string_view consequence) const;

 private:
  PeerProcess(pid_t pid, int pidfd) : pid_(pid), pidfd_(pidfd) {}

  pid_t pid_ = 0;
  int pidfd_ = -1;
};

}  // namespace kvferry
