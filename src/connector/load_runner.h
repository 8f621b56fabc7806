// The decode side's loads (rules 8 to 12, 16): each queued load plans which prefill ranks hold
// which bytes, reads them as one batch per rank through the data plane (a layer-wise load: one
// batch per rank each time the rank announces more layers written), tells the prefill ranks it is
// done (or aborts their holds when it failed), and is reported exactly once as finished, with an
// error when it failed. While loads run, their holds' leases are renewed. The engine can abort a
// load. Used by the worker; the agent cache gives it the prefill ranks. load_runner.cc holds what
// both kinds of load share, load_plan.cc where a load reads from (stages, layers, groups' TP
// sources), load_reads.cc the whole-request load, layerwise_load.cc the layer-wise load.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/work_queue.h"
#include "connector/agent_cache.h"
#include "connector/layerwise_plan.h"
#include "kvferry/connector.h"
#include "layout/block_runs.h"
#include "layout/tp_map.h"
#include "sidechannel/notifier.h"

namespace kvferry {

/// The prompt tokens a load brings: [first, first + count).
struct TokenSpan {
  std::int64_t first = 0;
  std::int64_t count = 0;

  friend bool operator==(const TokenSpan&, const TokenSpan&) = default;
};

/// The tokens of a whole-request load between blocks of `remote_tokens_per_block` and
/// `local_tokens_per_block` tokens: the load's own first_token and num_tokens where it has them;
/// from its block ids alone where a local block holds a whole number m of remote ones (its
/// local blocks are the last of the ceil(remote / m) the prompt fills, the tail rule in tokens).
/// InvalidArgument otherwise (blocks of the decode side smaller than the prefill's cannot be
/// placed without the token counts), or for a first token that is not at a local block.
Result<TokenSpan> TokensOfLoad(const LoadSpec& load, std::int64_t remote_tokens_per_block,
                               std::int64_t local_tokens_per_block);
/// The same for one KV cache group's block ids (LoadSpec::LocalIds, RemoteIds).
Result<TokenSpan> TokensOfLoad(const LoadSpec& load, std::span<const std::int64_t> remote_ids,
                               std::span<const std::int64_t> local_ids,
                               std::int64_t remote_tokens_per_block,
                               std::int64_t local_tokens_per_block);

/// What a LoadRunner shares with its worker; everything outlives the runner.
struct LoadRunnerContext {
  const WorkerConfig& config;
  wire::PeerRef self;
  Transport& transport;
  sidechannel::Client& client;
  AgentCache& agents;
};

/// Thread-safe. Its lock is never held across a network wait, a batch wait or a Cancel.
class LoadRunner {
 public:
  /// Starts the load threads, the notice threads and the lease thread.
  explicit LoadRunner(const LoadRunnerContext& context);
  /// Stop(), then waits for queued loads (they fail fast) and drops queued notices.
  ~LoadRunner();
  LoadRunner(const LoadRunner&) = delete;
  LoadRunner& operator=(const LoadRunner&) = delete;

  /// The local caches (RegisterKvCaches) and the worker's listener, where layer-wise progress is
  /// pushed; before the first load runs.
  void SetCaches(const CacheGroups& caches, const std::vector<CacheAddresses>& addresses,
                 const std::string& listener_endpoint) EXCLUDES(mu_);

  /// Queues each load not already running. A load that cannot be queued (max_queued_loads)
  /// ends failed at once, its blocks to recompute: every load ends (rule 11).
  void Start(const std::vector<LoadSpec>& loads) EXCLUDES(mu_);
  /// Loads that ended since the last call, done or failed, each once.
  std::vector<std::string> TakeFinished() EXCLUDES(mu_);
  /// Failed loads since the last call. A load's error is recorded before it is reported in
  /// TakeFinished, so a caller that takes finished loads first sees every error by then.
  std::vector<LoadError> TakeErrors() EXCLUDES(mu_);
  /// Worker::TakeLoadTransfers's contract.
  std::vector<LoadTransfer> TakeTransfers() EXCLUDES(mu_);
  /// Worker::AbortLoad's contract.
  Status Abort(const std::string& request_id, const std::string& reason) EXCLUDES(mu_);
  /// A prefill rank pushed the progress of a transfer a layer-wise load here reads: Ack 1 when
  /// taken, Ack 0 when it is not newer than the last one taken from that rank (a duplicate, or
  /// out of order); NotFound when no load here reads the transfer (the sender stops pushing it);
  /// InvalidArgument, and nothing changes, when it comes from a rank the load does not read or
  /// contradicts the load (docs/reliability.md, "Hostile input").
  wire::Message OnProgress(const wire::Progress& progress) EXCLUDES(mu_);
  /// Its counters, in the decode fields of WorkerStats (loads, failures, bytes, reads, runs,
  /// notices dropped, loads outstanding, transfer latency); the other fields are zero.
  WorkerStats Stats() const EXCLUDES(mu_);

