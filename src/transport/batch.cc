#include "transport/batch.h"

#include <utility>

#include "common/clock.h"

namespace kvferry {

Batch::Batch(BatchId id, Deadline deadline, std::vector<RegionPin> pins,
             std::function<void(const BatchResult&, std::uint64_t)> on_end)
    : id_(id), deadline_(deadline), on_end_(std::move(on_end)), pins_(std::move(pins)) {
  local_kinds_.reserve(pins_.size());
  for (const RegionPin& pin : pins_) {
    local_kinds_.push_back(pin.kind());
    local_all_host_ = local_all_host_ && pin.kind().is_host();
  }
}

void Batch::AddUnit() {
  std::lock_guard<std::mutex> lock(mu_);
  ++outstanding_;
}

void Batch::Seal() {
  std::unique_lock<std::mutex> lock(mu_);
  sealed_ = true;
  MaybeEnd(std::move(lock));
}

void Batch::UnitDone(const Status& status, std::uint64_t bytes) {
  std::unique_lock<std::mutex> lock(mu_);
  bytes_ += bytes;
  if (!status.ok()) {
    if (first_error_.ok() && !cancelled_) first_error_ = status;
    stop_.store(true, std::memory_order_release);
  }
  --outstanding_;
  MaybeEnd(std::move(lock));
}

void Batch::MaybeEnd(std::unique_lock<std::mutex> lock) {
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
  lock.unlock();
  release.clear();
  if (on_end_) on_end_(result, total);
  lock.lock();
  announced_ = true;
  ended_cv_.notify_all();
}

bool Batch::ShouldStop() const {
  return stop_.load(std::memory_order_acquire) || Expired(deadline_);
}

Status Batch::StopStatus() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (cancelled_) return Status::Cancelled("batch " + std::to_string(id_) + " was cancelled");
  if (!first_error_.ok()) return first_error_;
  return Status::Timeout("batch " + std::to_string(id_) +
                         " did not complete by its deadline; the peer is slow, stopped or "
                         "unreachable");
}

void Batch::StopWith(const Status& status) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!ended_) {
    if (status.code() == StatusCode::kCancelled) {
      if (first_error_.ok()) cancelled_ = true;
    } else if (first_error_.ok() && !cancelled_) {
      first_error_ = status;
    }
  }
  stop_.store(true, std::memory_order_release);
  ended_cv_.wait(lock, [&] { return announced_; });
}

void Batch::Cancel() { StopWith(Status::Cancelled("cancelled")); }

void Batch::Fail(const Status& status) { StopWith(status); }

bool Batch::PinsRegion(RegionId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const RegionPin& p : pins_) {
    if (p.region() == id) return true;
  }
  return false;
}

BatchResult Batch::Current() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!announced_) return {};
  return result_;
}

BatchResult Batch::WaitEnd(Deadline deadline) const {
  std::unique_lock<std::mutex> lock(mu_);
  ended_cv_.wait_until(lock, deadline, [&] { return announced_; });
  if (!announced_) return {};
  return result_;
}

}  // namespace kvferry
