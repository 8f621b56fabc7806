// The Transport every caller gets from CreateTransport: registration, validation, batches,
// deadlines and stats in one place, with the registered backends (backend.h) behind it, chosen
// per peer. It knows no backend by name.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "kvferry/transport.h"
#include "transport/backend.h"
#include "transport/descriptor.h"
#include "transport/region_registry.h"

namespace kvferry {

class TransportCore final : public Transport {
 public:
  /// Checks every option, then creates the backends `options.backend` names ("auto": all of
  /// them, in registry order).
  static Result<std::unique_ptr<TransportCore>> Create(const TransportOptions& options);
  ~TransportCore() override;

  /// The backend called `name` of this transport, or null; for tests and diagnostics.
  Backend* FindBackendInstance(std::string_view name) const;

  // mu_ is never held across a call into a backend, a network wait, or a batch's Cancel or
  // WaitEnd; EXCLUDES(mu_) marks the calls that take it or do those.
  using Transport::RegisterMemory;
  Status RegisterMemory(RegionId id, void* addr, std::size_t length, MemoryKind kind) override;
  Status DeregisterMemory(RegionId id) override EXCLUDES(mu_);
  Result<std::vector<std::uint8_t>> Descriptor() override;
  Result<PeerId> Connect(std::span<const std::uint8_t> descriptor, Deadline deadline) override
      EXCLUDES(mu_);
  void Disconnect(PeerId peer) override EXCLUDES(mu_);
  Result<std::string> PeerBackend(PeerId peer) override EXCLUDES(mu_);
  Result<BatchId> SubmitReads(PeerId peer, std::vector<ReadOp> ops, Deadline deadline) override
      EXCLUDES(mu_);
  BatchResult Poll(BatchId batch) override EXCLUDES(mu_);
  BatchResult Wait(BatchId batch, Deadline deadline) override EXCLUDES(mu_);
  void Cancel(BatchId batch) override EXCLUDES(mu_);
  void Release(BatchId batch) override EXCLUDES(mu_);
  TransportStats Stats() override;

 private:
  explicit TransportCore(const TransportOptions& options) : options_(options) {}

  struct PeerRecord {
    Backend* backend = nullptr;
    std::shared_ptr<BackendPeer> peer;
    std::shared_ptr<const RemoteRegionTable> regions;  // shared with running SubmitReads
  };
  struct BatchRecord {
    PeerId peer = 0;
    std::shared_ptr<Batch> batch;
  };
  std::shared_ptr<Batch> FindBatch(BatchId id) EXCLUDES(mu_);

  const TransportOptions options_;
  RegionRegistry registry_;
  std::vector<std::unique_ptr<Backend>> backends_;  // in order of preference; use registry_

  Mutex mu_;
  std::map<PeerId, PeerRecord> peers_ GUARDED_BY(mu_);
  std::map<BatchId, BatchRecord> batches_ GUARDED_BY(mu_);
  PeerId next_peer_ GUARDED_BY(mu_) = 1;
  BatchId next_batch_ GUARDED_BY(mu_) = 1;

  std::atomic<std::uint64_t> submitted_{0};
  std::atomic<std::uint64_t> done_{0};
  std::atomic<std::uint64_t> failed_{0};
  std::atomic<std::uint64_t> cancelled_{0};
  std::atomic<std::uint64_t> bytes_read_{0};
  std::atomic<std::uint64_t> refused_{0};
};

}  // namespace kvferry
