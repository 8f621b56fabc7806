#include "transport/transport_core.h"

#include <algorithm>
#include <limits>
#include <string>

#include "common/log.h"
#include "device/device.h"
#include "transport/backend_options.h"

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

Result<std::vector<std::string>> SelectedTransportBackends(std::string_view backend) {
  const auto known = [] {
    std::string list = "auto";
    for (const std::string& n : TransportBackendNames()) list += ", " + n;
    return list + ", or a comma-separated list of backends (shm,tcp)";
  };
  std::vector<std::string> selected;
  if (backend == "auto") {
    for (const BackendFactory& f : RegisteredBackends()) {
      if (f.in_auto) selected.push_back(f.name);
    }
    return selected;
  }
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = backend.find(',', start);
    const std::string name(backend.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
    if (FindBackend(name) == nullptr) {
      const std::string in = name == backend ? "" : " in '" + std::string(backend) + "'";
      return Status::InvalidArgument("unknown transport '" + name + "'" + in + ": expected " +
                                     known());
    }
    if (std::find(selected.begin(), selected.end(), name) != selected.end()) {
      return Status::InvalidArgument("transport '" + std::string(backend) + "' names " + name +
                                     " twice: expected each backend at most once");
    }
    selected.push_back(name);
    if (comma == std::string_view::npos) return selected;
    start = comma + 1;
  }
}

Status CheckTransportBackend(std::string_view backend) {
  return SelectedTransportBackends(backend).status();
}

Status AddTransportOption(std::string_view key_value, TransportOptionMap* options) {
  const std::size_t eq = key_value.find('=');
  if (eq == std::string_view::npos || eq == 0) {
    return Status::InvalidArgument("transport option '" + std::string(key_value) +
                                   "': expected KEY=VALUE, as tcp.connections=4");
  }
  (*options)[std::string(key_value.substr(0, eq))] = std::string(key_value.substr(eq + 1));
  return Status::Ok();
}

Status CheckTransportOptions(const TransportOptions& options) {
  KVFERRY_RETURN_IF_ERROR(CheckTransportBackend(options.backend));
  for (const auto& [key, value] : options.backend_options) {
    const std::size_t dot = key.find('.');
    if (dot == std::string::npos || FindBackend(key.substr(0, dot)) == nullptr) {
      std::string list;
      for (const std::string& n : TransportBackendNames()) list += (list.empty() ? "" : ", ") + n;
      return Status::InvalidArgument("transport option " + key +
                                     ": expected a key <backend>.<option> of a backend of this "
                                     "build (" +
                                     list + ")");
    }
  }
  // Every backend's options, used or not, so that a typo is found before it matters.
  for (const BackendFactory& f : RegisteredBackends()) {
    KVFERRY_RETURN_IF_ERROR(f.check(options, OwnOptions(options.backend_options, f.name)));
  }
  return Status::Ok();
}

Result<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& options) {
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<TransportCore> core, TransportCore::Create(options));
  return std::unique_ptr<Transport>(std::move(core));
}

Result<std::unique_ptr<TransportCore>> TransportCore::Create(const TransportOptions& options) {
  KVFERRY_RETURN_IF_ERROR(CheckTransportOptions(options));
  std::unique_ptr<TransportCore> core(new TransportCore(options));
  KVFERRY_ASSIGN_OR_RETURN(std::vector<std::string> selected,
                           SelectedTransportBackends(options.backend));
  for (const std::string& name : selected) {
    const BackendFactory& f = *FindBackend(name);
    const TransportOptionMap own = OwnOptions(options.backend_options, f.name);
    KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                             f.create(BackendContext{options, own, &core->registry_}));
    core->backends_.push_back(std::move(backend));
  }
  return core;
}

Backend* TransportCore::FindBackendInstance(std::string_view name) const {
  for (const auto& b : backends_) {
    if (name == b->name()) return b.get();
  }
  return nullptr;
}

TransportCore::~TransportCore() {
  std::map<BatchId, BatchRecord> batches;
  std::map<PeerId, PeerRecord> peers;
  {
    MutexLock lock(mu_);
    batches.swap(batches_);
    peers.swap(peers_);
  }
  for (auto& [id, b] : batches) b.batch->Cancel();
  for (auto& [id, p] : peers) p.peer->Shutdown();
  peers.clear();
  backends_.clear();  // stops their servers while registry_ still exists
}

