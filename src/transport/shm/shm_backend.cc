#include "transport/shm/shm_backend.h"

#include <poll.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <mutex>

#include "common/errno_text.h"

namespace kvferry {
namespace {

// Per unit of work: bounded so that cancel and deadlines are seen within a few milliseconds.
constexpr std::size_t kMaxIovPerCall = 512;  // below IOV_MAX (1024)
constexpr std::uint64_t kMaxUnitBytes = 8u << 20;

struct Piece {
  std::byte* local;
  std::uint64_t remote_addr;
  std::uint64_t length;
};

// The state units of one peer share; outlives the peer object while units still run.
class ShmPeerState {
 public:
  ShmPeerState(pid_t pid, int pidfd) : pid_(pid), pidfd_(pidfd) {}
  ~ShmPeerState() { close(pidfd_); }
  ShmPeerState(const ShmPeerState&) = delete;
  ShmPeerState& operator=(const ShmPeerState&) = delete;

  pid_t pid() const { return pid_; }

  // True while the process lives. A pidfd becomes readable when its process exits, so this cannot
  // be fooled by PID reuse.
  bool Alive() const {
    pollfd p{pidfd_, POLLIN, 0};
    return poll(&p, 1, 0) == 0;
  }

  bool Enter() {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_) return false;
    ++running_;
    return true;
  }
  void Leave() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--running_ == 0) idle_.notify_all();
  }
  void Shutdown() {
    std::unique_lock<std::mutex> lock(mu_);
    shut_ = true;
    idle_.wait(lock, [&] { return running_ == 0; });
  }

 private:
  const pid_t pid_;
  const int pidfd_;
  std::mutex mu_;
  std::condition_variable idle_;
  bool shut_ = false;  // guarded by mu_
  int running_ = 0;    // guarded by mu_
};

Status PeerGone(pid_t pid) {
  return Status::PeerDisconnected("peer process " + std::to_string(pid) +
                                  " exited; its reads cannot complete");
}

// Reads every piece with as few process_vm_readv calls as possible, resuming after short reads.
Status ReadPieces(const ShmPeerState& peer, const Batch& batch, std::vector<Piece>& pieces,
                  std::uint64_t* bytes) {
  std::vector<iovec> local;
  std::vector<iovec> remote;
  std::size_t next = 0;
  std::uint64_t done_in_piece = 0;
  while (next < pieces.size()) {
    if (batch.ShouldStop()) return batch.StopStatus();
    local.clear();
    remote.clear();
    for (std::size_t i = next; i < pieces.size() && local.size() < kMaxIovPerCall; ++i) {
      const std::uint64_t skip = i == next ? done_in_piece : 0;
      local.push_back({pieces[i].local + skip, pieces[i].length - skip});
      remote.push_back(
          // An address in the peer's address space, never dereferenced here.
          {reinterpret_cast<void*>(  // NOLINT(performance-no-int-to-ptr)
               pieces[i].remote_addr + skip),
           pieces[i].length - skip});
    }
    const ssize_t n =
        process_vm_readv(peer.pid(), local.data(), local.size(), remote.data(), remote.size(), 0);
    if (n < 0) {
      const int err = errno;
      if (err == ESRCH || !peer.Alive()) return PeerGone(peer.pid());
      if (err == EPERM) {
        return Status::Unavailable("process_vm_readv on pid " + std::to_string(peer.pid()) +
                                   " was refused (EPERM): run both processes as the same user, "
                                   "or use the tcp transport");
      }
      if (err == EFAULT) {
        return Status::Internal("process_vm_readv on pid " + std::to_string(peer.pid()) +
                                " hit unmapped memory: the peer freed a registered region "
                                "without deregistering it");
      }
      return Status::Internal(std::string("process_vm_readv failed: ") + ErrnoText(err));
    }
    if (n == 0) {
      return Status::Internal("process_vm_readv on pid " + std::to_string(peer.pid()) +
                              " made no progress: the peer's registered memory is unmapped");
    }
    *bytes += static_cast<std::uint64_t>(n);
    auto left = static_cast<std::uint64_t>(n);
    while (left > 0) {
      const std::uint64_t rest = pieces[next].length - done_in_piece;
      if (left >= rest) {
        left -= rest;
        ++next;
        done_in_piece = 0;
      } else {
        done_in_piece += left;
        left = 0;
      }
    }
  }
  // A PID can only be reused after its process exits; if it exited during the reads, the bytes
  // may not be the peer's.
  if (!peer.Alive()) return PeerGone(peer.pid());
  return Status::Ok();
}