  /// Loads not yet running fail fast from now on, and the lease thread ends. Idempotent.
  void Stop() EXCLUDES(mu_);

 private:
  struct LoadState {
    LoadSpec spec;
    std::vector<std::string> endpoints;  // prefill ranks whose leases this load renews
    std::vector<BatchId> batches;        // submitted and not yet released
    std::optional<std::string> aborted;  // the engine's reason, once Abort was called
    bool reported = false;               // ended for GetFinished already (by Abort)
  };
  // One prefill rank a load reads, handshaken.
  struct SourceAgent {
    TpSource source;
    std::string endpoint;
    std::shared_ptr<RemoteAgent> agent;
  };
  // A batch of reads to submit to one prefill rank.
  struct PlannedBatch {
    const SourceAgent* from = nullptr;
    std::vector<ReadOp> ops;
    std::uint64_t bytes = 0;
    std::uint64_t runs = 0;
  };
  // What a load needs before it reads: the caches, the plan, the ranks to notify.
  struct LoadPlan {
    CacheGroups caches;
    std::vector<CacheAddresses> addresses;  // by group
    // Group 0's TP sources: the prefill ranks the load reads (every group's name the same).
    std::vector<TpSource> sources;
    // Every group's, by group, in the order of `sources`.
    std::vector<std::vector<TpSource>> group_sources;
    std::vector<std::string> endpoints;
    const CacheSpec& spec() const { return caches[0]; }
  };

  // A layer-wise load's state between its steps: touched only by the step that runs (one at a
  // time), so it needs no lock.
  struct LayerwiseState {
    LoadSpec load;
    std::optional<LoadPlan> plan;
    std::vector<SourceAgent> agents;
    std::map<int, LayerwiseCursor> cursors;
    std::map<int, std::uint64_t> taken;  // by rank, the seq of the announcement last read
    Clock::time_point start{};
    Deadline deadline{};
    Deadline start_deadline{};
    Deadline progress_deadline = Deadline::max();
    Clock::time_point heard{};   // the last fresh announcement, or poll
    Clock::time_point polled{};  // the last poll answered (the subscription's first reply too)
    std::string listener;        // this worker's, where progress is pushed
    std::uint64_t moved = 0;
    bool set_up = false;
  };
  // A layer-wise load (docs/layerwise.md): a state machine that a layer-wise thread steps when
  // one of its prefill ranks announces progress, a deadline or poll falls due, or the engine
  // aborts it; between steps it holds no thread, so a worker runs thousands on a few. OnProgress
  // (the listener's thread) writes `latest`; the step reads it.
  struct ProgressWatch {
    Mutex mu;
    std::string engine_id;
    std::vector<LayerwiseGroup> groups GUARDED_BY(mu);    // the load's, once set up
    std::map<int, wire::Progress> latest GUARDED_BY(mu);  // by prefill rank, the newest taken
    // By rank, once handshaken: the blocks of each group of its cache, in engine block ids.
    std::map<int, std::vector<std::int64_t>> remote_blocks GUARDED_BY(mu);
    // By rank, once handshaken: who it is (engine, DP, TP and PP rank); progress from anyone
    // else (another DP rank of the same engine) is refused.
    std::map<int, wire::PeerRef> peers GUARDED_BY(mu);
    bool queued GUARDED_BY(mu) = false;   // a step is posted
    bool running GUARDED_BY(mu) = false;  // a step runs
    bool dirty GUARDED_BY(mu) = false;    // woken while its step ran: it steps again
    bool ended GUARDED_BY(mu) = false;    // reported; never stepped again
    Clock::time_point wake_at GUARDED_BY(mu) = Clock::time_point::max();  // parked until then
    LayerwiseState state;                                                 // the stepping thread's
  };

