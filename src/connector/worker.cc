#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "common/clock.h"
#include "common/log.h"
#include "common/work_queue.h"
#include "connector/agent_cache.h"
#include "connector/hold_table.h"
#include "kvferry/connector.h"
#include "layout/block_runs.h"
#include "layout/tp_map.h"
#include "sidechannel/client.h"
#include "sidechannel/listener.h"
#include "sidechannel/notifier.h"

namespace kvferry {

namespace {

std::string Endpoint(const std::string& host, int port) { return SideChannelEndpoint(host, port); }

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

std::string ReaderKey(const wire::PeerRef& p) {
  return p.engine_id + "/" + std::to_string(p.dp_rank) + "/" + std::to_string(p.tp_rank);
}

// Only liveness failures take a peer down (rule 14): its connection is lost, its process is gone,
// or it refused us. A slow batch (Timeout) or a refused read fails its own load alone.
bool PeerFault(const Status& s) {
  return s.code() == StatusCode::kPeerDisconnected || s.code() == StatusCode::kUnavailable;
}

}  // namespace

class WorkerImpl {
 public:
  explicit WorkerImpl(WorkerConfig config)
      : cfg_(std::move(config)),
        holds_(HoldLimits{cfg_.hold_lease, cfg_.max_early_notices, cfg_.hold_lease},
               [this](std::uint32_t reader_tp) { return ExpectedReadersLocked(reader_tp); }) {}
  ~WorkerImpl();

  Status Init();
  Status RegisterKvCaches(const CacheSpec& spec, std::vector<std::vector<std::uint64_t>> bases,
                          const MemoryKind& memory);
  void StartLoadKv(const ConnectorMetadata& metadata);
  FinishedRequests GetFinished();
  std::vector<LoadError> TakeLoadErrors();
  Status AbortLoad(const std::string& request_id, const std::string& reason);
  WorkerStats Stats() const;
  WorkerMetrics Metrics() const {
    return {self_.engine_id, cfg_.role, static_cast<int>(self_.dp_rank),
            static_cast<int>(self_.tp_rank), Stats()};
  }
  const std::string& endpoint() const { return listener_->endpoint(); }

 private:
  struct LoadState {
    LoadSpec spec;
    std::vector<std::string> endpoints;  // prefill ranks whose leases this load renews
    std::vector<BatchId> batches;        // submitted and not yet released
    std::optional<std::string> aborted;  // the engine's reason, once AbortLoad was called
  };

  wire::Message Handle(const wire::Message& request);
  int ExpectedReadersLocked(std::uint32_t reader_tp) const;

  void RunLoad(const LoadSpec& load);
  // Reports a load's end (the one place, so each ends once); `recompute` false for engine aborts.
  void EndLoadLocked(const std::string& id, const std::vector<std::int64_t>& blocks,
                     const Status& s, bool recompute);
  Status DoLoad(const LoadSpec& load);
  std::vector<std::string> NoticeEndpoints(const LoadSpec& load,
                                           const std::vector<TpSource>& sources) const;
  // Cancelled with the engine's reason when the load was aborted; Ok otherwise.
  Status AbortedLocked(const std::string& request_id) const;
  void SendAborts(const LoadSpec& load, const std::string& reason);
  void RenewLeases();
  // Queues a best-effort network notice; dropped (and counted) when the queue is full.
  void PostBackground(std::function<void()> task);

  const WorkerConfig cfg_;
  wire::PeerRef self_;
  wire::AgentIdentity identity_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<sidechannel::Client> client_;
  std::unique_ptr<AgentCache> agents_;  // decode: the prefill ranks loads read from
  std::unique_ptr<sidechannel::FinishedNotifier> notifier_;
  std::unique_ptr<WorkQueue> transfers_;
  std::unique_ptr<WorkQueue> background_;
  std::unique_ptr<sidechannel::Listener> listener_;
  std::thread lease_thread_;

