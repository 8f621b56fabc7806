// kvferry: the connector a serving engine calls, shaped like vLLM's KV connector: a Scheduler on
// the engine's scheduler side and a Worker in every TP worker process. Each method states its
// contract here; the rule numbers in parentheses point to DESIGN.md's behaviour contract, where
// the tests that pin each rule are listed.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvferry/cache_spec.h"
#include "kvferry/histogram.h"
#include "kvferry/rank_table.h"
#include "kvferry/status.h"
#include "kvferry/transport.h"

namespace kvferry {

/// vLLM's kv_transfer_params, as the proxy forwards them from the prefill instance's response to
/// the decode instance's request. Absent fields are std::nullopt.
struct KvTransferParams {
  bool do_remote_prefill = false;
  bool do_remote_decode = false;
  std::optional<std::vector<std::int64_t>> remote_block_ids;
  std::optional<std::string> remote_engine_id;
  std::optional<std::string> remote_host;
  /// The side-channel port of the remote instance's TP rank 0 of pipeline stage 0 in its DP
  /// group; TP rank q of stage s listens on remote_port + s * remote_tp_size + q.
  std::optional<int> remote_port;
  std::optional<int> remote_tp_size;
  /// The request id on the prefill side, for engines that rename requests.
  std::optional<std::string> remote_request_id;
  /// Layer-wise transfer (docs/layerwise.md): the id the proxy gives both legs of one request,
  /// which it dispatches to a prefill and a decode instance at once. On the prefill leg (with
  /// do_remote_decode) the prefill side announces each layer's KV under it as it is written; on
  /// the decode leg (with do_remote_prefill and the prefill instance's remote_engine_id,
  /// remote_host, remote_port, remote_tp_size, but no remote_block_ids) the decode side reads
  /// each layer as it is announced. 1 to 1,024 bytes, unique per request.
  std::optional<std::string> transfer_id;
  /// The remote instance's pipeline-parallel size (NixlConnector's pp_size); absent means 1.
  std::optional<int> remote_pp_size;
  /// Hybrid caches (CacheGroups): the block ids of KV cache groups 1, 2, ..., in the caches'
  /// group order (remote_block_ids is group 0's); kNoBlock where the prefill side holds no block
  /// (a sliding window's freed blocks). Absent for a one-group cache.
  std::optional<std::vector<std::vector<std::int64_t>>> remote_group_block_ids;
  /// Where each rank of the remote instance listens when its ranks are on several hosts (a
  /// pipeline stage or a TP group per host): remote_pp_size * remote_tp_size hosts, stage-major
  /// (rank s * remote_tp_size + q is TP rank q of stage s); absent means every rank on
  /// remote_host. The prefill side fills it from its workers' handshake metadata
  /// (Scheduler::SetRankHosts).
  std::optional<std::vector<std::string>> remote_rank_hosts;

  friend bool operator==(const KvTransferParams&, const KvTransferParams&) = default;
};

/// How a request ended, as far as the connector cares.
enum class FinishReason : std::uint8_t {
  kLengthCapped = 0,  ///< stopped on its max-tokens cap: the prefill of a P/D request
  kStopped = 1,       ///< stopped on a stop token or string
  kAborted = 2,       ///< cancelled by the client or the engine
  kError = 3,
  /// preempted by the engine (vLLM's preempted_req_ids): its blocks are freed now and it will be
  /// recomputed; a layer-wise prefill leg's transfer ends at once (its readers fail), and no
  /// hold is made.
  kPreempted = 4,
};

/// One KV cache group's blocks of a load after group 0 (LoadSpec::more_groups).
struct GroupBlockIds {
  std::vector<std::int64_t> local;
  std::vector<std::int64_t> remote;

