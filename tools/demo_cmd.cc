// kvferry demo: a prefill and a decode instance (kvferry serve, TP workers each) on this host,
// driven through a proxy that forwards kv_transfer_params, with every byte verified.
// kvferry bench e2e: the same pipeline over a sweep of prompt lengths.
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

namespace kvferry::cli {
namespace {

using Json = nlohmann::json;
using std::chrono::milliseconds;

struct DemoArgs {
  PipelineArgs pipeline;
  int requests = 200;
  int min_prompt = 32;
  int max_prompt = 2048;
  double shared_prefix = 0.3;
  bool json = false;
};

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(std::lround(q * static_cast<double>(v.size() - 1)));
  return v[std::min(i, v.size() - 1)];
}

// Per-request figures of the connector itself (not of the demo engine around it): transfer
// times and rates of the loads that read bytes, exact per request.
struct ConnectorFigures {
  int loads = 0;
  std::uint64_t bytes = 0;
  double ms_p50 = 0, ms_p90 = 0, ms_p99 = 0, ms_max = 0;
  double gbps_p50 = 0, gbps_p10 = 0;  // bytes / transfer time; p10: the slow tail
  std::uint64_t bytes_p50 = 0;        // per request
};

ConnectorFigures FiguresOf(const std::vector<RequestTiming>& timings) {
  ConnectorFigures f;
  std::vector<double> ms, gbps, bytes;
  for (const RequestTiming& t : timings) {
    if (t.transfer_bytes == 0 || t.transfer_ms <= 0) continue;
    ++f.loads;
    f.bytes += t.transfer_bytes;
    ms.push_back(t.transfer_ms);
    gbps.push_back(static_cast<double>(t.transfer_bytes) / (t.transfer_ms * 1e6));
    bytes.push_back(static_cast<double>(t.transfer_bytes));
  }
  f.ms_p50 = Percentile(ms, 0.5);
  f.ms_p90 = Percentile(ms, 0.9);
  f.ms_p99 = Percentile(ms, 0.99);
  f.ms_max = Percentile(ms, 1.0);
  f.gbps_p50 = Percentile(gbps, 0.5);
  f.gbps_p10 = Percentile(gbps, 0.1);
  f.bytes_p50 = static_cast<std::uint64_t>(Percentile(bytes, 0.5));
  return f;
}

Json FiguresJson(const ConnectorFigures& f) {
  return {{"loads", f.loads},
          {"bytes", f.bytes},
          {"transfer_ms_p50", f.ms_p50},
          {"transfer_ms_p90", f.ms_p90},
          {"transfer_ms_p99", f.ms_p99},
          {"transfer_ms_max", f.ms_max},
          {"request_gbps_p50", f.gbps_p50},
          {"request_gbps_p10", f.gbps_p10},
          {"request_bytes_p50", f.bytes_p50}};
}

// Prompt lengths spread log-uniformly; a share of them start with one of a few common system
// prompts, so the decode side's prefix cache gets hits.
std::vector<std::vector<std::int32_t>> MakePrompts(int n, int min_len, int max_len, double shared,
                                                   std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::int32_t>> prefixes(4);
  for (auto& p : prefixes) {
    for (int i = 0; i < 256; ++i) p.push_back(static_cast<std::int32_t>(rng() % 32000));
  }
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<std::vector<std::int32_t>> out;
  for (int i = 0; i < n; ++i) {
    const double x = std::log(min_len) + u(rng) * (std::log(max_len) - std::log(min_len));
    const auto len = static_cast<std::size_t>(std::exp(x));
    std::vector<std::int32_t> p;
    if (u(rng) < shared) p = prefixes[rng() % prefixes.size()];
    while (p.size() < std::max<std::size_t>(len, 1))
      p.push_back(static_cast<std::int32_t>(rng() % 32000));
    out.push_back(std::move(p));
  }
  return out;
}

int RunDemo(const DemoArgs& a) {
  if (!a.json) {
    const bool external = !a.pipeline.prefill_control.empty();
    std::cout << "kvferry demo: "
              << (external
                      ? "the running instances at " + a.pipeline.prefill_control + " -> " +
                            a.pipeline.decode_control
                      : std::to_string(a.pipeline.prefill_instances) +
                            " prefill instance(s) of TP " + std::to_string(a.pipeline.prefill_tp) +
                            " -> " + std::to_string(a.pipeline.decode_instances) +
                            " decode instance(s) of TP " + std::to_string(a.pipeline.decode_tp))
              << ", " << a.requests << " requests, prompts " << a.min_prompt << ".." << a.max_prompt
              << " tokens, transport " << a.pipeline.transport << ", model "
              << a.pipeline.model.kind << " " << a.pipeline.model.layers << " layers" << std::endl;
  }
  const auto prompts =
      MakePrompts(a.requests, a.min_prompt, a.max_prompt, a.shared_prefix, a.pipeline.seed);
  Result<PipelineResult> r = RunPipeline(a.pipeline, prompts);
  if (!r.ok()) {
    std::cerr << "kvferry demo: " << r.status().ToString() << "\n";
    return 1;
  }
  std::vector<double> load, ttft, prefill, decode, exposed;
  int layerwise = 0;
  for (const RequestTiming& t : r->timings) {
    load.push_back(t.load_ms);
    ttft.push_back(t.ttft_ms);
    prefill.push_back(t.compute_ms);
    decode.push_back(t.decode_ms);
    exposed.push_back(t.exposed_ms());
    layerwise += t.layerwise ? 1 : 0;
  }
  const double gb = static_cast<double>(r->bytes_moved) / 1e9;
  const ConnectorFigures conn = FiguresOf(r->timings);
  Json report = {
      {"connector", FiguresJson(conn)},
      {"requests", a.requests},
      {"done", r->done},
      {"failed", r->failed},
      {"aborted", r->aborted()},
      {"aborted_at_prefill", r->aborted_at_prefill},
      {"aborted_after_prefill", r->aborted_after_prefill},
      {"aborted_at_decode", r->aborted_at_decode},
      {"aborts_too_late", r->aborts_too_late},
      {"errors", std::vector<std::string>(
                     r->errors.begin(),
                     r->errors.begin() +
                         static_cast<std::ptrdiff_t>(std::min<std::size_t>(r->errors.size(), 50)))},
      {"bytes_moved", r->bytes_moved},
      {"bytes_verified", r->bytes_verified},
      {"wall_s", r->wall_s},
      {"throughput_gbps", r->wall_s > 0 ? gb / r->wall_s : 0},
      {"load_p50_ms", Percentile(load, 0.5)},
      {"load_p99_ms", Percentile(load, 0.99)},
      {"transfer_p50_us", r->decode_end.value("transfer_p50_us", 0)},
      {"transfer_p90_us", r->decode_end.value("transfer_p90_us", 0)},
      {"transfer_p99_us", r->decode_end.value("transfer_p99_us", 0)},
      {"transfer_max_us", r->decode_end.value("transfer_max_us", 0)},
      {"ttft_p50_ms", Percentile(ttft, 0.5)},
      {"ttft_p99_ms", Percentile(ttft, 0.99)},
      {"prefill_p50_ms", Percentile(prefill, 0.5)},
      {"layerwise_requests", layerwise},
      {"exposed_p50_ms", Percentile(exposed, 0.5)},
      {"exposed_p99_ms", Percentile(exposed, 0.99)},
      {"decode_p50_ms", Percentile(decode, 0.5)},
      {"prefix_hit_blocks", r->prefix_hit_blocks},
      {"recomputed_blocks", r->recomputed_blocks},
      {"prefill_end", r->prefill_end},
      {"decode_end", r->decode_end},
      {"leaked", r->leaked}};
  if (a.json) {
    std::cout << report.dump(2) << std::endl;
  } else {
    char line[3072];
    std::snprintf(
        line, sizeof(line),
        "kvferry       %d loads, %.3f GB read by the connector; per request: transfer p50 %.2f "
        "ms, p90 %.2f ms, p99 %.2f ms, max %.2f ms; rate p50 %.2f GB/s, p10 %.2f GB/s\n"
        "requests      %d done, %d aborted, %d failed (of %d)\n"
        "verified      %.3f GB, every byte; %lld blocks from the decode prefix cache, "
        "%lld recomputed\n"
        "held at end   prefill %d blocks, %d holds; decode %d blocks\n"
        "demo engine   its own costs, not kvferry's: prefill p50 %.2f ms (simulated compute, "
        "KV generation); load p50 %.2f ms, p99 %.2f ms as the decode engine saw it (queued "
        "behind its verification); TTFT p50 %.2f ms, p99 %.2f ms; %.3f GB in %.2f s = %.2f "
        "GB/s across the run, which the demo engine's byte generation and checking bound\n",
        conn.loads, static_cast<double>(conn.bytes) / 1e9, conn.ms_p50, conn.ms_p90, conn.ms_p99,
        conn.ms_max, conn.gbps_p50, conn.gbps_p10, r->done, r->aborted(), r->failed, a.requests,
        static_cast<double>(r->bytes_verified) / 1e9, static_cast<long long>(r->prefix_hit_blocks),
        static_cast<long long>(r->recomputed_blocks), r->prefill_end.value("used_blocks", -1),
        r->prefill_end.value("holds", -1), r->decode_end.value("used_blocks", -1),
        Percentile(prefill, 0.5), Percentile(load, 0.5), Percentile(load, 0.99),
        Percentile(ttft, 0.5), Percentile(ttft, 0.99), gb, r->wall_s,
        r->wall_s > 0 ? gb / r->wall_s : 0);
    std::cout << line;
    if (a.pipeline.layerwise) {
      std::printf(
          "layer-wise    %d of %zu requests sent to both instances at once (shorter than %lld "
          "tokens: whole-request); exposed transfer p50 %.2f ms, p99 %.2f ms (TTFT less the "
          "prefill's compute and the decode's first step)\n",
          layerwise, r->timings.size(), static_cast<long long>(a.pipeline.layerwise_min_tokens),
          Percentile(exposed, 0.5), Percentile(exposed, 0.99));
    }
    for (std::size_t i = 0; i < std::min<std::size_t>(r->errors.size(), 10); ++i) {
      std::cout << "error         " << r->errors[i] << "\n";
    }
  }
  if (!a.json && a.pipeline.abort_rate > 0) {
    std::printf(
        "aborted       %d at prefill, %d after prefill (hold ended by lease), %d at decode "
        "(dropped while waiting, or load stopped and prefill told); %d aborts came after the "
        "request had ended\n",
        r->aborted_at_prefill, r->aborted_after_prefill, r->aborted_at_decode, r->aborts_too_late);
  }
  const bool ok = r->failed == 0 && !r->leaked && r->done + r->aborted() == a.requests;
  if (!a.json) std::cout << (ok ? "demo: ok" : "demo: FAILED") << std::endl;
  return ok ? 0 : 1;
}

void AddPipelineOptions(CLI::App& cmd, PipelineArgs& p) {
  cmd.add_option("--prefill-instances", p.prefill_instances,
                 "Prefill instances (xPyD); the proxy balances by outstanding requests")
      ->capture_default_str();
  cmd.add_option("--decode-instances", p.decode_instances, "Decode instances (xPyD)")
      ->capture_default_str();
  cmd.add_option("--prefill-tp", p.prefill_tp, "TP size of the prefill instance")
      ->capture_default_str();
  cmd.add_option("--decode-tp", p.decode_tp, "TP size of the decode instance")
      ->capture_default_str();
  cmd.add_option("--transport", p.transport, TransportChoices())->capture_default_str();
  AddTransportOptOption(cmd, p.transport_opts);
  cmd.add_flag("--shm-permit-any-tracer", p.shm_permit_any_tracer,
               "Pass --shm-permit-any-tracer to the instances started here (shm between them "
               "under Yama ptrace_scope=1)");
  cmd.add_option("--concurrency", p.concurrency, "Requests in flight")->capture_default_str();
  cmd.add_option("--hold-lease-ms", p.hold_lease_ms,
                 "Prefill hold lease (of the instances started here; with --prefill-control, "
                 "say theirs: the run waits that long for abandoned holds to end)")
      ->capture_default_str();
  cmd.add_option("--abort-rate", p.abort_rate,
                 "Share of requests abandoned by the client, at prefill, between prefill and "
                 "decode, or at decode")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  cmd.add_option("--request-timeout-ms", p.request_timeout_ms,
                 "A request with no answer from an instance in this long fails")
      ->capture_default_str();
  cmd.add_option("--seed", p.seed, "Seed of the prompts and of the abort choices")
      ->capture_default_str();
  cmd.add_option("--compute-us-per-token", p.compute_us_per_token,
                 "Simulated prefill compute per token, in which the KV bytes are made "
                 "(layer-wise requests: an equal share per layer)");
  cmd.add_option("--layerwise-min-tokens", p.layerwise_min_tokens,
                 "With layer-wise transfer: shorter prompts take the whole-request path")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--drop-prefill-legs", p.drop_prefill_legs,
                 "Fault injection, layer-wise: share of requests whose prefill leg the proxy "
                 "never sends (their decode loads fail at the start deadline, recomputed)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  cmd.add_option("--prefill-chunk-tokens", p.prefill_chunk_tokens,
                 "Prefill instances: chunked prefill of layer-wise requests (0: whole prompts)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--layers-per-notice", p.layers_per_notice,
                 "Prefill instances: layers per layer-wise announcement")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  cmd.add_option("--memory", p.memory,
                 "Where both instances keep their KV caches: host, or a device (sim:0, cuda:0); "
                 "every byte is verified by copying it back")
      ->capture_default_str();
  cmd.add_option("--prefill-control", p.prefill_control,
                 "Control endpoints of running prefill instances, comma-separated (with "
                 "--decode-control: drive those instead of starting instances here)");
  cmd.add_option("--decode-control", p.decode_control,
                 "Control endpoints of running decode instances, comma-separated");
  AddModelOptions(cmd, p.model);
}

