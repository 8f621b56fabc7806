#include "kvferry/histogram.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace kvferry {

std::size_t LatencyHistogram::BucketIndex(std::uint64_t us) {
  if (us < kLinearLimit) return static_cast<std::size_t>(us);
  const int exponent = std::bit_width(us) - 1;
  if (exponent > kMaxExponent) return kNumBuckets - 1;
  // us is in [2^exponent, 2^(exponent+1)): its top kSubBucketBits + 1 bits pick the bucket.
  const int shift = exponent - kSubBucketBits;
  const std::uint64_t sub = (us >> shift) - kSubBuckets;  // 0..63
  return static_cast<std::size_t>(
      kLinearLimit + static_cast<std::uint64_t>(exponent - kSubBucketBits - 1) * kSubBuckets + sub);
}

std::uint64_t LatencyHistogram::BucketLower(std::size_t index) {
  if (index < kLinearLimit) return index;
  const std::uint64_t past = index - kLinearLimit;
  const std::uint64_t shift = past / kSubBuckets + 1;
  return (kSubBuckets + past % kSubBuckets) << shift;
}

std::uint64_t LatencyHistogram::BucketUpper(std::size_t index) {
  if (index < kLinearLimit) return index;
  const std::uint64_t shift = (index - kLinearLimit) / kSubBuckets + 1;
  return BucketLower(index) + (std::uint64_t{1} << shift) - 1;
}

void LatencyHistogram::Add(std::chrono::microseconds d) {
  const auto us = static_cast<std::uint64_t>(std::max<std::int64_t>(d.count(), 0));
  if (buckets_.empty()) buckets_.assign(kNumBuckets, 0);
  ++buckets_[BucketIndex(us)];
  min_us_ = count_ == 0 ? us : std::min(min_us_, us);
  max_us_ = std::max(max_us_, us);
  ++count_;
  sum_us_ += us;
  // Bounds are sorted: every bound from the first one >= us on counts this value.
  const auto first = std::lower_bound(kExportBoundsUs.begin(), kExportBoundsUs.end(), us);
  for (auto i = static_cast<std::size_t>(first - kExportBoundsUs.begin());
       i < kExportBoundsUs.size(); ++i) {
    ++at_or_below_[i];
  }
}

void LatencyHistogram::Merge(const LatencyHistogram& other) {
  if (other.count_ == 0) return;
  if (buckets_.empty()) buckets_.assign(kNumBuckets, 0);
  for (std::size_t b = 0; b < kNumBuckets; ++b) buckets_[b] += other.buckets_[b];
  for (std::size_t i = 0; i < at_or_below_.size(); ++i) at_or_below_[i] += other.at_or_below_[i];
  min_us_ = count_ == 0 ? other.min_us_ : std::min(min_us_, other.min_us_);
  max_us_ = std::max(max_us_, other.max_us_);
  count_ += other.count_;
  sum_us_ += other.sum_us_;
}

std::uint64_t LatencyHistogram::Quantile(double q) const {
  if (count_ == 0) return 0;
  q = std::clamp(std::isnan(q) ? 0.0 : q, 0.0, 1.0);
  const auto rank = std::clamp<std::uint64_t>(
      static_cast<std::uint64_t>(std::ceil(q * static_cast<double>(count_))), 1, count_);
  std::uint64_t seen = 0;
  for (std::size_t b = 0; b < kNumBuckets; ++b) {
    seen += buckets_[b];
    if (seen >= rank) return std::min(BucketUpper(b), max_us_);
  }
  return max_us_;
}

std::uint64_t LatencyHistogram::CountAtOrBelowBound(std::size_t i) const {
  return i < at_or_below_.size() ? at_or_below_[i] : count_;
}

}  // namespace kvferry