  friend bool operator==(const GroupBlockIds&, const GroupBlockIds&) = default;
};

/// One load the decode side's worker must perform: remote blocks into local ones.
struct LoadSpec {
  std::string request_id;
  std::vector<std::int64_t> local_block_ids;
  std::vector<std::int64_t> remote_block_ids;
  std::string remote_engine_id;
  std::string remote_host;
  int remote_port = 0;
  int remote_tp_size = 1;
  std::string remote_request_id;
  /// Non-empty: a layer-wise load (remote_block_ids empty; the prefill side announces them with
  /// each layer). remote_request_id is then the transfer id too.
  std::string transfer_id;
  /// Pipeline stages of the prefill instance: a decode worker of stage s reads stage s (equal PP
  /// sizes only, whose stages hold the same layers; the compatibility hash checks the ranges),
  /// at remote_port + s * remote_tp_size + q.
  int remote_pp_size = 1;
  /// The prompt tokens this load brings: [first_token, first_token + num_tokens), held by
  /// local_block_ids from first_token on (first_token is the prefix the decode side had cached)
  /// and by remote_block_ids from token 0. What pairs blocks of different token counts on the two
  /// sides (docs/protocol.md, "Block sizes"). -1 where the engine gave only block ids: blocks then
  /// pair by the tail rule, and different block sizes only where a decode block holds a whole
  /// number of prefill blocks.
  std::int64_t first_token = -1;
  std::int64_t num_tokens = -1;
  /// The host of each prefill rank when they are on several hosts (KvTransferParams::
  /// remote_rank_hosts): as the scheduler queues it, remote_pp_size * remote_tp_size hosts,
  /// stage-major; as the worker runs it, the remote_tp_size hosts of the stage it reads. Empty:
  /// every rank on remote_host.
  std::vector<std::string> remote_rank_hosts{};
  /// Hybrid caches (CacheGroups): the blocks of groups 1, 2, ... (local_block_ids and
  /// remote_block_ids are group 0's), positioned as group 0's are: local ids from first_token,
  /// remote ids from token 0, kNoBlock where a side holds no block. A sliding-window group reads
  /// only the blocks of the prompt's last `sliding_window` tokens. Empty for one group.
  std::vector<GroupBlockIds> more_groups{};

  /// The number of KV cache groups this load names blocks of.
  int num_groups() const { return 1 + static_cast<int>(more_groups.size()); }
  /// Group `g`'s local and remote block ids.
  const std::vector<std::int64_t>& LocalIds(int g) const {
    return g == 0 ? local_block_ids : more_groups[static_cast<std::size_t>(g - 1)].local;
  }
  const std::vector<std::int64_t>& RemoteIds(int g) const {
    return g == 0 ? remote_block_ids : more_groups[static_cast<std::size_t>(g - 1)].remote;
  }

  /// The host of TP rank `q` of the stage this load reads.
  const std::string& RankHost(int q) const {
    return remote_rank_hosts.empty() ? remote_host : remote_rank_hosts[static_cast<std::size_t>(q)];
  }

  friend bool operator==(const LoadSpec&, const LoadSpec&) = default;
};

/// One prefill-side hold the worker must register: the request's blocks stay allocated until
/// its readers have reported, it is aborted, or `lease_ms` pass without a renewal.
struct HoldSpec {
  std::string request_id;
  std::int64_t lease_ms = 0;
  /// Non-empty for a layer-wise request: its readers' notices name this id instead of the
  /// request id, and the hold also completes the transfer's announcements (every layer written).
  std::string transfer_id;

  friend bool operator==(const HoldSpec&, const HoldSpec&) = default;
};

/// Prefill side, layer-wise: a request whose KV this step writes, so that the worker announces
/// each layer of it as Worker::SaveKvLayer reports the layer written.
struct LayerwiseSave {
  std::string request_id;
  std::string transfer_id;
  /// All the request's blocks so far, in prompt order (block i holds tokens
  /// [i * tokens_per_block, (i + 1) * tokens_per_block)).
  std::vector<std::int64_t> block_ids;
  /// This step writes the KV of prompt tokens [first_token, end_token); tokens before
  /// first_token are already written (earlier chunks, or the prefill side's prefix cache).
  std::int64_t first_token = 0;
  std::int64_t end_token = 0;
  std::int64_t prompt_tokens = 0;
  /// A cache of several KV cache groups: groups 1, 2, ...'s blocks, positioned as block_ids
  /// (kNoBlock where the engine holds none, a sliding window's freed blocks). Empty for one.
  std::vector<std::vector<std::int64_t>> group_block_ids{};

