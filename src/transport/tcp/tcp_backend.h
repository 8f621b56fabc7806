// The tcp backend: on the decode side several authenticated connections per peer, requests
// striped across them, responses received straight into the destination blocks; on the prefill
// side (serving) its own read server (tcp_server.h).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "device/device.h"
#include "transport/backend.h"
#include "transport/tcp/tcp_options.h"
#include "transport/tcp/tcp_section.h"
#include "transport/tcp/tcp_server.h"

namespace kvferry::tcp {

class TcpBackend final : public Backend {
 public:
  /// With options.serve, binds and starts the read server over `regions` (a busy port is
  /// Unavailable naming it).
  static Result<std::unique_ptr<TcpBackend>> Create(TcpOptions options, bool serve,
                                                    RegionRegistry* regions);
  /// The registry's entry: name "tcp".
  static BackendFactory Factory();
  ~TcpBackend() override;

  const char* name() const override { return "tcp"; }
  /// The server's endpoint; empty when not serving.
  std::vector<std::uint8_t> DescriptorSection() override;
  /// OK for a peer with a tcp section (it serves); Unavailable without one.
  Status CanReach(const PeerView& peer) override;
  Result<std::unique_ptr<BackendPeer>> Connect(const PeerView& peer, Deadline deadline) override;
  /// Host memory into host memory only.
  bool CanRead(const MemoryKind& remote, const MemoryKind& local) const override {
    // Device memory is staged through pinned host memory on both ends (docs/device.md).
    return (remote.is_host() || device::KnownDeviceType(remote.type)) &&
           (local.is_host() || device::KnownDeviceType(local.type));
  }
  void RevokeRegion(RegionId region) override;
  void AddStats(TransportStats* stats) const override;

 private:
  explicit TcpBackend(TcpOptions options) : options_(std::move(options)) {}

  TcpOptions options_;
  ServerCounters counters_;
  std::unique_ptr<TcpServer> server_;  // null when not serving; uses counters_
};

}  // namespace kvferry::tcp
