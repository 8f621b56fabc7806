// What the engine needs from a backend (shm, tcp): connect to a peer, then carry out batches of
// already-validated reads. The engine owns registration, validation, batches and stats, so each
// backend holds only what is specific to how its bytes move.
#pragma once

#include <memory>
#include <vector>

#include "kvferry/transport.h"
#include "transport/batch.h"
#include "transport/descriptor.h"

namespace kvferry {

/// One connected peer of one backend. Thread-safe.
class BackendPeer {
 public:
  virtual ~BackendPeer() = default;
  /// Starts `ops` of `batch`: calls batch->AddUnit() for every unit before starting it and
  /// batch->UnitDone() when the unit ends. Every op has been checked against both sides'
  /// regions. Returns without waiting for the reads.
  virtual void Start(const std::shared_ptr<Batch>& batch, std::vector<ReadOp> ops) = 0;
  /// Stops this peer's work; returns once none of it runs. Units still queued end as failed.
  virtual void Shutdown() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  /// Connects to `peer`, or says why this backend cannot reach it (Unavailable), or that the
  /// peer refused us (Unauthenticated).
  virtual Result<std::unique_ptr<BackendPeer>> Connect(const PeerDescriptor& peer,
                                                       Deadline deadline) = 0;
};

}  // namespace kvferry