  friend bool operator==(const LayerwiseSave&, const LayerwiseSave&) = default;
};

/// Prefill side, layer-wise: a request that ended without a hold (aborted, failed, stopped before
/// its length cap, preempted): its transfer fails, and readers that confirm it are refused.
struct TransferEnd {
  std::string transfer_id;
  std::string reason;

  friend bool operator==(const TransferEnd&, const TransferEnd&) = default;
};

/// What the scheduler hands the workers every step (DESIGN rule 3). A plain value; Encode and
/// Decode let engines ship it to worker processes.
struct ConnectorMetadata {
  std::vector<LoadSpec> loads;
  std::vector<HoldSpec> holds;
  /// Prefill side, layer-wise: the requests this step writes, and those that ended without KV.
  std::vector<LayerwiseSave> saves;
  std::vector<TransferEnd> transfer_ends;

  std::vector<std::uint8_t> Encode() const;
  /// Never trusts its input (bounded msgpack, like the side channel).
  static Result<ConnectorMetadata> Decode(std::span<const std::uint8_t> bytes);
  friend bool operator==(const ConnectorMetadata&, const ConnectorMetadata&) = default;
};

struct SchedulerConfig {
  Role role = Role::kPrefill;
  std::string engine_id;
  /// Where this instance's workers listen: the host peers connect to, the base port, and the
  /// DP rank, TP and PP sizes that place rank 0's port at base_port + dp_rank * pp_size *
  /// tp_size (worker_port).
  std::string host = "127.0.0.1";
  int base_port = 5557;
  int dp_rank = 0;
  int tp_size = 1;
  /// How long a prefill hold lasts without renewal (the reference's abort timeout).
  std::chrono::milliseconds hold_lease{120000};
  /// Pipeline stages of this instance (after hold_lease, so positional initialisers of the
  /// fields above keep their meaning).
  int pp_size = 1;
  /// The cache has a state group (CacheKind::kState: Mamba, linear attention). Then vLLM's token
  /// rule for them holds (NixlConnector's _truncate_mamba_request_for_prefill and
  /// _get_remote_prefill_token_count): the prefill side computes its prompt less the last token
  /// (PrefillTokens), so its state is the state before that token; a load brings that many
  /// (GetNumNewMatchedTokens: prompt - 1 - computed), and the decode side computes the last
  /// prompt token from the loaded state. Both instances must agree (the groups' hash does).
  bool state_groups = false;
};

/// The scheduler side. Pure bookkeeping, no I/O. Single-threaded by contract: call it from the
/// engine's scheduler thread only.
class Scheduler {
 public:
  explicit Scheduler(SchedulerConfig config) : config_(std::move(config)) {}

  /// For a request whose params ask for remote prefill (do_remote_prefill), the number of prompt
  /// tokens the decode side will load instead of computing, max(prompt - computed, 0), and
  /// whether that load is asynchronous (true when the count is > 0: the engine must wait for the
  /// load before scheduling the request). For any other request (0, false). Never fails; reads
  /// nothing but its arguments (rule 1).
  std::pair<std::int64_t, bool> GetNumNewMatchedTokens(const KvTransferParams& params,
                                                       std::int64_t num_prompt_tokens,
                                                       std::int64_t num_computed_tokens) const;
  /// Prefill side: the prompt tokens the engine computes for a request of `num_prompt_tokens`:
  /// all of them, or, with state groups and params asking for remote decode, all but the last
  /// (SchedulerConfig::state_groups; at least one).
  std::int64_t PrefillTokens(const KvTransferParams& params, std::int64_t num_prompt_tokens) const;