struct E2eArgs {
  PipelineArgs pipeline;
  /// off (whole-request), on (layer-wise), or both, measured one after the other per length.
  std::string layerwise = "off";
  bool warm_pool = false;
  std::vector<int> prompts = {128, 512, 2048};
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
    gp << "set terminal png size 1200,500\n"
       << "set output '" << a.chart << "'\n"
       << "set multiplot layout 1,2 title 'kvferry per request: prefill TP "
       << a.pipeline.prefill_tp << " -> decode TP " << a.pipeline.decode_tp << ", transport "
       << a.pipeline.transport << ", " << a.requests << " requests per point'\n"
       << "set logscale x 2\nset grid\nset key top left\nset xlabel 'prompt length (tokens)'\n"
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
  const std::string cmd = "gnuplot " + script;
  if (std::system(cmd.c_str()) != 0) {  // NOLINT(concurrency-mt-unsafe): one thread here
    return Status::Internal("gnuplot failed; is gnuplot installed (make deps)?");
  }
  std::filesystem::remove(data);
  std::filesystem::remove(script);
  return Status::Ok();
}

// Two panels against prompt length, whole-request and layer-wise side by side: TTFT p50, and the
// exposed transfer p50 (TTFT less the prefill's compute and the decode's first step).
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
    gp << "set terminal png size 1200,500\n"
       << "set output '" << a.chart << "'\n"
       << "set multiplot layout 1,2 title 'whole-request and layer-wise transfer, same run: "
       << a.pipeline.model.layers << " layers, TP " << a.pipeline.prefill_tp << " -> "
       << a.pipeline.decode_tp << ", " << a.pipeline.transport << ", "
       << a.pipeline.compute_us_per_token << " us/token of prefill compute, " << a.requests
       << " requests a point'\n"
       << "set logscale x 2\nset grid\nset key top left\nset xlabel 'prompt length (tokens)'\n"
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
  const std::string cmd = "gnuplot " + script;
  if (std::system(cmd.c_str()) != 0) {  // NOLINT(concurrency-mt-unsafe): one thread here
    return Status::Internal("gnuplot failed; is gnuplot installed (make deps)?");
  }
  std::filesystem::remove(data);
  std::filesystem::remove(script);
  return Status::Ok();
}

