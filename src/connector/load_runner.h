// The decode side's loads (rules 8 to 12): each queued load plans which prefill ranks hold which
// bytes, reads them as one batch per rank through the data plane, tells the prefill ranks it is
// done (or aborts their holds when it failed), and is reported exactly once as finished, with an
// error when it failed. While loads run, their holds' leases are renewed. The engine can abort a
// load. Used by the worker; the agent cache gives it the prefill ranks.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/work_queue.h"
#include "connector/agent_cache.h"
#include "kvferry/connector.h"
#include "layout/block_runs.h"
#include "layout/tp_map.h"
#include "sidechannel/notifier.h"

namespace kvferry {

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

  /// The local caches (RegisterKvCaches), before the first load runs.
  void SetCaches(const CacheSpec& spec, const CacheAddresses& addresses) EXCLUDES(mu_);

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
  };

  // A load's whole life on a transfer thread. Network and batch waits: never under mu_.
  void Run(const LoadSpec& load) EXCLUDES(mu_);
  // `*bytes`: what it read, once every read has ended.
  Status DoLoad(const LoadSpec& load, std::uint64_t* bytes) EXCLUDES(mu_);
  // Reports a load's end (the one place, so each ends once); `recompute` false for engine aborts.
  void EndLocked(const LoadSpec& load, const Status& s, bool recompute) REQUIRES(mu_);
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

  mutable Mutex mu_;
  CondVar stop_cv_;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::optional<CacheSpec> spec_ GUARDED_BY(mu_);
  std::optional<CacheAddresses> addresses_ GUARDED_BY(mu_);
  std::map<std::string, LoadState> loads_ GUARDED_BY(mu_);
  std::vector<std::string> finished_ GUARDED_BY(mu_);
  std::vector<LoadError> errors_ GUARDED_BY(mu_);
  std::deque<LoadTransfer> done_transfers_ GUARDED_BY(mu_);  // the last kMaxTransfers
  WorkerStats stats_ GUARDED_BY(mu_);                        // the decode fields only
  std::thread lease_thread_;                                 // last: it uses the rest
};

}  // namespace kvferry