  /// After the engine allocated blocks for a remote-prefill request: queues its load into
  /// `new_block_ids` (its newly allocated, unhashed blocks; none when the decode side's prefix
  /// cache covered the prompt, and the load then only tells the prefill side to free its hold)
  /// and clears params.do_remote_prefill, so it is never loaded twice. Incomplete params
  /// (remote_block_ids, remote_engine_id, remote_host, remote_port, remote_tp_size) are
  /// InvalidArgument naming the missing fields: nothing is queued, the flag is cleared too, and
  /// the engine should fail the request. With a transfer_id the load is layer-wise and
  /// remote_block_ids is not needed (the prefill side announces them). Requests without
  /// do_remote_prefill are ignored (OK). The scheduler keeps no reference to the span (rule 2).
  Status UpdateStateAfterAlloc(const std::string& request_id, KvTransferParams& params,
                               std::span<const std::int64_t> new_block_ids);
  /// The same, knowing the tokens the load brings: vLLM's `num_external_tokens` of the request's
  /// `num_prompt_tokens` (the decode side computed the rest, a prefix of whole blocks). The load
  /// then reads prompt tokens [num_prompt_tokens - num_external_tokens, num_prompt_tokens), and
  /// the two instances may use any block sizes (LoadSpec::first_token). A count outside
  /// 0..num_prompt_tokens is InvalidArgument, with the flag cleared and nothing queued.
  Status UpdateStateAfterAlloc(const std::string& request_id, KvTransferParams& params,
                               std::span<const std::int64_t> new_block_ids,
                               std::int64_t num_external_tokens, std::int64_t num_prompt_tokens);
  /// The same for a cache of several KV cache groups: `group_block_ids[g]` are group g's blocks
  /// from the first token the load brings on (kNoBlock where the engine allocated none, as
  /// vLLM's null block outside a sliding window). The params must name as many groups
  /// (remote_block_ids and remote_group_block_ids), else InvalidArgument, nothing queued.
  Status UpdateStateAfterAllocAllGroups(const std::string& request_id, KvTransferParams& params,
                                        std::span<const std::vector<std::int64_t>> group_block_ids,
                                        std::int64_t num_external_tokens,
                                        std::int64_t num_prompt_tokens);

  /// Prefill side, layer-wise (rule 16): the engine scheduled `num_scheduled_tokens` tokens of
  /// a request that has `num_computed_tokens` computed, `num_prompt_tokens` in its prompt and
  /// `block_ids` (all its blocks so far, in prompt order). When its params ask for remote decode
  /// with a transfer_id and the step writes prompt tokens, a LayerwiseSave is queued for this
  /// step's metadata; any other request is ignored. Call it for every scheduled request of the
  /// step, before BuildConnectorMeta. A request whose computed tokens go back (preempted and
  /// recomputed) fails its transfer: readers may have read blocks it no longer owns.
  void RequestScheduled(const std::string& request_id, const KvTransferParams& params,
                        std::span<const std::int64_t> block_ids, std::int64_t num_computed_tokens,
                        std::int64_t num_scheduled_tokens, std::int64_t num_prompt_tokens);
  /// The same for a cache of several KV cache groups: `group_block_ids[g]` are group g's blocks
  /// so far in prompt order (kNoBlock where the engine freed one). With state groups the prompt
  /// is what the prefill side computes (PrefillTokens).
  void RequestScheduledAllGroups(const std::string& request_id, const KvTransferParams& params,
                                 std::span<const std::vector<std::int64_t>> group_block_ids,
                                 std::int64_t num_computed_tokens,
                                 std::int64_t num_scheduled_tokens, std::int64_t num_prompt_tokens);

  /// The loads, holds and layer-wise saves queued since the last call, for this step's workers
  /// (every TP rank gets the same metadata); clears them. Call once per engine step (rule 3).
  ConnectorMetadata BuildConnectorMeta();

