// One peer of the shm backend: the state its units share, the check that the process is the one
// that wrote the descriptor, and the reads (process_vm_readv units on the backend's threads, device
// regions over IPC, host memory staged into a device). shm_backend.cc connects (proof, probe,
// imports) and hands a proven peer to MakeShmPeer.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>

#include "common/mutex.h"
#include "common/work_queue.h"
#include "transport/backend.h"
#include "transport/peer_process.h"
#include "transport/shm/served_memory.h"
#include "transport/shm/shm_ipc.h"
#include "transport/shm/shm_section.h"

namespace kvferry {

/// The state units of one peer share; outlives the peer object while units still run.
class ShmPeerState {
 public:
  explicit ShmPeerState(PeerProcess process) : process_(std::move(process)) {}
  ShmPeerState(const ShmPeerState&) = delete;
  ShmPeerState& operator=(const ShmPeerState&) = delete;

  pid_t pid() const { return process_.pid(); }

  // True while the process lives; cannot be fooled by PID reuse (PeerProcess).
  bool Alive() const { return process_.Alive(); }

  bool Enter() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    if (shut_) return false;
    ++running_;
    return true;
  }
  void Leave() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    if (--running_ == 0) idle_.SignalAll();
  }
  void Shutdown() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    shut_ = true;
    while (running_ != 0) idle_.Wait(mu_);
  }

 private:
  const PeerProcess process_;
  Mutex mu_;
  CondVar idle_;
  bool shut_ GUARDED_BY(mu_) = false;
  int running_ GUARDED_BY(mu_) = 0;
};

/// shm's check on top of the peer-process proof (PeerProcess::Prove, which `peer` passed): the
/// instance nonce in the process's memory is the one `proof` names, and the process is still
/// alive after reading it, so the check cannot have looked at a process that replaced it.
Status ProveShmInstance(const ShmPeerState& peer, const ShmProof& proof);

/// The peer that reads a proven process: host regions with process_vm_readv on `pool` (a batch
/// split into at least `threads` units), or with memcpy where `mapped` has them (host memory into
/// host memory), `imported` device regions over IPC, host memory into device memory through
/// pinned lanes whose bytes `staging_gauge` counts.
std::unique_ptr<BackendPeer> MakeShmPeer(
    std::shared_ptr<ShmPeerState> state, RemoteRegionTable regions, std::shared_ptr<WorkQueue> pool,
    int threads, std::map<RegionId, ImportedRegion> imported,
    std::map<RegionId, std::unique_ptr<const MappedRegion>> mapped,
    std::shared_ptr<std::atomic<std::uint64_t>> staging_gauge);

}  // namespace kvferry
