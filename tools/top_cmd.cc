// kvferry top: a live terminal view of kvferry instances from their GET /metrics endpoints
// (kvferry serve --metrics-port): requests in flight, read rate, holds, failures, p99 transfer
// latency. docs/observability.md describes the columns.
#include <httplib.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "tools/commands.h"

namespace kvferry::cli {
namespace {

struct TopArgs {
  std::vector<std::string> endpoints;
  bool once = false;
  int interval_ms = 1000;
  int timeout_ms = 1000;
};

struct Target {
  std::string display;  // as given
  std::string base;     // scheme://host:port for httplib
  std::string path;     // /metrics unless the endpoint names another
};

// "host:port", "http://host:port" or either with a path.
Result<Target> ParseEndpoint(const std::string& text) {
  Target t;
  t.display = text;
  std::string rest = text;
  std::string scheme = "http://";
  if (rest.rfind("http://", 0) == 0) {
    rest = rest.substr(7);
  } else if (rest.find("://") != std::string::npos) {
    return Status::InvalidArgument("endpoint '" + text +
                                   "': expected host:port or http://host:port[/path]");
  }
  const std::size_t slash = rest.find('/');
  t.path = slash == std::string::npos ? "/metrics" : rest.substr(slash);
  rest = rest.substr(0, slash);
  const std::size_t colon = rest.rfind(':');
  if (rest.empty() || colon == std::string::npos || colon + 1 == rest.size() ||
      rest.find_first_not_of("0123456789", colon + 1) != std::string::npos) {
    return Status::InvalidArgument("endpoint '" + text +
                                   "': expected host:port or http://host:port[/path]");
  }
  t.base = scheme + rest;
  return t;
}

// One sample of the text format: name, labels, value.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// The text exposition format, as much of it as kvferry writes (comments skipped, labels with
// escapes, no timestamps needed). Lines that do not parse are skipped.
std::vector<Sample> ParseText(const std::string& text) {
  std::vector<Sample> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.empty() || line[0] == '#') continue;
    Sample s;
    std::size_t i = line.find_first_of("{ ");
    if (i == std::string::npos) continue;
    s.name = line.substr(0, i);
    if (line[i] == '{') {
      ++i;
      bool ok = true;
      while (i < line.size() && line[i] != '}') {
        const std::size_t eq = line.find("=\"", i);
        if (eq == std::string::npos) {
          ok = false;
          break;
        }
        std::string key = line.substr(i, eq - i);
        std::string value;
        std::size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\' && j + 1 < line.size()) {
            ++j;
            value += line[j] == 'n' ? '\n' : line[j];
          } else {
            value += line[j];
          }
        }
        s.labels[key] = value;
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      if (!ok || i >= line.size()) continue;
      ++i;  // '}'
    }
    while (i < line.size() && line[i] == ' ') ++i;
    const std::string value = line.substr(i, line.find(' ', i) - i);
    char* parsed_end = nullptr;
    s.value = std::strtod(value.c_str(), &parsed_end);
    if (value.empty() || parsed_end != value.c_str() + value.size()) continue;
    out.push_back(std::move(s));
  }
  return out;
}

// What one scrape of one instance says.
struct View {
  bool ok = false;
  std::string error;
  std::string role;
  double in_flight = 0;
  double loads = 0;
  double holds = 0;
  double bytes = 0;  // read by the connector (decode) plus served by the data plane (prefill)
  double done = 0;
  double failed = 0;
  double p99_s = 0;
  Clock::time_point at;
};

std::string Label(const Sample& s, const std::string& name) {
  auto it = s.labels.find(name);
  return it == s.labels.end() ? std::string() : it->second;
}