  struct FinishedResult {
    bool delay_free = false;  ///< the engine must not free the blocks until GetFinished says so
    std::optional<KvTransferParams> params;  ///< to return to the proxy for the decode side
  };
  /// When a request ends. Prefill side: a request that asked for remote decode and stopped on its
  /// length cap gets delay_free (the engine must keep `block_ids` allocated until GetFinished
  /// reports the request in `sending`) and params telling the decode side where to read them; a
  /// hold for it is queued for the next metadata. Any other prefill request: no hold, no params;
  /// a layer-wise one (with a transfer_id) queues a TransferEnd, so its readers fail at once.
  /// Layer-wise holds carry the transfer id, and the returned params name it as
  /// remote_request_id (so whole-request reads of them reach the same hold).
  /// Decode side: a request that ends while its params still ask for remote prefill (aborted
  /// before it was scheduled) queues a load of no blocks, whose finished notices free the prefill
  /// hold at once; no delay_free. The scheduler keeps no reference to the span (rule 4).
  FinishedResult RequestFinished(const std::string& request_id, const KvTransferParams& params,
                                 FinishReason reason, std::span<const std::int64_t> block_ids);
  /// The same for a cache of several KV cache groups (vLLM's request_finished_all_groups):
  /// `group_block_ids[g]` are group g's blocks in prompt order (kNoBlock where the engine freed
  /// one); the params name group 0's as remote_block_ids and the others as
  /// remote_group_block_ids. delay_free when any group holds a block.
  FinishedResult RequestFinishedAllGroups(
      const std::string& request_id, const KvTransferParams& params, FinishReason reason,
      std::span<const std::vector<std::int64_t>> group_block_ids);

  /// Prefill side, ranks on several hosts: where each of this instance's pp_size * tp_size
  /// workers listens, stage-major (the engine learns it from its workers, as vLLM's
  /// set_xfer_handshake_metadata). RequestFinished's params then carry it as
  /// remote_rank_hosts, so that a decode stage reads the host of the prefill stage it reads.
  /// A count other than pp_size * tp_size, or an empty or over-long host, is InvalidArgument and
  /// changes nothing. An empty list: every rank on `host` again.
  Status SetRankHosts(std::vector<std::string> hosts);

 private:
  // The prompt tokens the prefill side computes and a load brings (state_groups: less one).
  std::int64_t LoadedPrompt(std::int64_t n) const {
    return config_.state_groups && n > 1 ? n - 1 : n;
  }
  SchedulerConfig config_;
  std::vector<std::string> rank_hosts_;  // SetRankHosts; empty: every rank on config_.host
  ConnectorMetadata pending_;
  // Layer-wise requests scheduled and not finished: the prompt tokens computed so far.
  std::map<std::string, std::int64_t> layerwise_computed_;
};

/// What to do with a load that failed.
enum class LoadFailurePolicy : std::uint8_t {
  kRecompute = 0,  ///< report its blocks in TakeLoadErrors so the engine recomputes them
  kFail = 1,       ///< report it; the engine should fail the request
};

struct WorkerConfig {
  Role role = Role::kPrefill;
  std::string engine_id;
  int dp_rank = 0;
  int tp_size = 1;
  int tp_rank = 0;
  /// Pipeline parallelism: this worker's stage of pp_size. Its cache holds its stage's layers
  /// (CacheSpecOptions::first_layer says which), it listens on the port of (dp_rank, pp_rank,
  /// tp_rank) and, on the decode side, reads the same stage of the prefill instance.
  int pp_size = 1;
  int pp_rank = 0;
  /// Side channel: bind address (also what peers are told), base port, shared secret.
  std::string host = "127.0.0.1";
  int base_port = 5557;
  std::string secret;
  bool allow_insecure_remote = false;
  /// Optional rank table: when set, the worker's identity comes from its entry (rule 5).
  std::optional<RankTable> rank_table;
  std::string server_id;                     ///< this host, as the rank table names it
  std::vector<std::string> visible_devices;  ///< empty: all
  /// Data plane. Its secret defaults to the side channel's (`secret`), and so does the address
  /// its tcp read server listens on (`host`) unless backend_options sets "tcp.bind_host".
  TransportOptions transport;
  /// Builds the data plane from the options above; default CreateTransport. For embedders and
  /// tests that wrap the transport (for example with fault injection or their own metrics).
  std::function<Result<std::unique_ptr<Transport>>(const TransportOptions&)> make_transport;
  std::chrono::milliseconds handshake_timeout{5000};
  std::chrono::milliseconds transfer_timeout{30000};
  std::chrono::milliseconds notice_timeout{5000};
  std::chrono::milliseconds hold_lease{120000};
  /// Loads carried out at once; more wait in a queue of at most `max_queued_loads` (past it a
  /// load fails at once with ResourceExhausted, reported like any failed load).
  int transfer_threads = 4;
  std::size_t max_queued_loads = 65536;
  /// Caps on what remote peers can make this worker keep (docs/reliability.md, "Hostile
  /// input"): early notices (finished/abort notices for requests not held yet), prefill ranks
  /// with a cached handshake and data-plane connection (least recently used ones without a
  /// running load are dropped), and queued best-effort notices (lease renewals, aborts).
  std::size_t max_early_notices = 16384;
  int max_agents = 256;
  std::size_t max_queued_notices = 16384;
  LoadFailurePolicy failure_policy = LoadFailurePolicy::kRecompute;

