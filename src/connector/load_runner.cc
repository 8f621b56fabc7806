// The decode side's runner of loads: queueing them on its threads, their bookkeeping (finished,
// errors, transfers, stats), aborts and the prefill holds' lease renewal. The steps of one load
// are load_reads.cc (whole request) and layerwise_load.cc (layer-wise).
#include "connector/load_runner.h"

#include <algorithm>
#include <iterator>

#include "common/clock.h"
#include "common/log.h"

namespace kvferry {

LoadRunner::LoadRunner(const LoadRunnerContext& context)
    : cfg_(context.config),
      self_(context.self),
      transport_(context.transport),
      client_(context.client),
      agents_(context.agents) {
  notifier_ = std::make_unique<sidechannel::FinishedNotifier>(
      &client_, self_, static_cast<std::uint32_t>(cfg_.tp_size), sidechannel::NotifierOptions{},
      [](const std::string& endpoint, const std::vector<std::string>& ids, const Status& s) {
        if (!s.ok()) {
          Log().warn(
              "finished notice for {} request(s) to {} failed: {}; the prefill side frees them "
              "when their lease expires",
              ids.size(), endpoint, s.ToString());
        }
      });
  // Best-effort notices (aborts, lease renewals): bounded, and dropped at shutdown rather than
  // delaying it by their timeouts.
  background_ = std::make_unique<WorkQueue>(2, "kvferry-bg", cfg_.max_queued_notices,
                                            WorkQueue::OnStop::kDrop);
  transfers_ =
      std::make_unique<WorkQueue>(cfg_.transfer_threads, "kvferry-load", cfg_.max_queued_loads);
  // Steps of layer-wise loads: a step never waits for an announcement, only for its own reads
  // and round trips, so a few threads step every load of the worker.
  layerwise_ = std::make_unique<WorkQueue>(std::max(1, cfg_.layerwise_threads), "kvferry-lw",
                                           cfg_.max_queued_loads);
  timer_thread_ = std::thread([this] { RunTimers(); });
  lease_thread_ = std::thread([this] { RenewLeases(); });
}

LoadRunner::~LoadRunner() {
  Stop();
  // In this order, before any member goes: queued loads run (and fail fast, posting abort
  // notices), then the notifier flushes, then queued notices are dropped.
  transfers_.reset();
  layerwise_.reset();
  notifier_.reset();
  background_.reset();
}

void LoadRunner::Stop() {
  {
    MutexLock lock(mu_);
    stopping_ = true;
    // Each layer-wise load steps once more, sees the stop and ends (a running step looks again
    // before it would park).
    for (const auto& [id, watch] : watches_) Wake(watch);
  }
  {
    MutexLock lock(timer_mu_);
    timers_stopping_ = true;
  }
  timer_cv_.SignalAll();
  stop_cv_.SignalAll();
  if (timer_thread_.joinable()) timer_thread_.join();
  if (lease_thread_.joinable()) lease_thread_.join();
}

void LoadRunner::SetCaches(const CacheGroups& caches, const std::vector<CacheAddresses>& addresses,
                           const std::string& listener_endpoint) {
  MutexLock lock(mu_);
  caches_ = caches;
  addresses_ = addresses;
  listener_endpoint_ = listener_endpoint;
}

void LoadRunner::Start(const std::vector<LoadSpec>& loads) {
  std::vector<LoadSpec> to_start;
  {
    MutexLock lock(mu_);
    for (const LoadSpec& load : loads) {
      if (loads_.count(load.request_id) != 0) continue;  // already loading
      loads_[load.request_id] = LoadState{load, {}, {}, std::nullopt};
      to_start.push_back(load);
    }
  }
  for (const LoadSpec& load : to_start) {
    // A layer-wise load is stepped by the layer-wise threads as its announcements come; a
    // whole-request one (or one of no blocks, which only tells the prefill side) runs on a
    // transfer thread.
    const bool layerwise = !load.transfer_id.empty() && !load.local_block_ids.empty();
    Status queued =
        layerwise ? StartLayerwise(load) : transfers_->TryPost([this, load] { Run(load); });
    if (!queued.ok()) {
      // Every load ends (rule 11): one that cannot even queue fails now, its blocks recomputed.
      Status s = queued.WithContext("queueing the load of request " + load.request_id);
      Log().warn("{}", s.ToString());
      bool reported_here = false;
      {
        MutexLock lock(mu_);
        reported_here = EndLocked(load, s, /*recompute=*/true);
      }
      if (reported_here) SendAborts(load, std::string(s.message()));
    }
  }
}

std::vector<std::string> LoadRunner::TakeFinished() {
  MutexLock lock(mu_);
  std::vector<std::string> out;
  out.swap(finished_);
  return out;
}

std::vector<LoadTransfer> LoadRunner::TakeTransfers() {
  MutexLock lock(mu_);
  std::vector<LoadTransfer> out(std::make_move_iterator(done_transfers_.begin()),
                                std::make_move_iterator(done_transfers_.end()));
  done_transfers_.clear();
  return out;
}

std::vector<LoadError> LoadRunner::TakeErrors() {
  MutexLock lock(mu_);
  std::vector<LoadError> out;
  out.swap(errors_);
  return out;
}

WorkerStats LoadRunner::Stats() const {
  MutexLock lock(mu_);
  WorkerStats s = stats_;
  // Started and not yet reported: a load that Abort reported stays in loads_ until its thread has
  // unwound, and is no longer outstanding to the engine (it is in GetFinished already).
  s.loads_outstanding = static_cast<std::uint64_t>(std::count_if(
      loads_.begin(), loads_.end(), [](const auto& kv) { return !kv.second.reported; }));
  return s;
}

Status LoadRunner::Abort(const std::string& request_id, const std::string& reason) {
  std::vector<BatchId> running;
  {
    MutexLock lock(mu_);
    auto it = loads_.find(request_id);
    if (it == loads_.end()) {
      return Status::NotFound("no load of request " + request_id +
                              " is running on this worker (it ended, or never started)");
    }
    if (it->second.aborted) return Status::Ok();
    it->second.aborted = reason;  // DoLoad submits nothing more for it from now on
    running = it->second.batches;
    if (!it->second.spec.transfer_id.empty()) WakeWatch(it->second.spec.transfer_id);
  }
  // Cancelled outside mu_ (rule 14: no wait on I/O under a lock other requests need). DoLoad
  // drops a batch from the list only after it ended, so every batch that may still write into the
  // request's blocks is in `running`; Cancel returns once no read of it runs, after which the
  // engine may reuse the blocks. A batch released meanwhile had ended: Cancel ignores it.
  for (BatchId b : running) transport_.Cancel(b);
  // No read of it runs now, and none can start (reads are submitted only while it is not
  // aborted): it ends here, whatever its thread waits on (a handshake with a peer that does not
  // answer, a subscription, an announcement), and its thread ends it quietly later.
  std::optional<LoadSpec> spec;
  {
    MutexLock lock(mu_);
    auto it = loads_.find(request_id);
    if (it != loads_.end() && !it->second.reported) {
      it->second.reported = true;
      spec = it->second.spec;
      ReportLocked(*spec, Status::Cancelled("the engine aborted the load: " + reason),
                   /*recompute=*/false);
    }
  }
  if (spec) SendAborts(*spec, reason);
  return Status::Ok();
}

Status LoadRunner::AbortedLocked(const std::string& request_id) const {
  auto it = loads_.find(request_id);
  if (it == loads_.end() || !it->second.aborted) return Status::Ok();
  return Status::Cancelled("the engine aborted the load: " + *it->second.aborted);
}

void LoadRunner::Run(const LoadSpec& load) {
  const Clock::time_point start = Clock::now();
  std::uint64_t bytes = 0;
  Status s = DoLoad(load, &bytes);
  EndLoad(load, start, std::move(s), bytes);
}

void LoadRunner::EndLoad(const LoadSpec& load, Clock::time_point start, Status s,
                         std::uint64_t bytes) {
  bool aborted_by_engine = false;
  if (!s.ok()) {
    // A load the engine aborted reports that, whatever else went wrong on the way.
    MutexLock lock(mu_);
    if (Status aborted = AbortedLocked(load.request_id); !aborted.ok()) {
      s = aborted;
      aborted_by_engine = true;
    }
  }
  if (!s.ok() && !aborted_by_engine) {
    Log().warn("request {}: load of {} blocks from {} failed: {}", load.request_id,
               load.local_block_ids.size(), load.remote_engine_id, s.ToString());
  }
  bool reported_here = false;
  {
    MutexLock lock(mu_);
    if (s.ok()) {
      const auto took = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start);
      stats_.transfer_latency.Add(took);
      constexpr std::size_t kMaxTransfers = 65536;  // between TakeTransfers calls
      if (done_transfers_.size() == kMaxTransfers) done_transfers_.pop_front();
      done_transfers_.push_back({load.request_id, bytes, took});
    }
    // A load the engine aborted has nothing to recompute: the engine has dropped the request.
    reported_here = EndLocked(load, s, !aborted_by_engine);
  }
  // Whoever reports a failed load tells the prefill ranks: Abort, when it ended the load first,
  // or this thread, also for an engine abort that this thread ended before Abort could (its
  // reads stopped on the abort flag between Abort's two steps).
  if (!s.ok() && reported_here) SendAborts(load, std::string(s.message()));
}

