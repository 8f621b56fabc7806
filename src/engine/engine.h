// A small paged-KV serving engine for the demo, the end-to-end benchmark and tests: a block
// allocator with reference counts, a decode-side prefix cache, and a step loop that calls the
// connector as vLLM does. "Compute" writes KV bytes derived from (token prefix, layer, part, head,
// dim), so the decode side can verify every byte it receives.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "device/device.h"
#include "kvferry/connector.h"
#include "kvferry/host_memory.h"
#include "kvferry/metrics.h"

namespace kvferry::engine {

/// Fixed-size block pool with reference counts. Not thread-safe (the engine loop owns it).
class BlockAllocator {
 public:
  explicit BlockAllocator(std::int64_t num_blocks);
  /// `n` fresh blocks with one reference each, or ResourceExhausted.
  Result<std::vector<std::int64_t>> Allocate(std::size_t n);
  void Ref(std::int64_t block);
  /// Drops a reference; returns true when the block became free.
  bool Unref(std::int64_t block);
  int refs(std::int64_t block) const { return refs_[static_cast<std::size_t>(block)]; }
  std::int64_t free_blocks() const { return static_cast<std::int64_t>(free_.size()); }
  std::int64_t used_blocks() const { return total_ - free_blocks(); }

 private:
  std::int64_t total_;
  std::vector<std::int64_t> free_;
  std::vector<int> refs_;
};

struct InstanceConfig {
  Role role = Role::kPrefill;
  std::string engine_id;
  int tp_size = 1;
  /// Pipeline stages: stage s holds the model's layers as vLLM's get_pp_indices splits them, with
  /// TP workers of its own (pp_size * tp_size workers, stage-major).
  int pp_size = 1;
  int dp_rank = 0;
  std::string host = "127.0.0.1";
  int base_port = 5557;
  std::string secret;
  /// TransportOptions::backend and backend_options for every worker.
  std::string transport = "auto";
  TransportOptionMap transport_options;
  std::optional<RankTable> rank_table;
  std::vector<std::string> visible_devices;
  /// Model shape, for every TP rank (the spec's TP fields are set per rank): KV cache group 0, the
  /// whole cache of a uniform model.
  CacheSpecOptions model;
  /// A hybrid model's KV cache groups after `model` (vLLM's kv_cache_groups 1, 2, ...): each with
  /// its own kind, window, layers and block pool; a pipeline stage holds each group's share of
  /// the model's layers (the groups' layers interleave: model layer m is layer m / G of group
  /// m % G for G groups of equal size, as vLLM groups gpt-oss's and Qwen3-Next's layers). The
  /// engine frees a sliding-window group's blocks outside the window once the prompt is computed
  /// (prefill) and allocates only the window's (decode), as vLLM's SlidingWindowManager; its
  /// decode prefix cache serves uniform models only.
  std::vector<CacheSpecOptions> more_groups;
  std::chrono::milliseconds hold_lease{30000};
  /// Simulated prefill compute (a GPU's time, in which the model writes the KV): a request takes
  /// at least this per prompt token, and its KV bytes are made inside that time (stretching it
  /// when making them takes longer).
  std::chrono::microseconds compute_per_token{0};
  /// Prefill: a layer-wise request (params with a transfer_id) is computed a layer at a time, each
  /// layer an equal share of the compute with its KV, announced with Worker::SaveKvLayer.
  /// Its prompt is computed in chunks of this many tokens (0: all at once), each chunk a step of
  /// its own as far as the connector sees it (vLLM's chunked prefill).
  std::int64_t prefill_chunk_tokens = 0;
  /// WorkerConfig::layerwise_layers_per_notice, layerwise_start_timeout and
  /// layerwise_progress_timeout of every worker.
  int layers_per_notice = 1;
  std::chrono::milliseconds layerwise_start_timeout{30000};
  std::chrono::milliseconds layerwise_progress_timeout{5000};
  /// Where the KV caches are: "host", or a device of this process ("sim:0", "cuda:0"; "sim" is
  /// "sim:0"; docs/device.md) holding every rank's caches. With a device the engine computes into a
  /// host mirror and copies the blocks up, and copies them back down to verify them.
  std::string memory = "host";
};

/// A request as the proxy sends it.
struct EngineRequest {
  std::string request_id;
  std::vector<std::int32_t> prompt;
  KvTransferParams params;
};

/// What the engine reports when a request finishes.
struct EngineResult {
  std::string request_id;
  Status status;
  KvTransferParams params;  ///< prefill: for the decode side
  std::int64_t prefix_hit_blocks = 0;
  std::int64_t loaded_blocks = 0;
  std::int64_t recomputed_blocks = 0;
  std::uint64_t verified_bytes = 0;
  double queue_ms = 0;    ///< submitted to scheduled
  double compute_ms = 0;  ///< prefill compute
  double load_ms = 0;     ///< decode: load started to finished
  /// decode: the engine's first step after the load, here the verification of every byte (what
  /// a real engine's first decode step costs is in its place in TTFT).
  double first_step_ms = 0;
  /// When the prefill's compute ended (prefill) and the first step began (decode), in
  /// microseconds of the steady clock, which every process on a host shares (CLOCK_MONOTONIC):
  /// a request's exposed transfer is first_step_at_us at decode - computed_at_us at prefill.
  std::int64_t computed_at_us = 0;
  std::int64_t first_step_at_us = 0;
  /// decode: when the engine saw every rank's load of it finished (the step that verifies it
  /// begins at or after it: first_step_at_us - loaded_at_us is the engine's pick-up).
  std::int64_t loaded_at_us = 0;
  /// decode, a load that ended done: what the connector read for it (every rank) and how long
  /// its transfer took in the connector (the slowest rank's; Worker::TakeLoadTransfers).
  std::uint64_t transfer_bytes = 0;
  double transfer_ms = 0;
};

struct InstanceStats {
  std::int64_t used_blocks = 0;    ///< allocated to running requests or held for transfer
  std::int64_t cached_blocks = 0;  ///< decode prefix cache, evictable
  std::uint64_t holds = 0;
  std::uint64_t loads_outstanding = 0;
  std::uint64_t bytes_read = 0;
  std::uint64_t requests_done = 0;
  std::uint64_t requests_failed = 0;
  std::uint64_t requests_aborted = 0;
  /// The connector's own transfer latency over all TP ranks, µs (LatencyHistogram: quantiles
  /// within 1.6 % above the true value, max exact).
  std::uint64_t transfer_p50_us = 0;
  std::uint64_t transfer_p90_us = 0;
  std::uint64_t transfer_p99_us = 0;
  std::uint64_t transfer_max_us = 0;
};

/// One engine instance: TP workers (each with its own cache), one scheduler. Single-threaded:
/// Submit and Step from one thread.
class Instance {
 public:
  static Result<std::unique_ptr<Instance>> Create(InstanceConfig config);
  ~Instance();