  /// Layer-wise transfer (docs/layerwise.md). Prefill side: one announcement per this many
  /// layers written (and one after the last layer).
  int layerwise_layers_per_notice = 1;
  /// Decode side: a layer-wise load fails (to be recomputed) when the prefill side has not
  /// started the request `layerwise_start_timeout` after the subscription (the prefill leg never
  /// arrived, or waits behind a long queue), or when, once started, no announcement comes for
  /// `layerwise_progress_timeout` (the prefill instance died or stopped); and like every load at
  /// `transfer_timeout` from its start.
  std::chrono::milliseconds layerwise_start_timeout{30000};
  std::chrono::milliseconds layerwise_progress_timeout{5000};
  /// Decode side: the threads that step layer-wise loads. A load holds one only while it plans
  /// and reads what an announcement brought (or handshakes, subscribes, polls, confirms: round
  /// trips bounded by their timeouts), never while it waits for the next, so a few step
  /// thousands of loads (docs/layerwise.md).
  int layerwise_threads = 16;
  /// Prefill side caps on what peers can make this worker keep (docs/reliability.md): transfers
  /// subscribed to before this worker started their request, and subscribers per transfer.
  /// Past them a subscription is refused with ResourceExhausted.
  std::size_t max_waiting_subscriptions = 4096;
  std::size_t max_subscribers_per_transfer = 256;
};

/// One part of one layer of a KV cache, as RegisterKvCaches takes it.
struct KvCachePart {
  std::uint64_t address = 0;  ///< first byte: a host pointer, or a device address
  std::uint64_t bytes = 0;    ///< must be CacheSpec::PartBytes(part)
  MemoryKind memory;          ///< host, or the device the memory is on
};

/// Requests that finished since the last GetFinished (like vLLM's get_finished).
struct FinishedRequests {
  std::vector<std::string> sending;    ///< prefill side: holds ended; free these blocks now
  std::vector<std::string> receiving;  ///< decode side: loads ended, done or failed
};

struct LoadError {
  std::string request_id;
  std::vector<std::int64_t> local_block_ids;
  Status status;
  /// True: the engine should recompute these blocks (policy kRecompute); their contents are
  /// undefined, since a read may have written part of them. False: fail the request (policy
  /// kFail), or the engine aborted the load itself (status Cancelled) and has nothing to redo.
  bool recompute = true;
};

/// A load that ended done (decode side): what the connector moved for it and how long it took.
struct LoadTransfer {
  std::string request_id;
  std::uint64_t bytes = 0;                ///< read by this worker for the request
  std::chrono::microseconds duration{0};  ///< start to the last read, as transfer_latency
};

struct WorkerStats {
  std::uint64_t bytes_read = 0;
  std::uint64_t reads = 0;        ///< byte ranges read
  std::uint64_t merged_runs = 0;  ///< block runs after merging contiguous blocks
  std::uint64_t loads_done = 0;
  std::uint64_t loads_failed = 0;
  /// Whole-request loads read a second time after a peer fault, through a new handshake (a
  /// prefill rank restarted on its endpoint; docs/reliability.md, "A fleet").
  std::uint64_t loads_reread = 0;
  std::uint64_t handshakes = 0;
  std::map<std::string, std::uint64_t> failures;  ///< by status code name
  /// Failed loads by the prefill engine they read from (remote_engine_id); at most 256 engines,
  /// later ones counted under "other".
  std::map<std::string, std::uint64_t> failures_by_peer;
  std::uint64_t holds_outstanding = 0;
  std::uint64_t holds_released_by_readers = 0;
  std::uint64_t holds_released_by_abort = 0;
  std::uint64_t holds_expired = 0;
  std::uint64_t early_notices = 0;          ///< now, not monotonic
  std::uint64_t early_notices_refused = 0;  ///< past max_early_notices
  std::uint64_t agents_evicted = 0;         ///< past max_agents
  std::uint64_t notices_dropped = 0;        ///< past max_queued_notices
  /// Side-channel messages the listener answered, by type (finished, abort, lease,
  /// metadata_request, ...).
  std::map<std::string, std::uint64_t> notices_received;
  /// Loads started and not yet reported to GetFinished (an aborted load leaves at its abort).
  std::uint64_t loads_outstanding = 0;
  /// Loads that ended done, from start to the last read (decode side).
  LatencyHistogram transfer_latency;
  /// Handshakes with a prefill rank: metadata request, descriptor, data-plane connect.
  LatencyHistogram handshake_latency;
  /// The data plane's own counters (Transport::Stats), read when the stats are taken.
  TransportStats transport;
};

/// One worker's stats and the labels that tell its series apart from other workers'
/// (kvferry/metrics.h turns a set of them into Prometheus text).
struct WorkerMetrics {
  std::string engine_id;
  Role role = Role::kPrefill;
  int dp_rank = 0;
  int tp_rank = 0;  ///< from the rank table when one is configured
  WorkerStats stats;
};

class WorkerImpl;

/// The worker side: one per TP worker process. Thread-safe: any method from any thread. No
/// method waits on the network while holding a lock another method needs.
class Worker {
 public:
  /// Starts the worker: its identity (from the rank table's entry for this server, visible
  /// devices and TP rank when a table is given: rule 5), its data plane (CreateTransport, or
  /// config.make_transport) and its side-channel listener at base_port + (dp_rank * pp_size +
  /// pp_rank) * tp_size + tp_rank (rule 7; with one stage, base_port + dp_rank * tp_size +
  /// tp_rank). InvalidArgument for a config that names no engine, an invalid TP rank or
  /// size, or no matching rank-table entry; Unavailable for a busy port (the message names it).
  static Result<std::unique_ptr<Worker>> Create(WorkerConfig config);
  /// Stops the listener, ends every load (queued ones fail fast; running ones are cancelled and
  /// waited for, so no read writes into the caches after it returns), drops queued best-effort
  /// notices, and closes the data plane. Holds end with the process: the prefill side's peers
  /// see their reads fail.
  ~Worker();