Status TransportCore::RegisterMemory(RegionId id, void* addr, std::size_t length, MemoryKind kind) {
  if (!IsValidMemoryKindType(kind.type) || (kind.is_host() && kind.device != 0)) {
    return Status::InvalidArgument("region " + std::to_string(id) + ": memory kind '" +
                                   kind.ToString() +
                                   "' is malformed; expected host or <type>:<device>");
  }
  if (!kind.is_host()) {
    // Some backend must be able to read into it or serve from it, or registering it is a
    // mistake the caller should hear about now, not at the first read.
    bool usable = false;
    for (const auto& b : backends_) {
      usable = usable || b->CanRead(kind, kind) || b->CanRead(MemoryKind::Host(), kind) ||
               b->CanRead(kind, MemoryKind::Host());
    }
    if (!usable) {
      std::string names;
      for (const auto& b : backends_) names += std::string(names.empty() ? "" : ", ") + b->name();
      return Status::InvalidArgument("region " + std::to_string(id) + " is " + kind.ToString() +
                                     " memory, which no backend of this transport (" + names +
                                     ") reads or serves; register host memory, or use a "
                                     "backend that supports " +
                                     kind.type + " memory");
    }
    // The memory must be this process's memory of that device (device::ProcessDevice), inside
    // one of its allocations: a wrong kind would have backends copy from the wrong place.
    Result<device::Device*> dev = device::ProcessDevice(kind.ToString());
    if (!dev.ok()) return dev.status().WithContext("region " + std::to_string(id));
    const auto base = reinterpret_cast<std::uintptr_t>(addr);
    Result<device::PointerInfo> info = (*dev)->Query(base);
    if (!info.ok() || base + length > info->alloc_base + info->alloc_size) {
      return Status::InvalidArgument(
          "region " + std::to_string(id) + " is registered as " + kind.ToString() +
          " memory, but [" + std::to_string(base) + ", +" + std::to_string(length) +
          ") is not inside one allocation of that device in this process" +
          (info.ok() ? "" : " (" + info.status().ToString() + ")") +
          "; allocate it with that device (device::ProcessDevice) or register its true kind");
    }
  }
  const RegionInfo region{id, static_cast<std::byte*>(addr), length, kind};
  KVFERRY_RETURN_IF_ERROR(registry_.Add(id, addr, length, std::move(kind)));
  for (const auto& b : backends_) b->RegionAdded(region);
  return Status::Ok();
}

Status TransportCore::DeregisterMemory(RegionId id) {
  // New reads of the region fail from the moment it is unlisted; reads already running against it
  // are ended now instead of at their deadlines: batches landing in it are cancelled, and each
  // backend ends its servers' use of it (tcp drops connections with responses from it queued).
  return registry_.Remove(id, [this](RegionId region) {
    std::vector<std::shared_ptr<Batch>> landing;
    {
      MutexLock lock(mu_);
      for (auto& [batch_id, b] : batches_) {
        if (b.batch->PinsRegion(region)) landing.push_back(b.batch);
      }
    }
    for (auto& b : landing) b->Cancel();
    for (auto& backend : backends_) backend->RevokeRegion(region);
  });
}

Result<std::vector<std::uint8_t>> TransportCore::Descriptor() {
  PeerDescriptor d;
  // The regions first: each backend's section then covers every region listed, even one
  // registered meanwhile (a reader refuses ucx for a listed region without a key).
  for (const RegionInfo& r : registry_.List()) {
    d.regions.push_back({r.id, reinterpret_cast<std::uint64_t>(r.addr), r.length, r.kind});
  }
  for (const auto& backend : backends_) {
    std::vector<std::uint8_t> section = backend->DescriptorSection();
    if (!section.empty()) d.sections.emplace(backend->name(), std::move(section));
  }
  return EncodeDescriptor(d);
}

