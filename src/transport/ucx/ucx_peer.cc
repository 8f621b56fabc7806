#include "transport/ucx/ucx_peer.h"

#include <cstring>

#include "common/log.h"
#include "transport/ucx/ucx_api.h"
#include "transport/ucx/ucx_worker.h"

namespace kvferry {
namespace {

constexpr std::chrono::milliseconds kLivenessInterval{20};

std::set<RegionId> KeyedRegions(const UcxSection& section) {
  std::set<RegionId> out;
  for (const UcxRegionKey& k : section.keys) out.insert(k.region);
  return out;
}

bool PeerGoneStatus(ucs_status_t s) {
  return s == UCS_ERR_ENDPOINT_TIMEOUT || s == UCS_ERR_CONNECTION_RESET ||
         s == UCS_ERR_UNREACHABLE || s == UCS_ERR_CANCELED || s == UCS_ERR_REJECTED;
}

Status GetFailed(ucs_status_t s, const UcxChunk& c) {
  const std::string what = "a ucx get of " + std::to_string(c.length) +
                           " bytes from the peer's region " + std::to_string(c.region) +
                           " failed: " + UcsText(s);
  if (PeerGoneStatus(s)) {
    return Status::PeerDisconnected(what + "; the peer process exited or the network to it failed");
  }
  return Status::Unavailable(what);
}

}  // namespace

UcxPeerState::UcxPeerState(UcxSection section, RemoteRegionTable regions,
                           std::optional<PeerProcess> process, std::uint64_t max_inflight)
    : section_(std::move(section)),
      regions_(std::move(regions)),
      keyed_(KeyedRegions(section_)),
      process_(std::move(process)),
      max_inflight_(max_inflight) {}

UcxPeerState::~UcxPeerState() {
  // Gets left here were abandoned on an endpoint without error handling; the worker that could
  // complete them is gone.
  for (UcxGet* g : gets_) delete g;
}

bool UcxPeerState::Enter() {
  MutexLock lock(mu_);
  if (closed_) return false;
  ++running_;
  return true;
}

void UcxPeerState::Leave() {
  MutexLock lock(mu_);
  if (--running_ == 0) idle_.SignalAll();
}

void UcxPeerState::CloseEntry() {
  MutexLock lock(mu_);
  closed_ = true;
}

bool UcxPeerState::WaitIdle(Deadline deadline) {
  MutexLock lock(mu_);
  while (running_ != 0) {
    if (idle_.WaitUntil(mu_, deadline)) return running_ == 0;
  }
  return true;
}

void UcxPeerState::OnGetDone(void* request, ucs_status_t status, void* user_data) {
  auto* g = static_cast<UcxGet*>(user_data);
  g->request = request;
  g->status = status;
  g->peer->completed_.push_back(g);
}

void UcxPeerState::OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<UcxPeerState*>(arg);
  if (ep == self->ep_ && self->ep_error_ == UCS_OK) self->ep_error_ = status;
}

Status UcxPeerState::EnsureEp(ucp_worker_h worker) {
  if (ep_ != nullptr) return Status::Ok();
  if (!failed_.ok()) return failed_;
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.address = reinterpret_cast<const ucp_address_t*>(section_.worker_address.data());
  if (peer_mode_) {
    p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &UcxPeerState::OnEpError;
    p.err_handler.arg = this;
  } else {
    p.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  }
  ucp_ep_h ep = nullptr;
  ucs_status_t s = Ucx().ucp_ep_create(worker, &p, &ep);
  if (s == UCS_ERR_UNREACHABLE && peer_mode_) {
    // UCX 1.13's shared-memory transports have no peer failure handler: without error handling
    // they reach the peer; liveness then comes from the pidfd and the deadline (ucx_peer.h).
    peer_mode_ = false;
    p.field_mask &= ~static_cast<std::uint64_t>(UCP_EP_PARAM_FIELD_ERR_HANDLER);
    p.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    s = Ucx().ucp_ep_create(worker, &p, &ep);
    if (s == UCS_OK) {
      Log().info(
          "ucx: no transport of UCX_TLS reaches the peer with peer error handling; its endpoint "
          "has none (a dead peer is found by {}, a stopped one by the batch deadline)",
          process_ ? "its pidfd" : "the batch deadline only");
    }
  }
  if (s != UCS_OK) {
    return Status::Unavailable(
        "ucp_ep_create to the peer's worker failed: " + UcsText(s) +
        "; UCX found no transport of UCX_TLS that reaches the peer (`ucx_info "
        "-d` lists this host's; both sides need a common one)");
  }
  ep_ = ep;
  for (const UcxRegionKey& k : section_.keys) {
    ucp_rkey_h rkey = nullptr;
    s = Ucx().ucp_ep_rkey_unpack(ep_, k.bytes.data(), &rkey);
    if (s != UCS_OK) {
      CloseEp();
      return Status::Unavailable("ucp_ep_rkey_unpack of the peer's key for region " +
                                 std::to_string(k.region) + " failed: " + UcsText(s) +
                                 "; the peer's descriptor is from an incompatible UCX or corrupt");
    }
    rkeys_[k.region] = rkey;
  }
  return Status::Ok();
}

