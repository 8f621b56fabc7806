// The simulated device: device memory that host code cannot touch, for tests on machines without
// an accelerator (docs/device.md, "The sim device").
//
// Each allocation is a memfd. Its device address is a PROT_NONE reservation of the same size, so a
// host load or store through a sim address faults (SIGSEGV). The memfd is also mapped read-write at
// a second, private address that only the sim's own copy functions use. IPC passes the memfd to
// another process of the same user through /proc/<pid>/fd/<fd>.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "device/device.h"

namespace kvferry::device {

struct SimOptions {
  int index = 0;  ///< the N of "sim:N"; a label, every SimDevice is independent
  /// Added to every copy (0: none), to make pipelining visible in benchmarks.
  std::chrono::nanoseconds copy_latency{0};
  /// Per-stream copy bandwidth in bytes per second (0: as fast as memcpy).
  double bytes_per_second = 0;
};

class SimTable;  // sim_device.cc: the device's allocations and imports

class SimDevice final : public Device {
 public:
  static Result<std::unique_ptr<SimDevice>> Create(SimOptions options);
  ~SimDevice() override;

  const std::string& name() const override { return name_; }
  std::string_view kind() const override { return "sim"; }
  int index() const override { return options_.index; }

  Result<PointerInfo> Query(DeviceAddress address) const override;
  Result<std::unique_ptr<DeviceAllocation>> Allocate(std::uint64_t size) override;
  Result<std::unique_ptr<PinnedBuffer>> AllocatePinned(std::uint64_t size) override;
  /// The handle names this process, the memfd's descriptor number and its inode; it is valid while
  /// the allocation lives. Importing needs the same user (ptrace read access to this process).
  Result<IpcHandle> ExportIpc(DeviceAddress address) override;
  Result<std::unique_ptr<ImportedMemory>> ImportIpc(const IpcHandle& handle) override;
  /// A stream is one thread that runs its copies in order.
  Result<std::unique_ptr<Stream>> CreateStream() override;
  /// On one of this device's streams, by its native_handle().
  Result<std::unique_ptr<Event>> RecordEventOn(std::uint64_t native_stream) override;

  /// Bytes of pinned buffers alive now, and the most alive at once since the device was created or
  /// ResetPinnedPeak was last called: what tests check staging bounds with.
  std::uint64_t pinned_bytes() const;
  std::uint64_t pinned_peak_bytes() const;
  void ResetPinnedPeak();

 private:
  SimDevice(SimOptions options, std::shared_ptr<SimTable> table);

  const SimOptions options_;
  const std::string name_;
  std::shared_ptr<SimTable> table_;
};

}  // namespace kvferry::device
