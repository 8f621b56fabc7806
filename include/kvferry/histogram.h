// kvferry: a latency histogram with log-linear buckets, the distribution behind every latency
// kvferry reports (WorkerStats, the CLI, /metrics, the Python module).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvferry {

/// A distribution of durations in whole microseconds (a duration is truncated to whole µs when
/// added). Values below 128 µs each have a bucket of their own; above, every power-of-two range
/// [2^k, 2^(k+1)) is cut into 64 equal buckets, so a bucket is at most 1/64 of its lower edge
/// wide. Quantile reports the largest value of the bucket holding the quantile, clamped to the
/// exact maximum: never below the true quantile and less than 1/64 (1.6 %) above it. Values of
/// 2^41 µs (25 days) and more share the last bucket; `max_us` stays exact.
///
/// For exporters with a fixed bucket layout (Prometheus), the count of values at or below each
/// of kExportBoundsUs is kept exactly as values are added.
///
/// A plain value: copyable, mergeable, not thread-safe (the owner synchronises). About 18 KiB
/// once the first value is added; an empty histogram allocates nothing.
class LatencyHistogram {
 public:
  /// Bucket layout: 2^kSubBucketBits buckets per power of two past the linear range.
  static constexpr int kSubBucketBits = 6;
  static constexpr std::uint64_t kSubBuckets = std::uint64_t{1} << kSubBucketBits;  // 64
  static constexpr std::uint64_t kLinearLimit = 2 * kSubBuckets;  // 0..127 µs: one per µs
  static constexpr int kMaxExponent = 40;                         // last range [2^40, 2^41)
  static constexpr std::size_t kNumBuckets =
      kLinearLimit + (kMaxExponent - kSubBucketBits) * kSubBuckets;
  /// The fixed upper bounds (inclusive, µs) whose cumulative counts CountAtOrBelowBound keeps
  /// exactly: 50 µs to 60 s. An exporter adds the +Inf bucket (count()).
  static constexpr std::array<std::uint64_t, 19> kExportBoundsUs = {
      50,     100,    250,    500,     1000,    2500,    5000,     10000,    25000,   50000,
      100000, 250000, 500000, 1000000, 2500000, 5000000, 10000000, 30000000, 60000000};

  /// Records one duration; negative durations count as 0.
  void Add(std::chrono::microseconds d);
  /// Adds every value of `other` to this one, as if each had been added here.
  void Merge(const LatencyHistogram& other);

  std::uint64_t count() const { return count_; }
  std::uint64_t sum_us() const { return sum_us_; }
  /// Exact smallest and largest value added; 0 when empty.
  std::uint64_t min_us() const { return count_ == 0 ? 0 : min_us_; }
  std::uint64_t max_us() const { return max_us_; }

  /// The q-quantile (q in 0..1, clamped), in µs: the bucket holding the ceil(q * count)-th
  /// smallest value (at least the first), reported as that bucket's largest value or the exact
  /// maximum, whichever is smaller. Quantile(0) is within 1/64 of min_us, Quantile(1) is
  /// max_us. 0 when empty.
  std::uint64_t Quantile(double q) const;

  /// How many values are <= kExportBoundsUs[i]; exact. An `i` past the bounds means +Inf:
  /// count().
  std::uint64_t CountAtOrBelowBound(std::size_t i) const;

  /// Bucket arithmetic, exposed for tests and exporters: the bucket of a value, and the
  /// smallest and largest value a bucket holds.
  static std::size_t BucketIndex(std::uint64_t us);
  static std::uint64_t BucketLower(std::size_t index);
  static std::uint64_t BucketUpper(std::size_t index);

 private:
  std::uint64_t count_ = 0;
  std::uint64_t sum_us_ = 0;
  std::uint64_t min_us_ = 0;
  std::uint64_t max_us_ = 0;
  std::vector<std::uint64_t> buckets_;  // kNumBuckets once the first value is added
  std::array<std::uint64_t, kExportBoundsUs.size()> at_or_below_{};
};

}  // namespace kvferry
