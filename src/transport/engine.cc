#include "transport/engine.h"

#include <algorithm>
#include <string>

#include "common/log.h"
#include "transport/shm/shm_backend.h"
#include "transport/tcp/tcp_backend.h"

namespace kvferry {

const char* BatchStateName(BatchState state) {
  switch (state) {
    case BatchState::kInProgress:
      return "in_progress";
    case BatchState::kDone:
      return "done";
    case BatchState::kFailed:
      return "failed";
    case BatchState::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

const char* TransportKindName(TransportKind kind) {
  switch (kind) {
    case TransportKind::kAuto:
      return "auto";
    case TransportKind::kShm:
      return "shm";
    case TransportKind::kTcp:
      return "tcp";
  }
  return "unknown";
}

Result<TransportKind> ParseTransportKind(std::string_view name) {
  if (name == "auto") return TransportKind::kAuto;
  if (name == "shm") return TransportKind::kShm;
  if (name == "tcp") return TransportKind::kTcp;
  return Status::InvalidArgument("unknown transport '" + std::string(name) +
                                 "': expected auto, shm or tcp");
}

Result<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& options) {
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(options));
  return std::unique_ptr<Transport>(std::move(engine));
}

bool ServingPermitsAnyTracer(const TransportOptions& options) {
  return options.shm_permit_any_tracer && options.serve && options.kind != TransportKind::kTcp;
}

Result<std::unique_ptr<Engine>> Engine::Create(const TransportOptions& options) {
  if (options.tcp_connections_per_peer < 1 || options.shm_threads < 1 ||
      options.max_request_bytes == 0) {
    return Status::InvalidArgument(
        "transport options need at least one tcp connection per peer, one shm thread and a "
        "positive request size");
  }
  std::unique_ptr<Engine> e(new Engine(options));
  KVFERRY_ASSIGN_OR_RETURN(e->self_, LocalHostIdentity());
  KVFERRY_ASSIGN_OR_RETURN(e->shm_proof_, ShmBackend::LocalProof());
  const bool use_shm = options.kind != TransportKind::kTcp;
  const bool use_tcp = options.kind != TransportKind::kShm;
  if (use_shm) {
    e->backends_.push_back(std::make_unique<ShmBackend>(e->self_, options.shm_threads));
    if (ServingPermitsAnyTracer(options)) {
      ShmBackend::PermitAnyTracer();
      e->permitted_any_tracer_ = true;
    }
  }
  if (use_tcp) {
    e->backends_.push_back(std::make_unique<tcp::TcpBackend>(
        tcp::ClientOptions{options.secret, options.tcp_connections_per_peer,
                           options.max_request_bytes, options.tcp_user_timeout}));
    if (options.serve) {
      const std::string advertise =
          options.tcp_advertise_host.empty() ? options.tcp_bind_host : options.tcp_advertise_host;
      if (advertise == "0.0.0.0" || advertise == "::") {
        return Status::InvalidArgument(
            "the tcp server binds to " + options.tcp_bind_host +
            "; set tcp_advertise_host to the address peers should connect to");
      }
      KVFERRY_ASSIGN_OR_RETURN(
          e->server_,
          tcp::TcpServer::Start(
              &e->registry_, options.tcp_bind_host, options.tcp_port, options.secret,
              &e->server_counters_,
              tcp::ServerLimits{options.tcp_handshake_timeout, options.tcp_idle_timeout,
                                options.tcp_send_stall_timeout, options.tcp_max_connections,
                                options.tcp_max_connections_per_source}));
    }
  }
  return e;
}

Engine::~Engine() {
  std::map<BatchId, BatchRecord> batches;
  std::map<PeerId, PeerRecord> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    batches.swap(batches_);
    peers.swap(peers_);
  }
  for (auto& [id, b] : batches) b.batch->Cancel();
  for (auto& [id, p] : peers) p.peer->Shutdown();
  server_.reset();
}

Status Engine::RegisterMemory(RegionId id, void* addr, std::size_t length) {
  return registry_.Add(id, addr, length);
}

Status Engine::DeregisterMemory(RegionId id) {
  // New reads of the region fail from the moment it is unlisted; reads already running against it
  // are ended now instead of at their deadlines: batches landing in it are cancelled, and the tcp
  // server drops connections with responses from it queued.
  return registry_.Remove(id, [this](RegionId region) {
    std::vector<std::shared_ptr<Batch>> landing;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [batch_id, b] : batches_) {
        if (b.batch->PinsRegion(region)) landing.push_back(b.batch);
      }
    }
    for (auto& b : landing) b->Cancel();
    if (server_) server_->RevokeRegion(region);
  });
}

Result<std::vector<std::uint8_t>> Engine::Descriptor() {
  PeerDescriptor d;
  d.host = self_;
  d.shm = shm_proof_;
  if (server_) {
    d.tcp = TcpEndpoint{
        options_.tcp_advertise_host.empty() ? options_.tcp_bind_host : options_.tcp_advertise_host,
        server_->port(), server_->instance()};
  }
  for (const RegionInfo& r : registry_.List()) {
    d.regions.push_back({r.id, reinterpret_cast<std::uint64_t>(r.addr), r.length});
  }
  return EncodeDescriptor(d);
}

