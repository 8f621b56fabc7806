#include "connector/load_runner.h"

#include <algorithm>
#include <set>

#include "common/clock.h"
#include "common/log.h"

namespace kvferry {
namespace {

// Remote input decides how many ranks a load talks to and their ports: bounded before any loop.
Status CheckRemoteRanks(int remote_tp_size, int remote_port) {
  if (remote_tp_size < 1 || remote_tp_size > kMaxTpSize) {
    return Status::InvalidArgument("remote_tp_size " + std::to_string(remote_tp_size) +
                                   " is outside 1.." + std::to_string(kMaxTpSize));
  }
  if (remote_port < 1 || remote_port + remote_tp_size - 1 > 65535) {
    return Status::InvalidArgument("remote_port " + std::to_string(remote_port) + " with " +
                                   std::to_string(remote_tp_size) +
                                   " ranks reaches past port 65535");
  }
  return Status::Ok();
}

// Only liveness failures take a peer down (rule 14): its connection is lost, its process is gone,
// or it refused us. A slow batch (Timeout) or a refused read fails its own load alone.
bool PeerFault(const Status& s) {
  return s.code() == StatusCode::kPeerDisconnected || s.code() == StatusCode::kUnavailable;
}

}  // namespace

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
  layerwise_ = std::make_unique<WorkQueue>(std::max(1, cfg_.layerwise_threads), "kvferry-lw",
                                           cfg_.max_queued_loads);
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
    for (const auto& [id, watch] : watches_) {
      MutexLock w(watch->mu);
      watch->wake = true;
      watch->cv.SignalAll();
    }
  }
  stop_cv_.SignalAll();
  if (lease_thread_.joinable()) lease_thread_.join();
}

void LoadRunner::SetCaches(const CacheSpec& spec, const CacheAddresses& addresses,
                           const std::string& listener_endpoint) {
  MutexLock lock(mu_);
  spec_ = spec;
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
    // A layer-wise load sleeps between announcements: it takes a thread of its own pool, so it
    // never keeps whole-request loads waiting.
    WorkQueue& queue =
        load.transfer_id.empty() || load.local_block_ids.empty() ? *transfers_ : *layerwise_;
    Status queued = queue.TryPost([this, load] { Run(load); });
    if (!queued.ok()) {
      // Every load ends (rule 11): one that cannot even queue fails now, its blocks recomputed.
      Status s = queued.WithContext("queueing the load of request " + load.request_id);
      Log().warn("{}", s.ToString());
      MutexLock lock(mu_);
      EndLocked(load, s, /*recompute=*/true);
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
  s.loads_outstanding = loads_.size();
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
    // (An engine abort told the prefill ranks already, when it ended the load.)
    Log().warn("request {}: load of {} blocks from {} failed: {}", load.request_id,
               load.local_block_ids.size(), load.remote_engine_id, s.ToString());
    SendAborts(load, std::string(s.message()));
  }
  MutexLock lock(mu_);
  if (s.ok()) {
    const auto took = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start);
    stats_.transfer_latency.Add(took);
    constexpr std::size_t kMaxTransfers = 65536;  // between TakeTransfers calls
    if (done_transfers_.size() == kMaxTransfers) done_transfers_.pop_front();
    done_transfers_.push_back({load.request_id, bytes, took});
  }
  // A load the engine aborted has nothing to recompute: the engine has dropped the request.
  EndLocked(load, s, !aborted_by_engine);
}

void LoadRunner::EndLocked(const LoadSpec& load, const Status& s, bool recompute) {
  auto it = loads_.find(load.request_id);
  const bool reported = it != loads_.end() && it->second.reported;
  if (it != loads_.end()) loads_.erase(it);
  if (!reported) ReportLocked(load, s, recompute);
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
  errors_.push_back({load.request_id, load.local_block_ids, s,
                     recompute && cfg_.failure_policy == LoadFailurePolicy::kRecompute});
}