  mutable std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;                            // guarded by mu_
  std::optional<CacheSpec> spec_;                    // guarded by mu_
  std::optional<CacheAddresses> addresses_;          // guarded by mu_
  std::optional<wire::AgentMetadata> metadata_;      // guarded by mu_
  HoldTable holds_;                                  // guarded by mu_
  std::map<std::string, LoadState> loads_;           // guarded by mu_
  std::vector<std::string> finished_receiving_;      // guarded by mu_
  std::vector<LoadError> load_errors_;               // guarded by mu_
  WorkerStats stats_;                                // guarded by mu_
  Clock::time_point last_stats_log_ = Clock::now();  // guarded by mu_
};

Result<std::unique_ptr<Worker>> Worker::Create(WorkerConfig config) {
  auto impl = std::make_unique<WorkerImpl>(std::move(config));
  KVFERRY_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Worker>(new Worker(std::move(impl)));
}

Worker::Worker(std::unique_ptr<WorkerImpl> impl) : impl_(std::move(impl)) {}
Worker::~Worker() = default;
Status Worker::RegisterKvCaches(const CacheSpec& spec,
                                std::vector<std::vector<std::uint64_t>> bases, MemoryKind memory) {
  return impl_->RegisterKvCaches(spec, std::move(bases), memory);
}
void Worker::StartLoadKv(const ConnectorMetadata& metadata) { impl_->StartLoadKv(metadata); }
FinishedRequests Worker::GetFinished() { return impl_->GetFinished(); }
std::vector<LoadError> Worker::TakeLoadErrors() { return impl_->TakeLoadErrors(); }
Status Worker::AbortLoad(const std::string& request_id, const std::string& reason) {
  return impl_->AbortLoad(request_id, reason);
}
WorkerStats Worker::Stats() const { return impl_->Stats(); }
WorkerMetrics Worker::Metrics() const { return impl_->Metrics(); }
const std::string& Worker::listener_endpoint() const { return impl_->endpoint(); }

Status WorkerImpl::Init() {
  if (cfg_.engine_id.empty()) {
    return Status::InvalidArgument("worker config needs an engine_id (vLLM's engine_id)");
  }
  if (cfg_.tp_size < 1 || cfg_.tp_size > kMaxTpSize || cfg_.tp_rank < 0 ||
      cfg_.tp_rank >= cfg_.tp_size || cfg_.dp_rank < 0) {
    return Status::InvalidArgument("TP rank " + std::to_string(cfg_.tp_rank) + " of size " +
                                   std::to_string(cfg_.tp_size) + " (DP rank " +
                                   std::to_string(cfg_.dp_rank) + ") is invalid");
  }
  self_ = {cfg_.engine_id, static_cast<std::uint32_t>(cfg_.dp_rank),
           static_cast<std::uint32_t>(cfg_.tp_rank)};
  identity_.peer = self_;
  identity_.tp_size = static_cast<std::uint32_t>(cfg_.tp_size);
  identity_.server_id = cfg_.server_id.empty() ? cfg_.host : cfg_.server_id;
  identity_.device_id = std::to_string(cfg_.tp_rank);
  identity_.device_ip = cfg_.host;
  if (cfg_.rank_table) {
    // Rule 5: the local entry by server id, visible devices and TP rank.
    KVFERRY_ASSIGN_OR_RETURN(DeviceEntry e,
                             cfg_.rank_table->SelectLocal(cfg_.role, identity_.server_id,
                                                          cfg_.visible_devices, cfg_.tp_rank));
    identity_.server_id = e.server_id;
    identity_.device_id = e.device_id;
    identity_.device_ip = e.device_ip;
    identity_.cluster_id = e.cluster_id;
    identity_.super_pod_id = e.super_pod_id;
    identity_.super_device_id = e.super_device_id;
  }

  TransportOptions t = cfg_.transport;
  if (t.secret.empty()) t.secret = cfg_.secret;
  if (t.tcp_advertise_host.empty() && t.tcp_bind_host == TransportOptions{}.tcp_bind_host) {
    t.tcp_bind_host = cfg_.host;
  }
  t.serve = cfg_.role == Role::kPrefill;
  KVFERRY_ASSIGN_OR_RETURN(transport_,
                           cfg_.make_transport ? cfg_.make_transport(t) : CreateTransport(t));

  sidechannel::ClientOptions co;
  co.secret = cfg_.secret;
  co.attempt_timeout = std::min(cfg_.handshake_timeout, cfg_.notice_timeout);
  client_ = std::make_unique<sidechannel::Client>(co);
  agents_ = std::make_unique<AgentCache>(*client_, *transport_, self_, cfg_.max_agents);
  transfers_ =
      std::make_unique<WorkQueue>(cfg_.transfer_threads, "kvferry-load", cfg_.max_queued_loads);
  // Best-effort notices (aborts, lease renewals): bounded, and dropped at shutdown rather than
  // delaying it by their timeouts.
  background_ = std::make_unique<WorkQueue>(2, "kvferry-bg", cfg_.max_queued_notices,
                                            WorkQueue::OnStop::kDrop);
  if (cfg_.role == Role::kDecode) {
    notifier_ = std::make_unique<sidechannel::FinishedNotifier>(
        client_.get(), self_, static_cast<std::uint32_t>(cfg_.tp_size),
        sidechannel::NotifierOptions{},
        [](const std::string& endpoint, const std::vector<std::string>& ids, const Status& s) {
          if (!s.ok()) {
            Log().warn(
                "finished notice for {} request(s) to {} failed: {}; the prefill side "
                "frees them when their lease expires",
                ids.size(), endpoint, s.ToString());
          }
        });
  }
  sidechannel::ListenerOptions lo;
  lo.bind_host = cfg_.host;
  lo.base_port = cfg_.base_port;
  lo.dp_rank = cfg_.dp_rank;
  lo.tp_size = cfg_.tp_size;
  lo.tp_rank = cfg_.tp_rank;
  lo.secret = cfg_.secret;
  lo.allow_insecure_remote = cfg_.allow_insecure_remote;
  KVFERRY_ASSIGN_OR_RETURN(
      listener_,
      sidechannel::Listener::Start(lo, [this](const wire::Message& m) { return Handle(m); }));
  if (cfg_.role == Role::kDecode) lease_thread_ = std::thread([this] { RenewLeases(); });
  return Status::Ok();
}

WorkerImpl::~WorkerImpl() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (lease_thread_.joinable()) lease_thread_.join();
  listener_.reset();
  transfers_.reset();  // queued loads see stopping_ and fail fast
  notifier_.reset();
  background_.reset();
  agents_.reset();  // uses client_ and transport_
  transport_.reset();
}