  void Submit(EngineRequest request);
  /// The client went away. A request still waiting ends at once; a decode request whose KV is
  /// loading ends when its loads have stopped (the connector cancels them and tells the prefill
  /// side), so no read lands in a block after it is freed. Either way it ends in a later Step
  /// with a Cancelled status, exactly once. A prefill request that already finished keeps its
  /// hold (the decode side may be reading it) until its readers report or its lease ends; a
  /// request that already ended, or an unknown id, is left alone.
  void Abort(const std::string& request_id);
  /// One engine step; returns the requests that finished in it.
  std::vector<EngineResult> Step();
  InstanceStats Stats() const;
  /// The connector's metrics of every TP worker, and the engine's own as extra samples
  /// (kvferry_requests_in_flight, kvferry_requests_total{outcome}, kvferry_blocks_allocated), as
  /// of the last Submit, Abort or Step. Unlike the rest of Instance, safe to call from any thread
  /// while another one runs the engine: the metrics server of `kvferry serve` does.
  std::vector<WorkerMetrics> ConnectorMetrics() const;
  std::vector<ExtraMetric> EngineMetrics() const;
  /// Worker `index`'s cache (stage-major, as the workers are), every group.
  const CacheGroups& caches(int index) const;
  /// Nothing submitted is unfinished.
  bool Idle() const;
  /// Whether Step has work to do now (requests to schedule or compute, aborts to report), as
  /// opposed to waiting for the connector (loads in flight, holds being read), which a caller
  /// may poll for at a slower pace instead of spinning.
  bool HasWorkNow() const;