Result<PeerId> Engine::Connect(std::span<const std::uint8_t> descriptor, Deadline deadline) {
  KVFERRY_ASSIGN_OR_RETURN(PeerDescriptor d, DecodeDescriptor(descriptor));
  std::string reasons;
  for (const auto& backend : backends_) {
    Result<std::unique_ptr<BackendPeer>> peer = backend->Connect(d, deadline);
    if (!peer.ok()) {
      // A refused secret is final; any other reason lets the next backend try.
      if (peer.status().code() == StatusCode::kUnauthenticated) return peer.status();
      reasons += std::string(reasons.empty() ? "" : "; ") + backend->name() + ": " +
                 std::string(peer.status().message());
      continue;
    }
    if (!reasons.empty() && d.host.boot_id == self_.boot_id &&
        d.host.pid_namespace == self_.pid_namespace) {
      // A peer on this host that shm could not read: say why, and how to enable shm.
      Log().warn("peer process {} on this host is read over {}, not shm: {}", d.host.pid,
                 backend->name(), reasons);
    }
    std::lock_guard<std::mutex> lock(mu_);
    const PeerId id = next_peer_++;
    peers_[id] = PeerRecord{backend->name(), std::move(peer).value(), IndexRegions(d)};
    return id;
  }
  return Status::Unavailable("cannot reach the peer with the " +
                             std::string(TransportKindName(options_.kind)) +
                             " transport: " + reasons);
}

void Engine::Disconnect(PeerId peer) {
  std::shared_ptr<BackendPeer> backend_peer;
  std::vector<std::shared_ptr<Batch>> running;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return;
    backend_peer = it->second.peer;
    peers_.erase(it);
    for (auto& [id, b] : batches_) {
      if (b.peer == peer) running.push_back(b.batch);
    }
  }
  for (auto& b : running) b->Cancel();
  backend_peer->Shutdown();
}

Result<std::string> Engine::PeerBackend(PeerId peer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return Status::NotFound("peer " + std::to_string(peer) + " is unknown");
  return std::string(it->second.backend);
}

Result<BatchId> Engine::SubmitReads(PeerId peer, std::vector<ReadOp> ops, Deadline deadline) {
  std::shared_ptr<BackendPeer> backend_peer;
  std::vector<RegionPin> pins;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) {
      return Status::NotFound("peer " + std::to_string(peer) + " is unknown or disconnected");
    }
    // Every op is checked on this side before any byte moves.
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const ReadOp& op = ops[i];
      Status s =
          CheckRemoteRange(it->second.regions, op.remote_region, op.remote_offset, op.length);
      if (!s.ok()) {
        refused_.fetch_add(1);
        return s.WithContext("read " + std::to_string(i));
      }
    }
    backend_peer = it->second.peer;
  }
  // Two reads into the same local bytes would race: refuse the batch.
  {
    std::vector<std::size_t> order(ops.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return ops[a].local < ops[b].local; });
    for (std::size_t k = 1; k < order.size(); ++k) {
      const ReadOp& prev = ops[order[k - 1]];
      if (prev.local + prev.length > ops[order[k]].local) {
        refused_.fetch_add(1);
        return Status::InvalidArgument("reads " + std::to_string(order[k - 1]) + " and " +
                                       std::to_string(order[k]) +
                                       " write overlapping local bytes; every read of a batch "
                                       "needs its own destination");
      }
    }
  }
  pins.reserve(ops.size());
  for (std::size_t i = 0; i < ops.size(); ++i) {
    Result<RegionPin> pin = registry_.PinLocal(ops[i].local, ops[i].length);
    if (!pin.ok()) {
      refused_.fetch_add(1);
      return pin.status().WithContext("read " + std::to_string(i));
    }
    pins.push_back(std::move(pin).value());
  }
  BatchId id = 0;
  std::shared_ptr<Batch> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_batch_++;
    batch = std::make_shared<Batch>(
        id, deadline, std::move(pins), [this](const BatchResult& r, std::uint64_t bytes) {
          bytes_read_.fetch_add(r.state == BatchState::kDone ? bytes : 0);
          switch (r.state) {
            case BatchState::kDone:
              done_.fetch_add(1);
              break;
            case BatchState::kFailed:
              failed_.fetch_add(1);
              break;
            case BatchState::kCancelled:
            case BatchState::kInProgress:
              cancelled_.fetch_add(1);
              break;
          }
        });
    batches_[id] = BatchRecord{peer, batch};
  }
  submitted_.fetch_add(1);
  backend_peer->Start(batch, std::move(ops));
  batch->Seal();
  return id;
}

std::shared_ptr<Batch> Engine::FindBatch(BatchId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = batches_.find(id);
  return it == batches_.end() ? nullptr : it->second.batch;
}

BatchResult Engine::Poll(BatchId batch) {
  std::shared_ptr<Batch> b = FindBatch(batch);
  if (!b) {
    return {BatchState::kFailed,
            Status::NotFound("batch " + std::to_string(batch) + " is unknown or released")};
  }
  return b->Current();
}

BatchResult Engine::Wait(BatchId batch, Deadline deadline) {
  std::shared_ptr<Batch> b = FindBatch(batch);
  if (!b) {
    return {BatchState::kFailed,
            Status::NotFound("batch " + std::to_string(batch) + " is unknown or released")};
  }
  return b->WaitEnd(deadline);
}

void Engine::Cancel(BatchId batch) {
  if (std::shared_ptr<Batch> b = FindBatch(batch)) b->Cancel();
}

void Engine::Release(BatchId batch) {
  std::shared_ptr<Batch> b;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = batches_.find(batch);
    if (it == batches_.end()) return;
    b = it->second.batch;
    batches_.erase(it);
  }
  b->Cancel();
}

TransportStats Engine::Stats() {
  TransportStats s;
  s.batches_submitted = submitted_.load();
  s.batches_done = done_.load();
  s.batches_failed = failed_.load();
  s.batches_cancelled = cancelled_.load();
  s.bytes_read = bytes_read_.load();
  s.bytes_served = server_counters_.bytes_served.load();
  s.requests_refused = refused_.load() + server_counters_.refused.load();
  return s;
}

}  // namespace kvferry