std::vector<std::string> LoadRunner::NoticeEndpoints(const LoadSpec& load, const CacheSpec& spec,
                                                     const std::vector<TpSource>& sources) const {
  std::set<int> ranks;
  for (const TpSource& s : sources) ranks.insert(s.prefill_rank);
  // Prefill ranks nobody reads (decode TP smaller) are told by one decode rank each.
  for (int q = 0; q < load.remote_tp_size; ++q) {
    Result<int> readers = ExpectedReaders(spec, load.remote_tp_size, cfg_.tp_size, q);
    if (readers.ok() && *readers == 0 && q % cfg_.tp_size == cfg_.tp_rank) ranks.insert(q);
  }
  std::vector<std::string> out;
  out.reserve(ranks.size());
  for (int q : ranks) out.push_back(SideChannelEndpoint(load.remote_host, load.remote_port + q));
  return out;
}

Result<LoadRunner::LoadPlan> LoadRunner::Plan(const LoadSpec& load) {
  std::optional<CacheSpec> spec;
  std::optional<CacheAddresses> addresses;
  {
    MutexLock lock(mu_);
    if (stopping_) return Status::Cancelled("the worker is shutting down");
    spec = spec_;
    addresses = addresses_;
  }
  if (!spec) {
    return Status::InvalidArgument("KV caches are not registered; call RegisterKvCaches first");
  }
  KVFERRY_RETURN_IF_ERROR(CheckRemoteRanks(load.remote_tp_size, load.remote_port));
  // Rule 8: which prefill ranks, which bytes.
  KVFERRY_ASSIGN_OR_RETURN(std::vector<TpSource> sources,
                           PlanTpSources(*spec, load.remote_tp_size, cfg_.tp_size, cfg_.tp_rank));
  std::vector<std::string> endpoints = NoticeEndpoints(load, *spec, sources);
  {
    MutexLock lock(mu_);
    KVFERRY_RETURN_IF_ERROR(AbortedLocked(load.request_id));  // aborted while queued
    auto it = loads_.find(load.request_id);
    if (it != loads_.end()) it->second.endpoints = endpoints;
  }
  return LoadPlan{*spec, *addresses, std::move(sources), std::move(endpoints)};
}

Result<std::vector<LoadRunner::SourceAgent>> LoadRunner::ResolveSources(const LoadSpec& load,
                                                                        const LoadPlan& plan,
                                                                        Deadline deadline,
                                                                        const char* feature) {
  std::vector<SourceAgent> out;
  for (const TpSource& source : plan.sources) {
    const std::string endpoint =
        SideChannelEndpoint(load.remote_host, load.remote_port + source.prefill_rank);
    const Deadline hs_deadline = std::min(deadline, DeadlineAfter(cfg_.handshake_timeout));
    KVFERRY_ASSIGN_OR_RETURN(
        std::shared_ptr<RemoteAgent> agent,
        agents_.Get({endpoint, load.remote_engine_id, source.prefill_rank, load.remote_tp_size},
                    hs_deadline));
    // A restarted prefill instance answers on the same endpoint under a new engine id; its
    // blocks are not this request's.
    if (agent->metadata->agent.peer.engine_id != load.remote_engine_id) {
      return Status::Unavailable("the prefill instance at " + endpoint + " is now engine " +
                                 agent->metadata->agent.peer.engine_id + ", but request " +
                                 load.request_id + " was held by engine " + load.remote_engine_id +
                                 ", which is gone");
    }
    KVFERRY_RETURN_IF_ERROR(CheckRegionLayout(agent->metadata->cache));
    if (feature != nullptr && !agent->metadata->Offers(feature)) {
      return Status::NotSupported("the prefill worker at " + endpoint + " (engine " +
                                  load.remote_engine_id + ") does not speak " + feature +
                                  " transfer (an older kvferry); request " + load.request_id +
                                  " is recomputed here: send it whole-request legs instead");
    }
    out.push_back({source, endpoint, std::move(agent)});
  }
  return out;
}

