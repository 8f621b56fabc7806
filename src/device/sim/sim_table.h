// The sim device's memory: mappings (allocations and imports) by device address. Internal to
// src/device/sim/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "common/mutex.h"
#include "device/device.h"

namespace kvferry::device {

// One memfd seen two ways: `base` is a PROT_NONE reservation (the device address), `backing` a
// read-write shared mapping of the same memfd that only the sim's copies use. Owns the fd and both
// mappings; streams hold a shared_ptr so a copy in flight keeps its memory mapped.
struct SimMapping {
  SimMapping() = default;
  SimMapping(const SimMapping&) = delete;
  SimMapping& operator=(const SimMapping&) = delete;
  ~SimMapping();

  DeviceAddress base = 0;
  std::uint64_t size = 0;         // bytes the caller asked for
  std::uint64_t mapped_size = 0;  // size rounded up to pages
  std::byte* backing = nullptr;
  int fd = -1;
};

// Maps a memfd of `size` bytes at a PROT_NONE reservation and a private read-write address. Takes
// ownership of `fd` (closed on error too).
Result<std::shared_ptr<SimMapping>> MapSimMemory(int fd, std::uint64_t size);

// A resolved device range: the mapping that holds it and the backing address of its first byte.
struct SimRange {
  std::shared_ptr<SimMapping> mapping;
  std::byte* backing = nullptr;
};

// The device's mappings. Thread-safe.
class SimTable {
 public:
  explicit SimTable(std::string device_name) : device_name_(std::move(device_name)) {}
  const std::string& device_name() const { return device_name_; }

  void Insert(std::shared_ptr<SimMapping> mapping) EXCLUDES(mu_);
  void Erase(DeviceAddress base) EXCLUDES(mu_);
  // The mapping that holds [address, address + size), or InvalidArgument saying what was found.
  Result<SimRange> Resolve(DeviceAddress address, std::uint64_t size, const char* what) const
      EXCLUDES(mu_);
  // The mapping that holds `address`, or null.
  std::shared_ptr<SimMapping> Find(DeviceAddress address) const EXCLUDES(mu_);

  // Pinned buffers alive: bytes now and the most at once since the last ResetPinnedPeak.
  void PinnedAdded(std::uint64_t bytes) EXCLUDES(mu_);
  void PinnedFreed(std::uint64_t bytes) EXCLUDES(mu_);
  std::uint64_t pinned_bytes() const EXCLUDES(mu_);
  std::uint64_t pinned_peak_bytes() const EXCLUDES(mu_);
  void ResetPinnedPeak() EXCLUDES(mu_);

  // The device's live streams by native handle, for RecordEventOn. A stream adds itself when it
  // starts and removes itself before it stops.
  void AddStream(std::uint64_t handle, Stream* stream) EXCLUDES(mu_);
  void RemoveStream(std::uint64_t handle) EXCLUDES(mu_);
  // RecordEvent on the stream `handle` names, under the table's lock so it cannot go meanwhile.
  Result<std::unique_ptr<Event>> RecordOn(std::uint64_t handle) EXCLUDES(mu_);

 private:
  const std::string device_name_;
  mutable Mutex mu_;
  std::map<DeviceAddress, std::shared_ptr<SimMapping>> by_base_ GUARDED_BY(mu_);
  std::uint64_t pinned_ GUARDED_BY(mu_) = 0;
  std::uint64_t pinned_peak_ GUARDED_BY(mu_) = 0;
  std::map<std::uint64_t, Stream*> streams_ GUARDED_BY(mu_);
};

struct SimOptions;
// A stream of the sim device (sim_stream.cc).
Result<std::unique_ptr<Stream>> CreateSimStream(std::shared_ptr<SimTable> table,
                                                const SimOptions& options);

}  // namespace kvferry::device