namespace {

// A batch's strided reads as their pieces (ReadOp's contract): InvalidArgument for a count of 0,
// a stride shorter than the piece (pieces would overlap), or offsets past 64 bits.
Result<std::vector<ReadOp>> ExpandStridedReads(std::vector<ReadOp> ops) {
  std::size_t pieces = 0;
  bool strided = false;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const ReadOp& op = ops[i];
    if (op.count == 1) {
      ++pieces;
      continue;
    }
    strided = true;
    const std::uint64_t max = std::numeric_limits<std::uint64_t>::max();
    if (op.count == 0 || op.remote_stride < op.length || op.local_stride < op.length ||
        (op.count - 1) > (max - op.remote_offset) / std::max<std::uint64_t>(op.remote_stride, 1) ||
        (op.count - 1) > max / std::max<std::uint64_t>(op.local_stride, 1)) {
      return Status::InvalidArgument(
          "read " + std::to_string(i) + ": a strided read of " + std::to_string(op.count) +
          " pieces of " + std::to_string(op.length) +
          " bytes needs a count of at least 1 and "
          "strides of at least the piece (remote " +
          std::to_string(op.remote_stride) + ", local " + std::to_string(op.local_stride) +
          ") that stay within 64 bits");
    }
    pieces += static_cast<std::size_t>(op.count);
  }
  if (!strided) return ops;
  std::vector<ReadOp> out;
  out.reserve(pieces);
  for (const ReadOp& op : ops) {
    for (std::uint64_t k = 0; k < op.count; ++k) {
      out.push_back({op.local + k * op.local_stride, op.remote_region,
                     op.remote_offset + k * op.remote_stride, op.length, 1, 0, 0});
    }
  }
  return out;
}

