#include "transport/ucx/ucx_backend.h"

#include <unistd.h>

#include <set>

#include "transport/backend_options.h"
#include "transport/ucx/ucx_section.h"

namespace kvferry {
namespace {

class UcxPeer final : public BackendPeer {
 public:
  UcxPeer(UcxEngine* engine, std::shared_ptr<UcxPeerState> state)
      : engine_(engine), state_(std::move(state)) {}
  ~UcxPeer() override { Shutdown(); }

  void Start(const std::shared_ptr<Batch>& batch, std::vector<ReadOp> ops) override {
    engine_->Start(state_, batch, ops);
  }
  void Shutdown() override { engine_->ShutdownPeer(state_); }

 private:
  UcxEngine* engine_;  // the backend's; outlives its peers (Backend's contract)
  std::shared_ptr<UcxPeerState> state_;
};

}  // namespace

Result<UcxOptions> ParseUcxOptions(const TransportOptions& /*options*/,
                                   const TransportOptionMap& own) {
  UcxOptions o;
  BackendOptionReader r("ucx", own);
  KVFERRY_RETURN_IF_ERROR(r.ReadUint("max_inflight", 1, 4096, &o.max_inflight));
  KVFERRY_RETURN_IF_ERROR(r.ReadUint("chunk_bytes", 4096, std::uint64_t{1} << 30, &o.chunk_bytes));
  KVFERRY_RETURN_IF_ERROR(r.RejectUnknown());
  return o;
}

UcxBackend::UcxBackend(std::unique_ptr<UcxEngine> engine, HostIdentity self, bool serve,
                       RegionRegistry* regions)
    : engine_(std::move(engine)), self_(std::move(self)), serve_(serve), regions_(regions) {}

BackendFactory UcxBackend::Factory() {
  BackendFactory f;
  f.name = "ucx";
  f.check = [](const TransportOptions& options, const TransportOptionMap& own) {
    return ParseUcxOptions(options, own).status();
  };
  f.create = [](const BackendContext& ctx) -> Result<std::unique_ptr<Backend>> {
    KVFERRY_ASSIGN_OR_RETURN(UcxOptions o, ParseUcxOptions(ctx.options, ctx.own_options));
    KVFERRY_ASSIGN_OR_RETURN(HostIdentity self, LocalHostIdentity());
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t start, ProcessStartTime(getpid()));
    KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<UcxEngine> engine, UcxEngine::Create(o, self, start));
    return std::unique_ptr<Backend>(std::make_unique<UcxBackend>(std::move(engine), std::move(self),
                                                                 ctx.options.serve, ctx.regions));
  };
  // Its endpoints do not authenticate (docs/transport.md, "ucx"): only when named.
  f.in_auto = false;
  return f;
}

std::vector<std::uint8_t> UcxBackend::DescriptorSection() {
  if (!serve_ || regions_ == nullptr) return {};
  return engine_->Section(regions_->List());
}

Status UcxCanReach(std::uint64_t memory_types, const PeerView& peer) {
  if (peer.section.empty()) {
    return Status::Unavailable(
        "the peer's descriptor has no ucx section: it does not serve over ucx (name ucx in its "
        "transport backend list and let it serve)");
  }
  KVFERRY_ASSIGN_OR_RETURN(const UcxSection section, DecodeUcxSection(peer.section));
  std::set<std::uint32_t> keyed;
  for (const UcxRegionKey& k : section.keys) keyed.insert(k.region);
  for (const RemoteRegion& r : peer.regions) {
    if (!UcxReadsKind(memory_types, r.kind) || keyed.count(r.id) != 0) continue;
    return Status::Unavailable(
        "the peer published no ucx key for its region " + std::to_string(r.id) + " (" +
        r.kind.ToString() +
        " memory): its UCX does not read that kind (a UCX built without CUDA, for cuda memory) "
        "or could not map the region (the peer's log says why); read it over another backend "
        "(a list such as ucx,tcp) or give the peer a UCX that reads it");
  }
  return Status::Ok();
}

Result<std::unique_ptr<BackendPeer>> UcxBackend::Connect(const PeerView& peer, Deadline deadline) {
  KVFERRY_RETURN_IF_ERROR(CanReach(peer));
  KVFERRY_ASSIGN_OR_RETURN(UcxSection section, DecodeUcxSection(peer.section));
  KVFERRY_ASSIGN_OR_RETURN(std::shared_ptr<UcxPeerState> state,
                           engine_->Connect(section, IndexRegions(peer.regions), deadline));
  return std::unique_ptr<BackendPeer>(std::make_unique<UcxPeer>(engine_.get(), std::move(state)));
}

void UcxBackend::RevokeRegion(RegionId region) { engine_->Unmap(region); }

}  // namespace kvferry
