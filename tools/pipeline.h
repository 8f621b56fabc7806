// The proxy of kvferry demo and kvferry bench e2e: a prefill and a decode instance (kvferry serve)
// started here or already running, requests sent to prefill, its kv_transfer_params forwarded to
// decode, every byte verified by the decode instance, and nothing left held at the end.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvferry/status.h"
#include "tools/commands.h"

namespace kvferry::cli {

struct PipelineArgs {
  int prefill_tp = 2;
  int decode_tp = 2;
  /// Pipeline stages of each role's instances (equal on both: a decode stage reads the prefill
  /// stage that holds its layers).
  int prefill_pp = 1;
  int decode_pp = 1;
  /// xPyD: instances of each role, each with its TP ranks and its own devices of the rank table;
  /// the proxy sends each request to the instance with the fewest outstanding requests.
  int prefill_instances = 1;
  int decode_instances = 1;
  ModelArgs model;
  /// Tokens per block of each role's instances; 0: the model's --tokens-per-block. The two may
  /// differ (whole-request loads pair tokens; layer-wise transfer needs one size).
  std::int64_t prefill_tokens_per_block = 0;
  std::int64_t decode_tokens_per_block = 0;
  std::string transport = "auto";
  std::vector<std::string> transport_opts;
  bool shm_permit_any_tracer = false;
  int concurrency = 16;
  int hold_lease_ms = 30000;
  int compute_us_per_token = 0;
  /// Layer-wise transfer (docs/layerwise.md): requests whose prompt has at least
  /// `layerwise_min_tokens` tokens go to a prefill and a decode instance at once with a shared
  /// transfer id; shorter ones, and all when off, take the whole-request path.
  bool layerwise = false;
  std::int64_t layerwise_min_tokens = 32;  // measured: docs/layerwise.md, "The threshold"
  /// Fault injection: the share of layer-wise requests whose prefill leg the proxy never sends
  /// (a lost leg); their decode loads fail at the start deadline and are recomputed.
  double drop_prefill_legs = 0;
  /// Prefill instances: chunked prefill of layer-wise requests, and layers per announcement.
  std::int64_t prefill_chunk_tokens = 0;
  int layers_per_notice = 1;
  std::string memory = "host";
  bool progress = true;
  /// Share of requests the client abandons: at the prefill instance, between prefill and decode,
  /// or at the decode instance (a third each), at a random moment.
  double abort_rate = 0;
  /// A request with no answer from an instance in this long fails (a dead instance).
  int request_timeout_ms = 60000;
  std::uint32_t seed = 7;
  /// Drive instances that already run (kvferry serve) instead of starting them here: their
  /// control endpoints, comma-separated for several.
  std::string prefill_control;
  std::string decode_control;
  /// etcd://HOST:PORT/PREFIX: drive the kvferry serve instances registered there (serve
  /// --register), which may join, drain and leave during the run (docs/fleet.md).
  std::string discovery;
};

struct RequestTiming {
  std::size_t index = 0;     // of its prompt in RunPipeline's list
  double prefill_ms = 0;     // proxy sent to prefill -> prefill answered
  double decode_ms = 0;      // proxy sent to decode -> decode answered (load and verify)
  double load_ms = 0;        // decode side: load started -> finished
  double ttft_ms = 0;        // proxy sent to prefill -> decode answered
  double compute_ms = 0;     // prefill side: its compute (layer by layer for a layer-wise one)
  double first_step_ms = 0;  // decode side: its first step after the load (verification)
  double queue_ms = 0;       // prefill side: submitted -> scheduled (its queue)
  // Steady-clock microseconds (shared by the processes of a host): the end of its prefill
  // compute, the start of its decode's first step; 0 when not reported.
  std::int64_t computed_at_us = 0;
  std::int64_t first_step_at_us = 0;
  std::int64_t loaded_at_us = 0;  // the decode engine saw every rank's load finished
  bool layerwise = false;         // both legs sent at once
  // TTFT less the prefill's compute and the decode's first step: what the transfer, the hops
  // around it and, with requests queued, the prefill's queue add to time-to-first-token.
  double exposed_ttft_ms() const { return ttft_ms - compute_ms - first_step_ms; }
  // The request's own exposed transfer: from the end of its prefill compute to its decode's
  // first step (negative where the load ended first); the prefill's queue is not in it.
  // exposed_ttft_ms() where the instances did not report the two times.
  double exposed_ms() const {
    if (computed_at_us == 0 || first_step_at_us == 0) return exposed_ttft_ms();
    return static_cast<double>(first_step_at_us - computed_at_us) / 1000.0;
  }
  // Of exposed_ms(), the part until the decode engine saw the load finished (the connector's,
  // with the engine's polling of it), and the rest, the engine's pick-up (its loop and the first
  // steps of other requests ahead in the same step). NaN where a time was not reported.
  double exposed_to_loaded_ms() const {
    if (computed_at_us == 0 || loaded_at_us == 0) return std::numeric_limits<double>::quiet_NaN();
    return static_cast<double>(loaded_at_us - computed_at_us) / 1000.0;
  }
  std::uint64_t loaded_bytes = 0;
  // In the connector (every rank): bytes read and the transfer's time, 0 when nothing was read.
  std::uint64_t transfer_bytes = 0;
  double transfer_ms = 0;
};

struct PipelineResult {
  int done = 0;
  int failed = 0;
  int aborted_at_prefill = 0;     // the prefill instance ended it as aborted
  int aborted_after_prefill = 0;  // the client left after prefill: the hold ends by lease
  int aborted_at_decode = 0;      // the decode instance ended it as aborted (load stopped)
  /// --discovery: legs refused by an instance that had begun draining, sent to another one.
  int resent_to_another_instance = 0;
  int aborts_too_late = 0;  // abort sent, the request had already ended: done
  int aborted() const { return aborted_at_prefill + aborted_after_prefill + aborted_at_decode; }
  std::vector<std::string> errors;
  std::vector<RequestTiming> timings;
  std::uint64_t bytes_moved = 0;
  std::uint64_t bytes_verified = 0;
  std::int64_t prefix_hit_blocks = 0;
  std::int64_t recomputed_blocks = 0;
  double wall_s = 0;
  /// The instances' stats at the end, summed over the instances of each role (the transfer
  /// percentiles: the slowest decode instance's).
  nlohmann::json prefill_end;
  nlohmann::json decode_end;
  bool leaked = false;
};

/// Runs every prompt through the pipeline; an error only when the instances cannot be started or
/// asked for their stats (failed requests are counted in the result, with their errors).
Result<PipelineResult> RunPipeline(const PipelineArgs& args,
                                   const std::vector<std::vector<std::int32_t>>& prompts);

/// The model of one role's instances: the pipeline's model with that role's tokens per block.
ModelArgs RoleModel(const PipelineArgs& args, bool prefill);

/// Bytes one block occupies across all layers, parts and TP ranks of an instance.
Result<std::uint64_t> BytesPerBlock(const ModelArgs& model, int tp);

}  // namespace kvferry::cli
