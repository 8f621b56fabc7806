// kvferry bench e2e: the demo's pipeline (pipeline.h) over a sweep of prompt lengths, with the
// transport's own rate measured in the same run, whole-request and layer-wise, and charts.
#include <openssl/rand.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/ports.h"
#include "common/subprocess.h"
#include "kvferry/rank_table.h"
#include "sidechannel/zmq_util.h"
#include "tools/commands.h"
#include "tools/control_client.h"
#include "tools/engine_protocol.h"
#include "tools/pipeline.h"
#include "tools/pipeline_cli.h"

namespace kvferry::cli {
namespace {

using Json = nlohmann::json;
using std::chrono::milliseconds;

struct E2eArgs {
  PipelineArgs pipeline;
  /// off (whole-request), on (layer-wise), or both, measured one after the other per length.
  std::string layerwise = "off";
  bool warm_pool = false;
  std::vector<int> prompts = {128, 512, 2048};
  /// Requests in flight, swept: each point runs at least this many measured requests.
  std::vector<int> concurrency = {16};
  bool concurrency_given = false;  // then each point runs at least that many measured requests
  int requests = 24;
  int warmup = 8;
  bool json = false;
  std::string chart;
};

// The transport baselines for the model's block size, measured now by bench transport.
Json TransportBaselines(const ModelArgs& m, int tp) {
  Result<CacheSpecOptions> o = BuildModel(m);
  if (!o.ok()) return Json::object();
  o->tp_size = tp;
  Result<CacheSpec> spec = CacheSpec::Create(*o);
  if (!spec.ok()) return Json::object();
  const std::string block = std::to_string(spec->BlockBytes(0));
  Result<Subprocess> p = Subprocess::Spawn({SelfExe(), "bench", "transport", "--sizes", block,
                                            "--repeat", "1", "--min-seconds", "0.3", "--json"});
  if (!p.ok()) return Json::object();
  Result<std::string> line = p->ReadLine(milliseconds(120000));
  (void)p->CloseAndWait(milliseconds(5000));
  if (!line.ok()) return Json::object();
  Json j = Json::parse(*line, nullptr, false);
  return j.is_discarded() ? Json::object() : j;
}

// The transport's own rate at the model's block size, measured in this run by bench transport,
// for the backend the pipeline uses (auto on one host: shm); 0 when not measured.
std::string BaselineBackendName(const std::string& transport) {
  return transport == "auto" ? "shm" : transport.substr(0, transport.find(','));
}

double BaselineGbps(const Json& baselines, const std::string& transport) {
  if (!baselines.contains("results")) return 0;
  const std::string want = BaselineBackendName(transport);
  for (const Json& b : baselines["results"]) {
    if (b.value("backend", "") == want) return b.value("gbps", 0.0);
  }
  return 0;
}

// Runs gnuplot on `script`, which draws from `data`, and removes both.
Status RunGnuplot(const std::string& script, const std::string& data) {
  const std::string cmd = "gnuplot " + script;
  if (std::system(cmd.c_str()) != 0) {  // NOLINT(concurrency-mt-unsafe): one thread here
    return Status::Internal("gnuplot failed; is gnuplot installed (make deps)?");
  }
  std::filesystem::remove(data);
  std::filesystem::remove(script);
  return Status::Ok();
}

// The first lines of a chart's gnuplot script: a 1200x500 PNG at --chart, two panels under
// `title`.
void ChartHeader(std::ostream& gp, const E2eArgs& a, const std::string& title) {
  gp << "set terminal png size 1200,500\n"
     << "set output '" << a.chart << "'\n"
     << "set multiplot layout 1,2 title '" << title << "'\n";
}

// What a run comparing whole-request and layer-wise transfer ran: layers, TP, transport, compute.
std::string RunDescription(const E2eArgs& a) {
  return std::to_string(a.pipeline.model.layers) + " layers, TP " +
         std::to_string(a.pipeline.prefill_tp) + " -> " + std::to_string(a.pipeline.decode_tp) +
         ", " + a.pipeline.transport + ", " + std::to_string(a.pipeline.compute_us_per_token) +
         " us/token of prefill compute";
}

// Two panels against prompt length, of what kvferry does per request: the transfer time in the
// connector (p50, p99), and the rate (bytes / transfer time: p50, p10) under the transport's own
// rate measured in the same run.
Status WriteChart(const E2eArgs& a, const Json& points, const Json& baselines) {
  const std::string data = a.chart + ".dat";
  {
    std::ofstream out(data);
    for (const Json& pt : points) {
      const Json& c = pt["connector"];
      out << pt["prompt_tokens"].get<int>() << " " << c["transfer_ms_p50"].get<double>() << " "
          << c["transfer_ms_p99"].get<double>() << " " << c["request_gbps_p50"].get<double>() << " "
          << c["request_gbps_p10"].get<double>() << "\n";
    }
    if (!out) return Status::Internal("cannot write " + data);
  }
  const double baseline = BaselineGbps(baselines, a.pipeline.transport);
  const std::string script = a.chart + ".gp";
  {
    std::ofstream gp(script);
    ChartHeader(gp, a,
                "kvferry per request: prefill TP " + std::to_string(a.pipeline.prefill_tp) +
                    " -> decode TP " + std::to_string(a.pipeline.decode_tp) + ", transport " +
                    a.pipeline.transport + ", " + std::to_string(a.requests) +
                    " requests per point");
    gp << "set logscale x 2\nset grid\nset key top left\nset xlabel 'prompt length (tokens)'\n"
       << "set ylabel 'transfer time in the connector (ms)'\n"
       << "plot '" << data << "' using 1:2 with linespoints lw 2 pt 7 title 'p50', '" << data
       << "' using 1:3 with linespoints lw 2 pt 5 title 'p99'\n"
       << "set ylabel 'per-request rate (GB/s)'\nset yrange [0:*]\n"
       << "plot '" << data << "' using 1:4 with linespoints lw 2 pt 7 title 'p50', '" << data
       << "' using 1:5 with linespoints lw 2 pt 5 title 'p10 (slow tail)'";
    if (baseline > 0) {
      gp << ", " << baseline << " with lines dt 2 lw 2 title 'transport alone, same run ("
         << BaselineBackendName(a.pipeline.transport) << ")'";
    }
    gp << "\nunset multiplot\n";
    if (!gp) return Status::Internal("cannot write " + script);
  }
  return RunGnuplot(script, data);
}

// Two panels against prompt length, whole-request and layer-wise side by side: TTFT p50, and the
// exposed transfer p50 (from the end of each request's prefill compute to its decode's first
// step).
Status WriteLayerwiseChart(const E2eArgs& a, const Json& points) {
  const std::string data = a.chart + ".dat";
  {
    std::ofstream out(data);
    std::map<int, std::map<std::string, const Json*>> by_len;
    for (const Json& pt : points) by_len[pt["prompt_tokens"].get<int>()][pt["mode"]] = &pt;
    for (const auto& [len, modes] : by_len) {
      if (modes.size() != 2) continue;
      const Json& w = *modes.at("whole");
      const Json& l = *modes.at("layerwise");
      out << len << " " << w["ttft_p50_ms"].get<double>() << " " << l["ttft_p50_ms"].get<double>()
          << " " << w["exposed_p50_ms"].get<double>() << " " << l["exposed_p50_ms"].get<double>()
          << "\n";
    }
    if (!out) return Status::Internal("cannot write " + data);
  }
  const std::string script = a.chart + ".gp";
  {
    std::ofstream gp(script);
    ChartHeader(gp, a,
                "whole-request and layer-wise transfer, same run: " + RunDescription(a) + ", " +
                    std::to_string(a.requests) + " requests a point");
    gp << "set logscale x 2\nset grid\nset key top left\nset xlabel 'prompt length (tokens)'\n"
       << "set logscale y 10\nset ylabel 'TTFT p50 (ms)'\n"
       << "plot '" << data << "' using 1:2 with linespoints lw 2 pt 7 title 'whole-request', '"
       << data << "' using 1:3 with linespoints lw 2 pt 5 title 'layer-wise'\n"
       << "unset logscale y\nset yrange [*:*]\nset xzeroaxis\n"
       << "set ylabel 'exposed transfer p50 (ms)'\n"
       << "set title 'exposed = TTFT - prefill compute - first decode step'\n"
       << "plot '" << data << "' using 1:4 with linespoints lw 2 pt 7 title 'whole-request', '"
       << data << "' using 1:5 with linespoints lw 2 pt 5 title 'layer-wise'\n"
       << "unset multiplot\n";
    if (!gp) return Status::Internal("cannot write " + script);
  }
  return RunGnuplot(script, data);
}

// A --concurrency sweep with both modes: two panels against the requests in flight, each prompt
// length whole-request and layer-wise: the exposed transfer p50 (from the end of each request's
// own prefill compute to its decode's first step), and the decode instance's peak threads.
Status WriteConcurrencyChart(const E2eArgs& a, const Json& points) {
  // The exposed panel's log axis starts here; a point at or below it is drawn on it.
  constexpr double kHiddenFloorMs = 0.01;
  const std::string data = a.chart + ".dat";
  // Rows by concurrency; per prompt length four columns: exposed whole, exposed layer-wise,
  // threads whole, threads layer-wise (NaN where a point is missing).
  std::map<int, std::map<int, std::map<std::string, const Json*>>> by_conc;
  std::set<int> lens;
  for (const Json& pt : points) {
    const int len = pt["prompt_tokens"].get<int>();
    lens.insert(len);
    by_conc[pt["concurrency"].get<int>()][len][pt["mode"]] = &pt;
  }
  {
    std::ofstream out(data);
    for (const auto& [conc, by_len] : by_conc) {
      out << conc;
      for (int len : lens) {
        // A name of its own for the binding: clang before 16 cannot capture structured bindings.
        auto at = [&, &row = by_len](const char* mode, const char* key) -> std::string {
          auto l = row.find(len);
          if (l == row.end() || l->second.count(mode) == 0) return "NaN";
          return l->second.at(mode)->at(key).dump();
        };
        out << " " << at("whole", "exposed_p50_ms") << " " << at("layerwise", "exposed_p50_ms")
            << " " << at("whole", "decode_threads_peak") << " "
            << at("layerwise", "decode_threads_peak");
      }
      out << "\n";
    }
    if (!out) return Status::Internal("cannot write " + data);
  }
  const std::string script = a.chart + ".gp";
  {
    std::ofstream gp(script);
    ChartHeader(gp, a,
                "whole-request and layer-wise under concurrency, same run: " + RunDescription(a));
    gp << "set logscale x 2\nset grid\nset key top left\nset xlabel 'requests in flight'\n"
       << "set logscale y 10\nset ylabel 'exposed transfer p50 (ms; at most " << kHiddenFloorMs
       << " drawn at " << kHiddenFloorMs << ")'\n"
       << "set title 'from the end of its prefill compute to its first decode step'\n";
    // `floor`: a value on the log axis (an exposed transfer at or below zero, every byte read
    // before the prefill's compute ended, would leave the line out).
    auto plot = [&](int first_column, bool floor) {
      auto y = [&](int column) {
        if (!floor) return std::to_string(column);
        std::ostringstream e;
        e << "(column(" << column << ") > " << kHiddenFloorMs << " ? column(" << column
          << ") : " << kHiddenFloorMs << ")";
        return e.str();
      };
      gp << "plot ";
      int column = first_column;
      for (int len : lens) {
        if (column != first_column) gp << ", ";
        gp << "'" << data << "' using 1:" << y(column) << " with linespoints lw 2 pt 7 title '"
           << len << " tokens, whole-request', '" << data << "' using 1:" << y(column + 1)
           << " with linespoints lw 2 pt 5 title '" << len << " tokens, layer-wise'";
        column += 4;
      }
      gp << "\n";
    };
    plot(2, /*floor=*/true);
    gp << "unset logscale y\nset yrange [0:*]\nset key bottom right\n"
       << "set ylabel 'decode instance threads, peak'\n"
       << "set title 'threads of the decode instance'\n";
    plot(4, /*floor=*/false);
    gp << "unset multiplot\n";
    if (!gp) return Status::Internal("cannot write " + script);
  }
  return RunGnuplot(script, data);
}

// A hybrid model's point: the bytes per request against the bound of what it needs, and against
// vLLM's full-attention fallback run now on the same prompts (a model with a window only).
Result<Json> HybridFigures(const E2eArgs& a, const PipelineArgs& p,
                           const std::vector<std::vector<std::int32_t>>& prompts, int warmup,
                           int len, const ConnectorFigures& conn) {
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t bound,
                           BoundBytesPerRequest(RoleModel(p, false), p.decode_tp, len));
  Json out = {{"groups", GroupsSpec(a.pipeline.model)},
              {"bytes_per_request_p50", conn.bytes_p50},
              {"bound_bytes_per_request", bound},
              {"within_bound", conn.bytes_p50 > 0 && conn.bytes_p50 <= bound},
              {"fallback", nullptr}};
  const std::optional<ModelArgs> fallback = FullAttentionFallback(a.pipeline.model);
  if (!fallback) return out;
  PipelineArgs f = p;
  f.model = *fallback;
  KVFERRY_ASSIGN_OR_RETURN(PipelineResult r, RunPipeline(f, prompts));
  std::vector<RequestTiming> measured;
  for (const RequestTiming& t : r.timings) {
    if (t.index >= static_cast<std::size_t>(warmup)) measured.push_back(t);
  }
  const ConnectorFigures fc = FiguresOf(measured);
  out["fallback"] = {{"groups", fallback->groups},
                     {"bytes_per_request_p50", fc.bytes_p50},
                     {"failed", r.failed},
                     {"leaked", r.leaked}};
  out["bytes_vs_fallback"] =
      fc.bytes_p50 > 0 ? static_cast<double>(conn.bytes_p50) / static_cast<double>(fc.bytes_p50)
                       : 0.0;
  return out;
}

void PrintHybrid(int len, const char* mode, const Json& h) {
  std::fprintf(stdout,
               "prompt %6d tokens, %-9s: hybrid %s: %.2f MiB per request (bound %.2f MiB%s)", len,
               mode, h["groups"].get<std::string>().c_str(),
               static_cast<double>(h["bytes_per_request_p50"].get<std::uint64_t>()) / 1048576.0,
               static_cast<double>(h["bound_bytes_per_request"].get<std::uint64_t>()) / 1048576.0,
               h["within_bound"].get<bool>() ? "" : ", EXCEEDED");
  if (h["fallback"].is_null()) {
    std::fprintf(stdout, "\n");
    return;
  }
  std::fprintf(
      stdout, "; full-attention fallback %.2f MiB in the same run: %.1f %% of it\n",
      static_cast<double>(h["fallback"]["bytes_per_request_p50"].get<std::uint64_t>()) / 1048576.0,
      100.0 * h["bytes_vs_fallback"].get<double>());
}

int RunE2e(const E2eArgs& a) {
  if (!a.chart.empty() && a.concurrency.size() > 1 && a.layerwise != "both") {
    std::cerr << "kvferry bench e2e: with a --concurrency sweep, --chart plots whole-request "
                 "against layer-wise; give --layerwise both, or one --concurrency value\n";
    return 2;
  }
  Json points = Json::array();
  std::vector<bool> modes;
  if (a.layerwise != "on") modes.push_back(false);
  if (a.layerwise != "off") modes.push_back(true);
  for (int concurrency : a.concurrency) {
    for (int len : a.prompts) {
      for (bool layerwise : modes) {
        // The warm-up requests go first (fresh instances: first handshakes, first touches of the
        // caches' pages) and are left out of the per-request figures.
        // With --warm-pool, enough warm-up for the decode pool to be cycled once: the decode prefix
        // cache keeps each
        // request's blocks, so requests land in blocks nobody used until the pool is full, and the
        // kernel's first write into a page costs several times a later one (about 12 us a page
        // on this VM), which is not kvferry's doing and would blur the comparison.
        const std::int64_t blocks = (len + a.pipeline.model.tokens_per_block - 1) /
                                    std::max<std::int64_t>(1, a.pipeline.model.tokens_per_block);
        const int warmup =
            !a.warm_pool
                ? a.warmup
                : std::max<int>(a.warmup, static_cast<int>(std::min<std::int64_t>(
                                              64, (a.pipeline.model.num_blocks + blocks - 1) /
                                                      std::max<std::int64_t>(1, blocks))));
        const int requests = a.concurrency_given ? std::max(a.requests, concurrency) : a.requests;
        const auto prompts =
            MakePrompts(warmup + requests, len, len, 0.0, static_cast<std::uint32_t>(len));
        PipelineArgs p = a.pipeline;
        p.progress = false;
        p.layerwise = layerwise;
        p.concurrency = concurrency;
        Result<PipelineResult> r = RunPipeline(p, prompts);
        if (!r.ok()) {
          std::cerr << "kvferry bench e2e: " << r.status().ToString() << "\n";
          return 1;
        }
        std::vector<double> ttft, exposed, exposed_ttft, queue, compute, first_step, to_loaded;
        std::vector<RequestTiming> measured;
        int took_layerwise = 0;
        for (const RequestTiming& t : r->timings) {
          if (t.index < static_cast<std::size_t>(warmup)) continue;
          ttft.push_back(t.ttft_ms);
          exposed.push_back(t.exposed_ms());
          if (const double l = t.exposed_to_loaded_ms(); !std::isnan(l)) to_loaded.push_back(l);
          exposed_ttft.push_back(t.exposed_ttft_ms());
          queue.push_back(t.queue_ms);
          compute.push_back(t.compute_ms);
          first_step.push_back(t.first_step_ms);
          measured.push_back(t);
          took_layerwise += t.layerwise ? 1 : 0;
        }
        const double gb = static_cast<double>(r->bytes_moved) / 1e9;
        const ConnectorFigures conn = FiguresOf(measured);
        const char* mode = layerwise ? "layerwise" : "whole";
        Json hybrid;
        if (!GroupsSpec(a.pipeline.model).empty()) {
          Result<Json> h = HybridFigures(a, p, prompts, warmup, len, conn);
          if (!h.ok()) {
            std::cerr << "kvferry bench e2e: " << h.status().ToString() << "\n";
            return 1;
          }
          hybrid = *h;
        }
        const Json& dec = r->decode_end;
        points.push_back({{"prompt_tokens", len},
                          {"concurrency", concurrency},
                          {"prefill_queue_p50_ms", Percentile(queue, 0.5)},
                          {"prefill_queue_p99_ms", Percentile(queue, 0.99)},
                          {"exposed_ttft_p50_ms", Percentile(exposed_ttft, 0.5)},
                          {"exposed_ttft_p99_ms", Percentile(exposed_ttft, 0.99)},
                          {"decode_threads_peak", dec.value("threads_peak", 0)},
                          {"decode_rss_peak_bytes", dec.value("rss_peak_bytes", std::uint64_t{0})},
                          {"hybrid", hybrid},
                          {"mode", mode},
                          {"layerwise_requests", took_layerwise},
                          {"connector", FiguresJson(conn)},
                          {"requests", requests},
                          {"warmup", warmup},
                          {"failed", r->failed},
                          {"leaked", r->leaked},
                          {"bytes_moved", r->bytes_moved},
                          {"wall_s", r->wall_s},
                          {"gbps", r->wall_s > 0 ? gb / r->wall_s : 0},
                          {"ttft_p50_ms", Percentile(ttft, 0.5)},
                          {"ttft_p99_ms", Percentile(ttft, 0.99)},
                          {"exposed_p50_ms", Percentile(exposed, 0.5)},
                          {"exposed_p99_ms", Percentile(exposed, 0.99)},
                          // Of it, until the decode engine saw the load finished; the rest is
                          // the engine's pick-up (docs/layerwise.md).
                          {"exposed_to_loaded_p50_ms", Percentile(to_loaded, 0.5)},
                          {"exposed_to_loaded_p99_ms", Percentile(to_loaded, 0.99)},
                          {"prefill_compute_p50_ms", Percentile(compute, 0.5)},
                          {"first_step_p50_ms", Percentile(first_step, 0.5)}});
        points.back().update(TransferPercentilesJson(r->decode_end));
        if (!a.json) {
          std::fprintf(
              stdout,
              "prompt %6d tokens, %-9s, concurrency %3d: %3d requests, %d failed; kvferry "
              "per request: %.2f MB, transfer p50 %.2f p99 %.2f ms, rate p50 %.2f p10 %.2f "
              "GB/s; TTFT p50 %.1f p99 %.1f ms (prefill queue p50 %.1f p99 %.1f, compute "
              "%.1f, first step %.1f), exposed transfer p50 %.2f p99 %.2f ms (until the "
              "decode engine saw it loaded p50 %.2f); decode instance: %d threads at most, "
              "%.0f MiB resident at most\n",
              len, mode, concurrency, requests, r->failed,
              static_cast<double>(conn.bytes_p50) / 1e6, conn.ms_p50, conn.ms_p99, conn.gbps_p50,
              conn.gbps_p10, Percentile(ttft, 0.5), Percentile(ttft, 0.99), Percentile(queue, 0.5),
              Percentile(queue, 0.99), Percentile(compute, 0.5), Percentile(first_step, 0.5),
              Percentile(exposed, 0.5), Percentile(exposed, 0.99), Percentile(to_loaded, 0.5),
              dec.value("threads_peak", 0),
              static_cast<double>(dec.value("rss_peak_bytes", std::uint64_t{0})) / 1048576.0);
          if (!hybrid.is_null()) PrintHybrid(len, mode, hybrid);
          std::fflush(stdout);
        }
      }
      if (modes.size() == 2 && !a.json) {
        const Json& w = points[points.size() - 2];
        const Json& l = points[points.size() - 1];
        const double we = w["exposed_p50_ms"].get<double>();
        const double wt = w["ttft_p50_ms"].get<double>();
        std::fprintf(stdout,
                     "prompt %6d tokens, concurrency %3d: layer-wise exposed transfer %.1f %% of "
                     "whole-request's, TTFT p50 %.1f %% of whole-request's\n",
                     len, concurrency,
                     we > 0 ? 100.0 * l["exposed_p50_ms"].get<double>() / we : 0.0,
                     wt > 0 ? 100.0 * l["ttft_p50_ms"].get<double>() / wt : 0.0);
      }
    }
  }
  const Json baselines = TransportBaselines(a.pipeline.model, a.pipeline.decode_tp);
  const Json report = {{"points", points}, {"transport_baselines", baselines}};
  if (a.json) {
    std::cout << report.dump(2) << std::endl;
  } else if (baselines.contains("results")) {
    for (const Json& b : baselines["results"]) {
      std::fprintf(stdout, "baseline %s at %llu-byte blocks: %.2f GB/s (%s %.2f GB/s)\n",
                   b.value("backend", "").c_str(),
                   static_cast<unsigned long long>(b.value("block_bytes", 0)), b.value("gbps", 0.0),
                   b.value("baseline", "").c_str(), b.value("baseline_gbps", 0.0));
    }
  }
  if (!a.chart.empty()) {
    Status c = a.concurrency.size() > 1 ? WriteConcurrencyChart(a, points)
               : modes.size() == 2      ? WriteLayerwiseChart(a, points)
                                        : WriteChart(a, points, baselines);
    if (!c.ok()) {
      std::cerr << "kvferry bench e2e: " << c.ToString() << "\n";
      return 1;
    }
    if (!a.json) std::cout << "chart: " << a.chart << "\n";
  }
  for (const Json& pt : points) {
    if (pt["failed"].get<int>() != 0 || pt["leaked"].get<bool>()) return 1;
    if (!pt["hybrid"].is_null() && !pt["hybrid"]["within_bound"].get<bool>()) return 1;
  }
  return 0;
}

}  // namespace

