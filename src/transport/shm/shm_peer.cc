#include "transport/shm/shm_peer.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "common/errno_text.h"
#include "common/hex.h"
#include "transport/shm/shm_backend.h"

namespace kvferry {
namespace {

// Per unit of work: bounded so that cancel and deadlines are seen within a few milliseconds.
constexpr std::size_t kMaxIovPerCall = 512;  // below IOV_MAX (1024)
constexpr std::uint64_t kMaxUnitBytes = 8u << 20;
// A batch smaller than threads * kMaxUnitBytes is still split across the threads, down to units of
// this size: one layer of a layer-wise load (a few MiB) is read by every thread, not one.
constexpr std::uint64_t kMinUnitBytes = 256u << 10;

using Piece = HostRead;

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
      if (err == EPERM) return Status::Unavailable(ShmBackend::RefusedReadText(peer.pid()));
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

// A read of a peer's region mapped into this process (served_memory.h).
struct CopyPiece {
  std::byte* local;
  const std::byte* remote;
  std::uint64_t length;
};

// Copies every piece, stopping between pieces when the batch stops.
Status CopyMapped(const ShmPeerState& peer, const Batch& batch,
                  const std::vector<CopyPiece>& pieces, std::uint64_t* bytes) {
  for (const CopyPiece& p : pieces) {
    if (batch.ShouldStop()) return batch.StopStatus();
    std::memcpy(p.local, p.remote, p.length);
    *bytes += p.length;
  }
  // As for process_vm_readv: bytes copied while the peer exited may be half written.
  if (!peer.Alive()) return PeerGone(peer.pid());
  return Status::Ok();
}

using MappedRegions = std::map<RegionId, std::unique_ptr<const MappedRegion>>;

class ShmPeer final : public BackendPeer {
 public:
  ShmPeer(std::shared_ptr<ShmPeerState> state, RemoteRegionTable regions,
          std::shared_ptr<WorkQueue> pool, int threads, std::map<RegionId, ImportedRegion> imported,
          MappedRegions mapped, std::shared_ptr<std::atomic<std::uint64_t>> staging_gauge)
      : threads_(static_cast<std::uint64_t>(std::max(threads, 1))),
        staging_gauge_(std::move(staging_gauge)),
        state_(std::move(state)),
        regions_(std::move(regions)),
        pool_(std::move(pool)),
        imported_(std::make_shared<const std::map<RegionId, ImportedRegion>>(std::move(imported))),
        mapped_(std::move(mapped)) {
    for (const auto& [id, r] : *imported_) {
      if (streams_.count(r.device) == 0) {
        streams_[r.device] = std::make_shared<StreamPool>(r.device);
      }
    }
  }
  // Units copy from the mappings only between Enter and Leave, so none does once Shutdown has
  // returned: the mappings go with the peer (at Disconnect), not with a unit's closure.
  ~ShmPeer() override { Shutdown(); }

  void Start(const std::shared_ptr<Batch>& batch, std::vector<ReadOp> ops) override {
    if (!imported_->empty()) StartDevice(batch, ops);
    std::uint64_t host_bytes = 0;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (imported_->count(ops[i].remote_region) == 0 && batch->local_kind(i).is_host()) {
        host_bytes += ops[i].length;
      }
    }
    const std::uint64_t unit_limit =
        std::clamp((host_bytes + threads_ - 1) / threads_, kMinUnitBytes, kMaxUnitBytes);
    std::vector<Piece> unit;
    std::uint64_t unit_bytes = 0;
    auto flush = [&] {
      if (unit.empty()) return;
      PostUnit(batch,
               [state = state_, batch, pieces = std::move(unit)](std::uint64_t* bytes) mutable {
                 return ReadPieces(*state, *batch, pieces, bytes);
               });
      unit = {};
      unit_bytes = 0;
    };
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const ReadOp& op = ops[i];
      if (imported_->count(op.remote_region) != 0) continue;  // StartDevice's
      if (!batch->local_kind(i).is_host()) continue;          // StartStaged's
      if (mapped_.count(op.remote_region) != 0) continue;     // StartMapped's
      const std::uint64_t base = regions_.at(op.remote_region).addr + op.remote_offset;
      for (std::uint64_t off = 0; off < op.length;) {
        const std::uint64_t len = std::min(op.length - off, unit_limit - unit_bytes);
        unit.push_back({op.local + off, base + off, len});
        unit_bytes += len;
        off += len;
        if (unit_bytes >= unit_limit || unit.size() >= 4 * kMaxIovPerCall) flush();
      }
    }
    flush();
    if (!mapped_.empty()) StartMapped(batch, ops, unit_limit);
    if (!batch->local_all_host()) StartStaged(batch, ops);
  }

