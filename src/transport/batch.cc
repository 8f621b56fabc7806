#include "transport/batch.h"

#include <utility>

#include "common/clock.h"

namespace kvferry {

Batch::Batch(BatchId id, Deadline deadline, std::vector<RegionPin> pins,
             std::function<void(const BatchResult&, std::uint64_t)> on_end)
    : id_(id), deadline_(deadline), on_end_(std::move(on_end)), pins_(std::move(pins)) {
  // Kept only when some read lands in device memory: host batches, the common case, copy none.
  for (const RegionPin& pin : pins_) local_all_host_ = local_all_host_ && pin.kind().is_host();
  if (local_all_host_) return;
  local_kinds_.reserve(pins_.size());
  for (const RegionPin& pin : pins_) local_kinds_.push_back(pin.kind());
}

void Batch::AddUnit() {
  MutexLock lock(mu_);
  ++outstanding_;
}

void Batch::Seal() {
  MutexLock lock(mu_);
  sealed_ = true;
  MaybeEnd();
}

void Batch::UnitDone(const Status& status, std::uint64_t bytes) {
  MutexLock lock(mu_);
  bytes_ += bytes;
  if (!status.ok()) {
    if (first_error_.ok() && !cancelled_) first_error_ = status;
    stop_.store(true, std::memory_order_release);
  }
  --outstanding_;
  MaybeEnd();
}

void Batch::MaybeEnd() {
  if (!sealed_ || outstanding_ > 0 || ended_) return;
  ended_ = true;
  if (cancelled_) {
    result_ = {BatchState::kCancelled,
               Status::Cancelled("batch " + std::to_string(id_) + " was cancelled")};
  } else if (!first_error_.ok()) {
    result_ = {BatchState::kFailed, first_error_};
  } else {
    result_ = {BatchState::kDone, Status::Ok()};
  }
  const BatchResult result = result_;
  const std::uint64_t total = bytes_;
  std::vector<RegionPin> release = std::move(pins_);
  // Run on_end_ before waking waiters, so stats are current when Wait returns.
  mu_.unlock();
  release.clear();
  if (on_end_) on_end_(result, total);
  mu_.lock();
  announced_ = true;
  ended_cv_.SignalAll();
}

bool Batch::ShouldStop() const {
  return stop_.load(std::memory_order_acquire) || Expired(deadline_);
}

Status Batch::StopStatus() const {
  MutexLock lock(mu_);
  if (cancelled_) return Status::Cancelled("batch " + std::to_string(id_) + " was cancelled");
  if (!first_error_.ok()) return first_error_;
  return Status::Timeout("batch " + std::to_string(id_) +
                         " did not complete by its deadline; the peer is slow, stopped or "
                         "unreachable");
}

void Batch::StopWith(const Status& status) {
  MutexLock lock(mu_);
  if (!ended_) {
    if (status.code() == StatusCode::kCancelled) {
      if (first_error_.ok()) cancelled_ = true;
    } else if (first_error_.ok() && !cancelled_) {
      first_error_ = status;
    }
  }
  stop_.store(true, std::memory_order_release);
  while (!announced_) ended_cv_.Wait(mu_);
}

void Batch::Cancel() { StopWith(Status::Cancelled("cancelled")); }

void Batch::Fail(const Status& status) { StopWith(status); }

bool Batch::PinsRegion(RegionId id) const {
  MutexLock lock(mu_);
  for (const RegionPin& p : pins_) {
    if (p.region() == id) return true;
  }
  return false;
}

BatchResult Batch::Current() const {
  MutexLock lock(mu_);
  if (!announced_) return {};
  return result_;
}

BatchResult Batch::WaitEnd(Deadline deadline) const {
  MutexLock lock(mu_);
  while (!announced_) {
    if (ended_cv_.WaitUntil(mu_, deadline)) break;  // timed out
  }
  if (!announced_) return {};
  return result_;
}

}  // namespace kvferry
