// LatencyHistogram: the error bound every reported latency relies on (issue 16, item 3).
#include "kvferry/histogram.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace kvferry {
namespace {

using std::chrono::microseconds;

// The rank-th smallest value for quantile q, as LatencyHistogram defines it: ceil(q * n), at
// least 1.
std::uint64_t TrueQuantile(const std::vector<std::uint64_t>& sorted, double q) {
  const auto n = static_cast<double>(sorted.size());
  const auto rank = std::max<std::size_t>(1, static_cast<std::size_t>(std::ceil(q * n)));
  return sorted[std::min(rank, sorted.size()) - 1];
}

// The property the histogram promises: a reported quantile is never below the true one and
// less than 1/64 (1.6 %, inside the 3 % the issue allows) above it. The old power-of-two
// histogram failed this by up to 100 % (1025 µs was reported as 2048).
void ExpectQuantilesWithinBound(const std::vector<std::uint64_t>& values) {
  LatencyHistogram h;
  for (std::uint64_t v : values) h.Add(microseconds(v));
  std::vector<std::uint64_t> sorted = values;
  std::sort(sorted.begin(), sorted.end());
  for (double q : {0.0, 0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0}) {
    const std::uint64_t truth = TrueQuantile(sorted, q);
    const std::uint64_t got = h.Quantile(q);
    EXPECT_GE(got, truth) << "q=" << q;
    EXPECT_LE(static_cast<double>(got - truth), static_cast<double>(truth) / 64.0)
        << "q=" << q << " truth " << truth << " reported " << got;
    EXPECT_LE(static_cast<double>(got), static_cast<double>(truth) * 1.03) << "q=" << q;
  }
}

TEST(LatencyHistogramTest, QuantilesWithinOneSixtyFourthOfLogUniformValues) {
  std::mt19937_64 rng(16);
  std::uniform_real_distribution<double> exponent(0.0, 10.0);  // 1 µs .. 10 s
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<std::uint64_t> values(1000 + trial * 37);
    for (auto& v : values) v = static_cast<std::uint64_t>(std::pow(10.0, exponent(rng)));
    ExpectQuantilesWithinBound(values);
  }
}

TEST(LatencyHistogramTest, QuantilesWithinBoundJustAbovePowersOfTwo) {
  // Where power-of-two buckets were worst: one past each power of two.
  for (std::uint64_t p = 128; p <= (std::uint64_t{1} << 36); p <<= 1) {
    ExpectQuantilesWithinBound({p + 1, p + 1, p + 2, 2 * p - 1});
  }
}

TEST(LatencyHistogramTest, EveryValueFallsInsideItsBucketAndBucketsAreNarrow) {
  for (std::size_t b = 0; b < LatencyHistogram::kNumBuckets; ++b) {
    const std::uint64_t lo = LatencyHistogram::BucketLower(b);
    const std::uint64_t hi = LatencyHistogram::BucketUpper(b);
    ASSERT_LE(lo, hi);
    ASSERT_EQ(LatencyHistogram::BucketIndex(lo), b) << lo;
    ASSERT_EQ(LatencyHistogram::BucketIndex(hi), b) << hi;
    if (b > 0) {
      ASSERT_EQ(LatencyHistogram::BucketUpper(b - 1) + 1, lo) << "gap before " << b;
    }
    // Width relative to the smallest value in the bucket: the error bound.
    ASSERT_LE(static_cast<double>(hi - lo), static_cast<double>(lo) / 64.0) << b;
  }
  EXPECT_EQ(LatencyHistogram::BucketIndex(~std::uint64_t{0}), LatencyHistogram::kNumBuckets - 1);
}

TEST(LatencyHistogramTest, MinMaxSumAndCountAreExact) {
  LatencyHistogram h;
  EXPECT_EQ(h.Quantile(0.5), 0u);
  EXPECT_EQ(h.min_us(), 0u);
  for (std::uint64_t v : {5000u, 7u, 123457u, 999u}) h.Add(microseconds(v));
  h.Add(microseconds(-3));  // counts as 0
  EXPECT_EQ(h.count(), 5u);
  EXPECT_EQ(h.sum_us(), 5000u + 7u + 123457u + 999u);
  EXPECT_EQ(h.min_us(), 0u);
  EXPECT_EQ(h.max_us(), 123457u);
  EXPECT_EQ(h.Quantile(1.0), 123457u);
  EXPECT_EQ(h.Quantile(0.0), 0u);
}

TEST(LatencyHistogramTest, MergeEqualsAddingEveryValueToOne) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::uint64_t> us(0, 5000000);
  LatencyHistogram a, b, all;
  for (int i = 0; i < 5000; ++i) {
    const microseconds v(static_cast<std::int64_t>(us(rng)));
    (i % 3 == 0 ? a : b).Add(v);
    all.Add(v);
  }
  LatencyHistogram empty;
  a.Merge(empty);
  empty.Merge(a);
  empty.Merge(b);
  EXPECT_EQ(empty.count(), all.count());
  EXPECT_EQ(empty.sum_us(), all.sum_us());
  EXPECT_EQ(empty.min_us(), all.min_us());
  EXPECT_EQ(empty.max_us(), all.max_us());
  for (double q : {0.0, 0.5, 0.9, 0.99, 1.0}) EXPECT_EQ(empty.Quantile(q), all.Quantile(q));
  for (std::size_t i = 0; i <= LatencyHistogram::kExportBoundsUs.size(); ++i) {
    EXPECT_EQ(empty.CountAtOrBelowBound(i), all.CountAtOrBelowBound(i));
  }
}

TEST(LatencyHistogramTest, ExportBucketsCountExactlyAtOrBelowEachBound) {
  LatencyHistogram h;
  std::vector<std::uint64_t> values;
  for (std::uint64_t bound : LatencyHistogram::kExportBoundsUs) {
    for (std::uint64_t v : {bound - 1, bound, bound + 1}) {
      values.push_back(v);
      h.Add(microseconds(v));
    }
  }
  for (std::size_t i = 0; i < LatencyHistogram::kExportBoundsUs.size(); ++i) {
    const auto want = static_cast<std::uint64_t>(
        std::count_if(values.begin(), values.end(),
                      [&](std::uint64_t v) { return v <= LatencyHistogram::kExportBoundsUs[i]; }));
    EXPECT_EQ(h.CountAtOrBelowBound(i), want) << LatencyHistogram::kExportBoundsUs[i];
  }
  EXPECT_EQ(h.CountAtOrBelowBound(LatencyHistogram::kExportBoundsUs.size()), h.count());
}

}  // namespace
}  // namespace kvferry