bool UcxPeerState::CloseEp() {
  if (ep_ == nullptr) return false;
  ++generation_;
  ucp_ep_h ep = ep_;
  ep_ = nullptr;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // Force needs peer error handling; without it UCX refuses it (UCS_ERR_INVALID_PARAM), so that
  // endpoint is flushed and closed, which it does once its gets completed.
  p.flags = peer_mode_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  const ucs_status_ptr_t r = Ucx().ucp_ep_close_nbx(ep, &p);
  // A close still in progress completes, and is released, on its own.
  if (r != nullptr && !UCS_PTR_IS_ERR(r)) Ucx().ucp_request_free(r);
  // After the close: its gets, which used the keys, have completed (forced) or are flushed.
  for (auto& [id, rkey] : rkeys_) Ucx().ucp_rkey_destroy(rkey);
  rkeys_.clear();
  return true;
}

void UcxPeerState::Adopt(std::shared_ptr<UcxUnit> unit) {
  if (released_) {
    unit->batch->UnitDone(Status::PeerDisconnected("the ucx peer was disconnected"), 0);
    Leave();
    return;
  }
  units_.push_back(std::move(unit));
}

void UcxPeerState::Issue(UcxUnit& u, const UcxChunk& c) {
  auto g = std::make_unique<UcxGet>();
  g->peer = this;
  g->unit = &u;
  g->chunk = c;
  g->generation = generation_;
  void* dst = c.local;
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  p.cb.send = &UcxPeerState::OnGetDone;
  p.user_data = g.get();
  p.memory_type = c.local_type;
  if (!peer_mode_) {
    if (c.local_type != UCS_MEMORY_TYPE_HOST) {
      // The staging buffer is host memory, copied into the destination with memcpy: not into
      // device memory. Such an endpoint cannot stop its gets either, so refuse the read.
      if (u.error.ok()) {
        u.error = Status::Unavailable(
            "UCX reaches this peer only over transports without peer error handling (shared "
            "memory), and the ucx backend reads into device memory only over an endpoint that "
            "has it; let UCX_TLS offer one (tcp, rc, dc, cuda_ipc) or read over another backend");
      }
      return;
    }
    g->stage = std::make_unique_for_overwrite<std::byte[]>(c.length);
    dst = g->stage.get();  // host memory, as c.local_type says
  }
  const ucs_status_ptr_t r =
      Ucx().ucp_get_nbx(ep_, dst, c.length, c.remote, rkeys_.at(c.region), &p);
  if (r == nullptr) {  // completed at once; no callback follows
    if (g->stage) std::memcpy(c.local, g->stage.get(), c.length);
    u.bytes += c.length;
    return;
  }
  if (UCS_PTR_IS_ERR(r)) {
    if (u.error.ok()) u.error = GetFailed(UCS_PTR_STATUS(r), c);
    return;
  }
  g->request = r;
  u.gets.insert(g.get());
  gets_.insert(g.release());
}

