// shm: the decode side reads the prefill process's registered memory with process_vm_readv.
// Truly one-sided: the prefill process's CPU does nothing. Same host and PID namespace only, and
// the kernel must permit the read (same user, or CAP_SYS_PTRACE; under Yama's ptrace_scope=1 also
// a descendant reader or a serving process that called PermitReaders).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "common/work_queue.h"
#include "transport/backend.h"

namespace kvferry {

class ShmBackend final : public Backend {
 public:
  ShmBackend(HostIdentity self, int threads);
  const char* name() const override { return "shm"; }
  /// Before any read: the peer's pid must be > 0 and name a live process whose start time
  /// (/proc/PID/stat) equals the descriptor's and whose instance nonce, read from its memory,
  /// equals the descriptor's; otherwise PeerDisconnected (the process is gone or was replaced)
  /// or Unavailable (another host, no shm section, or the kernel refused the read).
  Result<std::unique_ptr<BackendPeer>> Connect(const PeerDescriptor& peer,
                                               Deadline deadline) override;

  /// This process's shm section for its descriptor: its start time and the address and value of
  /// its instance nonce (random, chosen on first use, never changed, kept for the process's life).
  static Result<ShmProof> LocalProof();

  /// Allows every process to ptrace this one, not only to read its memory, when Yama's
  /// ptrace_scope is 1 (prctl PR_SET_PTRACER_ANY; without Yama it changes nothing). Called only
  /// when TransportOptions::shm_permit_any_tracer is set; never undone.
  static void PermitAnyTracer();

  /// The text a refused read (EPERM) reports: why, and how to let shm work.
  static std::string RefusedReadText(pid_t pid);

 private:
  HostIdentity self_;
  std::shared_ptr<WorkQueue> pool_;
};

}  // namespace kvferry
