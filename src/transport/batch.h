// A batch of reads split into units of work that backends carry out on their own threads. The
// batch ends exactly once, when its last unit has finished, so "ended" always means that no read
// of it runs any more.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "kvferry/transport.h"
#include "transport/region_registry.h"

namespace kvferry {

class Batch {
 public:
  /// `on_end` runs once, on the thread that finishes the last unit, without the batch's lock.
  Batch(BatchId id, Deadline deadline, std::vector<RegionPin> pins,
        std::function<void(const BatchResult&, std::uint64_t bytes)> on_end);

  BatchId id() const { return id_; }
  Deadline deadline() const { return deadline_; }

  /// Backends call AddUnit once per unit before starting it, then Seal once all are added.
  void AddUnit();
  void Seal();
  /// A unit finished; `status` is OK if all its bytes arrived.
  void UnitDone(const Status& status, std::uint64_t bytes);

  /// True once units should stop early: cancelled, another unit failed, or the deadline passed.
  bool ShouldStop() const;
  /// The status a unit that stops early reports.
  Status StopStatus() const;

  /// Asks the units to stop and waits until they all have; the batch then ends as cancelled
  /// unless it had already ended.
  void Cancel();
  /// Fails the batch with `status` (for example the peer died) and waits as Cancel does.
  void Fail(const Status& status);

  /// The memory kind of the local region read `op` (in SubmitReads order) lands in; host for a
  /// batch made without pins (tests).
  MemoryKind local_kind(std::size_t op) const {
    return op < local_kinds_.size() ? local_kinds_[op] : MemoryKind::Host();
  }
  /// True when every read lands in host memory.
  bool local_all_host() const { return local_all_host_; }

  /// True while the batch runs and one of its reads lands in region `id`.
  bool PinsRegion(RegionId id) const;

  BatchResult Current() const;
  BatchResult WaitEnd(Deadline deadline) const;

 private:
  void StopWith(const Status& status);
  void MaybeEnd(std::unique_lock<std::mutex> lock);

  const BatchId id_;
  const Deadline deadline_;
  std::vector<MemoryKind> local_kinds_;  // one per read; set by the constructor
  bool local_all_host_ = true;
  std::function<void(const BatchResult&, std::uint64_t)> on_end_;

  mutable std::mutex mu_;
  mutable std::condition_variable ended_cv_;
  std::atomic<bool> stop_{false};
  int outstanding_ = 0;          // guarded by mu_
  bool sealed_ = false;          // guarded by mu_
  bool ended_ = false;           // outcome decided; guarded by mu_
  bool announced_ = false;       // outcome visible to waiters, after on_end_; guarded by mu_
  bool cancelled_ = false;       // guarded by mu_
  Status first_error_;           // guarded by mu_
  std::uint64_t bytes_ = 0;      // guarded by mu_
  BatchResult result_;           // guarded by mu_
  std::vector<RegionPin> pins_;  // released when the batch ends; guarded by mu_
};

}  // namespace kvferry
