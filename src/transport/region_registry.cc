#include "transport/region_registry.h"

#include <string>

namespace kvferry {

RegionPin& RegionPin::operator=(RegionPin&& other) noexcept {
  if (this != &other) {
    if (registry_ != nullptr) registry_->Unpin(id_);
    registry_ = other.registry_;
    id_ = other.id_;
    kind_ = other.kind_;
    other.registry_ = nullptr;
  }
  return *this;
}

RegionPin::~RegionPin() {
  if (registry_ != nullptr) registry_->Unpin(id_);
}

Status RegionRegistry::Add(RegionId id, void* addr, std::size_t length, MemoryKind kind) {
  if (addr == nullptr || length == 0) {
    return Status::InvalidArgument("region " + std::to_string(id) +
                                   ": expected a non-null address and a positive length");
  }
  const auto begin = reinterpret_cast<std::uintptr_t>(addr);
  if (begin + length < begin) {
    return Status::InvalidArgument("region " + std::to_string(id) + " wraps the address space");
  }
  MutexLock lock(mu_);
  if (regions_.count(id) != 0) {
    return Status::InvalidArgument("region id " + std::to_string(id) +
                                   " is already registered; deregister it first");
  }
  // The same bytes under a second id (an alias): KV cache groups that share a tensor, as
  // vLLM's hybrid models do (one tensor per layer of every group). Lookups by address find the
  // first id; reads name either.
  if (auto same = by_addr_.find(begin); same != by_addr_.end()) {
    const RegionInfo& s = regions_.at(same->second).info;
    if (s.length == length && s.kind == kind) {
      regions_[id] = Entry{{id, static_cast<std::byte*>(addr), length, std::move(kind)}, 0, false};
      return Status::Ok();
    }
  }
  // Overlap with the neighbours on either side.
  auto next = by_addr_.lower_bound(begin);
  if (next != by_addr_.end() && next->first < begin + length) {
    return Status::InvalidArgument("region " + std::to_string(id) + " overlaps region " +
                                   std::to_string(next->second));
  }
  if (next != by_addr_.begin()) {
    auto prev = std::prev(next);
    const RegionInfo& p = regions_.at(prev->second).info;
    if (prev->first + p.length > begin) {
      return Status::InvalidArgument("region " + std::to_string(id) + " overlaps region " +
                                     std::to_string(prev->second));
    }
  }
  regions_[id] = Entry{{id, static_cast<std::byte*>(addr), length, std::move(kind)}, 0, false};
  by_addr_[begin] = id;
  return Status::Ok();
}

Status RegionRegistry::Remove(RegionId id, const std::function<void(RegionId)>& revoke) {
  UniqueLock lock(mu_);
  auto it = regions_.find(id);
  if (it == regions_.end() || it->second.removing) {
    return Status::NotFound("region " + std::to_string(id) + " is not registered");
  }
  it->second.removing = true;
  const auto addr = reinterpret_cast<std::uintptr_t>(it->second.info.addr);
  if (auto listed = by_addr_.find(addr); listed != by_addr_.end() && listed->second == id) {
    by_addr_.erase(listed);
    // An alias of the same bytes takes its place.
    for (const auto& [other, e] : regions_) {
      if (other != id && !e.removing && reinterpret_cast<std::uintptr_t>(e.info.addr) == addr) {
        by_addr_[addr] = other;
        break;
      }
    }
  }
  if (revoke) {
    lock.Unlock();
    revoke(id);
    lock.Lock();
  }
  // Pins are held by reads; `revoke` ends them early, and every read ends by its batch's
  // deadline in any case, so this wait ends.
  while (regions_.at(id).pins != 0) unpinned_.Wait(mu_);
  regions_.erase(id);
  return Status::Ok();
}

std::vector<RegionInfo> RegionRegistry::List() const {
  MutexLock lock(mu_);
  std::vector<RegionInfo> out;
  for (const auto& [id, e] : regions_) {
    if (!e.removing) out.push_back(e.info);
  }
  return out;
}

Result<RegionPin> RegionRegistry::PinLocal(const std::byte* p, std::uint64_t length) {
  const auto begin = reinterpret_cast<std::uintptr_t>(p);
  MutexLock lock(mu_);
  auto it = by_addr_.upper_bound(begin);
  if (it != by_addr_.begin()) {
    --it;
    Entry& e = regions_.at(it->second);
    if (begin - it->first <= e.info.length && length <= e.info.length - (begin - it->first)) {
      ++e.pins;
      return RegionPin(this, e.info.id, &e.info.kind);
    }
  }
  return Status::InvalidArgument("local destination of " + std::to_string(length) +
                                 " bytes is not inside a registered region; register the "
                                 "destination memory before reading into it");
}

Result<std::byte*> RegionRegistry::PinRange(RegionId id, std::uint64_t offset, std::uint64_t length,
                                            RegionPin* pin) {
  std::byte* where = nullptr;
  const MemoryKind* kind = nullptr;
  {
    MutexLock lock(mu_);
    auto it = regions_.find(id);
    if (it == regions_.end() || it->second.removing) {
      return Status::InvalidArgument("region " + std::to_string(id) + " is not registered here");
    }
    Entry& e = it->second;
    if (offset > e.info.length || length > e.info.length - offset) {
      return Status::InvalidArgument("read of " + std::to_string(length) + " bytes at offset " +
                                     std::to_string(offset) + " is outside region " +
                                     std::to_string(id) + " of " + std::to_string(e.info.length) +
                                     " bytes");
    }
    ++e.pins;
    where = e.info.addr + offset;
    kind = &e.info.kind;
  }
  // Outside the lock: a pin `*pin` held before is dropped here, and dropping takes the lock.
  *pin = RegionPin(this, id, kind);
  return where;
}

void RegionRegistry::Unpin(RegionId id) {
  MutexLock lock(mu_);
  auto it = regions_.find(id);
  if (it != regions_.end() && --it->second.pins == 0) unpinned_.SignalAll();
}

}  // namespace kvferry
