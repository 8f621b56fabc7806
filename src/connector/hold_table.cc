#include "connector/hold_table.h"

#include <algorithm>
#include <utility>

#include "common/log.h"

namespace kvferry {

HoldTable::HoldTable(HoldLimits limits, std::function<int(std::uint32_t)> expected_readers)
    : limits_(limits), expected_readers_(std::move(expected_readers)) {}

void HoldTable::Hold(const std::string& request_id, std::chrono::milliseconds lease,
                     Clock::time_point now, const std::string& key) {
  const std::string& id = key.empty() ? request_id : key;
  if (holds_.count(id) != 0) return;
  Held& h = holds_[id];
  h.id = request_id;
  h.expiry = now + std::min(lease, limits_.max_lease);
  auto early = early_.find(id);
  if (early == early_.end()) return;
  const bool aborted = early->second.aborted;
  h.readers = std::move(early->second.readers);
  if (early->second.reader_tp > 0) {
    h.expected =
        expected_readers_(early->second.reader_tp) * static_cast<int>(early->second.pp_readers);
  }
  early_.erase(early);
  if (aborted) {
    Release(id, &by_abort_);
    return;
  }
  TryComplete(id);
}

HoldTable::Early* HoldTable::EarlyFor(const std::string& id, Clock::time_point now) {
  auto it = early_.find(id);
  if (it == early_.end()) {
    if (early_.size() >= limits_.max_early) {
      ++early_refused_;
      return nullptr;
    }
    it = early_.emplace(id, Early{}).first;
  }
  it->second.expiry = now + limits_.early_ttl;
  return &it->second;
}

Status HoldTable::EarlyTableFull(const char* kind, std::size_t refused, std::size_t total) const {
  return Status::ResourceExhausted(
      std::to_string(refused) + " of " + std::to_string(total) + " " + kind +
      " notices name requests this worker does not hold, and its "
      "table of early notices is full (" +
      std::to_string(limits_.max_early) + "); their holds end by lease");
}

Result<std::uint32_t> HoldTable::Finished(const std::string& reader, std::uint32_t reader_tp,
                                          std::span<const std::string> ids, Clock::time_point now,
                                          std::uint32_t pp_readers) {
  std::uint32_t applied = 0;
  std::size_t refused = 0;
  std::string stale;
  for (const std::string& id : ids) {
    auto it = holds_.find(id);
    if (it != holds_.end()) {
      it->second.readers.insert(reader);
      if (it->second.expected < 0) {
        it->second.expected = expected_readers_(reader_tp) * static_cast<int>(pp_readers);
      }
      TryComplete(id);
      ++applied;
      continue;
    }
    if (ended_.count(id) != 0) {
      if (stale.empty()) stale = id;
      continue;
    }
    // Rule 10: a notice that arrives before its hold is kept, not lost (up to the cap).
    Early* e = EarlyFor(id, now);
    if (e == nullptr) {
      ++refused;
      continue;
    }
    e->readers.insert(reader);
    e->reader_tp = reader_tp;
    e->pp_readers = pp_readers;
    ++applied;
  }
  if (!stale.empty()) {
    return Status::NotFound("the hold of request " + stale +
                            " had ended (its lease expired, or it was aborted) before reader " +
                            reader +
                            " reported it: its blocks may have been reused while they "
                            "were read, so the bytes read must not be used; recompute them");
  }
  if (refused > 0) return EarlyTableFull("finished", refused, ids.size());
  return applied;
}

Result<std::uint32_t> HoldTable::Aborted(std::span<const std::string> ids, Clock::time_point now) {
  std::uint32_t applied = 0;
  std::size_t refused = 0;
  for (const std::string& id : ids) {
    if (holds_.count(id) != 0) {
      Release(id, &by_abort_);
      ++applied;
      continue;
    }
    Early* e = EarlyFor(id, now);
    if (e == nullptr) {
      ++refused;
      continue;
    }
    e->aborted = true;
    ++applied;
  }
  if (refused > 0) return EarlyTableFull("abort", refused, ids.size());
  return applied;
}

std::uint32_t HoldTable::Renew(std::span<const std::string> ids, std::chrono::milliseconds lease,
                               Clock::time_point now) {
  std::uint32_t renewed = 0;
  const Clock::time_point until = now + std::min(lease, limits_.max_lease);
  for (const std::string& id : ids) {
    auto it = holds_.find(id);
    if (it == holds_.end()) continue;
    it->second.expiry = std::max(it->second.expiry, until);
    ++renewed;
  }
  return renewed;
}

void HoldTable::Expire(Clock::time_point now) {
  for (auto it = holds_.begin(); it != holds_.end();) {
    auto next = std::next(it);
    if (it->second.expiry <= now) {
      if (it->second.expected < 0) {
        Log().warn(
            "request {}: hold released after its lease expired with no reader heard from; the "
            "decode side never loaded it (request abandoned, or the decode instance is gone)",
            it->first);
      } else {
        Log().warn(
            "request {}: hold released after its lease expired with {} of {} readers reported; "
            "the decode side is gone or stopped renewing",
            it->first, it->second.readers.size(), it->second.expected);
      }
      Release(it->first, &expired_);
    }
    it = next;
  }
  for (auto it = early_.begin(); it != early_.end();) {
    it = it->second.expiry <= now ? early_.erase(it) : std::next(it);
  }
}

std::vector<std::string> HoldTable::TakeReleased() {
  std::vector<std::string> out;
  out.swap(released_);
  return out;
}

void HoldTable::TryComplete(const std::string& id) {
  auto it = holds_.find(id);
  if (it == holds_.end() || it->second.expected < 0) return;
  if (static_cast<int>(it->second.readers.size()) >= it->second.expected) {
    Release(id, &by_readers_);
  }
}

std::vector<std::string> HoldTable::TakeReleasedKeys() {
  std::vector<std::string> out;
  out.swap(released_keys_);
  return out;
}

void HoldTable::Invalidate(const std::string& key) {
  if (holds_.count(key) != 0) {
    Release(key, &by_abort_);
    return;
  }
  early_.erase(key);
  RememberEnded(key);
}

void HoldTable::RememberEnded(const std::string& key) {
  if (!ended_.insert(key).second) return;
  ended_order_.push_back(key);
  if (ended_order_.size() > 65536) {
    ended_.erase(ended_order_.front());
    ended_order_.pop_front();
  }
}

void HoldTable::Release(const std::string& id, std::uint64_t* counter) {
  // A copy: callers may pass the key of the very entry erased here.
  std::string key = id;
  auto it = holds_.find(key);
  std::string request_id = it != holds_.end() ? std::move(it->second.id) : key;
  holds_.erase(key);
  if (counter != &by_readers_) RememberEnded(key);
  released_.push_back(std::move(request_id));
  released_keys_.push_back(std::move(key));
  ++*counter;
}

}  // namespace kvferry
