// The connector Worker (DESIGN rules 5-16): its life, the registration of its caches, and the
// calls the engine makes each step (loads, layer saves, finished requests, aborts, stats). What it
// answers peers on its side channel is worker_requests.cc.
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
#include "connector/worker_impl.h"
#include "device/device.h"
#include "layout/block_runs.h"
#include "layout/tp_map.h"
#include "sidechannel/notifier.h"

namespace kvferry {

Result<std::unique_ptr<Worker>> Worker::Create(WorkerConfig config) {
  auto impl = std::make_unique<WorkerImpl>(std::move(config));
  KVFERRY_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Worker>(new Worker(std::move(impl)));
}

Worker::Worker(std::unique_ptr<WorkerImpl> impl) : impl_(std::move(impl)) {}
Worker::~Worker() = default;
Status Worker::RegisterKvCaches(const CacheSpec& spec,
                                std::vector<std::vector<std::uint64_t>> bases, MemoryKind memory) {
  std::vector<std::vector<std::vector<std::uint64_t>>> one;
  one.push_back(std::move(bases));
  return impl_->RegisterKvCaches(spec, std::move(one), memory);
}
Status Worker::RegisterKvCaches(const CacheGroups& caches,
                                std::vector<std::vector<std::vector<std::uint64_t>>> bases,
                                MemoryKind memory) {
  return impl_->RegisterKvCaches(caches, std::move(bases), memory);
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
  return RegisterKvCaches(spec, std::move(bases), memory);
}
void Worker::StartLoadKv(const ConnectorMetadata& metadata) { impl_->StartLoadKv(metadata); }
Status Worker::SaveKvLayer(int layer, std::uint64_t stream) {
  return impl_->SaveKvLayer(layer, stream);
}
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
  if (cfg_.pp_size < 1 || cfg_.pp_size > kMaxTpSize || cfg_.pp_rank < 0 ||
      cfg_.pp_rank >= cfg_.pp_size) {
    return Status::InvalidArgument("pipeline stage " + std::to_string(cfg_.pp_rank) + " of " +
                                   std::to_string(cfg_.pp_size) +
                                   " is invalid: expected a PP size of at least 1 and "
                                   "0 <= stage < size");
  }
  self_ = {cfg_.engine_id, static_cast<std::uint32_t>(cfg_.dp_rank),
           static_cast<std::uint32_t>(cfg_.tp_rank), static_cast<std::uint32_t>(cfg_.pp_rank)};
  identity_.peer = self_;
  identity_.tp_size = static_cast<std::uint32_t>(cfg_.tp_size);
  identity_.server_id = cfg_.server_id.empty() ? cfg_.host : cfg_.server_id;
  identity_.device_id = std::to_string(cfg_.tp_rank);
  identity_.device_ip = cfg_.host;
  if (cfg_.rank_table) {
    // Rule 5: the local entry by server id, visible devices and the worker's local rank (the TP
    // rank; with pipeline parallelism stage-major, pp_rank * tp_size + tp_rank, as vLLM's).
    KVFERRY_ASSIGN_OR_RETURN(
        DeviceEntry e,
        cfg_.rank_table->SelectLocal(cfg_.role, identity_.server_id, cfg_.visible_devices,
                                     cfg_.pp_rank * cfg_.tp_size + cfg_.tp_rank));
    identity_.server_id = e.server_id;
    identity_.device_id = e.device_id;
    identity_.device_ip = e.device_ip;
    identity_.cluster_id = e.cluster_id;
    identity_.super_pod_id = e.super_pod_id;
    identity_.super_device_id = e.super_device_id;
  }

  TransportOptions t = cfg_.transport;
  if (t.secret.empty()) t.secret = cfg_.secret;
  // The tcp read server listens where the side channel does, unless the options say where.
  t.backend_options.emplace("tcp.bind_host", cfg_.host);
  t.serve = ServesKv(cfg_.role);
  KVFERRY_ASSIGN_OR_RETURN(transport_,
                           cfg_.make_transport ? cfg_.make_transport(t) : CreateTransport(t));

