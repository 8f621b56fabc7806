#include "tools/pipeline_cli.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "tools/commands.h"

namespace kvferry::cli {

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(std::lround(q * static_cast<double>(v.size() - 1)));
  return v[std::min(i, v.size() - 1)];
}

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

nlohmann::json FiguresJson(const ConnectorFigures& f) {
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

nlohmann::json TransferPercentilesJson(const nlohmann::json& decode_end) {
  nlohmann::json out = nlohmann::json::object();
  for (const char* key :
       {"transfer_p50_us", "transfer_p90_us", "transfer_p99_us", "transfer_max_us"}) {
    out[key] = decode_end.value(key, 0);
  }
  return out;
}

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
  cmd.add_option("--prefill-pp", p.prefill_pp,
                 "Pipeline stages of the prefill instances (each stage's TP workers hold its "
                 "layers)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  cmd.add_option("--decode-pp", p.decode_pp,
                 "Pipeline stages of the decode instances (equal to --prefill-pp: a decode "
                 "stage reads the prefill stage holding its layers)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  cmd.add_option("--prefill-tokens-per-block", p.prefill_tokens_per_block,
                 "Tokens per block of the prefill instances (0: --tokens-per-block)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--decode-tokens-per-block", p.decode_tokens_per_block,
                 "Tokens per block of the decode instances (0: --tokens-per-block); may differ "
                 "from the prefill's")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
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
  cmd.add_option("--discovery", p.discovery,
                 "etcd://HOST:PORT/PREFIX: drive the kvferry serve instances registered there "
                 "(serve --register), which may join, drain and leave during the run; instead of "
                 "starting instances here (docs/fleet.md)");
  cmd.add_option("--prefill-control", p.prefill_control,
                 "Control endpoints of running prefill instances, comma-separated (with "
                 "--decode-control: drive those instead of starting instances here)");
  cmd.add_option("--decode-control", p.decode_control,
                 "Control endpoints of running decode instances, comma-separated");
  AddModelOptions(cmd, p.model);
}

}  // namespace kvferry::cli
