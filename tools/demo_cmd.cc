// kvferry demo: a prefill and a decode instance (kvferry serve, TP workers each) on this host,
// driven through a proxy that forwards kv_transfer_params, with every byte verified.
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
#include "tools/pipeline_cli.h"

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
int RunDemo(const DemoArgs& a) {
  if (!a.json) {
    const bool external = !a.pipeline.prefill_control.empty();
    auto placement = [](int tp, int pp, std::int64_t tpb) {
      return "TP " + std::to_string(tp) + (pp > 1 ? " x PP " + std::to_string(pp) : "") +
             (tpb > 0 ? ", " + std::to_string(tpb) + "-token blocks" : "");
    };
    std::cout << "kvferry demo: "
              << (external
                      ? "the running instances at " + a.pipeline.prefill_control + " -> " +
                            a.pipeline.decode_control
                      : std::to_string(a.pipeline.prefill_instances) + " prefill instance(s) of " +
                            placement(a.pipeline.prefill_tp, a.pipeline.prefill_pp,
                                      a.pipeline.prefill_tokens_per_block) +
                            " -> " + std::to_string(a.pipeline.decode_instances) +
                            " decode instance(s) of " +
                            placement(a.pipeline.decode_tp, a.pipeline.decode_pp,
                                      a.pipeline.decode_tokens_per_block))
              << ", " << a.requests << " requests, prompts " << a.min_prompt << ".." << a.max_prompt
              << " tokens, transport " << a.pipeline.transport << ", model "
              << ModelText(a.pipeline.model) << std::endl;
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
      {"resent_to_another_instance", r->resent_to_another_instance},
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
  report.update(TransferPercentilesJson(r->decode_end));
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
          "tokens: whole-request); exposed transfer p50 %.2f ms, p99 %.2f ms (from the end of "
          "each request's prefill compute to its decode's first step)\n",
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
  AddBenchE2eCommand(*app.get_subcommand("bench"), exit_code);
}

}  // namespace kvferry::cli