  sidechannel::ClientOptions co;
  co.secret = cfg_.secret;
  co.attempt_timeout = std::min(cfg_.handshake_timeout, cfg_.notice_timeout);
  client_ = std::make_unique<sidechannel::Client>(co);
  agents_ = std::make_unique<AgentCache>(*client_, *transport_, self_, cfg_.max_agents);
  loads_ =
      std::make_unique<LoadRunner>(LoadRunnerContext{cfg_, self_, *transport_, *client_, *agents_});
  pusher_ = std::make_unique<ProgressPusher>(
      *client_, ProgressPusherOptions{},
      [this](const std::string& transfer_id, const std::string& subscriber) {
        MutexLock lock(mu_);
        if (layerwise_) layerwise_->Unsubscribe(transfer_id, subscriber);
      });
  announcer_ = std::make_unique<LayerAnnouncer>(
      [this](const LayerAnnouncer::Entry& e, const Status& s) { LayerWritten(e, s); },
      cfg_.transfer_timeout);
  sidechannel::ListenerOptions lo;
  lo.bind_host = cfg_.host;
  lo.base_port = cfg_.base_port;
  lo.dp_rank = cfg_.dp_rank;
  lo.tp_size = cfg_.tp_size;
  lo.tp_rank = cfg_.tp_rank;
  lo.pp_size = cfg_.pp_size;
  lo.pp_rank = cfg_.pp_rank;
  lo.secret = cfg_.secret;
  lo.allow_insecure_remote = cfg_.allow_insecure_remote;
  KVFERRY_ASSIGN_OR_RETURN(
      listener_,
      sidechannel::Listener::Start(lo, [this](const wire::Message& m) { return Handle(m); }));
  return Status::Ok();
}

WorkerImpl::~WorkerImpl() {
  listener_.reset();   // no more notices from peers
  announcer_.reset();  // no more announcements
  pusher_.reset();
  loads_.reset();   // stops its threads; queued loads end
  agents_.reset();  // uses client_ and transport_
  transport_.reset();
}

Status WorkerImpl::RegisterKvCaches(const CacheGroups& caches,
                                    std::vector<std::vector<std::vector<std::uint64_t>>> bases,
                                    const MemoryKind& memory) {
  const CacheSpec& first = caches[0];
  if (first.tp_size() != cfg_.tp_size || first.tp_rank() != cfg_.tp_rank) {
    return Status::InvalidArgument(
        "the cache spec is for TP rank " + std::to_string(first.tp_rank()) + " of " +
        std::to_string(first.tp_size()) + " but this worker is rank " +
        std::to_string(cfg_.tp_rank) + " of " + std::to_string(cfg_.tp_size));
  }
  if (bases.size() != static_cast<std::size_t>(caches.size())) {
    return Status::InvalidArgument("the caches have " + std::to_string(caches.size()) +
                                   " KV cache groups but the addresses of " +
                                   std::to_string(bases.size()) + "; expected one list per group");
  }
  std::vector<CacheAddresses> addresses;
  for (int g = 0; g < caches.size(); ++g) {
    const auto gi = static_cast<std::size_t>(g);
    Status checked = CheckRegionBases(caches[g], bases[gi]);
    Result<CacheAddresses> a = checked.ok()
                                   ? CacheAddresses::Create(caches[g], std::move(bases[gi]))
                                   : Result<CacheAddresses>(checked);
    if (!a.ok()) {
      return caches.size() == 1 ? a.status()
                                : a.status().WithContext("KV cache group " + std::to_string(g));
    }
    addresses.push_back(std::move(a).value());
  }
  {
    MutexLock lock(mu_);
    if (caches_) return Status::InvalidArgument("KV caches are already registered");
  }
  // docs/transport.md, "Region ids": one region per part, or per layer when parts interleave;
  // each group's after the earlier groups'. The registry refuses groups whose tensors overlap.
  for (int g = 0; g < caches.size(); ++g) {
    const CacheSpec& spec = caches[g];
    for (int l = 0; l < spec.num_layers(); ++l) {
      for (int p = 0; p < spec.num_parts(); ++p) {
        const PartRegion region = RegionOfPart(caches, g, l, p);
        if (region.offset != 0) continue;  // inside the layer's region of part 0
        KVFERRY_RETURN_IF_ERROR(transport_->RegisterMemory(
            static_cast<RegionId>(region.id),
            reinterpret_cast<void*>(  // NOLINT(performance-no-int-to-ptr)
                addresses[static_cast<std::size_t>(g)].Base(l, p)),
            static_cast<std::size_t>(RegionBytes(spec, p)), memory));
      }
    }
  }
  KVFERRY_ASSIGN_OR_RETURN(std::vector<std::uint8_t> descriptor, transport_->Descriptor());
  agents_->SetLocalCache(caches);
  loads_->SetCaches(caches, addresses, listener_->endpoint());
  MutexLock lock(mu_);
  caches_ = caches;
  memory_ = memory;
  metadata_ = wire::AgentMetadata{
      identity_,
      listener_->endpoint(),
      {{kTransportKind, std::move(descriptor)}},
      caches,
      caches.Hash(),
      {wire::kFeatureLayerwise, wire::kFeaturePpReaders, wire::kFeatureLayerwiseGroups}};
  LayerwiseLimits limits;
  limits.group_layers.clear();
  for (const CacheSpec& g : caches.specs()) limits.group_layers.push_back(g.num_layers());
  limits.layers_per_notice = std::max(1, cfg_.layerwise_layers_per_notice);
  limits.max_waiting = cfg_.max_waiting_subscriptions;
  limits.max_subscribers = cfg_.max_subscribers_per_transfer;
  limits.max_wait = std::max(cfg_.hold_lease, cfg_.layerwise_start_timeout);
  layerwise_.emplace(limits, self_);
  int layers = 0;
  for (const CacheSpec& g : caches.specs()) layers += g.num_layers();
  Log().info(
      "kvferry {} worker {} tp {}/{}: registered {} layers x {} parts in {} KV cache group(s), {} "
      "bytes of {} memory; listening on {}",
      RoleName(cfg_.role), cfg_.engine_id, cfg_.tp_rank, cfg_.tp_size, layers, first.num_parts(),
      caches.size(), caches.TotalBytes(), memory.ToString(), listener_->endpoint());
  return Status::Ok();
}