bool LoadRunner::EndLocked(const LoadSpec& load, const Status& s, bool recompute) {
  auto it = loads_.find(load.request_id);
  const bool reported = it != loads_.end() && it->second.reported;
  if (it != loads_.end()) loads_.erase(it);
  if (!reported) ReportLocked(load, s, recompute);
  return !reported;
}

void LoadRunner::ReportLocked(const LoadSpec& load, const Status& s, bool recompute) {
  // Every started load is reported here, exactly once: done or failed, to GetFinished.
  finished_.push_back(load.request_id);
  if (s.ok()) {
    ++stats_.loads_done;
    return;
  }
  ++stats_.loads_failed;
  ++stats_.failures[StatusCodeName(s.code())];
  // Bounded: peers name themselves, so a churning fleet must not grow this without end.
  constexpr std::size_t kMaxPeers = 256;
  const bool known = stats_.failures_by_peer.count(load.remote_engine_id) != 0;
  ++stats_.failures_by_peer[known || stats_.failures_by_peer.size() < kMaxPeers
                                ? load.remote_engine_id
                                : std::string("other")];
  // Every group's blocks the load wrote into (a hybrid load's, without the no-block positions).
  std::vector<std::int64_t> blocks = load.local_block_ids;
  for (const GroupBlockIds& g : load.more_groups) {
    std::copy_if(g.local.begin(), g.local.end(), std::back_inserter(blocks),
                 [](std::int64_t b) { return b != kNoBlock; });
  }
  errors_.push_back({load.request_id, std::move(blocks), s,
                     recompute && cfg_.failure_policy == LoadFailurePolicy::kRecompute});
}