  /// Registers every part of every layer with the data plane (rule 6). `parts[layer][part]`
  /// names each part's memory: its address, its size, which must be spec.PartBytes(part), and
  /// its memory kind, host or a device ("sim:0", "cuda:1"; docs/device.md), the same for every
  /// part. The worker never touches the memory itself: the transport moves it (device memory
  /// over IPC on one host or staged tcp). The memory is the engine's: it must stay allocated
  /// and in place until the worker is destroyed, since peers read it for as long as holds last.
  /// The spec's TP rank and size must be this worker's. InvalidArgument (nothing registered) for
  /// a wrong count of layers or parts, a size that is not the part's, mixed memory kinds,
  /// overlapping parts or a second call; the data plane's error for memory it cannot register.
  /// Call once, before the first StartLoadKv.
  Status RegisterKvCaches(const CacheSpec& spec,
                          const std::vector<std::vector<KvCachePart>>& parts);
  /// The same with bare base addresses, `bases[layer][part]`, each spec.PartBytes(part) long,
  /// all in `memory`.
  Status RegisterKvCaches(const CacheSpec& spec, std::vector<std::vector<std::uint64_t>> bases,
                          MemoryKind memory = MemoryKind::Host());
  /// A cache of several KV cache groups (a hybrid model: full attention and sliding-window
  /// layers): `bases[group][layer][part]`, each group's parts as RegisterKvCaches above checks
  /// them (docs/connector.md, "KV cache groups"). Every group's memory is in `memory`. Groups
  /// may share tensors exactly (layer i of every group one tensor, as vLLM's hybrid allocator
  /// makes them: registered as aliases), never overlap them otherwise. Layer-wise transfer takes
  /// one group.
  Status RegisterKvCaches(const CacheGroups& caches,
                          std::vector<std::vector<std::vector<std::uint64_t>>> bases,
                          MemoryKind memory = MemoryKind::Host());