void WorkerImpl::StartLoadKv(const ConnectorMetadata& metadata) {
  std::vector<ProgressPush> pushes;
  bool begin_queued = false;
  LayerAnnouncer::Entry begin;
  auto add = [&pushes](std::vector<ProgressPush> more) {
    pushes.insert(pushes.end(), std::make_move_iterator(more.begin()),
                  std::make_move_iterator(more.end()));
  };
  {
    MutexLock lock(mu_);
    const Clock::time_point now = Clock::now();
    for (const HoldSpec& h : metadata.holds) {
      holds_.Hold(h.request_id, std::chrono::milliseconds(h.lease_ms), now, h.transfer_id);
      // Held means prefilled: every layer of the prompt is written, whatever was announced.
      if (!h.transfer_id.empty() && layerwise_) add(layerwise_->Complete(h.transfer_id));
    }
    for (const TransferEnd& e : metadata.transfer_ends) {
      // Before this step's forward pass may write into the freed blocks: readers that confirm
      // from now on are refused.
      holds_.Invalidate(e.transfer_id);
      if (layerwise_) add(layerwise_->Fail(e.transfer_id, e.reason));
    }
    step_saves_ = std::make_shared<const std::vector<LayerwiseSave>>(metadata.saves);
    // The step begins after every layer of the steps before it has been announced: a begin
    // counts the tokens before it as written in every layer, which must not overtake a layer
    // still waiting for its device work (a late announcement of it is then ignored).
    if (layerwise_ && !step_saves_->empty() && announcer_->Idle()) {
      for (const LayerwiseSave& save : *step_saves_) add(layerwise_->Begin(save, now));
    } else if (!step_saves_->empty()) {
      begin_queued = true;
      begin = {step_saves_, LayerAnnouncer::kBegin, nullptr};
    }
  }
  if (begin_queued) announcer_->Add(std::move(begin));
  if (!pushes.empty()) pusher_->Push(std::move(pushes));
  // A pipeline stage reads the same stage of the prefill instance: its ports follow stage 0's
  // TP ranks, its hosts are that stage's (a PP size that differs fails the load in
  // LoadRunner::Plan, naming both).
  std::vector<LoadSpec> loads = metadata.loads;
  for (LoadSpec& l : loads) {
    if (l.remote_pp_size != cfg_.pp_size) continue;
    l.remote_port += cfg_.pp_rank * l.remote_tp_size;
    if (!l.remote_rank_hosts.empty()) {
      const auto first = l.remote_rank_hosts.begin() + cfg_.pp_rank * l.remote_tp_size;
      l.remote_rank_hosts = std::vector<std::string>(first, first + l.remote_tp_size);
    }
  }
  loads_->Start(loads);
}