Status WorkerImpl::RegisterKvCaches(const CacheSpec& spec,
                                    std::vector<std::vector<std::uint64_t>> bases,
                                    const MemoryKind& memory) {
  if (spec.tp_size() != cfg_.tp_size || spec.tp_rank() != cfg_.tp_rank) {
    return Status::InvalidArgument(
        "the cache spec is for TP rank " + std::to_string(spec.tp_rank()) + " of " +
        std::to_string(spec.tp_size()) + " but this worker is rank " +
        std::to_string(cfg_.tp_rank) + " of " + std::to_string(cfg_.tp_size));
  }
  KVFERRY_RETURN_IF_ERROR(CheckRegionBases(spec, bases));
  KVFERRY_ASSIGN_OR_RETURN(CacheAddresses addresses,
                           CacheAddresses::Create(spec, std::move(bases)));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (spec_) return Status::InvalidArgument("KV caches are already registered");
  }
  // docs/transport.md, "Region ids": one region per part, or per layer when parts interleave.
  for (int l = 0; l < spec.num_layers(); ++l) {
    for (int p = 0; p < spec.num_parts(); ++p) {
      const PartRegion region = RegionOfPart(spec, l, p);
      if (region.offset != 0) continue;  // inside the layer's region of part 0
      KVFERRY_RETURN_IF_ERROR(transport_->RegisterMemory(
          static_cast<RegionId>(region.id),
          reinterpret_cast<void*>(addresses.Base(l, p)),  // NOLINT(performance-no-int-to-ptr)
          static_cast<std::size_t>(RegionBytes(spec, p)), memory));
    }
  }
  KVFERRY_ASSIGN_OR_RETURN(std::vector<std::uint8_t> descriptor, transport_->Descriptor());
  agents_->SetLocalCache(spec);
  std::lock_guard<std::mutex> lock(mu_);
  spec_ = spec;
  addresses_ = std::move(addresses);
  metadata_ = wire::AgentMetadata{identity_,
                                  listener_->endpoint(),
                                  {{kTransportKind, std::move(descriptor)}},
                                  spec,
                                  spec.Hash()};
  Log().info(
      "kvferry {} worker {} tp {}/{}: registered {} layers x {} parts, {} bytes of {} memory; "
      "listening on {}",
      RoleName(cfg_.role), cfg_.engine_id, cfg_.tp_rank, cfg_.tp_size, spec.num_layers(),
      spec.num_parts(), spec.TotalBytes(), memory.ToString(), listener_->endpoint());
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Prefill side: holds, readers, aborts, leases.