void LoadRunner::SendAborts(const LoadSpec& load, const std::string& reason) {
  // Every prefill rank of the request may hold it (of every stage it reads); tell them all, best
  // effort.
  for (const LoadSpec& stage : Stages(load)) {
    for (int q = 0; q < stage.remote_tp_size; ++q) {
      const std::string endpoint = SideChannelEndpoint(stage.RankHost(q), stage.remote_port + q);
      PostBackground([this, endpoint, id = load.remote_request_id, reason] {
        Result<wire::Message> r = client_.Call(endpoint, wire::AbortNotice{self_, {id}, reason},
                                               DeadlineAfter(cfg_.notice_timeout));
        if (!r.ok()) {
          Log().info("abort notice for {} to {} failed: {}", id, endpoint, r.status().ToString());
        }
      });
    }
  }
}

void LoadRunner::PostBackground(std::function<void()> task) {
  Status s = background_->TryPost(std::move(task));
  if (!s.ok()) {
    MutexLock lock(mu_);
    if (++stats_.notices_dropped % 1000 == 1) {
      Log().warn("dropped a best-effort notice ({} so far): {}; holds it concerned end by lease",
                 stats_.notices_dropped, s.ToString());
    }
  }
}

void LoadRunner::RenewLeases() {
  const auto interval =
      std::max<std::chrono::milliseconds>(cfg_.hold_lease / 4, std::chrono::milliseconds(20));
  for (;;) {
    std::map<std::string, std::vector<std::string>> by_endpoint;
    {
      MutexLock lock(mu_);
      const Deadline next = DeadlineAfter(interval);
      while (!stopping_) {
        if (stop_cv_.WaitUntil(mu_, next)) break;
      }
      if (stopping_) return;
      for (const auto& [id, state] : loads_) {
        for (const std::string& e : state.endpoints) {
          by_endpoint[e].push_back(state.spec.remote_request_id);
        }
      }
    }
    // Posted without mu_: PostBackground takes it to count a notice the full queue dropped.
    for (auto& [endpoint, ids] : by_endpoint) {
      PostBackground([this, endpoint = endpoint, ids = std::move(ids)] {
        (void)client_.Call(
            endpoint,
            wire::LeaseRenewal{self_, ids, static_cast<std::uint32_t>(cfg_.hold_lease.count())},
            DeadlineAfter(cfg_.notice_timeout));
      });
    }
  }
}

}  // namespace kvferry