Status LoadRunner::AddReads(const LoadPlan& plan, const SourceAgent& s,
                            std::span<const std::int64_t> remote_ids,
                            std::span<const std::int64_t> local_ids, int first_layer, int end_layer,
                            PlannedBatch& batch) const {
  const CacheSpec& remote = s.agent->metadata->cache;
  KVFERRY_ASSIGN_OR_RETURN(
      std::vector<BlockRun> runs,
      MergeBlockRuns(remote_ids, local_ids, remote.num_blocks(), plan.spec.num_blocks()));
  for (const ByteRange& r : RunByteRanges(runs, first_layer, end_layer,
                                          PartBlockGeometryOf(remote, plan.spec), s.source)) {
    const PartRegion region = RegionOfPart(remote, r.layer, r.part);
    batch.ops.push_back(
        {reinterpret_cast<std::byte*>(  // NOLINT(performance-no-int-to-ptr)
             plan.addresses.Base(r.layer, r.part) + static_cast<std::uint64_t>(r.local_offset)),
         static_cast<RegionId>(region.id),
         static_cast<std::uint64_t>(region.offset + r.remote_offset),
         static_cast<std::uint64_t>(r.length), static_cast<std::uint64_t>(r.count),
         static_cast<std::uint64_t>(r.remote_step), static_cast<std::uint64_t>(r.local_step)});
    batch.bytes += static_cast<std::uint64_t>(r.length * r.count);
  }
  batch.runs += runs.size();
  return Status::Ok();
}

Status LoadRunner::RunBatches(const LoadSpec& load, std::vector<PlannedBatch>& planned,
                              Deadline deadline, std::uint64_t* moved) {
  struct Submitted {
    BatchId batch;
    const SourceAgent* from;
  };
  std::vector<Submitted> batches;
  Status failure;
  std::uint64_t bytes = 0;
  std::uint64_t reads = 0;
  std::uint64_t runs = 0;
  for (PlannedBatch& p : planned) {
    if (p.ops.empty()) continue;
    bytes += p.bytes;
    reads += p.ops.size();
    runs += p.runs;
    UniqueLock lock(mu_);
    if (Status aborted = AbortedLocked(load.request_id); !aborted.ok()) {
      failure = aborted;
      break;
    }
    // Submitted under mu_ so an AbortLoad either sees this batch or ran before the check above.
    Result<BatchId> b = transport_.SubmitReads(p.from->agent->peer, std::move(p.ops), deadline);
    if (b.ok()) loads_.at(load.request_id).batches.push_back(*b);
    lock.Unlock();
    if (!b.ok()) {
      failure = b.status();
      if (PeerFault(failure)) agents_.Invalidate(p.from->endpoint, p.from->agent);
      break;
    }
    batches.push_back({*b, p.from});
  }
  for (const Submitted& s : batches) {
    if (!failure.ok()) {
      transport_.Cancel(s.batch);
    } else {
      BatchResult r = transport_.Wait(s.batch, deadline + std::chrono::seconds(1));
      if (r.state == BatchState::kInProgress) {
        transport_.Cancel(s.batch);
        r = {BatchState::kFailed, Status::Timeout("the read did not finish in time")};
      }
      if (r.state == BatchState::kCancelled) {
        MutexLock lock(mu_);
        if (Status aborted = AbortedLocked(load.request_id); !aborted.ok()) {
          // The engine's abort cancelled it: the peer is fine, and other loads read from it.
          r.status = aborted;
        } else {
          // Not cancelled by this load: another load found the peer dead and dropped it.
          r.status = Status::PeerDisconnected("the read was stopped because its peer was dropped");
        }
      }
      if (r.state != BatchState::kDone) {
        failure = r.status.WithContext("reading from " + s.from->endpoint);
        // Rule 12: a dead or restarted peer is dropped and re-handshaken on next use.
        if (PeerFault(r.status)) agents_.Invalidate(s.from->endpoint, s.from->agent);
      }
    }
    {
      MutexLock lock(mu_);
      std::vector<BatchId>& mine = loads_.at(load.request_id).batches;
      mine.erase(std::remove(mine.begin(), mine.end(), s.batch), mine.end());
      if (Status aborted = AbortedLocked(load.request_id); !aborted.ok()) failure = aborted;
    }
    transport_.Release(s.batch);
  }
  if (!failure.ok()) return failure;
  *moved += bytes;
  MutexLock lock(mu_);
  stats_.bytes_read += bytes;
  stats_.reads += reads;
  stats_.merged_runs += runs;
  return Status::Ok();
}