wire::Message WorkerImpl::Handle(const wire::Message& request) {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.notices_received[wire::MessageTypeName(request)];
  if (std::holds_alternative<wire::MetadataRequest>(request)) {
    if (!metadata_) {
      return wire::ErrorReply{StatusCode::kUnavailable,
                              "this worker has not registered its KV caches yet; retry shortly"};
    }
    return *metadata_;
  }
  if (cfg_.role != Role::kPrefill) {
    return wire::ErrorReply{StatusCode::kInvalidArgument,
                            std::string("a decode worker does not take '") +
                                wire::MessageTypeName(request) + "' messages"};
  }
  const Clock::time_point now = Clock::now();
  Result<std::uint32_t> count = std::uint32_t{0};
  if (const auto* f = std::get_if<wire::FinishedNotice>(&request)) {
    count = holds_.Finished(ReaderKey(f->from), f->tp_size, f->request_ids, now);
  } else if (const auto* a = std::get_if<wire::AbortNotice>(&request)) {
    Log().info("abort notice from {} for {} request(s), first {}: {}", ReaderKey(a->from),
               a->request_ids.size(), a->request_ids.empty() ? "-" : a->request_ids.front(),
               a->reason);
    count = holds_.Aborted(a->request_ids, now);
  } else if (const auto* l = std::get_if<wire::LeaseRenewal>(&request)) {
    // Clamped to this worker's own lease: no peer can pin blocks for longer.
    count = holds_.Renew(l->request_ids, std::chrono::milliseconds(l->lease_ms), now);
  }
  if (!count.ok())
    return wire::ErrorReply{count.status().code(), std::string(count.status().message())};
  return wire::Ack{*count};
}

int WorkerImpl::ExpectedReadersLocked(std::uint32_t reader_tp) const {
  if (!spec_) return 1;
  Result<int> n = ExpectedReaders(*spec_, cfg_.tp_size, static_cast<int>(reader_tp), cfg_.tp_rank);
  if (!n.ok()) {
    Log().warn("cannot count readers for decode TP {}: {}; waiting for one", reader_tp,
               n.status().ToString());
    return 1;
  }
  return *n;
}

void WorkerImpl::StartLoadKv(const ConnectorMetadata& metadata) {
  std::vector<LoadSpec> to_start;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point now = Clock::now();
    for (const HoldSpec& h : metadata.holds) {
      holds_.Hold(h.request_id, std::chrono::milliseconds(h.lease_ms), now);
    }
    for (const LoadSpec& load : metadata.loads) {
      if (loads_.count(load.request_id) != 0) continue;  // already loading
      loads_[load.request_id] = LoadState{load, {}, {}, std::nullopt};
      to_start.push_back(load);
    }
  }
  for (LoadSpec& load : to_start) {
    const std::string id = load.request_id;
    const std::vector<std::int64_t> blocks = load.local_block_ids;
    Status queued = transfers_->TryPost([this, load = std::move(load)] { RunLoad(load); });
    if (!queued.ok()) {
      // Every load ends (rule 11): one that cannot even queue fails now, its blocks recomputed.
      Status s = queued.WithContext("queueing the load of request " + id);
      Log().warn("{}", s.ToString());
      std::lock_guard<std::mutex> lock(mu_);
      EndLoadLocked(id, blocks, s, /*recompute=*/true);
    }
  }
}

FinishedRequests WorkerImpl::GetFinished() {
  std::lock_guard<std::mutex> lock(mu_);
  const Clock::time_point now = Clock::now();
  holds_.Expire(now);
  if (now - last_stats_log_ > std::chrono::seconds(30)) {
    last_stats_log_ = now;
    Log().info("kvferry {} worker tp {}: loads done {} failed {}, {} bytes, holds {}",
               RoleName(cfg_.role), cfg_.tp_rank, stats_.loads_done, stats_.loads_failed,
               stats_.bytes_read, holds_.holds());
  }
  FinishedRequests out;
  out.sending = holds_.TakeReleased();
  out.receiving.swap(finished_receiving_);
  return out;
}

std::vector<LoadError> WorkerImpl::TakeLoadErrors() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<LoadError> out;
  out.swap(load_errors_);
  return out;
}

