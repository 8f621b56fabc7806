#include "device/staging_pool.h"

#include <string>

namespace kvferry::device {

StagingLease::StagingLease(StagingLease&& other) noexcept
    : pool_(other.pool_), buffer_(std::move(other.buffer_)) {
  other.pool_ = nullptr;
}

StagingLease& StagingLease::operator=(StagingLease&& other) noexcept {
  if (this != &other) {
    Return();
    pool_ = other.pool_;
    buffer_ = std::move(other.buffer_);
    other.pool_ = nullptr;
  }
  return *this;
}

StagingLease::~StagingLease() { Return(); }

void StagingLease::Return() {
  if (pool_ != nullptr && buffer_ != nullptr) pool_->Return(std::move(buffer_));
  pool_ = nullptr;
}

Result<std::unique_ptr<StagingPool>> StagingPool::Create(Device& device, std::uint64_t buffer_bytes,
                                                         std::uint32_t max_buffers) {
  if (buffer_bytes == 0 || max_buffers == 0) {
    return Status::InvalidArgument(
        "staging pool: expected a buffer size and a buffer count > 0; "
        "found " +
        std::to_string(buffer_bytes) + " bytes x " + std::to_string(max_buffers));
  }
  return std::unique_ptr<StagingPool>(new StagingPool(device, buffer_bytes, max_buffers));
}

StagingPool::~StagingPool() = default;

Result<StagingLease> StagingPool::Acquire(Deadline deadline) {
  UniqueLock lock(mu_);
  while (idle_.empty() && allocated_ >= max_buffers_) {
    if (returned_.WaitUntil(mu_, deadline) && idle_.empty() && allocated_ >= max_buffers_) {
      return Status::Timeout("staging pool: all " + std::to_string(max_buffers_) + " buffers of " +
                             std::to_string(buffer_bytes_) +
                             " bytes stayed leased until the deadline; raise the bound or the "
                             "deadline, or end leases sooner");
    }
  }
  if (!idle_.empty()) {
    auto buffer = std::move(idle_.back());
    idle_.pop_back();
    return StagingLease(this, std::move(buffer));
  }
  ++allocated_;  // reserve the slot, then allocate without holding the lock
  lock.Unlock();
  auto buffer = device_.AllocatePinned(buffer_bytes_);
  if (!buffer.ok()) {
    lock.Lock();
    --allocated_;
    returned_.Signal();
    return buffer.status().WithContext("staging pool");
  }
  return StagingLease(this, std::move(buffer).value());
}

std::uint64_t StagingPool::allocated_bytes() const {
  MutexLock lock(mu_);
  return std::uint64_t{allocated_} * buffer_bytes_;
}

void StagingPool::Return(std::unique_ptr<PinnedBuffer> buffer) {
  {
    MutexLock lock(mu_);
    idle_.push_back(std::move(buffer));
  }
  returned_.Signal();
}

}  // namespace kvferry::device
