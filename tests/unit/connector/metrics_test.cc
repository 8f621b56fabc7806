// PrometheusText: the exposition format of the connector's metrics (issue 16, item 4).
#include "kvferry/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <sstream>

namespace kvferry {
namespace {

using std::chrono::microseconds;
using ::testing::HasSubstr;

struct Sample {
  std::string name;
  std::string labels;  // the text between the braces
  std::string value;
};

struct Parsed {
  std::map<std::string, std::string> type;  // family -> type
  std::map<std::string, int> help_lines;    // family -> HELP lines seen
  std::vector<Sample> samples;
};

Parsed Parse(const std::string& text) {
  Parsed p;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("# HELP ", 0) == 0) {
      ++p.help_lines[line.substr(7, line.find(' ', 7) - 7)];
    } else if (line.rfind("# TYPE ", 0) == 0) {
      const std::size_t sp = line.find(' ', 7);
      EXPECT_EQ(p.type.count(line.substr(7, sp - 7)), 0u) << "family typed twice: " << line;
      p.type[line.substr(7, sp - 7)] = line.substr(sp + 1);
    } else {
      const std::size_t brace = line.find('{');
      const std::size_t space = line.rfind(' ');
      Sample s;
      if (brace != std::string::npos && brace < space) {
        s.name = line.substr(0, brace);
        s.labels = line.substr(brace + 1, line.rfind('}') - brace - 1);
      } else {
        s.name = line.substr(0, space);
      }
      s.value = line.substr(space + 1);
      p.samples.push_back(s);
    }
  }
  return p;
}

WorkerMetrics Example(int tp_rank) {
  WorkerMetrics w;
  w.engine_id = "decode \"0\"\\x";
  w.role = Role::kDecode;
  w.tp_rank = tp_rank;
  w.stats.loads_done = 3;
  w.stats.loads_failed = 2;
  w.stats.failures = {{"Timeout", 1}, {"PeerDisconnected", 1}};
  w.stats.failures_by_peer = {{"prefill-\"a\"", 2}};
  w.stats.bytes_read = 12345;
  w.stats.holds_outstanding = 4;
  w.stats.notices_received = {{"finished", 9}};
  w.stats.transport.bytes_served = 77;
  for (int us : {40, 900, 2600, 2600, 70000000}) w.stats.transfer_latency.Add(microseconds(us));
  return w;
}

TEST(PrometheusTextTest, EveryFamilyHasOneHelpAndTypeAndEverySampleBelongsToOne) {
  const std::vector<WorkerMetrics> workers = {Example(0), Example(1)};
  const std::vector<ExtraMetric> extra = {
      {"kvferry_requests_in_flight", "Requests in flight", MetricType::kGauge, {}, 2},
      {"kvferry_requests_total", "Requests", MetricType::kCounter, {{"outcome", "done"}}, 5},
      {"kvferry_requests_total", "Requests", MetricType::kCounter, {{"outcome", "failed"}}, 1}};
  const Parsed p = Parse(PrometheusText(workers, extra));
  for (const auto& [family, type] : p.type) EXPECT_EQ(p.help_lines.at(family), 1) << family;
  for (const Sample& s : p.samples) {
    std::string family = s.name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      const std::string sfx = suffix;
      if (p.type.count(family) == 0 && family.size() > sfx.size() &&
          family.compare(family.size() - sfx.size(), sfx.size(), sfx) == 0) {
        family.resize(family.size() - sfx.size());
      }
    }
    ASSERT_EQ(p.type.count(family), 1u) << "sample without a family: " << s.name;
    if (p.type.at(family) == "counter") {
      EXPECT_EQ(s.name.substr(s.name.size() - 6), "_total") << s.name;
    }
  }
  EXPECT_EQ(p.type.at("kvferry_transfer_latency_seconds"), "histogram");
  EXPECT_EQ(p.type.at("kvferry_transfer_latency_seconds_quantiles"), "summary");
  EXPECT_EQ(p.type.at("kvferry_requests_total"), "counter");
  EXPECT_EQ(p.type.at("kvferry_holds_outstanding"), "gauge");
}

TEST(PrometheusTextTest, HistogramBucketsAreCumulativeEndInInfAndMatchCount) {
  const std::vector<WorkerMetrics> workers = {Example(0)};
  const Parsed p = Parse(PrometheusText(workers));
  std::vector<std::pair<std::string, double>> buckets;  // (le, count)
  double count = -1, sum = -1;
  for (const Sample& s : p.samples) {
    if (s.name == "kvferry_transfer_latency_seconds_bucket") {
      const std::size_t le = s.labels.find(",le=\"");
      ASSERT_NE(le, std::string::npos) << s.labels;
      buckets.emplace_back(s.labels.substr(le + 5, s.labels.find('"', le + 5) - le - 5),
                           std::stod(s.value));
    } else if (s.name == "kvferry_transfer_latency_seconds_count") {
      count = std::stod(s.value);
    } else if (s.name == "kvferry_transfer_latency_seconds_sum") {
      sum = std::stod(s.value);
    }
  }
  ASSERT_EQ(buckets.size(), LatencyHistogram::kExportBoundsUs.size() + 1);
  EXPECT_EQ(buckets.back().first, "+Inf");
  EXPECT_EQ(buckets.back().second, 5);
  EXPECT_EQ(count, 5);
  EXPECT_DOUBLE_EQ(sum, (40 + 900 + 2600 + 2600 + 70000000) / 1e6);
  for (std::size_t i = 1; i < buckets.size(); ++i) {
    EXPECT_LE(buckets[i - 1].second, buckets[i].second) << buckets[i].first;
    if (i + 1 < buckets.size()) {
      EXPECT_LT(std::stod(buckets[i - 1].first), std::stod(buckets[i].first));
    }
  }
  // 40 µs <= 50 µs; 900 <= 1 ms; the two 2.6 ms only from 5 ms on; 70 s only in +Inf.
  EXPECT_EQ(buckets[0].first, "5e-05");
  EXPECT_EQ(buckets[0].second, 1);
  EXPECT_EQ(buckets[4].second, 2);   // le 0.001
  EXPECT_EQ(buckets[5].second, 2);   // le 0.0025
  EXPECT_EQ(buckets[6].second, 4);   // le 0.005
  EXPECT_EQ(buckets[18].second, 4);  // le 60
}

TEST(PrometheusTextTest, LabelsAreEscapedAndFailuresCarryTheirCode) {
  const std::vector<WorkerMetrics> workers = {Example(1)};
  const std::string text = PrometheusText(workers);
  EXPECT_THAT(text, HasSubstr("kvferry_load_failures_total{engine_id=\"decode \\\"0\\\"\\\\x\","
                              "role=\"decode\",dp_rank=\"0\",tp_rank=\"1\",code=\"Timeout\"} 1\n"));
  EXPECT_THAT(text, HasSubstr(",outcome=\"failed\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("kvferry_load_failures_by_peer_total{"));
  EXPECT_THAT(text, HasSubstr(",peer=\"prefill-\\\"a\\\"\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("kvferry_notices_received_total{"));
  EXPECT_THAT(text, HasSubstr(",type=\"finished\"} 9\n"));
  EXPECT_THAT(text, HasSubstr("kvferry_transport_bytes_served_total{"));
  EXPECT_THAT(text, HasSubstr(",quantile=\"1\"} 70\n"));
}

}  // namespace
}  // namespace kvferry