Status WorkerImpl::AbortLoad(const std::string& request_id, const std::string& reason) {
  std::vector<BatchId> running;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = loads_.find(request_id);
    if (it == loads_.end()) {
      return Status::NotFound("no load of request " + request_id +
                              " is running on this worker (it ended, or never started)");
    }
    if (it->second.aborted) return Status::Ok();
    it->second.aborted = reason;  // DoLoad submits nothing more for it from now on
    running = it->second.batches;
  }
  // Cancelled outside mu_ (rule 14: no wait on I/O under a lock other requests need). DoLoad
  // drops a batch from the list only after it ended, so every batch that may still write into the
  // request's blocks is in `running`; Cancel returns once no read of it runs, after which the
  // engine may reuse the blocks. A batch released meanwhile had ended: Cancel ignores it.
  for (BatchId b : running) transport_->Cancel(b);
  return Status::Ok();
}

Status WorkerImpl::AbortedLocked(const std::string& request_id) const {
  auto it = loads_.find(request_id);
  if (it == loads_.end() || !it->second.aborted) return Status::Ok();
  return Status::Cancelled("the engine aborted the load: " + *it->second.aborted);
}

WorkerStats WorkerImpl::Stats() const {
  // The transport's counters are its own (thread-safe); read outside mu_.
  const TransportStats transport = transport_ != nullptr ? transport_->Stats() : TransportStats{};
  const AgentCacheStats agents = agents_ != nullptr ? agents_->Stats() : AgentCacheStats{};
  std::lock_guard<std::mutex> lock(mu_);
  WorkerStats s = stats_;
  s.transport = transport;
  s.handshakes = agents.handshakes;
  s.agents_evicted = agents.evicted;
  s.handshake_latency = agents.handshake_latency;
  s.holds_outstanding = holds_.holds();
  s.holds_released_by_readers = holds_.released_by_readers();
  s.holds_released_by_abort = holds_.released_by_abort();
  s.holds_expired = holds_.expired();
  s.early_notices = holds_.early();
  s.early_notices_refused = holds_.early_refused();
  s.loads_outstanding = loads_.size();
  return s;
}

// ---------------------------------------------------------------------------------------------
// Decode side: loads.

