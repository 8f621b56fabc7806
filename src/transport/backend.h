// What the transport core needs from a backend, and how a backend is registered. The core
// (transport_core.h) owns registration of memory, validation, batches, deadlines and stats; a
// backend owns its options, its section of the descriptor, its servers and threads, whether it
// can reach a peer, and which memory kinds it can read into which. Writing one: docs/transport.md,
// "Writing a backend".
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvferry/transport.h"
#include "transport/backend_options.h"
#include "transport/batch.h"
#include "transport/descriptor.h"
#include "transport/region_registry.h"

namespace kvferry {

/// One connected peer of one backend. Thread-safe.
class BackendPeer {
 public:
  virtual ~BackendPeer() = default;
  /// Starts `ops` of `batch`: calls batch->AddUnit() for every unit before starting it and
  /// batch->UnitDone() when the unit ends. Every op has been checked against both sides'
  /// regions, and their memory kinds against CanRead. Returns without waiting for the reads.
  virtual void Start(const std::shared_ptr<Batch>& batch, std::vector<ReadOp> ops) = 0;
  /// Stops this peer's work; returns once none of it runs. Units still queued end as failed.
  virtual void Shutdown() = 0;
};

/// What a peer published, as one backend sees it: the core's region list and this backend's own
/// section of the descriptor (empty when the peer published none).
struct PeerView {
  const std::vector<RemoteRegion>& regions;
  std::span<const std::uint8_t> section;
};

/// One backend instance of one transport. Thread-safe. Destroying it stops its servers and
/// threads; the core destroys it only after every BackendPeer of it is shut down.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  /// This process's section of the descriptor: opaque bytes to the core and to every other
  /// backend, versioned by this backend. Empty: nothing to publish (peers cannot reach this
  /// process with this backend, as a tcp backend that does not serve).
  virtual std::vector<std::uint8_t> DescriptorSection() = 0;

  /// The "can I reach this peer" answer for `auto`: OK when this backend may try Connect,
  /// Unavailable saying why not (another host, no section, a section version it cannot read).
  /// Cheap and without I/O. A peer this says OK to but Connect then refuses is logged by the
  /// core when a later backend carries it.
  virtual Status CanReach(const PeerView& peer) = 0;

  /// Connects to `peer` (CanReach said OK), or says why not: Unavailable (unreachable,
  /// refused read), PeerDisconnected (the process is gone or replaced), Unauthenticated (the peer
  /// refused us; final, no other backend is tried).
  virtual Result<std::unique_ptr<BackendPeer>> Connect(const PeerView& peer, Deadline deadline) = 0;

  /// Whether this backend can read memory of kind `remote` (a peer's region) into memory of kind
  /// `local` (this process's region).
  virtual bool CanRead(const MemoryKind& remote, const MemoryKind& local) const = 0;

  /// A local region was registered (the core calls it right after adding it, on the registering
  /// thread): a backend may prepare the memory for its readers. The memory is the caller's; a
  /// DeregisterMemory of the same id racing its registration is the caller's race.
  virtual void RegionAdded(const RegionInfo& /*region*/) {}

  /// A local region is being deregistered: end soon whatever this backend's servers are doing
  /// with it (their pins then go, and DeregisterMemory returns).
  virtual void RevokeRegion(RegionId /*region*/) {}

  /// Adds this backend's serving counters (bytes_served, requests_refused) and the staging memory
  /// it holds now (staging_bytes) to `stats`.
  virtual void AddStats(TransportStats* /*stats*/) const {}
};

/// What the core hands a backend's factory.
struct BackendContext {
  /// The whole options: the core's fields (secret, serve) and every backend's keys.
  const TransportOptions& options;
  /// This backend's keys of options.backend_options, without the "<name>." prefix.
  const TransportOptionMap& own_options;
  /// This transport's local regions; outlives the backend. Servers pin what they serve from it.
  RegionRegistry* regions;
};

/// A backend as the registry knows it.
struct BackendFactory {
  /// Lower-case letters and digits; the prefix of its option keys and its descriptor section's
  /// key. Never "auto".
  std::string name;
  /// Checks ctx.options and ctx.own_options without creating anything: InvalidArgument naming
  /// the key ("tcp.connections") for an unknown option or a bad value.
  Status (*check)(const TransportOptions& options, const TransportOptionMap& own_options) = nullptr;
  /// Creates the backend, starting its servers and threads.
  Result<std::unique_ptr<Backend>> (*create)(const BackendContext& ctx) = nullptr;
  /// Whether `auto` includes it. A backend the operator should choose knowingly (ucx: its
  /// fabric, its security model) says false and runs only when named in `backend`.
  bool in_auto = true;
};

/// Every backend of this build, in the order `auto` tries them (backend_registry.cc lists them:
/// one line per backend).
const std::vector<BackendFactory>& RegisteredBackends();
/// The backend called `name`, or null.
const BackendFactory* FindBackend(std::string_view name);

}  // namespace kvferry