View Scrape(const Target& t, int timeout_ms) {
  View v;
  v.at = Clock::now();
  httplib::Client client(t.base);
  const time_t sec = timeout_ms / 1000;
  const time_t usec = (timeout_ms % 1000) * 1000;
  client.set_connection_timeout(sec, usec);
  client.set_read_timeout(sec, usec);
  client.set_write_timeout(sec, usec);
  httplib::Result r = client.Get(t.path);
  if (!r) {
    v.error = httplib::to_string(r.error());
    return v;
  }
  if (r->status != 200) {
    v.error = "HTTP " + std::to_string(r->status);
    return v;
  }
  v.ok = true;
  bool have_engine = false;
  for (const Sample& s : ParseText(r->body)) {
    if (v.role.empty()) v.role = Label(s, "role");
    if (s.name == "kvferry_requests_in_flight") {
      v.in_flight += s.value;
      have_engine = true;
    } else if (s.name == "kvferry_loads_outstanding") {
      v.loads += s.value;
    } else if (s.name == "kvferry_holds_outstanding") {
      v.holds += s.value;
    } else if (s.name == "kvferry_bytes_read_total" ||
               s.name == "kvferry_transport_bytes_served_total") {
      v.bytes += s.value;
    } else if (s.name == "kvferry_requests_total" && Label(s, "outcome") == "done") {
      v.done += s.value;
    } else if (s.name == "kvferry_loads_total" && Label(s, "outcome") == "failed") {
      v.failed += s.value;
    } else if (s.name == "kvferry_transfer_latency_seconds_quantiles" &&
               Label(s, "quantile") == "0.99") {
      v.p99_s = std::max(v.p99_s, s.value);
    }
  }
  // An embedder without the engine's gauge: the loads in flight are the requests in flight.
  if (!have_engine) v.in_flight = v.loads;
  return v;
}

void PrintTable(const std::vector<Target>& targets, const std::vector<View>& before,
                const std::vector<View>& now) {
  int width = 8;
  for (const Target& t : targets) width = std::max(width, static_cast<int>(t.display.size()));
  std::printf("%-*s %-8s %9s %7s %7s %9s %10s %8s %10s\n", width, "ENDPOINT", "ROLE", "IN-FLIGHT",
              "LOADS", "HOLDS", "GB/s", "DONE", "FAILED", "p99 ms");
  for (std::size_t i = 0; i < targets.size(); ++i) {
    const View& v = now[i];
    if (!v.ok) {
      std::printf("%-*s unreachable: %s\n", width, targets[i].display.c_str(), v.error.c_str());
      continue;
    }
    double gbps = 0;
    if (before[i].ok) {
      const double dt = std::chrono::duration<double>(v.at - before[i].at).count();
      if (dt > 0) gbps = std::max(0.0, v.bytes - before[i].bytes) / dt / 1e9;
    }
    std::printf("%-*s %-8s %9.0f %7.0f %7.0f %9.3f %10.0f %8.0f %10.3f\n", width,
                targets[i].display.c_str(), v.role.empty() ? "-" : v.role.c_str(), v.in_flight,
                v.loads, v.holds, gbps, v.done, v.failed, v.p99_s * 1e3);
  }
  std::fflush(stdout);
}

int RunTop(const TopArgs& a) {
  std::vector<Target> targets;
  for (const std::string& e : a.endpoints) {
    Result<Target> t = ParseEndpoint(e);
    if (!t.ok()) {
      std::cerr << "kvferry top: " << t.status().ToString() << "\n";
      return 2;
    }
    targets.push_back(*t);
  }
  auto scrape_all = [&] {
    std::vector<View> views;
    for (const Target& t : targets) views.push_back(Scrape(t, a.timeout_ms));
    return views;
  };
  std::vector<View> before = scrape_all();
  for (;;) {
    std::this_thread::sleep_until(before.front().at + std::chrono::milliseconds(a.interval_ms));
    std::vector<View> now = scrape_all();
    if (!a.once) std::printf("\x1b[H\x1b[2J");  // home, clear: a fresh screen every refresh
    PrintTable(targets, before, now);
    if (a.once) {
      for (const View& v : now) {
        if (!v.ok) return 1;
      }
      return 0;
    }
    before = std::move(now);
  }
}

}  // namespace

void AddTopCommand(CLI::App& app, int& exit_code) {
  auto a = std::make_shared<TopArgs>();
  CLI::App* top = app.add_subcommand(
      "top", "Live view of kvferry instances from their /metrics endpoints (serve --metrics-port)");
  top->add_option("endpoints", a->endpoints, "host:port or http://host:port[/path], one or more")
      ->required();
  top->add_flag("--once", a->once,
                "Print one table (two scrapes --interval-ms apart, for the rates) and exit: 0 "
                "when every endpoint answered, 1 otherwise");
  top->add_option("--interval-ms", a->interval_ms, "Refresh interval")
      ->capture_default_str()
      ->check(CLI::Range(10, 3600000));
  top->add_option("--timeout-ms", a->timeout_ms, "Connect and read timeout of each scrape")
      ->capture_default_str()
      ->check(CLI::Range(10, 60000));
  top->callback([a, &exit_code] { exit_code = RunTop(*a); });
}

}  // namespace kvferry::cli
