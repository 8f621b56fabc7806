#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "common/clock.h"
#include "common/log.h"
#include "common/mutex.h"
#include "common/work_queue.h"
#include "connector/agent_cache.h"
#include "connector/hold_table.h"
#include "connector/load_runner.h"
#include "kvferry/connector.h"
#include "layout/block_runs.h"
#include "layout/tp_map.h"
#include "sidechannel/client.h"
#include "sidechannel/listener.h"
#include "sidechannel/notifier.h"

namespace kvferry {

namespace {

std::string ReaderKey(const wire::PeerRef& p) {
  return p.engine_id + "/" + std::to_string(p.dp_rank) + "/" + std::to_string(p.tp_rank);
}

}  // namespace

class WorkerImpl {
 public:
  explicit WorkerImpl(WorkerConfig config)
      : cfg_(std::move(config)),
        holds_(HoldLimits{cfg_.hold_lease, cfg_.max_early_notices, cfg_.hold_lease},
               [this](std::uint32_t reader_tp) {
                 // HoldTable calls it only from its own methods, which run under mu_.
                 mu_.AssertHeld();
                 return ExpectedReadersLocked(reader_tp);
               }) {}
  ~WorkerImpl();

  Status Init();
  Status RegisterKvCaches(const CacheSpec& spec, std::vector<std::vector<std::uint64_t>> bases,
                          const MemoryKind& memory);
  void StartLoadKv(const ConnectorMetadata& metadata) EXCLUDES(mu_);
  FinishedRequests GetFinished() EXCLUDES(mu_);
  std::vector<LoadError> TakeLoadErrors() EXCLUDES(mu_);
  std::vector<LoadTransfer> TakeLoadTransfers() { return loads_->TakeTransfers(); }
  // The load runner cancels outside any lock of the worker's.
  Status AbortLoad(const std::string& request_id, const std::string& reason) EXCLUDES(mu_);
  WorkerStats Stats() const EXCLUDES(mu_);
  WorkerMetrics Metrics() const {
    return {self_.engine_id, cfg_.role, static_cast<int>(self_.dp_rank),
            static_cast<int>(self_.tp_rank), Stats()};
  }
  const std::string& endpoint() const { return listener_->endpoint(); }

 private:
  wire::Message Handle(const wire::Message& request) EXCLUDES(mu_);
  int ExpectedReadersLocked(std::uint32_t reader_tp) const REQUIRES(mu_);

  const WorkerConfig cfg_;
  wire::PeerRef self_;
  wire::AgentIdentity identity_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<sidechannel::Client> client_;
  std::unique_ptr<AgentCache> agents_;  // decode: the prefill ranks loads read from
  std::unique_ptr<LoadRunner> loads_;   // decode: the loads
  std::unique_ptr<sidechannel::Listener> listener_;

  // Prefill side: holds, and what a metadata request is answered with.
  mutable Mutex mu_;
  std::optional<CacheSpec> spec_ GUARDED_BY(mu_);
  std::optional<wire::AgentMetadata> metadata_ GUARDED_BY(mu_);
  HoldTable holds_ GUARDED_BY(mu_);
  Clock::time_point last_stats_log_ GUARDED_BY(mu_) = Clock::now();
  std::map<std::string, std::uint64_t> notices_received_ GUARDED_BY(mu_);  // by message type
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
Status Worker::RegisterKvCaches(const CacheSpec& spec,
                                const std::vector<std::vector<KvCachePart>>& parts) {
  std::vector<std::vector<std::uint64_t>> bases(parts.size());
  const MemoryKind memory =
      !parts.empty() && !parts[0].empty() ? parts[0][0].memory : MemoryKind::Host();
  for (std::size_t l = 0; l < parts.size(); ++l) {
    for (std::size_t p = 0; p < parts[l].size(); ++p) {
      const KvCachePart& part = parts[l][p];
      const std::string where = "layer " + std::to_string(l) + " part " + std::to_string(p);
      if (p < static_cast<std::size_t>(spec.num_parts()) &&
          part.bytes != static_cast<std::uint64_t>(spec.PartBytes(static_cast<int>(p)))) {
        return Status::InvalidArgument(where + " is " + std::to_string(part.bytes) +
                                       " bytes, but the cache spec makes it " +
                                       std::to_string(spec.PartBytes(static_cast<int>(p))));
      }
      if (!(part.memory == memory)) {
        return Status::InvalidArgument(where + " is " + part.memory.ToString() +
                                       " memory, layer 0 part 0 " + memory.ToString() +
                                       "; a worker's caches are in one memory");
      }
      bases[l].push_back(part.address);
    }
  }
  return impl_->RegisterKvCaches(spec, std::move(bases), memory);
}
void Worker::StartLoadKv(const ConnectorMetadata& metadata) { impl_->StartLoadKv(metadata); }
FinishedRequests Worker::GetFinished() { return impl_->GetFinished(); }
std::vector<LoadError> Worker::TakeLoadErrors() { return impl_->TakeLoadErrors(); }
std::vector<LoadTransfer> Worker::TakeLoadTransfers() { return impl_->TakeLoadTransfers(); }
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
  loads_ =
      std::make_unique<LoadRunner>(LoadRunnerContext{cfg_, self_, *transport_, *client_, *agents_});
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
  return Status::Ok();
}

WorkerImpl::~WorkerImpl() {
  listener_.reset();  // no more notices from peers
  loads_.reset();     // stops its threads; queued loads end
  agents_.reset();    // uses client_ and transport_
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
    MutexLock lock(mu_);
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
  loads_->SetCaches(spec, addresses);
  MutexLock lock(mu_);
  spec_ = spec;
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
  MutexLock lock(mu_);
  ++notices_received_[wire::MessageTypeName(request)];
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
  {
    MutexLock lock(mu_);
    const Clock::time_point now = Clock::now();
    for (const HoldSpec& h : metadata.holds) {
      holds_.Hold(h.request_id, std::chrono::milliseconds(h.lease_ms), now);
    }
  }
  loads_->Start(metadata.loads);
}

FinishedRequests WorkerImpl::GetFinished() {
  MutexLock lock(mu_);
  const Clock::time_point now = Clock::now();
  holds_.Expire(now);
  if (now - last_stats_log_ > std::chrono::seconds(30)) {
    last_stats_log_ = now;
    const WorkerStats l = loads_->Stats();
    Log().info("kvferry {} worker tp {}: loads done {} failed {}, {} bytes, holds {}",
               RoleName(cfg_.role), cfg_.tp_rank, l.loads_done, l.loads_failed, l.bytes_read,
               holds_.holds());
  }
  FinishedRequests out;
  out.sending = holds_.TakeReleased();
  out.receiving = loads_->TakeFinished();
  return out;
}

std::vector<LoadError> WorkerImpl::TakeLoadErrors() { return loads_->TakeErrors(); }

Status WorkerImpl::AbortLoad(const std::string& request_id, const std::string& reason) {
  return loads_->Abort(request_id, reason);
}

WorkerStats WorkerImpl::Stats() const {
  // The transport's counters are its own (thread-safe); read outside mu_.
  const TransportStats transport = transport_ != nullptr ? transport_->Stats() : TransportStats{};
  const AgentCacheStats agents = agents_ != nullptr ? agents_->Stats() : AgentCacheStats{};
  // The decode fields are the load runner's; the rest are filled here.
  WorkerStats s = loads_ != nullptr ? loads_->Stats() : WorkerStats{};
  MutexLock lock(mu_);
  s.notices_received = notices_received_;
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
  return s;
}

}  // namespace kvferry
