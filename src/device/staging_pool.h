// A bounded pool of pinned host staging buffers, for paths that move device memory through host
// memory (tcp, or IPC that cannot be used).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/mutex.h"
#include "device/device.h"

namespace kvferry::device {

class StagingPool;

/// One buffer taken from a StagingPool; returns it to the pool when destroyed. Move-only. Must not
/// outlive its pool.
class StagingLease {
 public:
  StagingLease() = default;
  StagingLease(StagingLease&& other) noexcept;
  StagingLease& operator=(StagingLease&& other) noexcept;
  StagingLease(const StagingLease&) = delete;
  StagingLease& operator=(const StagingLease&) = delete;
  ~StagingLease();

  std::byte* data() const { return buffer_->data(); }
  std::uint64_t size() const { return buffer_->size(); }

 private:
  friend class StagingPool;
  StagingLease(StagingPool* pool, std::unique_ptr<PinnedBuffer> buffer)
      : pool_(pool), buffer_(std::move(buffer)) {}
  void Return();

  StagingPool* pool_ = nullptr;
  std::unique_ptr<PinnedBuffer> buffer_;
};

/// Hands out at most `max_buffers` pinned buffers of `buffer_bytes` each, so a connection's staging
/// memory never exceeds buffer_bytes * max_buffers. Buffers are allocated on first need and reused.
/// Thread-safe. Must not outlive `device`; every lease must end before the pool.
class StagingPool {
 public:
  /// InvalidArgument for a zero size or count.
  static Result<std::unique_ptr<StagingPool>> Create(Device& device, std::uint64_t buffer_bytes,
                                                     std::uint32_t max_buffers);
  ~StagingPool();

  /// A buffer, waiting until one is returned if all are leased. Timeout when `deadline` passes
  /// first; the device's error when allocating a new buffer fails.
  Result<StagingLease> Acquire(Deadline deadline) EXCLUDES(mu_);

  std::uint64_t buffer_bytes() const { return buffer_bytes_; }
  std::uint32_t max_buffers() const { return max_buffers_; }
  /// Bytes of pinned memory the pool holds now (leased or idle); never above the bound.
  std::uint64_t allocated_bytes() const EXCLUDES(mu_);

 private:
  friend class StagingLease;
  StagingPool(Device& device, std::uint64_t buffer_bytes, std::uint32_t max_buffers)
      : device_(device), buffer_bytes_(buffer_bytes), max_buffers_(max_buffers) {}
  void Return(std::unique_ptr<PinnedBuffer> buffer) EXCLUDES(mu_);

  Device& device_;
  const std::uint64_t buffer_bytes_;
  const std::uint32_t max_buffers_;
  mutable Mutex mu_;
  CondVar returned_;
  std::vector<std::unique_ptr<PinnedBuffer>> idle_ GUARDED_BY(mu_);
  std::uint32_t allocated_ GUARDED_BY(mu_) = 0;  // idle + leased
};

}  // namespace kvferry::device