  void Shutdown() override { state_->Shutdown(); }

 private:
  // Runs one unit of `batch` on the pool; `work` adds the bytes it moved. A unit that starts after
  // Shutdown moves nothing and ends PeerDisconnected, as a tcp unit of a disconnected peer does.
  void PostUnit(const std::shared_ptr<Batch>& batch, std::function<Status(std::uint64_t*)> work) {
    batch->AddUnit();
    pool_->Post([state = state_, batch, work = std::move(work)] {
      if (!state->Enter()) {
        batch->UnitDone(Status::PeerDisconnected("the shm peer was disconnected"), 0);
        return;
      }
      std::uint64_t bytes = 0;
      Status s = work(&bytes);
      state->Leave();
      batch->UnitDone(s, bytes);
    });
  }

  // The ops that read the peer's mapped host regions into host memory: units of at most
  // `unit_limit` bytes, each copied with memcpy on the pool between Enter and Leave, so no copy
  // outlives the mappings (~ShmPeer).
  void StartMapped(const std::shared_ptr<Batch>& batch, const std::vector<ReadOp>& ops,
                   std::uint64_t unit_limit) {
    std::vector<CopyPiece> unit;
    std::uint64_t unit_bytes = 0;
    auto flush = [&] {
      if (unit.empty()) return;
      PostUnit(batch, [state = state_, batch, pieces = std::move(unit)](std::uint64_t* bytes) {
        return CopyMapped(*state, *batch, pieces, bytes);
      });
      unit = {};
      unit_bytes = 0;
    };
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const ReadOp& op = ops[i];
      auto it = mapped_.find(op.remote_region);
      if (it == mapped_.end() || !batch->local_kind(i).is_host()) continue;
      const std::byte* base = it->second->data() + op.remote_offset;
      for (std::uint64_t off = 0; off < op.length;) {
        const std::uint64_t len = std::min(op.length - off, unit_limit - unit_bytes);
        unit.push_back({op.local + off, base + off, len});
        unit_bytes += len;
        off += len;
        if (unit_bytes >= unit_limit) flush();
      }
    }
    flush();
  }

  // The ops that read the peer's device regions: units of at most kMaxUnitBytes, each copied on
  // one stream of the importing device.
  void StartDevice(const std::shared_ptr<Batch>& batch, const std::vector<ReadOp>& ops) {
    std::vector<DevicePiece> unit;
    std::uint64_t unit_bytes = 0;
    device::Device* unit_device = nullptr;
    auto flush = [&] {
      if (unit.empty()) return;
      // `imported` keeps the imports mapped while the unit copies from them.
      PostUnit(batch, [state = state_, batch, streams = streams_.at(unit_device),
                       imported = imported_, pieces = std::move(unit)](std::uint64_t* bytes) {
        return CopyPieces([&] { return state->Alive() ? Status::Ok() : PeerGone(state->pid()); },
                          *batch, *streams, pieces, bytes);
      });
      unit = {};
      unit_bytes = 0;
    };
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const ReadOp& op = ops[i];
      auto it = imported_->find(op.remote_region);
      if (it == imported_->end()) continue;
      const ImportedRegion& r = it->second;
      if (unit_device != r.device) flush();
      unit_device = r.device;
      const bool local_host = batch->local_kind(i).is_host();
      for (std::uint64_t off = 0; off < op.length;) {
        const std::uint64_t len = std::min(op.length - off, kMaxUnitBytes - unit_bytes);
        unit.push_back({op.local + off, local_host,
                        r.memory->address(r.offset + op.remote_offset + off), len});
        unit_bytes += len;
        off += len;
        if (unit_bytes >= kMaxUnitBytes) flush();
      }
    }
    flush();
  }

  // The ops that read the peer's host memory into device memory of this process: units of at
  // most kMaxUnitBytes, each staged through one lane (pinned buffers and a stream) of the device.
  void StartStaged(const std::shared_ptr<Batch>& batch, const std::vector<ReadOp>& ops) {
    std::vector<StagedRead> unit;
    std::uint64_t unit_bytes = 0;
    device::Device* unit_device = nullptr;
    auto flush = [&] {
      if (unit.empty()) return;
      PostUnit(batch, [state = state_, batch, lanes = LanesFor(unit_device),
                       pieces = std::move(unit)](std::uint64_t* bytes) {
        const auto read = [&](std::vector<HostRead>& reads, std::uint64_t* n) {
          return ReadPieces(*state, *batch, reads, n);
        };
        return StageToDevice(read, *batch, *lanes, pieces, bytes);
      });
      unit = {};
      unit_bytes = 0;
    };
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const ReadOp& op = ops[i];
      if (imported_->count(op.remote_region) != 0 || batch->local_kind(i).is_host()) continue;
      Result<device::Device*> dev = device::ProcessDevice(batch->local_kind(i).ToString());
      if (!dev.ok()) {
        batch->AddUnit();
        batch->UnitDone(dev.status().WithContext("read " + std::to_string(i)), 0);
        continue;
      }
      if (unit_device != *dev) flush();
      unit_device = *dev;
      const std::uint64_t base = regions_.at(op.remote_region).addr + op.remote_offset;
      for (std::uint64_t off = 0; off < op.length;) {
        const std::uint64_t len = std::min(op.length - off, kMaxUnitBytes - unit_bytes);
        unit.push_back({reinterpret_cast<device::DeviceAddress>(op.local) + off, base + off, len});
        unit_bytes += len;
        off += len;
        if (unit_bytes >= kMaxUnitBytes) flush();
      }
    }
    flush();
  }

  std::shared_ptr<StagingLanes> LanesFor(device::Device* dev) EXCLUDES(lanes_mu_) {
    MutexLock lock(lanes_mu_);
    std::shared_ptr<StagingLanes>& lanes = lanes_[dev];
    if (!lanes) lanes = std::make_shared<StagingLanes>(dev, staging_gauge_);
    return lanes;
  }

  const std::uint64_t threads_;  // of pool_: a batch is split into at least this many units
  std::shared_ptr<std::atomic<std::uint64_t>> staging_gauge_;  // the backend's staging_bytes
  std::shared_ptr<ShmPeerState> state_;
  RemoteRegionTable regions_;
  std::shared_ptr<WorkQueue> pool_;
  // Shared with running units: the imports stay mapped while a unit copies from them.
  std::shared_ptr<const std::map<RegionId, ImportedRegion>> imported_;
  // Host regions mapped read-only (served_memory.h); unmapped when the peer goes (~ShmPeer).
  const MappedRegions mapped_;
  std::map<device::Device*, std::shared_ptr<StreamPool>> streams_;
  Mutex lanes_mu_;
  std::map<device::Device*, std::shared_ptr<StagingLanes>> lanes_ GUARDED_BY(lanes_mu_);
};

}  // namespace

