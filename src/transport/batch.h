// A batch of reads split into units of work that backends carry out on their own threads. The
// batch ends exactly once, when its last unit has finished, so "ended" always means that no read
// of it runs any more.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

#include "common/mutex.h"
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
  void AddUnit() EXCLUDES(mu_);
  void Seal() EXCLUDES(mu_);
  /// A unit finished; `status` is OK if all its bytes arrived.
  void UnitDone(const Status& status, std::uint64_t bytes) EXCLUDES(mu_);

  /// True once units should stop early: cancelled, another unit failed, or the deadline passed.
  bool ShouldStop() const;
  /// The status a unit that stops early reports.
  Status StopStatus() const EXCLUDES(mu_);

  /// Asks the units to stop and waits until they all have; the batch then ends as cancelled
  /// unless it had already ended.
  void Cancel() EXCLUDES(mu_);
  /// Fails the batch with `status` (for example the peer died) and waits as Cancel does.
  void Fail(const Status& status) EXCLUDES(mu_);

  /// The memory kind of the local region read `op` (in SubmitReads order) lands in; host for a
  /// batch made without pins (tests).
  MemoryKind local_kind(std::size_t op) const {
    return op < local_kinds_.size() ? local_kinds_[op] : MemoryKind::Host();
  }
  /// True when every read lands in host memory.
  bool local_all_host() const { return local_all_host_; }

  /// True while the batch runs and one of its reads lands in region `id`.
  bool PinsRegion(RegionId id) const EXCLUDES(mu_);

  BatchResult Current() const EXCLUDES(mu_);
  BatchResult WaitEnd(Deadline deadline) const EXCLUDES(mu_);

 private:
  void StopWith(const Status& status) EXCLUDES(mu_);
  // Ends the batch if it is sealed and its last unit finished. Called with mu_ held; releases it
  // while the pins are dropped and on_end_ runs, and holds it again on return.
  void MaybeEnd() REQUIRES(mu_);

  const BatchId id_;
  const Deadline deadline_;
  std::vector<MemoryKind> local_kinds_;  // one per read, unless all are host; set by the ctor
  bool local_all_host_ = true;
  std::function<void(const BatchResult&, std::uint64_t)> on_end_;

  mutable Mutex mu_;
  mutable CondVar ended_cv_;
  std::atomic<bool> stop_{false};
  int outstanding_ GUARDED_BY(mu_) = 0;
  bool sealed_ GUARDED_BY(mu_) = false;
  bool ended_ GUARDED_BY(mu_) = false;      // outcome decided
  bool announced_ GUARDED_BY(mu_) = false;  // outcome visible to waiters, after on_end_
  bool cancelled_ GUARDED_BY(mu_) = false;
  Status first_error_ GUARDED_BY(mu_);
  std::uint64_t bytes_ GUARDED_BY(mu_) = 0;
  BatchResult result_ GUARDED_BY(mu_);
  std::vector<RegionPin> pins_ GUARDED_BY(mu_);  // released when the batch ends
};

}  // namespace kvferry