int RunE2e(const E2eArgs& a) {
  Json points = Json::array();
  std::vector<bool> modes;
  if (a.layerwise != "on") modes.push_back(false);
  if (a.layerwise != "off") modes.push_back(true);
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
      const auto prompts =
          MakePrompts(warmup + a.requests, len, len, 0.0, static_cast<std::uint32_t>(len));
      PipelineArgs p = a.pipeline;
      p.progress = false;
      p.layerwise = layerwise;
      Result<PipelineResult> r = RunPipeline(p, prompts);
      if (!r.ok()) {
        std::cerr << "kvferry bench e2e: " << r.status().ToString() << "\n";
        return 1;
      }
      std::vector<double> ttft, exposed, compute, first_step;
      std::vector<RequestTiming> measured;
      int took_layerwise = 0;
      for (const RequestTiming& t : r->timings) {
        if (t.index < static_cast<std::size_t>(warmup)) continue;
        ttft.push_back(t.ttft_ms);
        exposed.push_back(t.exposed_ms());
        compute.push_back(t.compute_ms);
        first_step.push_back(t.first_step_ms);
        measured.push_back(t);
        took_layerwise += t.layerwise ? 1 : 0;
      }
      const double gb = static_cast<double>(r->bytes_moved) / 1e9;
      const ConnectorFigures conn = FiguresOf(measured);
      const char* mode = layerwise ? "layerwise" : "whole";
      points.push_back({{"prompt_tokens", len},
                        {"mode", mode},
                        {"layerwise_requests", took_layerwise},
                        {"connector", FiguresJson(conn)},
                        {"requests", a.requests},
                        {"warmup", warmup},
                        {"failed", r->failed},
                        {"leaked", r->leaked},
                        {"bytes_moved", r->bytes_moved},
                        {"wall_s", r->wall_s},
                        {"gbps", r->wall_s > 0 ? gb / r->wall_s : 0},
                        {"transfer_p50_us", r->decode_end.value("transfer_p50_us", 0)},
                        {"transfer_p90_us", r->decode_end.value("transfer_p90_us", 0)},
                        {"transfer_p99_us", r->decode_end.value("transfer_p99_us", 0)},
                        {"transfer_max_us", r->decode_end.value("transfer_max_us", 0)},
                        {"ttft_p50_ms", Percentile(ttft, 0.5)},
                        {"ttft_p99_ms", Percentile(ttft, 0.99)},
                        {"exposed_p50_ms", Percentile(exposed, 0.5)},
                        {"exposed_p99_ms", Percentile(exposed, 0.99)},
                        {"prefill_compute_p50_ms", Percentile(compute, 0.5)},
                        {"first_step_p50_ms", Percentile(first_step, 0.5)}});
      if (!a.json) {
        std::fprintf(stdout,
                     "prompt %6d tokens, %-9s: %3d requests, %d failed; kvferry per request: "
                     "%.2f MB, transfer p50 %.2f p99 %.2f ms, rate p50 %.2f p10 %.2f GB/s; "
                     "TTFT p50 %.1f p99 %.1f ms (prefill compute %.1f, first step %.1f), exposed "
                     "transfer p50 %.2f p99 %.2f ms\n",
                     len, mode, a.requests, r->failed, static_cast<double>(conn.bytes_p50) / 1e6,
                     conn.ms_p50, conn.ms_p99, conn.gbps_p50, conn.gbps_p10, Percentile(ttft, 0.5),
                     Percentile(ttft, 0.99), Percentile(compute, 0.5), Percentile(first_step, 0.5),
                     Percentile(exposed, 0.5), Percentile(exposed, 0.99));
        std::fflush(stdout);
      }
    }
    if (modes.size() == 2 && !a.json) {
      const Json& w = points[points.size() - 2];
      const Json& l = points[points.size() - 1];
      const double we = w["exposed_p50_ms"].get<double>();
      const double wt = w["ttft_p50_ms"].get<double>();
      std::fprintf(stdout,
                   "prompt %6d tokens: layer-wise exposed transfer %.1f %% of whole-request's, "
                   "TTFT p50 %.1f %% of whole-request's\n",
                   len, we > 0 ? 100.0 * l["exposed_p50_ms"].get<double>() / we : 0.0,
                   wt > 0 ? 100.0 * l["ttft_p50_ms"].get<double>() / wt : 0.0);
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
    Status c =
        modes.size() == 2 ? WriteLayerwiseChart(a, points) : WriteChart(a, points, baselines);
    if (!c.ok()) {
      std::cerr << "kvferry bench e2e: " << c.ToString() << "\n";
      return 1;
    }
    if (!a.json) std::cout << "chart: " << a.chart << "\n";
  }
  for (const Json& pt : points) {
    if (pt["failed"].get<int>() != 0 || pt["leaked"].get<bool>()) return 1;
  }
  return 0;
}

}  // namespace

