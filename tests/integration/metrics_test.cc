// kvferry serve --metrics-port and kvferry top (issue 16, items 4 and 5): a prefill and a decode
// instance serve GET /metrics; the exposition is checked line by line (HELP and TYPE for every
// family, cumulative histogram buckets ending in +Inf, _count equal to the +Inf bucket), one
// request carried through both moves the counters it should and no counter goes back, and
// kvferry top --once shows both instances.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/ports.h"
#include "common/subprocess.h"
#include "tools/control_client.h"

namespace kvferry::cli {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;
using std::chrono::milliseconds;

constexpr milliseconds kTimeout{20000};

struct Serve {
  std::optional<Subprocess> process;
  std::string control;  // tcp://host:port
  std::string metrics;  // http://host:port/metrics
};

Result<Serve> StartServe(const std::string& role, std::vector<std::string> extra = {}) {
  const int base = FreeLoopbackPorts(1);
  if (base == 0) return Status::Unavailable("no free port for the side channel");
  std::vector<std::string> argv = {KVFERRY_CLI_PATH,
                                   "serve",
                                   "--role",
                                   role,
                                   "--base-port",
                                   std::to_string(base),
                                   "--control-port",
                                   "0",
                                   "--metrics-port",
                                   "0",
                                   "--num-blocks",
                                   "64",
                                   "--layers",
                                   "2",
                                   "--exit-on-stdin-eof"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  KVFERRY_ASSIGN_OR_RETURN(Subprocess p, Subprocess::Spawn(argv, {"KVFERRY_SECRET="}));
  KVFERRY_ASSIGN_OR_RETURN(std::string ready, p.ReadLine(milliseconds(60000)));
  if (ready.rfind("READY ", 0) != 0) return Status::Internal("serve did not start: " + ready);
  KVFERRY_ASSIGN_OR_RETURN(std::string metrics, p.ReadLine(milliseconds(10000)));
  if (metrics.rfind("METRICS ", 0) != 0) {
    return Status::Internal("expected the METRICS line after READY, found: " + metrics);
  }
  Serve s;
  s.control = ready.substr(6);
  s.metrics = metrics.substr(8);
  s.process = std::move(p);
  return s;
}

// GET url (http://host:port/path) within 5 s.
Result<std::string> Fetch(const std::string& url) {
  const std::size_t path = url.find('/', 7);
  httplib::Client client(url.substr(0, path));
  client.set_connection_timeout(5, 0);
  client.set_read_timeout(5, 0);
  httplib::Result r = client.Get(url.substr(path));
  if (!r) return Status::Unavailable("GET " + url + ": " + httplib::to_string(r.error()));
  if (r->status != 200)
    return Status::Internal("GET " + url + ": HTTP " + std::to_string(r->status));
  if (r->get_header_value("Content-Type").rfind("text/plain; version=0.0.4", 0) != 0) {
    return Status::Internal("GET " + url + ": content type " + r->get_header_value("Content-Type"));
  }
  return r->body;
}

// A scrape: every series (name with its label text) and its value, with the families' types.
struct Scrape {
  std::map<std::string, std::string> type;
  std::map<std::string, double> series;  // "name{labels}" -> value
  std::vector<std::string> order;        // series in the order written

  double Sum(const std::string& name, const std::string& label_part = "") const {
    double total = 0;
    for (const auto& [key, value] : series) {
      if (key.substr(0, key.find('{')) == name && key.find(label_part) != std::string::npos) {
        total += value;
      }
    }
    return total;
  }
};

// Parses and checks the format: HELP then TYPE before a family's samples, each family once,
// samples only of typed families, histograms cumulative and complete.
Scrape ParseAndCheck(const std::string& text) {
  Scrape s;
  std::istringstream in(text);
  std::string line;
  std::string help_for;
  std::string current;  // the family whose samples may follow
  while (std::getline(in, line)) {
    if (line.rfind("# HELP ", 0) == 0) {
      help_for = line.substr(7, line.find(' ', 7) - 7);
      EXPECT_GT(line.size(), 8 + help_for.size()) << "empty help: " << line;
      continue;
    }
    if (line.rfind("# TYPE ", 0) == 0) {
      const std::size_t sp = line.find(' ', 7);
      const std::string family = line.substr(7, sp - 7);
      EXPECT_EQ(help_for, family) << "TYPE without its HELP line first: " << line;
      EXPECT_EQ(s.type.count(family), 0u) << "family written twice: " << family;
      s.type[family] = line.substr(sp + 1);
      current = family;
      continue;
    }
    EXPECT_NE(line.rfind('#', 0), 0u) << "unexpected comment: " << line;
    const std::size_t space = line.rfind(' ');
    const std::string key = line.substr(0, space);
    const std::string name = key.substr(0, key.find('{'));
    const std::string& type = s.type[current];
    const bool belongs =
        name == current || ((type == "histogram" || type == "summary") &&
                            (name == current + "_sum" || name == current + "_count" ||
                             (type == "histogram" && name == current + "_bucket")));
    EXPECT_TRUE(belongs) << name << " is not a sample of the family " << current;
    if (type == "counter") {
      EXPECT_EQ(name.substr(name.size() - 6), "_total") << name;
    }
    EXPECT_EQ(s.series.count(key), 0u) << "series written twice: " << key;
    s.series[key] = std::stod(line.substr(space + 1));
    s.order.push_back(key);
  }
  // Histograms: per label set, buckets in increasing le, cumulative, the last +Inf, equal to
  // _count.
  std::map<std::string, std::vector<std::pair<std::string, double>>> buckets;  // labels -> le
  for (const std::string& key : s.order) {
    const std::string name = key.substr(0, key.find('{'));
    if (name.size() < 7 || name.compare(name.size() - 7, 7, "_bucket") != 0) continue;
    const std::size_t le = key.find(",le=\"");
    EXPECT_NE(le, std::string::npos) << key;
    if (le == std::string::npos) continue;
    const std::string series =
        name.substr(0, name.size() - 7) + key.substr(name.size(), le - name.size());
    buckets[series].emplace_back(key.substr(le + 5, key.find('"', le + 5) - le - 5), s.series[key]);
  }
  EXPECT_FALSE(buckets.empty());
  for (const auto& [series, list] : buckets) {
    if (list.empty()) continue;
    EXPECT_EQ(list.back().first, "+Inf") << series;
    for (std::size_t i = 1; i < list.size(); ++i) {
      EXPECT_LE(list[i - 1].second, list[i].second) << series << " le=" << list[i].first;
      if (list[i].first != "+Inf") {
        EXPECT_LT(std::stod(list[i - 1].first), std::stod(list[i].first)) << series;
      }
    }
    const std::string count_key =
        series.substr(0, series.find('{')) + "_count" + series.substr(series.find('{')) + "}";
    EXPECT_EQ(s.series.count(count_key), 1u) << count_key;
    EXPECT_EQ(s.series[count_key], list.back().second) << series;
  }
  return s;
}

// Counters never go back between two scrapes; every series of the first is in the second.
void ExpectMonotonic(const Scrape& before, const Scrape& after) {
  for (const auto& [key, value] : before.series) {
    const std::string name = key.substr(0, key.find('{'));
    auto family = before.type.find(name);
    const bool counter = (family != before.type.end() && family->second == "counter") ||
                         name.ends_with("_bucket") || name.ends_with("_count") ||
                         name.ends_with("_sum");
    if (!counter) continue;
    ASSERT_EQ(after.series.count(key), 1u) << "series vanished: " << key;
    EXPECT_GE(after.series.at(key), value) << key;
  }
}

Result<Json> Generate(ControlClient& client, const std::string& id, Json params) {
  std::vector<int> prompt(100);
  for (int i = 0; i < 100; ++i) prompt[static_cast<std::size_t>(i)] = 1000 + i;
  KVFERRY_RETURN_IF_ERROR(client.Send({{"op", "generate"},
                                       {"request_id", id},
                                       {"prompt", prompt},
                                       {"kv_transfer_params", std::move(params)}}));
  const Deadline deadline = DeadlineAfter(kTimeout);
  while (!Expired(deadline)) {
    zmq_pollitem_t item{client.socket(), 0, ZMQ_POLLIN, 0};
    zmq_poll(&item, 1, PollTimeoutMs(deadline, 100));
    if (std::optional<Json> r = client.TryRecv(); r && r->value("request_id", "") == id) return *r;
  }
  return Status::Timeout("no reply to " + id);
}

TEST(MetricsEndpointTest, ARequestThroughPrefillAndDecodeMovesTheCounters) {
  Result<Serve> prefill = StartServe("prefill");
  ASSERT_TRUE(prefill.ok()) << prefill.status().ToString();
  Result<Serve> decode = StartServe("decode");
  ASSERT_TRUE(decode.ok()) << decode.status().ToString();
  // Loopback unless --metrics-host says otherwise.
  EXPECT_EQ(prefill->metrics.rfind("http://127.0.0.1:", 0), 0u) << prefill->metrics;

  Result<std::string> p0 = Fetch(prefill->metrics);
  Result<std::string> d0 = Fetch(decode->metrics);
  ASSERT_TRUE(p0.ok() && d0.ok()) << p0.status().ToString() << d0.status().ToString();
  const Scrape prefill_before = ParseAndCheck(*p0);
  const Scrape decode_before = ParseAndCheck(*d0);
  EXPECT_EQ(decode_before.type.at("kvferry_transfer_latency_seconds"), "histogram");
  EXPECT_EQ(decode_before.Sum("kvferry_loads_total"), 0);

  ControlClient p(prefill->control, "");
  ControlClient d(decode->control, "");
  Result<Json> pr = Generate(p, "m-1", {{"do_remote_decode", true}});
  ASSERT_TRUE(pr.ok()) << pr.status().ToString();
  ASSERT_TRUE(pr->value("ok", false)) << pr->dump();
  Result<Json> dr = Generate(d, "m-1", (*pr)["kv_transfer_params"]);
  ASSERT_TRUE(dr.ok()) << dr.status().ToString();
  ASSERT_TRUE(dr->value("ok", false)) << dr->dump();
  ASSERT_GT(dr->value("loaded_blocks", 0), 0) << dr->dump();
  Result<Json> stats = d.Call({{"op", "stats"}}, kTimeout);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();

  Result<std::string> d1 = Fetch(decode->metrics);
  ASSERT_TRUE(d1.ok()) << d1.status().ToString();
  const Scrape decode_after = ParseAndCheck(*d1);
  ExpectMonotonic(decode_before, decode_after);
  EXPECT_EQ(decode_after.Sum("kvferry_loads_total", "outcome=\"done\""), 1);
  EXPECT_EQ(decode_after.Sum("kvferry_loads_total", "outcome=\"failed\""), 0);
  EXPECT_EQ(decode_after.Sum("kvferry_handshakes_total"), 1);
  EXPECT_EQ(decode_after.Sum("kvferry_bytes_read_total"), stats->value("bytes_read", 0.0));
  EXPECT_GT(decode_after.Sum("kvferry_bytes_read_total"), 0);
  EXPECT_EQ(decode_after.Sum("kvferry_transfer_latency_seconds_count"), 1);
  EXPECT_EQ(decode_after.Sum("kvferry_handshake_latency_seconds_count"), 1);
  EXPECT_EQ(decode_after.Sum("kvferry_requests_total", "outcome=\"done\""), 1);
  EXPECT_EQ(decode_after.Sum("kvferry_requests_in_flight"), 0);
  EXPECT_EQ(decode_after.Sum("kvferry_loads_outstanding"), 0);

  // The prefill hold ends when the decode side's finished notice arrives; the notice may land
  // just after the decode reply, so wait for it (bounded) before reading the prefill counters.
  Scrape prefill_after;
  const Deadline deadline = DeadlineAfter(kTimeout);
  do {
    Result<std::string> p1 = Fetch(prefill->metrics);
    ASSERT_TRUE(p1.ok()) << p1.status().ToString();
    prefill_after = ParseAndCheck(*p1);
  } while (prefill_after.Sum("kvferry_holds_ended_total", "reason=\"readers\"") < 1 &&
           !Expired(deadline));
  ExpectMonotonic(prefill_before, prefill_after);
  EXPECT_EQ(prefill_after.Sum("kvferry_holds_ended_total", "reason=\"readers\""), 1);
  EXPECT_EQ(prefill_after.Sum("kvferry_holds_outstanding"), 0);
  EXPECT_GE(prefill_after.Sum("kvferry_notices_received_total", "type=\"finished\""), 1);
  EXPECT_GE(prefill_after.Sum("kvferry_notices_received_total", "type=\"metadata_request\""), 1);
  EXPECT_EQ(prefill_after.Sum("kvferry_requests_total", "outcome=\"done\""), 1);

  // Anything but GET /metrics is refused.
  httplib::Client raw(prefill->metrics.substr(0, prefill->metrics.find('/', 7)));
  raw.set_connection_timeout(5, 0);
  raw.set_read_timeout(5, 0);
  httplib::Result other = raw.Get("/other");
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 404);

  // kvferry top --once shows both instances, one row each, and exits 0.
  Result<Subprocess> top = Subprocess::Spawn({KVFERRY_CLI_PATH, "top", "--once", "--interval-ms",
                                              "100", prefill->metrics, decode->metrics});
  ASSERT_TRUE(top.ok()) << top.status().ToString();
  std::vector<std::string> lines;
  for (int i = 0; i < 3; ++i) {
    Result<std::string> line = top->ReadLine(kTimeout);
    ASSERT_TRUE(line.ok()) << line.status().ToString();
    lines.push_back(*line);
  }
  EXPECT_THAT(lines[0], HasSubstr("IN-FLIGHT"));
  EXPECT_THAT(lines[0], HasSubstr("p99 ms"));
  EXPECT_THAT(lines[1], HasSubstr(prefill->metrics));
  EXPECT_THAT(lines[1], HasSubstr(" prefill "));
  EXPECT_THAT(lines[2], HasSubstr(" decode "));
  Result<int> code = top->CloseAndWait(kTimeout);
  ASSERT_TRUE(code.ok()) << code.status().ToString();
  EXPECT_EQ(*code, 0);
}

TEST(MetricsEndpointTest, TopExitsOneWhenAnEndpointDoesNotAnswer) {
  const int port = FreeLoopbackPorts(1);
  ASSERT_NE(port, 0);
  Result<Subprocess> top = Subprocess::Spawn({KVFERRY_CLI_PATH, "top", "--once", "--interval-ms",
                                              "10", "127.0.0.1:" + std::to_string(port)});
  ASSERT_TRUE(top.ok()) << top.status().ToString();
  Result<std::string> header = top->ReadLine(kTimeout);
  ASSERT_TRUE(header.ok()) << header.status().ToString();
  Result<std::string> row = top->ReadLine(kTimeout);
  ASSERT_TRUE(row.ok()) << row.status().ToString();
  EXPECT_THAT(*row, HasSubstr("unreachable"));
  Result<int> code = top->CloseAndWait(kTimeout);
  ASSERT_TRUE(code.ok()) << code.status().ToString();
  EXPECT_EQ(*code, 1);
}

// Regression: httplib's default socket options include SO_REUSEPORT, with which a second
// instance bound the same port and silently took half the scrapes.
TEST(MetricsEndpointTest, ABusyMetricsPortEndsServeWithStatusOne) {
  Result<Serve> first = StartServe("prefill");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  const std::string port = first->metrics.substr(17, first->metrics.find('/', 17) - 17);
  const int base = FreeLoopbackPorts(1);
  Result<Subprocess> second = Subprocess::Spawn(
      {KVFERRY_CLI_PATH, "serve", "--role", "prefill", "--base-port", std::to_string(base),
       "--control-port", "0", "--metrics-port", port, "--num-blocks", "64", "--layers", "2"},
      {"KVFERRY_SECRET="});
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  Result<int> code = second->CloseAndWait(milliseconds(60000));
  ASSERT_TRUE(code.ok()) << code.status().ToString();
  EXPECT_EQ(*code, 1);
}

}  // namespace
}  // namespace kvferry::cli