  // A whole-request load's whole life on a transfer thread. Network and batch waits: never
  // under mu_.
  void Run(const LoadSpec& load) EXCLUDES(mu_);
  // Reports a load that ended (done, failed or aborted), once: its bookkeeping, its error, the
  // abort notices of a failed one.
  void EndLoad(const LoadSpec& load, Clock::time_point start, Status s, std::uint64_t bytes)
      EXCLUDES(mu_);
  // A layer-wise load begins: watched under its transfer id and stepped (InvalidArgument when
  // another load here reads the same transfer, ResourceExhausted past max_queued_loads of them).
  Status StartLayerwise(const LoadSpec& load) EXCLUDES(mu_);
  // Posts a step of `w` unless one is posted or runs (then it steps again).
  void Wake(const std::shared_ptr<ProgressWatch>& w);
  // One step: runs the load as far as it goes without waiting, then parks it (a timer at its
  // next deadline or poll) or ends it.
  void Step(const std::shared_ptr<ProgressWatch>& w) EXCLUDES(mu_);
  // The body of a step: nullopt when every layer is read, else the time to wake at.
  Result<std::optional<Clock::time_point>> AdvanceLayerwise(ProgressWatch& w) EXCLUDES(mu_);
  // Handshakes, checks the prefill ranks' caches and subscribes (the first step).
  Status SetUpLayerwise(ProgressWatch& w) EXCLUDES(mu_);
  // Subscribes (or polls) at every source; the replies are taken like pushed announcements.
  Status SubscribeAll(ProgressWatch& w) EXCLUDES(mu_);
  void AddTimer(Clock::time_point at, const std::shared_ptr<ProgressWatch>& w) EXCLUDES(timer_mu_);
  void RunTimers() EXCLUDES(timer_mu_);
  // `*bytes`: what it read, once every read has ended.
  Status DoLoad(const LoadSpec& load, std::uint64_t* bytes) EXCLUDES(mu_);
  // A whole-request load's reads: handshakes (or cached agents), the reads of every group from
  // every rank, the ranks read from in `read_from`; `*peer_fault` when the reads (not the
  // handshakes) failed on a peer fault, which dropped the agents concerned. With `probe_holds`
  // every rank is first asked whether it holds the request (ProbeHold).
  Status ReadLoad(const LoadSpec& load, const LoadPlan& plan, Deadline deadline,
                  std::uint64_t* bytes, std::set<std::string>& read_from, bool* peer_fault,
                  bool probe_holds) EXCLUDES(mu_);
  // NotFound unless the prefill rank at `endpoint` holds the load's request now (a lease
  // renewal's ack counts held requests only).
  Status ProbeHold(const LoadSpec& load, const std::string& endpoint) EXCLUDES(mu_);
  // The caches, the TP plan and the notice endpoints of `load`; fails for an aborted load.
  Result<LoadPlan> Plan(const LoadSpec& load) EXCLUDES(mu_);
  // Handshakes with (or finds cached) every prefill rank of `sources`, checking that each is the
  // engine the load names and that its cache can be read; `feature` too when not empty.
  Result<std::vector<SourceAgent>> ResolveSources(const LoadSpec& load, const LoadPlan& plan,
                                                  Deadline deadline, const char* feature)
      EXCLUDES(mu_);
  // The layers one prefill rank gives a load: this cache's layers [first, end), which are its
  // own layers [first + layer_shift, end + layer_shift) (pipeline stages hold different ranges).
  struct StageRead {
    const SourceAgent* from = nullptr;
    int first = 0;
    int end = 0;
    int layer_shift = 0;
  };
  // The prefill stages a load reads, each as a load aimed at that stage's ranks: the load itself
  // where the PP sizes are equal (the worker aimed it), every stage where they differ (then
  // without block ids: read them from the load).
  std::vector<LoadSpec> Stages(const LoadSpec& load) const;
  // FinishedNotice::pp_readers of a load's notices: 1, or this instance's PP size for unequal
  // pipelines (every stage tells every prefill stage).
  std::uint32_t PpReaders(const LoadSpec& load) const;
  // Rule 17: which layers each handshaken rank of `agents` gives (those holding none of ours are
  // left out); NotSupported, before any byte moves, when a layer of `local` is in none.
  static Result<std::vector<StageRead>> PlanStageReads(const LoadSpec& load, const CacheSpec& local,
                                                       std::span<const SourceAgent> agents,
                                                       int group);
  // Group `group`'s reads of the load from the rank `r` names: its blocks, the layers `r`
  // gives, a sliding window's tokens only.
  Status AddGroupReads(const LoadSpec& load, const LoadPlan& plan, const StageRead& r, int group,
                       PlannedBatch& batch) const;
  // A state group's read (rule 18): the request's state block, whole (its TP share of it).
  Status AddStateReads(const LoadSpec& load, const LoadPlan& plan, const StageRead& r, int group,
                       PlannedBatch& batch) const;
  // The reads of blocks `remote_ids` into `local_ids` of group `group`, the layers `r` gives.
  Status AddReads(const LoadPlan& plan, const StageRead& r, int group,
                  std::span<const std::int64_t> remote_ids, std::span<const std::int64_t> local_ids,
                  PlannedBatch& batch) const;
  // The same token run by token run (blocks of another token count than ours, or a sliding
  // window): prompt tokens `tokens` of group `group`.
  Status AddTokenReads(const LoadSpec& load, const LoadPlan& plan, const StageRead& r, int group,
                       TokenSpan tokens, PlannedBatch& batch) const;
  // `ranges` of group `group` (by this cache's layers; `s`'s own are layer_shift further) as
  // read ops into `batch`.
  void AppendReadOps(const LoadPlan& plan, const SourceAgent& s, int group,
                     std::span<const ByteRange> ranges, int layer_shift, PlannedBatch& batch) const;
  // The TP source of group `group` for the prefill rank `s` reads.
  static const TpSource& GroupSource(const LoadPlan& plan, const SourceAgent& s, int group);
  // Submits the batches (each registered with the load, so an abort cancels it), waits for all,
  // releases them and counts what they moved; the first failure (or the engine's abort) wins.
  Status RunBatches(const LoadSpec& load, std::vector<PlannedBatch>& batches, Deadline deadline,
                    std::uint64_t* bytes) EXCLUDES(mu_);
  // Rule 10: tells every prefill rank of `endpoints` the load is done; those it read from
  // (`read_from`) at once, awaiting their confirmation that they held the blocks throughout.
  Status Confirm(const LoadSpec& load, const std::vector<std::string>& endpoints,
                 const std::set<std::string>& read_from) EXCLUDES(mu_);
  void WakeWatch(const std::string& transfer_id) REQUIRES(mu_);
  // A load's thread is done with it: reported unless Abort reported it already (true where it
  // reported it here).
  bool EndLocked(const LoadSpec& load, const Status& s, bool recompute) REQUIRES(mu_);
  // Reports a load's end to GetFinished and TakeErrors (the one place, so each is reported once);
  // `recompute` false for engine aborts.
  void ReportLocked(const LoadSpec& load, const Status& s, bool recompute) REQUIRES(mu_);
  std::vector<std::string> NoticeEndpoints(const LoadSpec& load, const CacheSpec& spec,
                                           const std::vector<TpSource>& sources) const;
  // Cancelled with the engine's reason when the load was aborted; Ok otherwise.
  Status AbortedLocked(const std::string& request_id) const REQUIRES(mu_);
  void SendAborts(const LoadSpec& load, const std::string& reason) EXCLUDES(mu_);
  void RenewLeases() EXCLUDES(mu_);
  // Queues a best-effort network notice; dropped (and counted) when the queue is full. Must be
  // called without mu_ (it takes it to count a drop).
  void PostBackground(std::function<void()> task) EXCLUDES(mu_);