void AddDemoCommands(CLI::App& app, int& exit_code) {
  auto a = std::make_shared<DemoArgs>();
  CLI::App* demo = app.add_subcommand(
      "demo", "Prefill and decode instances on this host moving real KV bytes, all verified");
  demo->add_option("--requests", a->requests, "Requests to drive")->capture_default_str();
  demo->add_option("--min-prompt", a->min_prompt, "Shortest prompt, tokens")->capture_default_str();
  demo->add_option("--max-prompt", a->max_prompt, "Longest prompt, tokens")->capture_default_str();
  demo->add_option("--shared-prefix", a->shared_prefix,
                   "Share of prompts starting with a common system prompt")
      ->capture_default_str();
  demo->add_flag("--json", a->json, "Machine-readable report");
  demo->add_flag("!--no-progress", a->pipeline.progress, "No progress line");
  demo->add_flag("--layerwise", a->pipeline.layerwise,
                 "Layer-wise transfer: both legs of a request at once, the decode side reading "
                 "each layer as the prefill side writes it (docs/layerwise.md)");
  AddPipelineOptions(*demo, a->pipeline);
  demo->callback([a, &exit_code] { exit_code = RunDemo(*a); });

  auto e = std::make_shared<E2eArgs>();
  CLI::App* bench = app.get_subcommand("bench");
  CLI::App* e2e = bench->add_subcommand(
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
                  "Write a PNG chart (gnuplot) of kvferry's per-request transfer time and rate "
                  "against prompt length, with the transport's same-run rate");
  AddPipelineOptions(*e2e, e->pipeline);
  e2e->callback([e, &exit_code] { exit_code = RunE2e(*e); });
}

}  // namespace kvferry::cli