 private:
  struct Running;
  explicit Instance(InstanceConfig config);
  Status Init();
  void StepPrefill(std::vector<EngineResult>& out);
  void StepDecode(std::vector<EngineResult>& out);
  struct KvRow {
    std::size_t rank = 0;
    int group = 0;
    int layer = 0;
    int part = 0;
    std::int64_t block_index = 0;
    std::int64_t slot = 0;
    std::int64_t head = 0;
    std::uint8_t* data = nullptr;
    std::int64_t dim = 0;
    std::int64_t esize = 0;
    std::uint64_t seed = 0;
    bool past_prompt = false;
    /// A sliding-window group's token before the window: the decode side need not hold it.
    bool before_window = false;
    /// The row's token is in the range visited (the rest of its block is not).
    bool in_range = false;
  };
  // Layers [first, end) of a cache; All() is every layer.
  struct Layers {
    int first = 0;
    int end = 1 << 30;
    static Layers All() { return {}; }
  };
  // Prompt tokens [first, end): every group's blocks holding one of them (whole blocks).
  struct Tokens {
    std::int64_t first = 0;
    std::int64_t end = 0;
  };
  template <typename Fn>
  bool ForEachRow(const Running& r, Tokens tokens, Layers layers, Fn&& fn);
  Status Compute(const Running& r, Tokens tokens);
  // Device memory: the blocks of `tokens` of `r` on every rank, host mirror -> device (`up`) or
  // back; waits for the copies.
  Status CopyBlocks(const Running& r, Tokens tokens, bool up);
  // The same without waiting, for `layers` only: the copies are queued on stream_.
  Status EnqueueCopies(const Running& r, Tokens tokens, bool up, Layers layers);
  // Prefill of a layer-wise request: chunk by chunk, layer by layer, each layer announced.
  Status ComputeLayerwise(const Running& r);
  // Worker::SaveKvLayer on every rank for layer `layer` of each KV cache group that has one, of
  // the state groups or of the others.
  Status SaveLayer(int layer, bool state, std::uint64_t stream);
  std::uint64_t Verify(const Running& r, Tokens tokens, Status* status);
  // Every group's blocks of a request, kNoBlock skipped.
  void FreeBlocks(const std::vector<std::vector<std::int64_t>>& blocks);
  // Group 0's blocks, evicting prefix-cache entries to make room.
  Result<std::vector<std::int64_t>> AllocateEvicting(std::size_t n);
  // Blocks for every group of a request of `prompt` tokens into r.blocks; a sliding-window
  // group's blocks outside the window on the decode side (`window_only`) are kNoBlock. False,
  // with nothing allocated, when a pool is short.
  bool AllocateGroups(Running& r, std::int64_t prompt, bool window_only);
  // Prefill, once the prompt is computed: a sliding-window group's blocks wholly before its
  // window go back to the pool, kNoBlock in their place (vLLM's remove_skipped_blocks).
  void FreeOutsideWindow(Running& r);
  // Prefill: the request at the front of waiting_ ends failed with `status`, its blocks freed.
  void FailPrefill(Running& r, Status status, std::vector<EngineResult>& out);
  // Prefill: the scheduler's RequestFinished, every group's blocks.
  Scheduler::FinishedResult Finish(const Running& r, FinishReason reason);
  // Several groups, or one with a sliding window: blocks per group, kNoBlock outside a window,
  // through the scheduler's AllGroups calls, and no decode prefix cache.
  bool grouped() const {
    return num_groups() > 1 || config_.model.sliding_window > 0 ||
           config_.model.layers.front().kind == CacheKind::kState;
  }
  int num_groups() const { return 1 + static_cast<int>(config_.more_groups.size()); }
  const CacheSpecOptions& group_options(int g) const {
    return g == 0 ? config_.model : config_.more_groups[static_cast<std::size_t>(g - 1)];
  }
  void AddToPrefixCache(const Running& r);
  void PublishGauges();

  InstanceConfig config_;
  std::vector<CacheGroups> caches_;  // [worker]
  // Where each part of each layer of a group's cache starts, [layer * parts + part]: in the host
  // memory the engine computes in, and on the device (config_.memory) when the caches are there.
  struct GroupMemory {
    std::vector<std::uint8_t*> host;
    std::vector<std::uint64_t> device;
  };
  std::vector<std::vector<GroupMemory>> memory_;  // [worker][group]
  // The host memory memory_ points into: HostMemory, which a same-host shm reader maps.
  std::deque<HostMemory> storage_;
  // config_.memory a device: the caches themselves, memory_ their host mirror. Before workers_,
  // so they are freed after the workers stop reading them.
  device::Device* device_ = nullptr;
  std::unique_ptr<device::Stream> stream_;
  std::vector<std::unique_ptr<device::DeviceAllocation>> device_storage_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::unique_ptr<Scheduler> scheduler_;
  std::vector<std::unique_ptr<BlockAllocator>> allocators_;  // [group]

  std::deque<std::unique_ptr<Running>> waiting_;
  std::map<std::string, std::unique_ptr<Running>> running_;             // decode: loading
  std::map<std::string, std::vector<std::vector<std::int64_t>>> held_;  // prefill: blocks held
  std::map<std::string, std::set<int>> rank_reports_;  // per request: ranks reported
  std::map<std::string, Status> load_errors_;      // decode: a rank's load failed (until it ends)
  std::map<std::string, LoadTransfer> transfers_;  // decode: ranks' done loads (until it ends)
  // Decode prefix cache: chain hash of a full block's tokens -> block; LRU of evictable blocks.
  std::unordered_map<std::uint64_t, std::int64_t> prefix_;
  std::list<std::uint64_t> lru_;
  std::unordered_map<std::uint64_t, std::list<std::uint64_t>::iterator> lru_pos_;
  std::vector<EngineResult> aborted_now_;  // ended by Abort, returned by the next Step
  // Written by the engine thread, read by EngineMetrics from any thread: relaxed atomics, each
  // value independent of the others (no paired operation).
  std::atomic<std::uint64_t> done_{0};
  std::atomic<std::uint64_t> failed_{0};
  std::atomic<std::uint64_t> aborted_{0};
  std::atomic<std::uint64_t> in_flight_{0};
  std::atomic<std::int64_t> blocks_allocated_{0};
};

/// The model-wide layers [first, end) of pipeline stage `pp_rank` of `pp_size` for `num_layers`
/// layers, as vLLM splits them (vllm/distributed/utils.py, get_pp_indices): an equal share each,
/// the remainder one layer each to the stages before the last.
std::pair<int, int> PipelineLayers(int num_layers, int pp_rank, int pp_size);

/// Chain hashes of a prompt's positions: hash[t] covers tokens[0..t].
std::vector<std::uint64_t> PrefixHashes(const std::vector<std::int32_t>& prompt);

}  // namespace kvferry::engine