  /// Registers the step's holds (prefill: each request's blocks stay allocated until every
  /// decode rank that reads them has reported, it is aborted, or its lease passes without
  /// renewal) and queues its loads (decode: each runs on a transfer thread). Never blocks and
  /// never fails: a load that cannot even be queued ends failed, and is reported like any other.
  /// A load already running for the same request id is not started twice.
  void StartLoadKv(const ConnectorMetadata& metadata);
  /// Prefill side, layer-wise (rule 16): the engine has written layer `layer` of every request of
  /// the step's LayerwiseSaves (vLLM's save_kv_layer), so the worker announces it to their
  /// subscribers (every layerwise_layers_per_notice layers, and after the last). Call it once per
  /// layer, in layer order, from the thread that calls StartLoadKv. `stream`: the native stream
  /// (CUstream) of the caches' device on which the layer's KV was written; the announcement then
  /// waits for the work queued on it so far, on a worker thread, and the call never blocks. 0
  /// when the KV is already in memory (host caches, or the engine synchronised). Never blocks on
  /// the network. InvalidArgument for a layer out of range or a stream with host caches; a
  /// stream whose work fails fails the step's transfers instead of announcing them.
  Status SaveKvLayer(int layer, std::uint64_t stream = 0);
  /// What ended since the last call: `sending` (prefill) the requests whose holds ended, whose
  /// blocks the engine may now free; `receiving` (decode) the loads that ended, done or failed,
  /// each reported exactly once (rule 11). Expired holds are swept by this call.
  FinishedRequests GetFinished();
  /// Failed loads with their local block ids, since the last call. Call it after GetFinished:
  /// a load's error is recorded before the load is reported finished, so every failed load in
  /// `receiving` has its error by then (in this call or an earlier one).
  std::vector<LoadError> TakeLoadErrors();
  /// The loads that ended done since the last call, in the order they ended: per request what
  /// this worker read and how long it took (the per-request view of transfer_latency and
  /// bytes_read, for reports and per-transfer stats such as vLLM's). The last 65,536 are kept
  /// between calls; older ones are dropped. Failed and aborted loads are not listed.
  std::vector<LoadTransfer> TakeLoadTransfers();
  /// The engine aborted the request whose load runs or waits here: the load stops (reads in
  /// flight are cancelled; when this returns none of them writes any more), the prefill ranks
  /// are told to release their holds, and the load is still reported once in `receiving`, with a
  /// Cancelled LoadError that asks for no recompute, by the next GetFinished, whatever the load
  /// was waiting on (a handshake with a peer that does not answer, a layer-wise announcement).
  /// Keep the blocks allocated until then.
  /// NotFound when this worker has no such load (it already ended, or never started).
  Status AbortLoad(const std::string& request_id, const std::string& reason);

  /// A snapshot of the counters, gauges and latency histograms; thread-safe, cheap enough to
  /// call every second (copies two histograms of about 18 KiB each).
  WorkerStats Stats() const;
  /// Stats() with this worker's identity, for exporters (kvferry/metrics.h).
  WorkerMetrics Metrics() const;
  /// "tcp://host:port" of this worker's side-channel listener.
  const std::string& listener_endpoint() const;

 private:
  explicit Worker(std::unique_ptr<WorkerImpl> impl);
  std::unique_ptr<WorkerImpl> impl_;
};

}  // namespace kvferry