class ShmPeer final : public BackendPeer {
 public:
  ShmPeer(std::shared_ptr<ShmPeerState> state, RemoteRegionTable regions,
          std::shared_ptr<WorkQueue> pool)
      : state_(std::move(state)), regions_(std::move(regions)), pool_(std::move(pool)) {}
  ~ShmPeer() override { Shutdown(); }

  void Start(const std::shared_ptr<Batch>& batch, std::vector<ReadOp> ops) override {
    std::vector<Piece> unit;
    std::uint64_t unit_bytes = 0;
    auto flush = [&] {
      if (unit.empty()) return;
      batch->AddUnit();
      pool_->Post([state = state_, batch, pieces = std::move(unit)]() mutable {
        std::uint64_t bytes = 0;
        if (!state->Enter()) {
          batch->UnitDone(Status::Cancelled("the shm peer was disconnected"), 0);
          return;
        }
        Status s = ReadPieces(*state, *batch, pieces, &bytes);
        state->Leave();
        batch->UnitDone(s, bytes);
      });
      unit = {};
      unit_bytes = 0;
    };
    for (const ReadOp& op : ops) {
      const std::uint64_t base = regions_.at(op.remote_region).addr + op.remote_offset;
      for (std::uint64_t off = 0; off < op.length;) {
        const std::uint64_t len = std::min(op.length - off, kMaxUnitBytes - unit_bytes);
        unit.push_back({op.local + off, base + off, len});
        unit_bytes += len;
        off += len;
        if (unit_bytes >= kMaxUnitBytes || unit.size() >= 4 * kMaxIovPerCall) flush();
      }
    }
    flush();
  }

  void Shutdown() override { state_->Shutdown(); }

 private:
  std::shared_ptr<ShmPeerState> state_;
  RemoteRegionTable regions_;
  std::shared_ptr<WorkQueue> pool_;
};

}  // namespace

ShmBackend::ShmBackend(HostIdentity self, int threads)
    : self_(std::move(self)), pool_(std::make_shared<WorkQueue>(threads, "kvferry-shm")) {}

void ShmBackend::PermitReaders() {
  // Without Yama this has no effect and may fail with EINVAL; either way nothing to report.
  (void)prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
}

Result<std::unique_ptr<BackendPeer>> ShmBackend::Connect(const PeerDescriptor& peer,
                                                         Deadline /*deadline*/) {
  if (peer.host.boot_id != self_.boot_id || peer.host.pid_namespace != self_.pid_namespace) {
    return Status::Unavailable(
        "shm needs the peer on this kernel and PID namespace; the peer has boot id " +
        peer.host.boot_id + " and PID namespace " + std::to_string(peer.host.pid_namespace) +
        ", this process " + self_.boot_id + " and " + std::to_string(self_.pid_namespace));
  }
  const auto pid = static_cast<pid_t>(peer.host.pid);
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) {
    const int err = errno;
    if (err == ESRCH) {
      return Status::Unavailable("peer process " + std::to_string(pid) + " does not exist");
    }
    return Status::Unavailable("pidfd_open(" + std::to_string(pid) + ") failed: " + ErrnoText(err) +
                               "; shm needs Linux 5.3 or later");
  }
  auto state = std::make_shared<ShmPeerState>(pid, pidfd);
  // Probe one byte, so that a kernel that refuses (EPERM) is found now, not mid-transfer.
  if (!peer.regions.empty()) {
    std::byte probe{};
    iovec local{&probe, 1};
    // An address in the peer's address space, never dereferenced here.
    iovec remote{
        reinterpret_cast<void*>(peer.regions.front().addr),  // NOLINT(performance-no-int-to-ptr)
        1};
    if (process_vm_readv(pid, &local, 1, &remote, 1, 0) != 1) {
      const int err = errno;
      return Status::Unavailable("process_vm_readv on peer process " + std::to_string(pid) +
                                 " failed (" + ErrnoText(err) +
                                 "): the kernel does not let this process read the peer's "
                                 "memory; run both as the same user or use the tcp transport");
    }
  }
  return std::unique_ptr<BackendPeer>(
      std::make_unique<ShmPeer>(std::move(state), IndexRegions(peer), pool_));
}

}  // namespace kvferry