Status ProveShmInstance(const ShmPeerState& peer, const ShmProof& proof) {
  const pid_t pid = peer.pid();
  std::uint64_t nonce = 0;
  iovec local{&nonce, sizeof(nonce)};
  // An address in the peer's address space, never dereferenced here.
  iovec remote{reinterpret_cast<void*>(proof.nonce_addr),  // NOLINT(performance-no-int-to-ptr)
               sizeof(nonce)};
  const ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
  if (n != static_cast<ssize_t>(sizeof(nonce))) {
    const int err = n < 0 ? errno : 0;
    if (err == EPERM) return Status::Unavailable(ShmBackend::RefusedReadText(pid));
    if (err == ESRCH || !peer.Alive()) return PeerGone(pid);
    return Status::PeerDisconnected(
        "process " + std::to_string(pid) + " has no readable instance nonce at " +
        Hex(proof.nonce_addr) + " (" + (n < 0 ? ErrnoText(err) : std::string("short read")) +
        "): it is not the process that wrote the descriptor; get a new descriptor");
  }
  if (nonce != proof.nonce) {
    return Status::PeerDisconnected(
        "the instance nonce of process " + std::to_string(pid) +
        " differs from the descriptor's: it is not the process that wrote the descriptor (a "
        "restarted instance that got the same pid); get a new descriptor");
  }
  if (!peer.Alive()) return PeerGone(pid);
  return Status::Ok();
}

std::unique_ptr<BackendPeer> MakeShmPeer(
    std::shared_ptr<ShmPeerState> state, RemoteRegionTable regions, std::shared_ptr<WorkQueue> pool,
    int threads, std::map<RegionId, ImportedRegion> imported,
    std::map<RegionId, std::unique_ptr<const MappedRegion>> mapped,
    std::shared_ptr<std::atomic<std::uint64_t>> staging_gauge) {
  return std::make_unique<ShmPeer>(std::move(state), std::move(regions), std::move(pool), threads,
                                   std::move(imported), std::move(mapped),
                                   std::move(staging_gauge));
}

}  // namespace kvferry
