// shm: the decode side reads the prefill process's registered memory with process_vm_readv.
// Truly one-sided: the prefill process's CPU does nothing. Same host and PID namespace only, and
// the kernel must permit the read (same user, or CAP_SYS_PTRACE).
#pragma once

#include <memory>

#include "common/work_queue.h"
#include "transport/backend.h"

namespace kvferry {

class ShmBackend final : public Backend {
 public:
  ShmBackend(HostIdentity self, int threads);
  const char* name() const override { return "shm"; }
  Result<std::unique_ptr<BackendPeer>> Connect(const PeerDescriptor& peer,
                                               Deadline deadline) override;

  /// Allows any process of this user to read this process's memory even under Yama's
  /// ptrace_scope=1 (prctl PR_SET_PTRACER_ANY). Called by engines that serve reads.
  static void PermitReaders();

 private:
  HostIdentity self_;
  std::shared_ptr<WorkQueue> pool_;
};

}  // namespace kvferry