void AddBenchE2eCommand(CLI::App& bench, int& exit_code) {
  auto e = std::make_shared<E2eArgs>();
  CLI::App* e2e = bench.add_subcommand(
      "e2e", "The demo pipeline over a sweep of prompt lengths, with transport baselines");
  e2e->add_option("--prompts", e->prompts, "Prompt lengths in tokens")->delimiter(',');
  e2e->add_option("--requests", e->requests, "Measured requests per prompt length")
      ->capture_default_str();
  e2e->add_option("--warmup", e->warmup,
                  "Requests per prompt length run first and left out of the per-request figures")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  e2e->add_flag("--json", e->json, "Machine-readable output");
  e2e->add_flag("--warm-pool", e->warm_pool,
                "More warm-up requests, until the decode pool has been cycled once (at most 64): "
                "the kernel's first write into a page costs several times a later one on some "
                "machines, which would blur a comparison");
  e2e->add_option("--layerwise", e->layerwise,
                  "off: whole-request transfer; on: layer-wise; both: each prompt length both "
                  "ways in this run, with the exposed transfer of each (docs/layerwise.md)")
      ->capture_default_str()
      ->check(CLI::IsMember({"off", "on", "both"}));
  e2e->add_option("--chart", e->chart,
                  "Write a PNG chart (gnuplot): kvferry's per-request transfer time and rate "
                  "against prompt length, with the transport's same-run rate; with --layerwise "
                  "both, TTFT and exposed transfer of both modes against prompt length; with a "
                  "--concurrency sweep (and --layerwise both), exposed transfer and the decode "
                  "instance's threads against concurrency");
  AddPipelineOptions(*e2e, e->pipeline);
  // The pipeline's one --concurrency becomes a list swept here.
  e2e->remove_option(e2e->get_option("--concurrency"));
  e2e->add_option("--concurrency", e->concurrency,
                  "Requests in flight, comma-separated to sweep (each point runs at least that "
                  "many measured requests); per point the exposed transfer of each request from "
                  "the end of its prefill compute to its decode's first step, the prefill queue "
                  "apart, and the decode instance's peak threads and memory")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  e2e->callback([e, e2e, &exit_code] {
    e->concurrency_given = e2e->count("--concurrency") > 0;
    exit_code = RunE2e(*e);
  });
}

}  // namespace kvferry::cli
