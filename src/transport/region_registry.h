// The memory regions one transport registered: lookup, range checks, and pins that keep a region
// registered while a read serves from it or lands in it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "common/mutex.h"
#include "kvferry/status.h"
#include "kvferry/transport.h"

namespace kvferry {

struct RegionInfo {
  RegionId id = 0;
  std::byte* addr = nullptr;
  std::uint64_t length = 0;
  MemoryKind kind;
};

class RegionRegistry;

/// Keeps one region registered while alive. Move-only.
class RegionPin {
 public:
  RegionPin() = default;
  RegionPin(RegionPin&& other) noexcept
      : registry_(other.registry_), id_(other.id_), kind_(other.kind_) {
    other.registry_ = nullptr;
  }
  RegionPin& operator=(RegionPin&& other) noexcept;
  RegionPin(const RegionPin&) = delete;
  RegionPin& operator=(const RegionPin&) = delete;
  ~RegionPin();

  /// The pinned region; meaningful while the pin is held.
  RegionId region() const { return id_; }
  /// The pinned region's memory kind; valid while the pin is held.
  const MemoryKind& kind() const { return *kind_; }

 private:
  friend class RegionRegistry;
  RegionPin(RegionRegistry* registry, RegionId id, const MemoryKind* kind)
      : registry_(registry), id_(id), kind_(kind) {}
  RegionRegistry* registry_ = nullptr;
  RegionId id_ = 0;
  const MemoryKind* kind_ = nullptr;  // in the registry's entry, which a pin keeps listed
};

/// Thread-safe.
class RegionRegistry {
 public:
  Status Add(RegionId id, void* addr, std::size_t length, MemoryKind kind = MemoryKind::Host())
      EXCLUDES(mu_);
  /// Unlists the region at once (new pins fail), calls `revoke(id)` (without the registry's
  /// lock) so that the holders of its pins can end their reads early, then waits until its pins
  /// are gone. The wait is as long as the slowest holder takes to react to `revoke`.
  Status Remove(RegionId id, const std::function<void(RegionId)>& revoke = nullptr) EXCLUDES(mu_);
  std::vector<RegionInfo> List() const EXCLUDES(mu_);

  /// Pins the region that contains [p, p + length) entirely; InvalidArgument if none does.
  Result<RegionPin> PinLocal(const std::byte* p, std::uint64_t length) EXCLUDES(mu_);
  /// Pins region `id` for a read of [offset, offset + length); returns where those bytes are.
  /// `*pin` receives the pin (one it held before is dropped); it is left as it was on error.
  Result<std::byte*> PinRange(RegionId id, std::uint64_t offset, std::uint64_t length,
                              RegionPin* pin) EXCLUDES(mu_);

 private:
  friend class RegionPin;
  struct Entry {
    RegionInfo info;
    int pins = 0;
    bool removing = false;
  };
  void Unpin(RegionId id) EXCLUDES(mu_);

  mutable Mutex mu_;
  CondVar unpinned_;
  std::map<RegionId, Entry> regions_ GUARDED_BY(mu_);
  std::map<std::uintptr_t, RegionId> by_addr_ GUARDED_BY(mu_);  // listed regions only
};

}  // namespace kvferry