void UcxPeerState::Drain() {
  while (!completed_.empty()) {
    std::vector<UcxGet*> done;
    done.swap(completed_);
    for (UcxGet* raw : done) {
      const std::unique_ptr<UcxGet> g(raw);
      gets_.erase(raw);
      Ucx().ucp_request_free(g->request);
      UcxUnit* u = g->unit;
      if (u == nullptr) continue;  // abandoned: it landed (or not) in its own staging buffer
      u->gets.erase(raw);
      if (g->status == UCS_OK) {
        if (g->stage) std::memcpy(g->chunk.local, g->stage.get(), g->chunk.length);
        u->bytes += g->chunk.length;
      } else if (u->stopping) {
        // Cancelled or failed after the unit stopped: its stop status says why.
      } else if (g->status == UCS_ERR_CANCELED && g->generation != generation_) {
        u->retry.push_back(g->chunk);  // our own close of the endpoint for another unit
      } else if (u->error.ok()) {
        u->error = GetFailed(g->status, g->chunk);
      }
    }
  }
}

bool UcxPeerState::SweepUnits(ucp_worker_h worker, std::chrono::steady_clock::time_point now) {
  bool force = false;
  for (auto it = units_.begin(); it != units_.end();) {
    UcxUnit& u = **it;
    auto stop = [&](Status why) {
      if (u.stopping) return;
      if (u.error.ok()) u.error = std::move(why);
      u.stopping = true;
      u.stop_since = now;
    };
    if (!failed_.ok()) stop(failed_);
    if (shut_) stop(Status::PeerDisconnected("the ucx peer was disconnected"));
    if (!u.error.ok()) stop(u.error);
    if (u.batch->ShouldStop()) stop(Status::Ok());  // Ok: the batch's StopStatus says why
    if (!u.stopping) {
      Status ep = EnsureEp(worker);
      if (!ep.ok()) stop(ep);
    }
    while (!u.stopping && gets_.size() < max_inflight_) {
      if (!u.retry.empty()) {
        const UcxChunk c = u.retry.back();
        u.retry.pop_back();
        Issue(u, c);
      } else if (u.next < u.chunks.size()) {
        Issue(u, u.chunks[u.next++]);
      } else {
        break;
      }
      if (!u.error.ok()) stop(u.error);
    }
    if (u.stopping && !u.gets.empty()) {
      if (!peer_mode_) {
        // Nothing can complete or cancel these (ucx_peer.h): they land in their own buffers.
        for (UcxGet* g : u.gets) g->unit = nullptr;
        u.gets.clear();
      } else {
        if (!u.cancel_sent) {
          for (UcxGet* g : u.gets) Ucx().ucp_request_cancel(worker, g->request);
          u.cancel_sent = true;
        }
        if (now - u.stop_since >= kStopGrace || shut_ || !failed_.ok()) force = true;
      }
    }
    const bool all_issued = u.retry.empty() && u.next == u.chunks.size();
    if (u.gets.empty() && (u.stopping || all_issued)) {
      const Status s = !u.stopping ? Status::Ok() : !u.error.ok() ? u.error : u.batch->StopStatus();
      u.batch->UnitDone(s, u.bytes);
      it = units_.erase(it);
      Leave();
      continue;
    }
    ++it;
  }
  return force;
}

void UcxPeerState::Pump(ucp_worker_h worker, std::chrono::steady_clock::time_point now) {
  Drain();
  if (failed_.ok() && ep_error_ != UCS_OK) {
    failed_ =
        Status::PeerDisconnected("the ucx endpoint to the peer failed (" + UcsText(ep_error_) +
                                 "): the peer process exited or the network to it failed; "
                                 "connect to it again");
  }
  if (failed_.ok() && process_ && (!units_.empty() || !gets_.empty()) &&
      now >= next_liveness_check_) {
    next_liveness_check_ = now + kLivenessInterval;
    if (!process_->Alive()) failed_ = process_->Gone("its ucx reads cannot complete");
  }
  if (!failed_.ok() && peer_mode_ && CloseEp()) Drain();
  if (units_.empty()) return;
  if (SweepUnits(worker, now) && CloseEp()) {
    // The forced close completed the stopped units' gets (and others', which are issued again
    // on a new endpoint): finish them now.
    Drain();
    SweepUnits(worker, now);
  }
}

void UcxPeerState::Release() {
  released_ = true;
  // Abandoned gets on an endpoint without error handling may still complete: keep the endpoint
  // and its keys (the worker's destruction releases them).
  if (!gets_.empty()) return;
  CloseEp();
}

}  // namespace kvferry
