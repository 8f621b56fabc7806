// The ucx backend's state on its progress thread (ucx_worker.h): this process's registered
// regions mapped with ucp_mem_map, and per connected peer an endpoint, its unpacked remote keys
// and the units of work whose gets run on it. Reads are ucp_get_nbx straight into the destination
// (or, on an endpoint without peer error handling, into a staging buffer; see UcxPeerState), at
// most `max_inflight` per peer, split into gets of at most `chunk_bytes`.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/mutex.h"
#include "transport/batch.h"
#include "transport/descriptor.h"
#include "transport/region_registry.h"
#include "transport/ucx/ucx_peer.h"
#include "transport/ucx/ucx_section.h"
#include "transport/ucx/ucx_worker.h"

namespace kvferry {

/// The ucx backend's options (docs/transport.md, "Options").
struct UcxOptions {
  /// Gets in flight per peer at most (ucx.max_inflight).
  std::uint64_t max_inflight = 64;
  /// Bytes per get at most (ucx.chunk_bytes): a stopped batch waits for at most this much.
  std::uint64_t chunk_bytes = 1u << 20;
};

/// Whether the ucx backend maps and reads memory of `kind`, given `memory_types`, the memory types
/// the loaded UCX supports (ucp_context_query, a bit per ucs_memory_type_t): host memory always;
/// "cuda" memory only where that UCX was built with CUDA (bit UCS_MEMORY_TYPE_CUDA; Debian's is
/// not); the sim device's memory, and any other kind, never (sim addresses are PROT_NONE to every
/// reader but the sim device, UCX included).
bool UcxReadsKind(std::uint64_t memory_types, const MemoryKind& kind);
/// Backend::CanRead of the ucx backend: both kinds UcxReadsKind.
bool UcxCanRead(std::uint64_t memory_types, const MemoryKind& remote, const MemoryKind& local);
/// The UCS memory type of a kind UcxReadsKind accepts (host or cuda).
ucs_memory_type_t UcxMemoryType(const MemoryKind& kind);

class UcxPeerState;

/// Thread-safe: every member hands its work to the progress thread.
class UcxEngine {
 public:
  /// `self` and `start_time`: this process's identity and start time, for its section.
  static Result<std::unique_ptr<UcxEngine>> Create(const UcxOptions& options, HostIdentity self,
                                                   std::uint64_t start_time);
  /// Stops the progress thread; every peer must have been shut down (ShutdownPeer) before.
  ~UcxEngine();
  UcxEngine(const UcxEngine&) = delete;
  UcxEngine& operator=(const UcxEngine&) = delete;

  /// The memory types the loaded UCX supports (UcxReadsKind). Any thread.
  std::uint64_t memory_types() const { return worker_->memory_types(); }

  /// This process's section: maps the regions of `regions` whose kind UCX reads (UcxReadsKind)
  /// and that are not mapped yet (ucp_mem_map, with the region's memory type),
  /// unmaps those gone, and packs the worker address and each region's rkey. Empty (nothing to
  /// publish) only when the progress thread did not answer in time (logged).
  std::vector<std::uint8_t> Section(const std::vector<RegionInfo>& regions);
  /// Unmaps region `id` if it is mapped: peers can no longer read it through its rkey (over
  /// transports with hardware RMA; see docs/transport.md, "ucx", on emulated gets).
  void Unmap(RegionId id);

  /// Creates an endpoint to the worker of `section` and unpacks its keys; on the same host
  /// (boot id and PID namespace) first proves the peer process (PeerProcess::Prove, whose errors
  /// it returns), keeping its pidfd to watch the peer.
  Result<std::shared_ptr<UcxPeerState>> Connect(const UcxSection& section,
                                                const RemoteRegionTable& regions,
                                                Deadline deadline);
  /// Starts `ops` of `batch` on `peer` as one unit (BackendPeer::Start's contract).
  void Start(const std::shared_ptr<UcxPeerState>& peer, const std::shared_ptr<Batch>& batch,
             const std::vector<ReadOp>& ops);
  /// Ends every unit of `peer` (PeerDisconnected) and returns once none runs.
  void ShutdownPeer(const std::shared_ptr<UcxPeerState>& peer);

 private:
  UcxEngine(const UcxOptions& options, HostIdentity self, std::uint64_t start_time)
      : options_(options), self_(std::move(self)), start_time_(start_time) {}

  struct Mapping {
    std::byte* addr = nullptr;
    std::uint64_t length = 0;
    ucp_mem_h memh = nullptr;
    std::vector<std::uint8_t> rkey;
  };

  // Progress thread only.
  void Tick(ucp_worker_h worker);
  void StopAll(ucp_worker_h worker);
  Result<Mapping> Map(const RegionInfo& region);
  void UnmapOnThread(RegionId id);

  const UcxOptions options_;
  const HostIdentity self_;
  const std::uint64_t start_time_;
  // Progress thread only (the worker's closures and hooks).
  std::map<RegionId, Mapping> mapped_;
  std::list<std::shared_ptr<UcxPeerState>> peers_;
  ucp_context_h context_ = nullptr;  // worker_'s, usable while worker_ is destroyed
  // Last: destroyed first, which stops the thread before the state above goes.
  std::unique_ptr<UcxWorker> worker_;
};

}  // namespace kvferry