Status LoadRunner::DoLoad(const LoadSpec& load, std::uint64_t* moved) {
  const Deadline deadline = DeadlineAfter(cfg_.transfer_timeout);
  KVFERRY_ASSIGN_OR_RETURN(LoadPlan plan, Plan(load));
  if (!load.transfer_id.empty() && !load.local_block_ids.empty()) {
    return DoLayerwiseLoad(load, plan, deadline, moved);
  }
  std::set<std::string> read_from;
  if (!load.local_block_ids.empty()) {
    // The tail rule for decode-side prefix hits.
    KVFERRY_ASSIGN_OR_RETURN(std::span<const std::int64_t> remote_ids,
                             TailOfRemote(load.remote_block_ids, load.local_block_ids));
    KVFERRY_ASSIGN_OR_RETURN(std::vector<SourceAgent> agents,
                             ResolveSources(load, plan, deadline, nullptr));
    std::vector<PlannedBatch> batches;
    for (const SourceAgent& a : agents) {
      batches.push_back({&a, {}, 0, 0});
      KVFERRY_RETURN_IF_ERROR(AddReads(plan, a, remote_ids, load.local_block_ids, 0,
                                       plan.spec.num_layers(), batches.back()));
      read_from.insert(a.endpoint);
    }
    KVFERRY_RETURN_IF_ERROR(RunBatches(load, batches, deadline, moved));
  }
  return Confirm(load, plan.endpoints, read_from);
}

Status LoadRunner::Confirm(const LoadSpec& load, const std::vector<std::string>& endpoints,
                           const std::set<std::string>& read_from) {
  // Rule 10: every prefill rank read from (and the unread ones this rank covers) is told, also
  // when there was nothing to read. A rank read from is told at once and must confirm that it
  // still held the blocks: a hold that ended by lease or abort during the reads may have had its
  // blocks reused, and bytes read then must not be used (the load fails, to be recomputed). The
  // other ranks' notices are batched.
  for (const std::string& endpoint : endpoints) {
    if (read_from.count(endpoint) == 0) {
      notifier_->Finished(endpoint, load.remote_request_id, DeadlineAfter(cfg_.notice_timeout));
      continue;
    }
    Result<wire::Message> reply =
        client_.Call(endpoint,
                     wire::FinishedNotice{
                         self_, {load.remote_request_id}, static_cast<std::uint32_t>(cfg_.tp_size)},
                     DeadlineAfter(cfg_.notice_timeout));
    // An error reply arrives as an error status (NotFound: the hold had ended), as does no
    // reply: either way the bytes are not confirmed, and the load fails.
    if (!reply.ok()) {
      return reply.status().WithContext("confirming with " + endpoint +
                                        " that it held the blocks while they were read");
    }
  }
  return Status::Ok();
}

void LoadRunner::SendAborts(const LoadSpec& load, const std::string& reason) {
  // Every prefill rank of the request may hold it; tell them all, best effort.
  for (int q = 0; q < load.remote_tp_size; ++q) {
    const std::string endpoint = SideChannelEndpoint(load.remote_host, load.remote_port + q);
    PostBackground([this, endpoint, id = load.remote_request_id, reason] {
      Result<wire::Message> r = client_.Call(endpoint, wire::AbortNotice{self_, {id}, reason},
                                             DeadlineAfter(cfg_.notice_timeout));
      if (!r.ok()) {
        Log().info("abort notice for {} to {} failed: {}", id, endpoint, r.status().ToString());
      }
    });
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
