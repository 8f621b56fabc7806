// The Transport every caller gets from CreateTransport: registration, validation, batches and
// stats in one place, with the shm and tcp backends behind it, chosen per peer.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "kvferry/transport.h"
#include "transport/backend.h"
#include "transport/descriptor.h"
#include "transport/region_registry.h"
#include "transport/tcp/tcp_server.h"

namespace kvferry {

/// Whether a transport created with `options` calls prctl(PR_SET_PTRACER_ANY): only when it
/// serves, may use shm, and shm_permit_any_tracer is set.
bool ServingPermitsAnyTracer(const TransportOptions& options);

class Engine final : public Transport {
 public:
  static Result<std::unique_ptr<Engine>> Create(const TransportOptions& options);
  ~Engine() override;

  /// Whether Create called prctl(PR_SET_PTRACER_ANY) for this transport.
  bool permitted_any_tracer() const { return permitted_any_tracer_; }

  Status RegisterMemory(RegionId id, void* addr, std::size_t length) override;
  Status DeregisterMemory(RegionId id) override;
  Result<std::vector<std::uint8_t>> Descriptor() override;
  Result<PeerId> Connect(std::span<const std::uint8_t> descriptor, Deadline deadline) override;
  void Disconnect(PeerId peer) override;
  Result<std::string> PeerBackend(PeerId peer) override;
  Result<BatchId> SubmitReads(PeerId peer, std::vector<ReadOp> ops, Deadline deadline) override;
  BatchResult Poll(BatchId batch) override;
  BatchResult Wait(BatchId batch, Deadline deadline) override;
  void Cancel(BatchId batch) override;
  void Release(BatchId batch) override;
  TransportStats Stats() override;

 private:
  explicit Engine(const TransportOptions& options) : options_(options) {}

  struct PeerRecord {
    const char* backend = "";
    std::shared_ptr<BackendPeer> peer;
    RemoteRegionTable regions;
  };
  struct BatchRecord {
    PeerId peer = 0;
    std::shared_ptr<Batch> batch;
  };
  std::shared_ptr<Batch> FindBatch(BatchId id);

  const TransportOptions options_;
  HostIdentity self_;
  ShmProof shm_proof_;
  bool permitted_any_tracer_ = false;
  RegionRegistry registry_;
  tcp::ServerCounters server_counters_;
  std::unique_ptr<tcp::TcpServer> server_;
  std::vector<std::unique_ptr<Backend>> backends_;  // in order of preference

  std::mutex mu_;
  std::map<PeerId, PeerRecord> peers_;      // guarded by mu_
  std::map<BatchId, BatchRecord> batches_;  // guarded by mu_
  PeerId next_peer_ = 1;                    // guarded by mu_
  BatchId next_batch_ = 1;                  // guarded by mu_

  std::atomic<std::uint64_t> submitted_{0};
  std::atomic<std::uint64_t> done_{0};
  std::atomic<std::uint64_t> failed_{0};
  std::atomic<std::uint64_t> cancelled_{0};
  std::atomic<std::uint64_t> bytes_read_{0};
  std::atomic<std::uint64_t> refused_{0};
};

}  // namespace kvferry
