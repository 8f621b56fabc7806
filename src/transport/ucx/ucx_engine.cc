#include "transport/ucx/ucx_engine.h"

#include <algorithm>
#include <optional>

#include "common/clock.h"
#include "common/log.h"
#include "transport/ucx/ucx_api.h"

namespace kvferry {
namespace {

// How often the progress thread sweeps deadlines, cancels and liveness when nothing wakes it.
constexpr std::chrono::milliseconds kTick{50};
// How long a caller waits for the progress thread to take its work (it never blocks, so this is
// only reached when something is badly wrong).
constexpr std::chrono::milliseconds kCallTimeout{10000};

}  // namespace

bool UcxReadsKind(std::uint64_t memory_types, const MemoryKind& kind) {
  if (kind.is_host()) return true;
  return kind.type == "cuda" && (memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

bool UcxCanRead(std::uint64_t memory_types, const MemoryKind& remote, const MemoryKind& local) {
  return UcxReadsKind(memory_types, remote) && UcxReadsKind(memory_types, local);
}

ucs_memory_type_t UcxMemoryType(const MemoryKind& kind) {
  return kind.is_host() ? UCS_MEMORY_TYPE_HOST : UCS_MEMORY_TYPE_CUDA;
}

Result<std::unique_ptr<UcxEngine>> UcxEngine::Create(const UcxOptions& options, HostIdentity self,
                                                     std::uint64_t start_time) {
  std::unique_ptr<UcxEngine> e(new UcxEngine(options, std::move(self), start_time));
  UcxEngine* raw = e.get();
  KVFERRY_ASSIGN_OR_RETURN(e->worker_, UcxWorker::Create(
                                           kTick, [raw](ucp_worker_h worker) { raw->Tick(worker); },
                                           [raw](ucp_worker_h worker) { raw->StopAll(worker); }));
  // Read only by closures posted after Create returns and by StopAll.
  e->context_ = e->worker_->context();
  return e;
}

UcxEngine::~UcxEngine() {
  // Stops the thread (StopAll runs there) and destroys the worker before the peers, whose gets
  // the worker's destruction may still complete.
  worker_.reset();
}

void UcxEngine::Tick(ucp_worker_h worker) {
  const auto now = Clock::now();
  for (auto it = peers_.begin(); it != peers_.end();) {
    UcxPeerState& peer = **it;
    peer.Pump(worker, now);
    if (peer.Finished()) {
      peer.Release();
      it = peers_.erase(it);
      continue;
    }
    ++it;
  }
}

void UcxEngine::StopAll(ucp_worker_h worker) {
  // Every peer was shut down before (Backend's contract); end anything left all the same.
  for (const std::shared_ptr<UcxPeerState>& peer : peers_) {
    peer->SetShut();
    peer->Pump(worker, Clock::now());
    peer->Release();
  }
  while (!mapped_.empty()) UnmapOnThread(mapped_.begin()->first);
}

Result<UcxEngine::Mapping> UcxEngine::Map(const RegionInfo& region) {
  Mapping m;
  m.addr = region.addr;
  m.length = region.length;
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  mp.address = region.addr;
  mp.length = region.length;
  mp.memory_type = UcxMemoryType(region.kind);
  ucs_status_t s = Ucx().ucp_mem_map(context_, &mp, &m.memh);
  if (s != UCS_OK) {
    return Status::Unavailable("ucp_mem_map of region " + std::to_string(region.id) + " (" +
                               std::to_string(region.length) + " bytes) failed: " + UcsText(s));
  }
  void* packed = nullptr;
  std::size_t size = 0;
  s = Ucx().ucp_rkey_pack(context_, m.memh, &packed, &size);
  if (s != UCS_OK || size == 0 || size > kMaxUcxRkeyBytes) {
    if (s == UCS_OK) Ucx().ucp_rkey_buffer_release(packed);
    Ucx().ucp_mem_unmap(context_, m.memh);
    return Status::Unavailable(
        "ucp_rkey_pack of region " + std::to_string(region.id) + " failed: " +
        (s != UCS_OK ? UcsText(s) : std::to_string(size) + " bytes, expected 1 to 1024"));
  }
  const auto* p = static_cast<const std::uint8_t*>(packed);
  m.rkey.assign(p, p + size);
  Ucx().ucp_rkey_buffer_release(packed);
  return m;
}

void UcxEngine::UnmapOnThread(RegionId id) {
  auto it = mapped_.find(id);
  if (it == mapped_.end()) return;
  Ucx().ucp_mem_unmap(context_, it->second.memh);
  mapped_.erase(it);
}

std::vector<std::uint8_t> UcxEngine::Section(const std::vector<RegionInfo>& regions) {
  UcxSection section;
  section.worker_address = worker_->address();
  section.host = self_;
  section.start_time = start_time_;
  section.tcp_segments = worker_->tcp_segments();
  const Status call = worker_->Call(
      [&] {
        std::set<RegionId> listed;
        for (const RegionInfo& r : regions) {
          // Kinds this UCX cannot read are not mapped (docs/transport.md, "ucx"); CanRead
          // refuses them, so auto reads them over another backend.
          if (!UcxReadsKind(memory_types(), r.kind)) continue;
          listed.insert(r.id);
          auto it = mapped_.find(r.id);
          if (it != mapped_.end() && (it->second.addr != r.addr || it->second.length != r.length)) {
            UnmapOnThread(r.id);  // another region under a reused id
            it = mapped_.end();
          }
          if (it == mapped_.end()) {
            Result<Mapping> m = Map(r);
            if (!m.ok()) {
              Log().warn("ucx: region {} is not published: {}", r.id, m.status().ToString());
              continue;
            }
            it = mapped_.emplace(r.id, std::move(m).value()).first;
          }
          section.keys.push_back({r.id, it->second.rkey});
        }
        for (auto it = mapped_.begin(); it != mapped_.end();) {
          const RegionId id = (it++)->first;
          if (listed.count(id) == 0) UnmapOnThread(id);
        }
      },
      DeadlineAfter(kCallTimeout));
  if (!call.ok()) {
    Log().error("ucx: no section in the descriptor: {}", call.ToString());
    return {};
  }
  return EncodeUcxSection(section);
}

void UcxEngine::Unmap(RegionId id) {
  const Status call = worker_->Call([&] { UnmapOnThread(id); }, DeadlineAfter(kCallTimeout));
  if (!call.ok()) Log().error("ucx: region {} stays mapped: {}", id, call.ToString());
}

Result<std::shared_ptr<UcxPeerState>> UcxEngine::Connect(const UcxSection& section,
                                                         const RemoteRegionTable& regions,
                                                         Deadline deadline) {
  KVFERRY_RETURN_IF_ERROR(CheckUcxTcpSegments(worker_->tcp_segments(), section.tcp_segments));
  std::optional<PeerProcess> process;
  if (SameKernelAndPidNamespace(section.host, self_)) {
    // Same kernel and PID namespace: the peer-process proof, one rule with shm's (a pidfd is
    // required). Its pidfd tells when the peer exits, which an endpoint without peer error
    // handling (shared-memory transports) never reports.
    KVFERRY_ASSIGN_OR_RETURN(PeerProcess proven,
                             PeerProcess::Prove(self_, section.host, section.start_time));
    process.emplace(std::move(proven));
  }
  auto peer =
      std::make_shared<UcxPeerState>(section, regions, std::move(process), options_.max_inflight);
  Status created;
  const Status call = worker_->Call(
      [&] {
        created = peer->EnsureEp(worker_->worker());
        if (created.ok()) peers_.push_back(peer);
      },
      deadline);
  if (!call.ok()) return Status::Unavailable("connecting over ucx: " + call.ToString());
  KVFERRY_RETURN_IF_ERROR(created);
  return peer;
}

void UcxEngine::Start(const std::shared_ptr<UcxPeerState>& peer,
                      const std::shared_ptr<Batch>& batch, const std::vector<ReadOp>& ops) {
  auto unit = std::make_shared<UcxUnit>();
  unit->batch = batch;
  Status refused;
  for (std::size_t i = 0; i < ops.size() && refused.ok(); ++i) {
    const ReadOp& op = ops[i];
    if (!peer->HasKey(op.remote_region)) {
      refused = Status::Unavailable(
          "read " + std::to_string(i) + ": the peer published no ucx key for its region " +
          std::to_string(op.remote_region) +
          " (memory of a kind its UCX does not read, or registered after its descriptor was "
          "taken); get a new descriptor or read it over another backend");
      break;
    }
    const std::uint64_t base = peer->regions().at(op.remote_region).addr + op.remote_offset;
    const ucs_memory_type_t local_type = UcxMemoryType(batch->local_kind(i));
    for (std::uint64_t off = 0; off < op.length;) {
      const std::uint64_t len = std::min(op.length - off, options_.chunk_bytes);
      unit->chunks.push_back({op.local + off, base + off, len, op.remote_region, local_type});
      off += len;
    }
  }
  if (refused.ok() && unit->chunks.empty()) return;  // nothing to read: no unit
  batch->AddUnit();
  if (!refused.ok()) {
    batch->UnitDone(refused, 0);
    return;
  }
  if (!peer->Enter()) {
    batch->UnitDone(Status::PeerDisconnected("the ucx peer was disconnected"), 0);
    return;
  }
  if (!worker_->Post([peer, unit] { peer->Adopt(unit); })) {
    peer->Leave();
    batch->UnitDone(Status::PeerDisconnected("the ucx backend is shutting down"), 0);
  }
}

void UcxEngine::ShutdownPeer(const std::shared_ptr<UcxPeerState>& peer) {
  peer->CloseEntry();
  worker_->Post([peer] { peer->SetShut(); });
  if (!peer->WaitIdle(DeadlineAfter(kCallTimeout))) {
    Log().error("ucx: a peer's units did not end within {} ms of its shutdown",
                kCallTimeout.count());
  }
}

}  // namespace kvferry
