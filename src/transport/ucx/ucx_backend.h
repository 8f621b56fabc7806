// ucx: one-sided reads with UCX's UCP (ucp_get_nbx) from the serving process's registered memory
// into the destination blocks, over whatever transport UCX picks from UCX_TLS (tcp and shared
// memory on a host without RDMA; rc, dc, ud over verbs where there is hardware). Runs only when
// named in TransportOptions::backend: its endpoints do not authenticate, so the operator must
// choose its fabric knowingly (docs/transport.md, "ucx").
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "transport/backend.h"
#include "transport/ucx/ucx_engine.h"

namespace kvferry {

/// The ucx.* options over their defaults; InvalidArgument naming the key for an unknown key or
/// a bad value.
Result<UcxOptions> ParseUcxOptions(const TransportOptions& options, const TransportOptionMap& own);

/// Backend::CanReach of the ucx backend, given `memory_types`, the memory types of this process's
/// UCX (UcxReadsKind): OK when the peer's ucx section decodes and holds a key for every region of
/// the peer of a kind this UCX reads. A region without one is memory the peer's UCX does not read
/// (cuda memory of a server whose UCX has no CUDA, met by a reader whose UCX has) or could not
/// map; reading it over ucx would fail at read time, so this is Unavailable naming the region,
/// and a preference list ("ucx,tcp") carries the peer over its next backend. Unavailable without
/// a section; the decoder's error for a section that does not decode. Regions of kinds this UCX
/// does not read are CanRead's to refuse.
Status UcxCanReach(std::uint64_t memory_types, const PeerView& peer);

class UcxBackend final : public Backend {
 public:
  /// `serve`: whether this process publishes its regions (TransportOptions::serve). `regions`
  /// are the transport's; they outlive the backend.
  UcxBackend(std::unique_ptr<UcxEngine> engine, HostIdentity self, bool serve,
             RegionRegistry* regions);
  /// The registry's entry: name "ucx", not in auto.
  static BackendFactory Factory();

  const char* name() const override { return "ucx"; }
  /// When serving: the worker address, this process's identity and one packed rkey per region
  /// of a kind UCX reads (UcxReadsKind; each mapped with ucp_mem_map on first use). Empty when
  /// not serving.
  std::vector<std::uint8_t> DescriptorSection() override;
  /// UcxCanReach with the memory types of the UCX this process loaded (UCX itself finds out at
  /// Connect whether a transport reaches the peer).
  Status CanReach(const PeerView& peer) override {
    return UcxCanReach(engine_->memory_types(), peer);
  }
  /// Creates the endpoint and unpacks the keys; on the same host first proves, through a pidfd
  /// and the process start time, that the peer's pid still names the process that wrote the
  /// descriptor (PeerProcess::Prove, shm's rule: PeerDisconnected when it does not, Unavailable
  /// without a pidfd). Unavailable when UCX reaches the peer over none of its transports.
  Result<std::unique_ptr<BackendPeer>> Connect(const PeerView& peer, Deadline deadline) override;
  /// The memory types the loaded UCX supports (UcxReadsKind).
  std::uint64_t memory_types() const { return engine_->memory_types(); }
  /// UcxCanRead with the memory types of the UCX this process loaded.
  bool CanRead(const MemoryKind& remote, const MemoryKind& local) const override {
    return UcxCanRead(engine_->memory_types(), remote, local);
  }
  /// Unmaps the region (ucp_mem_unmap): its rkey stops working where UCX checks keys in
  /// hardware; see docs/transport.md on emulated gets.
  void RevokeRegion(RegionId region) override;
  // No AddStats: one-sided gets never run the serving process's code (or, where UCX emulates
  // them, run inside UCX), so bytes served cannot be counted.

 private:
  std::unique_ptr<UcxEngine> engine_;
  HostIdentity self_;
  bool serve_;
  RegionRegistry* regions_;
};

}  // namespace kvferry