  const WorkerConfig& cfg_;
  const wire::PeerRef self_;
  Transport& transport_;
  sidechannel::Client& client_;
  AgentCache& agents_;
  std::unique_ptr<sidechannel::FinishedNotifier> notifier_;
  std::unique_ptr<WorkQueue> background_;
  std::unique_ptr<WorkQueue> transfers_;  // after background_: its loads post notices there
  std::unique_ptr<WorkQueue> layerwise_;  // steps of layer-wise loads (never sleeping in one)

  mutable Mutex mu_;
  CondVar stop_cv_;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::optional<CacheGroups> caches_ GUARDED_BY(mu_);
  std::vector<CacheAddresses> addresses_ GUARDED_BY(mu_);
  std::string listener_endpoint_ GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<ProgressWatch>> watches_ GUARDED_BY(mu_);  // by transfer
  std::map<std::string, LoadState> loads_ GUARDED_BY(mu_);
  std::vector<std::string> finished_ GUARDED_BY(mu_);
  std::vector<LoadError> errors_ GUARDED_BY(mu_);
  std::deque<LoadTransfer> done_transfers_ GUARDED_BY(mu_);  // the last kMaxTransfers
  WorkerStats stats_ GUARDED_BY(mu_);                        // the decode fields only
  // Parked layer-wise loads by the time they wake at (a later park leaves a stale entry, which
  // wakes nothing).
  Mutex timer_mu_;
  CondVar timer_cv_;
  std::multimap<Clock::time_point, std::weak_ptr<ProgressWatch>> timers_ GUARDED_BY(timer_mu_);
  bool timers_stopping_ GUARDED_BY(timer_mu_) = false;
  std::thread timer_thread_;
  std::thread lease_thread_;  // last: it uses the rest
};

}  // namespace kvferry