// Unavailable naming the first pair of kinds `backend` cannot read (remote into local).
Status CanReadKinds(const Backend& backend, const std::vector<RemoteRegion>& remote,
                    const std::vector<MemoryKind>& local_kinds) {
  for (const RemoteRegion& r : remote) {
    for (const MemoryKind& local : local_kinds) {
      if (!backend.CanRead(r.kind, local)) {
        return Status::Unavailable("it cannot read the peer's " + r.kind.ToString() +
                                   " memory into this process's " + local.ToString() + " memory");
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Result<PeerId> TransportCore::Connect(std::span<const std::uint8_t> descriptor, Deadline deadline) {
  KVFERRY_ASSIGN_OR_RETURN(PeerDescriptor d, DecodeDescriptor(descriptor));
  std::string reasons;
  std::string refused;  // from backends that could reach the peer but failed to connect
  // With several backends (auto), one that cannot move every memory kind of the peer's regions
  // into every kind of ours is passed over: device memory on one host goes over tcp's staging
  // rather than failing at the first read over shm.
  std::vector<MemoryKind> local_kinds;  // each kind once
  for (const RegionInfo& r : registry_.List()) {
    if (std::find(local_kinds.begin(), local_kinds.end(), r.kind) == local_kinds.end()) {
      local_kinds.push_back(r.kind);
    }
  }
  for (const auto& backend : backends_) {
    const PeerView view{d.regions, d.Section(backend->name())};
    Status reach = backend->CanReach(view);
    if (reach.ok() && backends_.size() > 1) reach = CanReadKinds(*backend, d.regions, local_kinds);
    if (reach.code() == StatusCode::kInvalidArgument || reach.code() == StatusCode::kNotSupported) {
      // A section its backend cannot decode: the descriptor is malformed or from another build.
      return reach.WithContext("descriptor section " + std::string(backend->name()));
    }
    Result<std::unique_ptr<BackendPeer>> peer =
        reach.ok() ? backend->Connect(view, deadline) : Result<std::unique_ptr<BackendPeer>>(reach);
    if (!peer.ok()) {
      // A refused secret is final; any other reason lets the next backend try.
      if (peer.status().code() == StatusCode::kUnauthenticated) return peer.status();
      const std::string reason =
          std::string(backend->name()) + ": " + std::string(peer.status().message());
      reasons += (reasons.empty() ? "" : "; ") + reason;
      if (reach.ok()) refused += (refused.empty() ? "" : "; ") + reason;
      continue;
    }
    if (!refused.empty()) {
      // A backend that should have carried this peer could not: say why.
      Log().warn("the peer is read over {}, not its preferred backend: {}", backend->name(),
                 refused);
    }
    MutexLock lock(mu_);
    const PeerId id = next_peer_++;
    peers_[id] = PeerRecord{backend.get(), std::move(peer).value(),
                            std::make_shared<const RemoteRegionTable>(IndexRegions(d.regions))};
    return id;
  }
  return Status::Unavailable("cannot reach the peer with the " + options_.backend +
                             " transport: " + reasons);
}

void TransportCore::Disconnect(PeerId peer) {
  std::shared_ptr<BackendPeer> backend_peer;
  std::vector<std::shared_ptr<Batch>> running;
  {
    MutexLock lock(mu_);
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

Result<std::string> TransportCore::PeerBackend(PeerId peer) {
  MutexLock lock(mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return Status::NotFound("peer " + std::to_string(peer) + " is unknown");
  return std::string(it->second.backend->name());
}

Result<BatchId> TransportCore::SubmitReads(PeerId peer, std::vector<ReadOp> ops,
                                           Deadline deadline) {
  // Strided reads become their pieces here, so every backend moves exactly the bytes named: the
  // tcp server gathers them into its response, shm reads them as iovecs, ucx gets each.
  Result<std::vector<ReadOp>> expanded = ExpandStridedReads(std::move(ops));
  if (!expanded.ok()) {
    refused_.fetch_add(1);
    return expanded.status();
  }
  ops = std::move(expanded).value();
  std::shared_ptr<BackendPeer> backend_peer;
  Backend* backend = nullptr;
  std::shared_ptr<const RemoteRegionTable> regions;
  std::vector<RegionPin> pins;
  {
    MutexLock lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) {
      // Ids are never reused: one below next_peer_ was connected and has been disconnected (by
      // another load that found the peer dead, say), which is the peer's failure, not a bug.
      if (peer != 0 && peer < next_peer_) {
        return Status::PeerDisconnected("peer " + std::to_string(peer) +
                                        " was disconnected before these reads were submitted");
      }
      return Status::NotFound("peer " + std::to_string(peer) + " is unknown");
    }
    // Every op is checked on this side before any byte moves.
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const ReadOp& op = ops[i];
      Status s =
          CheckRemoteRange(*it->second.regions, op.remote_region, op.remote_offset, op.length);
      if (!s.ok()) {
        refused_.fetch_add(1);
        return s.WithContext("read " + std::to_string(i));
      }
    }
    backend_peer = it->second.peer;
    backend = it->second.backend;
    regions = it->second.regions;
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
    // The backend must be able to move the remote region's kind into the local region's.
    const MemoryKind& remote = regions->at(ops[i].remote_region).kind;
    const MemoryKind& local = pin->kind();
    if (!backend->CanRead(remote, local)) {
      refused_.fetch_add(1);
      return Status::NotSupported(
          "read " + std::to_string(i) + ": the " + backend->name() + " backend cannot read " +
          remote.ToString() + " memory (the peer's region " + std::to_string(ops[i].remote_region) +
          ") into " + local.ToString() + " memory (local region " + std::to_string(pin->region()) +
          ")");
    }
    pins.push_back(std::move(pin).value());
  }
  BatchId id = 0;
  std::shared_ptr<Batch> batch;
  {
    MutexLock lock(mu_);
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

std::shared_ptr<Batch> TransportCore::FindBatch(BatchId id) {
  MutexLock lock(mu_);
  auto it = batches_.find(id);
  return it == batches_.end() ? nullptr : it->second.batch;
}

BatchResult TransportCore::Poll(BatchId batch) {
  std::shared_ptr<Batch> b = FindBatch(batch);
  if (!b) {
    return {BatchState::kFailed,
            Status::NotFound("batch " + std::to_string(batch) + " is unknown or released")};
  }
  return b->Current();
}

BatchResult TransportCore::Wait(BatchId batch, Deadline deadline) {
  std::shared_ptr<Batch> b = FindBatch(batch);
  if (!b) {
    return {BatchState::kFailed,
            Status::NotFound("batch " + std::to_string(batch) + " is unknown or released")};
  }
  return b->WaitEnd(deadline);
}

void TransportCore::Cancel(BatchId batch) {
  if (std::shared_ptr<Batch> b = FindBatch(batch)) b->Cancel();
}

void TransportCore::Release(BatchId batch) {
  std::shared_ptr<Batch> b;
  {
    MutexLock lock(mu_);
    auto it = batches_.find(batch);
    if (it == batches_.end()) return;
    b = it->second.batch;
    batches_.erase(it);
  }
  b->Cancel();
}

TransportStats TransportCore::Stats() {
  TransportStats s;
  s.batches_submitted = submitted_.load();
  s.batches_done = done_.load();
  s.batches_failed = failed_.load();
  s.batches_cancelled = cancelled_.load();
  s.bytes_read = bytes_read_.load();
  s.requests_refused = refused_.load();
  for (const RegionInfo& r : registry_.List()) s.registered_bytes[r.kind.ToString()] += r.length;
  for (const auto& backend : backends_) backend->AddStats(&s);
  return s;
}

}  // namespace kvferry
