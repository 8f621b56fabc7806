// A Transport that wraps a real one and injects faults into chosen batches, for tests of the
// layers above. It forwards everything else unchanged, so the bytes still move through the real
// backend.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "common/mutex.h"
#include "kvferry/transport.h"

namespace kvferry {

/// Opened by a test to let batches held by a kHold rule end. Thread-safe.
class FaultGate {
 public:
  void Open() { open_.store(true); }
  bool is_open() const { return open_.load(); }

 private:
  std::atomic<bool> open_{false};
};

struct FaultRule {
  enum class Action {
    kDelay,  ///< the batch runs, but reports its end only `delay` after submission
    kFail,   ///< nothing moves; the batch fails at once with `status`
    kCut,    ///< only the first half of the reads run; the batch then fails with `status`
    kHold,   ///< the batch runs but stays in progress, as a slow transfer does, until `gate`
             ///< opens; Cancel, a Disconnect of its peer or its deadline end it as they end a
             ///< running batch
  };
  Action action = Action::kFail;
  /// Which batches: called with the submission's sequence number (0, 1, ...) and peer.
  std::function<bool(std::uint64_t seq, PeerId peer)> match;
  std::chrono::milliseconds delay{0};
  Status status = Status::PeerDisconnected("injected fault");
  std::shared_ptr<FaultGate> gate;  // kHold only
};

/// Thread-safe. Rules are tried in the order added; the first that matches applies.
class FaultInjectingTransport final : public Transport {
 public:
  explicit FaultInjectingTransport(std::unique_ptr<Transport> inner) : inner_(std::move(inner)) {}

  void AddRule(FaultRule rule) EXCLUDES(mu_);
  /// How many batches a rule has been applied to.
  std::uint64_t faults_injected() const EXCLUDES(mu_);
  /// Waits until a rule has been applied to at least `n` batches; false at `deadline` if not.
  bool WaitFaultsInjected(std::uint64_t n, Deadline deadline) const EXCLUDES(mu_);

  using Transport::RegisterMemory;
  Status RegisterMemory(RegionId id, void* addr, std::size_t length, MemoryKind kind) override {
    return inner_->RegisterMemory(id, addr, length, std::move(kind));
  }
  Status DeregisterMemory(RegionId id) override { return inner_->DeregisterMemory(id); }
  Result<std::vector<std::uint8_t>> Descriptor() override { return inner_->Descriptor(); }
  Result<PeerId> Connect(std::span<const std::uint8_t> descriptor, Deadline deadline) override {
    return inner_->Connect(descriptor, deadline);
  }
  void Disconnect(PeerId peer) override EXCLUDES(mu_);
  /// How many times Disconnect was called; tests check that a fault did or did not take a peer
  /// down.
  std::uint64_t disconnects() const EXCLUDES(mu_);
  Result<std::string> PeerBackend(PeerId peer) override { return inner_->PeerBackend(peer); }
  Result<BatchId> SubmitReads(PeerId peer, std::vector<ReadOp> ops, Deadline deadline) override
      EXCLUDES(mu_);
  BatchResult Poll(BatchId batch) override EXCLUDES(mu_);
  BatchResult Wait(BatchId batch, Deadline deadline) override EXCLUDES(mu_);
  void Cancel(BatchId batch) override EXCLUDES(mu_);
  void Release(BatchId batch) override EXCLUDES(mu_);
  TransportStats Stats() override { return inner_->Stats(); }

 private:
  struct Entry {
    std::optional<BatchId> inner;  // absent for kFail
    const FaultRule* rule = nullptr;
    Clock::time_point ready_at{};
    Deadline deadline{};
    PeerId peer = 0;
    bool cancelled = false;  // kHold: ended by Cancel or Disconnect
  };
  BatchResult Shape(const Entry& e, BatchResult inner_result) const;
  std::optional<Entry> Find(BatchId batch) const EXCLUDES(mu_);
  static BatchResult Unknown(BatchId batch);

  std::unique_ptr<Transport> inner_;
  mutable Mutex mu_;
  std::vector<std::unique_ptr<FaultRule>> rules_ GUARDED_BY(mu_);
  std::map<BatchId, Entry> batches_ GUARDED_BY(mu_);
  BatchId next_ GUARDED_BY(mu_) = 1;
  std::uint64_t seq_ GUARDED_BY(mu_) = 0;
  std::uint64_t injected_ GUARDED_BY(mu_) = 0;
  mutable CondVar injected_cv_;  // signalled when injected_ grows
  std::uint64_t disconnects_ GUARDED_BY(mu_) = 0;
};

}  // namespace kvferry