void WorkerImpl::RunLoad(const LoadSpec& load) {
  const Clock::time_point start = Clock::now();
  Status s = DoLoad(load);
  bool aborted_by_engine = false;
  if (!s.ok()) {
    // A load the engine aborted reports that, whatever else went wrong on the way.
    std::lock_guard<std::mutex> lock(mu_);
    if (Status aborted = AbortedLocked(load.request_id); !aborted.ok()) {
      s = aborted;
      aborted_by_engine = true;
    }
  }
  if (!s.ok()) {
    Log().warn("request {}: load of {} blocks from {} failed: {}", load.request_id,
               load.local_block_ids.size(), load.remote_engine_id, s.ToString());
    SendAborts(load, std::string(s.message()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (s.ok()) {
    stats_.transfer_latency.Add(
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start));
  }
  // A load the engine aborted has nothing to recompute: the engine has dropped the request.
  EndLoadLocked(load.request_id, load.local_block_ids, s, !aborted_by_engine);
}

void WorkerImpl::EndLoadLocked(const std::string& id, const std::vector<std::int64_t>& blocks,
                               const Status& s, bool recompute) {
  // Every started load ends here, exactly once: reported done or failed to GetFinished.
  loads_.erase(id);
  finished_receiving_.push_back(id);
  if (s.ok()) {
    ++stats_.loads_done;
    return;
  }
  ++stats_.loads_failed;
  ++stats_.failures[StatusCodeName(s.code())];
  load_errors_.push_back(
      {id, blocks, s, recompute && cfg_.failure_policy == LoadFailurePolicy::kRecompute});
}

std::vector<std::string> WorkerImpl::NoticeEndpoints(const LoadSpec& load,
                                                     const std::vector<TpSource>& sources) const {
  std::set<int> ranks;
  for (const TpSource& s : sources) ranks.insert(s.prefill_rank);
  // Prefill ranks nobody reads (decode TP smaller) are told by one decode rank each.
  for (int q = 0; q < load.remote_tp_size; ++q) {
    Result<int> readers = ExpectedReaders(*spec_, load.remote_tp_size, cfg_.tp_size, q);
    if (readers.ok() && *readers == 0 && q % cfg_.tp_size == cfg_.tp_rank) ranks.insert(q);
  }
  std::vector<std::string> out;
  out.reserve(ranks.size());
  for (int q : ranks) out.push_back(Endpoint(load.remote_host, load.remote_port + q));
  return out;
}

Status WorkerImpl::DoLoad(const LoadSpec& load) {
  const Deadline deadline = DeadlineAfter(cfg_.transfer_timeout);
  std::optional<CacheSpec> spec;
  std::optional<CacheAddresses> addresses;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return Status::Cancelled("the worker is shutting down");
    spec = spec_;
    addresses = addresses_;
  }
  if (!spec) {
    return Status::InvalidArgument("KV caches are not registered; call RegisterKvCaches first");
  }
  KVFERRY_RETURN_IF_ERROR(CheckRemoteRanks(load.remote_tp_size, load.remote_port));
  // Rule 8: which prefill ranks, which bytes; the tail rule for decode-side prefix hits.
  KVFERRY_ASSIGN_OR_RETURN(std::vector<TpSource> sources,
                           PlanTpSources(*spec, load.remote_tp_size, cfg_.tp_size, cfg_.tp_rank));
  KVFERRY_ASSIGN_OR_RETURN(std::span<const std::int64_t> remote_ids,
                           TailOfRemote(load.remote_block_ids, load.local_block_ids));
  const std::vector<std::string> endpoints = NoticeEndpoints(load, sources);
  {
    std::lock_guard<std::mutex> lock(mu_);
    KVFERRY_RETURN_IF_ERROR(AbortedLocked(load.request_id));  // aborted while queued
    auto it = loads_.find(load.request_id);
    if (it != loads_.end()) it->second.endpoints = endpoints;
  }

  if (!load.local_block_ids.empty()) {
    struct Submitted {
      BatchId batch;
      std::string endpoint;
      std::shared_ptr<RemoteAgent> agent;
    };
    std::vector<Submitted> batches;
    Status failure;
    std::uint64_t bytes = 0;
    std::uint64_t reads = 0;
    std::uint64_t runs_total = 0;
    for (const TpSource& source : sources) {
      const Deadline hs_deadline = std::min(deadline, DeadlineAfter(cfg_.handshake_timeout));
      Result<std::shared_ptr<RemoteAgent>> agent =
          agents_->Get({Endpoint(load.remote_host, load.remote_port + source.prefill_rank),
                        load.remote_engine_id, source.prefill_rank, load.remote_tp_size},
                       hs_deadline);
      if (!agent.ok()) {
        failure = agent.status();
        break;
      }
      // A restarted prefill instance answers on the same endpoint under a new engine id; its
      // blocks are not this request's.
      if ((*agent)->metadata->agent.peer.engine_id != load.remote_engine_id) {
        failure = Status::Unavailable(
            "the prefill instance at " +
            Endpoint(load.remote_host, load.remote_port + source.prefill_rank) + " is now engine " +
            (*agent)->metadata->agent.peer.engine_id + ", but request " + load.request_id +
            " was held by engine " + load.remote_engine_id + ", which is gone");
        break;
      }
      const CacheSpec& remote = (*agent)->metadata->cache;
      Result<std::vector<BlockRun>> runs =
          MergeBlockRuns(remote_ids, load.local_block_ids, remote.num_blocks(), spec->num_blocks());
      if (!runs.ok()) {
        failure = runs.status();
        break;
      }
      if (Status layout = CheckRegionLayout(remote); !layout.ok()) {
        failure = layout;
        break;
      }
      std::vector<ReadOp> ops;
      for (const ByteRange& r :
           RunByteRanges(*runs, spec->num_layers(), PartBlockGeometryOf(remote, *spec), source)) {
        const PartRegion region = RegionOfPart(remote, r.layer, r.part);
        ops.push_back(
            {reinterpret_cast<std::byte*>(  // NOLINT(performance-no-int-to-ptr)
                 addresses->Base(r.layer, r.part) + static_cast<std::uint64_t>(r.local_offset)),
             static_cast<RegionId>(region.id),
             static_cast<std::uint64_t>(region.offset + r.remote_offset),
             static_cast<std::uint64_t>(r.length)});
        bytes += static_cast<std::uint64_t>(r.length);
      }
      reads += ops.size();
      runs_total += runs->size();
      std::unique_lock<std::mutex> lock(mu_);
      if (Status aborted = AbortedLocked(load.request_id); !aborted.ok()) {
        failure = aborted;
        break;
      }
      // Submitted under mu_ so an AbortLoad either sees this batch or ran before the check above.
      Result<BatchId> b = transport_->SubmitReads((*agent)->peer, std::move(ops), deadline);
      if (b.ok()) loads_.at(load.request_id).batches.push_back(*b);
      lock.unlock();
      if (!b.ok()) {
        failure = b.status();
        if (PeerFault(failure))
          agents_->Invalidate(Endpoint(load.remote_host, load.remote_port + source.prefill_rank),
                              *agent);
        break;
      }
      batches.push_back(
          {*b, Endpoint(load.remote_host, load.remote_port + source.prefill_rank), *agent});
    }
    for (const Submitted& s : batches) {
      if (!failure.ok()) {
        transport_->Cancel(s.batch);
      } else {
        BatchResult r = transport_->Wait(s.batch, deadline + std::chrono::seconds(1));
        if (r.state == BatchState::kInProgress) {
          transport_->Cancel(s.batch);
          r = {BatchState::kFailed, Status::Timeout("the read did not finish in time")};
        }
        if (r.state == BatchState::kCancelled) {
          // Not cancelled by this load (an engine abort is reported as such below): another
          // load found the peer dead and dropped it.
          r.status = Status::PeerDisconnected("the read was stopped because its peer was dropped");
        }
        if (r.state != BatchState::kDone) {
          failure = r.status.WithContext("reading from " + s.endpoint);
          // Rule 12: a dead or restarted peer is dropped and re-handshaken on next use.
          if (PeerFault(r.status)) agents_->Invalidate(s.endpoint, s.agent);
        }
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        std::vector<BatchId>& mine = loads_.at(load.request_id).batches;
        mine.erase(std::remove(mine.begin(), mine.end(), s.batch), mine.end());
        if (Status aborted = AbortedLocked(load.request_id); !aborted.ok()) failure = aborted;
      }
      transport_->Release(s.batch);
    }
    if (!failure.ok()) return failure;
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_read += bytes;
    stats_.reads += reads;
    stats_.merged_runs += runs_total;
  }
  // Rule 10: every prefill rank read from (and the unread ones this rank covers) is told, also
  // when there was nothing to read.
  for (const std::string& endpoint : endpoints) {
    notifier_->Finished(endpoint, load.remote_request_id, DeadlineAfter(cfg_.notice_timeout));
  }
  return Status::Ok();
}

void WorkerImpl::SendAborts(const LoadSpec& load, const std::string& reason) {
  // Every prefill rank of the request may hold it; tell them all, best effort.
  for (int q = 0; q < load.remote_tp_size; ++q) {
    const std::string endpoint = Endpoint(load.remote_host, load.remote_port + q);
    PostBackground([this, endpoint, id = load.remote_request_id, reason] {
      Result<wire::Message> r = client_->Call(endpoint, wire::AbortNotice{self_, {id}, reason},
                                              DeadlineAfter(cfg_.notice_timeout));
      if (!r.ok()) {
        Log().info("abort notice for {} to {} failed: {}", id, endpoint, r.status().ToString());
      }
    });
  }
}

void WorkerImpl::PostBackground(std::function<void()> task) {
  Status s = background_->TryPost(std::move(task));
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (++stats_.notices_dropped % 1000 == 1) {
      Log().warn("dropped a best-effort notice ({} so far): {}; holds it concerned end by lease",
                 stats_.notices_dropped, s.ToString());
    }
  }
}

void WorkerImpl::RenewLeases() {
  const auto interval =
      std::max<std::chrono::milliseconds>(cfg_.hold_lease / 4, std::chrono::milliseconds(20));
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    stop_cv_.wait_for(lock, interval, [&] { return stopping_; });
    if (stopping_) return;
    std::map<std::string, std::vector<std::string>> by_endpoint;
    for (const auto& [id, state] : loads_) {
      for (const std::string& e : state.endpoints) {
        by_endpoint[e].push_back(state.spec.remote_request_id);
      }
    }
    for (auto& [endpoint, ids] : by_endpoint) {
      PostBackground([this, endpoint = endpoint, ids = std::move(ids)] {
        (void)client_->Call(
            endpoint,
            wire::LeaseRenewal{self_, ids, static_cast<std::uint32_t>(cfg_.hold_lease.count())},
            DeadlineAfter(cfg_.notice_timeout));
      });
    }
  }
}

}  // namespace kvferry