Status WorkerImpl::SaveKvLayer(int layer, std::uint64_t stream) {
  LayerAnnouncer::Entry entry;
  MemoryKind memory;
  {
    MutexLock lock(mu_);
    memory = memory_;
    if (!caches_) {
      return Status::InvalidArgument("SaveKvLayer before RegisterKvCaches: no layers yet");
    }
    // Several KV cache groups: group 0's layers, then group 1's, ... (docs/layerwise.md).
    int layers = 0;
    for (const CacheSpec& g : caches_->specs()) layers += g.num_layers();
    if (layer < 0 || layer >= layers) {
      return Status::InvalidArgument("SaveKvLayer: layer " + std::to_string(layer) +
                                     " is outside the cache's 0.." + std::to_string(layers - 1) +
                                     (caches_->size() > 1 ? " (its KV cache groups' layers, group "
                                                            "after group)"
                                                          : ""));
    }
    if (stream != 0 && memory_.is_host()) {
      return Status::InvalidArgument(
          "SaveKvLayer: a stream was given, but the caches are host memory; pass 0");
    }
    if (step_saves_ == nullptr || step_saves_->empty()) return Status::Ok();  // nothing layer-wise
    entry.saves = step_saves_;
    entry.layer = layer;
  }
  if (stream != 0) {
    KVFERRY_ASSIGN_OR_RETURN(device::Device * device, device::ProcessDevice(memory.ToString()));
    KVFERRY_ASSIGN_OR_RETURN(entry.event, device->RecordEventOn(stream));
  }
  if (entry.event == nullptr && announcer_->Idle()) {
    LayerWritten(entry, Status::Ok());  // nothing queued that it would overtake
  } else {
    announcer_->Add(std::move(entry));
  }
  return Status::Ok();
}

void WorkerImpl::LayerWritten(const LayerAnnouncer::Entry& entry, const Status& status) {
  std::vector<ProgressPush> pushes;
  {
    MutexLock lock(mu_);
    if (!layerwise_) return;
    if (entry.layer == LayerAnnouncer::kBegin) {
      const Clock::time_point now = Clock::now();
      for (const LayerwiseSave& save : *entry.saves) {
        std::vector<ProgressPush> more = layerwise_->Begin(save, now);
        pushes.insert(pushes.end(), std::make_move_iterator(more.begin()),
                      std::make_move_iterator(more.end()));
      }
    } else if (status.ok()) {
      pushes = layerwise_->LayerWritten(*entry.saves, entry.layer);
    } else {
      Log().error("layer-wise: {}; failing the {} transfer(s) of that step", status.ToString(),
                  entry.saves->size());
      for (const LayerwiseSave& save : *entry.saves) {
        std::vector<ProgressPush> more = layerwise_->Fail(save.transfer_id, status.ToString());
        pushes.insert(pushes.end(), std::make_move_iterator(more.begin()),
                      std::make_move_iterator(more.end()));
      }
    }
  }
  if (!pushes.empty()) pusher_->Push(std::move(pushes));
}

FinishedRequests WorkerImpl::GetFinished() {
  std::vector<ProgressPush> pushes;
  FinishedRequests out;
  {
    MutexLock lock(mu_);
    out = GetFinishedLocked(pushes);
  }
  if (!pushes.empty()) pusher_->Push(std::move(pushes));
  return out;
}

FinishedRequests WorkerImpl::GetFinishedLocked(std::vector<ProgressPush>& pushes) {
  const Clock::time_point now = Clock::now();
  holds_.Expire(now);
  for (const std::string& key : holds_.TakeReleasedKeys()) {
    if (layerwise_) layerwise_->Remove(key);
  }
  if (layerwise_) pushes = layerwise_->Expire(now);
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
