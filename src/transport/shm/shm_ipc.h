// shm's path to a same-host peer's device memory (docs/device.md, "The IPC path"): the serving
// side exports its device regions' IPC handles in its shm section; the reader opens each
// allocation once and copies from it on its own streams of that device.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "common/mutex.h"
#include "device/device.h"
#include "transport/batch.h"
#include "transport/descriptor.h"
#include "transport/region_registry.h"
#include "transport/shm/shm_section.h"

namespace kvferry {

// A peer's device region opened through its IPC handle: copies read it on `device`'s streams.
struct ImportedRegion {
  device::Device* device = nullptr;
  std::shared_ptr<device::ImportedMemory> memory;  // shared by the regions of one allocation
  std::uint64_t offset = 0;                        // of the region's first byte in `memory`
};

// Streams of one device, reused by the units of one peer (a stream is used by one unit at a
// time). Thread-safe.
class StreamPool {
 public:
  explicit StreamPool(device::Device* device) : device_(device) {}
  Result<std::unique_ptr<device::Stream>> Take() EXCLUDES(mu_);
  void Give(std::unique_ptr<device::Stream> s) EXCLUDES(mu_);

 private:
  device::Device* device_;
  Mutex mu_;
  std::vector<std::unique_ptr<device::Stream>> idle_ GUARDED_BY(mu_);
};

struct DevicePiece {
  std::byte* local;  // host pointer, or a device address of the same device
  bool local_host;
  device::DeviceAddress remote;
  std::uint64_t length;
};

/// A read of the peer's host memory (process_vm_readv) into host memory of this process.
struct HostRead {
  std::byte* local;
  std::uint64_t remote_addr;  // in the peer's address space
  std::uint64_t length;
};

/// A read of the peer's host memory into device memory of this process.
struct StagedRead {
  device::DeviceAddress local;
  std::uint64_t remote_addr;  // in the peer's address space
  std::uint64_t length;
};

/// What a unit that stages host memory into a device holds: a stream and two pinned buffers of
/// StagingLanes::kBufferBytes.
struct StagingLane {
  explicit StagingLane(std::atomic<std::uint64_t>* counter) : gauge(counter) {}
  StagingLane(const StagingLane&) = delete;
  StagingLane& operator=(const StagingLane&) = delete;
  ~StagingLane() {
    for (const auto& b : buffers) {
      if (b) gauge->fetch_sub(b->size());
    }
  }
  std::atomic<std::uint64_t>* gauge;  // the pinned bytes lanes hold (TransportStats)
  std::unique_ptr<device::Stream> stream;
  std::unique_ptr<device::PinnedBuffer> buffers[2];
};

/// Lanes of one device, reused by the units of one peer (one unit holds one lane at a time, so
/// staging memory is bounded by 2 * kBufferBytes per unit running). Thread-safe.
class StagingLanes {
 public:
  static constexpr std::uint64_t kBufferBytes = std::uint64_t{2} << 20;
  /// `gauge` counts the pinned bytes of its lanes (a lane taken out must end before the lanes).
  StagingLanes(device::Device* device, std::shared_ptr<std::atomic<std::uint64_t>> gauge)
      : device_(device), gauge_(std::move(gauge)) {}
  Result<std::unique_ptr<StagingLane>> Take() EXCLUDES(mu_);
  void Give(std::unique_ptr<StagingLane> lane) EXCLUDES(mu_);

 private:
  device::Device* device_;
  std::shared_ptr<std::atomic<std::uint64_t>> gauge_;
  Mutex mu_;
  std::vector<std::unique_ptr<StagingLane>> idle_ GUARDED_BY(mu_);
};

/// Reads `pieces` of the peer's host memory into device memory: each buffer's worth through
/// `read` (process_vm_readv into a pinned buffer) and then a host-to-device copy on the lane's
/// stream, the next buffer read while the last one copies. Stops between buffers when the batch
/// stops; every copy issued has ended when this returns (at most 10 s of waiting, else Internal
/// and the lane is dropped without freeing what a copy may still read).
Status StageToDevice(const std::function<Status(std::vector<HostRead>&, std::uint64_t*)>& read,
                     const Batch& batch, StagingLanes& lanes, const std::vector<StagedRead>& pieces,
                     std::uint64_t* bytes);

/// The IPC handles of this process's device regions (`regions`), for its shm section. A region
/// that cannot be exported (NotSupported, e.g. VMM) is left out and logged: readers then use tcp.
std::vector<ShmIpcRegion> ExportDeviceRegions(const std::vector<RegionInfo>& regions);

/// Opens the peer's handles (each allocation once) in this process's instance of the device each
/// region names. InvalidArgument for a handle that does not match its region; Unavailable when a
/// device or a handle does not open (shm then cannot read this peer).
Result<std::map<RegionId, ImportedRegion>> ImportPeerRegions(const std::vector<ShmIpcRegion>& ipc,
                                                             const RemoteRegionTable& regions);

/// Copies every piece on one stream and waits for them, in slices, so that a batch that stops
/// (cancel, deadline, another unit's failure) is seen; it then waits for the copies already
/// issued (at most 10 s) so that none writes after the unit ends. `alive` says whether the
/// exporting process still runs (its error otherwise), checked before and after the copies.
Status CopyPieces(const std::function<Status()>& alive, const Batch& batch, StreamPool& streams,
                  const std::vector<DevicePiece>& pieces, std::uint64_t* bytes);

}  // namespace kvferry
