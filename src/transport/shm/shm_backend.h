// shm: the decode side reads the prefill process's registered memory with process_vm_readv.
// Truly one-sided: the prefill process's CPU does nothing. Same host and PID namespace only, and
// the kernel must permit the read (same user, or CAP_SYS_PTRACE; under Yama's ptrace_scope=1 also
// a descendant reader or a serving process that called PermitReaders).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/work_queue.h"
#include "device/device.h"
#include "transport/backend.h"
#include "transport/shm/shm_options.h"
#include "transport/shm/shm_section.h"

namespace kvferry {

class ShmBackend final : public Backend {
 public:
  /// `self` and `proof` are this process's (LocalHostIdentity, LocalProof). `regions` (may be
  /// null: no device region is then published) are the transport's, whose device regions the
  /// section exports for IPC.
  ShmBackend(HostIdentity self, ShmProof proof, int threads, bool permitted_any_tracer = false,
             RegionRegistry* regions = nullptr, HugePages huge_pages = HugePages::kOff);
  /// The registry's entry: name "shm".
  static BackendFactory Factory();

  const char* name() const override { return "shm"; }
  std::vector<std::uint8_t> DescriptorSection() override;
  /// OK for a peer whose shm section names this kernel and PID namespace; Unavailable when it has
  /// no section or another host; InvalidArgument/NotSupported for a section that does not decode.
  Status CanReach(const PeerView& peer) override;
  /// Before any read: the peer-process proof (PeerProcess::Prove: a pidfd on the section's pid
  /// naming a live process with the section's start time), then the instance nonce, read from the
  /// process's memory, must equal the section's; otherwise PeerDisconnected (the process is gone
  /// or was replaced) or Unavailable (another host, no shm section, no pidfd, or the kernel
  /// refused the read).
  Result<std::unique_ptr<BackendPeer>> Connect(const PeerView& peer, Deadline deadline) override;
  /// Host memory into host memory (process_vm_readv) or into device memory (process_vm_readv
  /// into pinned buffers, then a copy up); a peer's device memory, opened through its IPC handle,
  /// into host memory or memory of the same device (copies on that device's stream;
  /// docs/device.md, "The IPC path").
  bool CanRead(const MemoryKind& remote, const MemoryKind& local) const override {
    if (remote.is_host()) return local.is_host() || device::KnownDeviceType(local.type);
    return device::KnownDeviceType(remote.type) && (local.is_host() || local == remote);
  }

  /// Serving: a host region gets shm.huge_pages (huge_pages.h); a refusal is logged, and the
  /// region is served all the same.
  void RegionAdded(const RegionInfo& region) override;

  void AddStats(TransportStats* stats) const override { stats->staging_bytes += *staging_bytes_; }

  /// Whether this backend called prctl(PR_SET_PTRACER_ANY) when it was created.
  bool permitted_any_tracer() const { return permitted_any_tracer_; }

  /// This process's proof for its section: its start time and the address and value of its
  /// instance nonce (random, chosen on first use, never changed, kept for the process's life).
  static Result<ShmProof> LocalProof();

  /// Allows every process to ptrace this one, not only to read its memory, when Yama's
  /// ptrace_scope is 1 (prctl PR_SET_PTRACER_ANY; without Yama it changes nothing). Called only
  /// when shm.permit_any_tracer is set on a serving transport; never undone.
  static void PermitAnyTracer();

  /// The text a refused read (EPERM) reports: why, and how to let shm work.
  static std::string RefusedReadText(pid_t pid);

 private:
  HostIdentity self_;
  ShmProof proof_;
  bool permitted_any_tracer_;
  RegionRegistry* regions_;
  std::shared_ptr<WorkQueue> pool_;
  int threads_;
  HugePages huge_pages_;  // kOff when the transport does not serve
  // Pinned bytes of the peers' staging lanes (host memory into a device); shared, since units
  // that hold lanes may outlive a peer.
  std::shared_ptr<std::atomic<std::uint64_t>> staging_bytes_ =
      std::make_shared<std::atomic<std::uint64_t>>(0);
};

}  // namespace kvferry
