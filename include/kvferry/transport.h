// kvferry: the data plane. One-sided reads of a peer's registered memory into local memory.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"

namespace kvferry {

using Clock = std::chrono::steady_clock;
/// A point in time by which an operation must have ended. Every wait in kvferry has one.
using Deadline = Clock::time_point;

/// Names a registered memory region. The caller chooses it (the connector uses
/// layer * parts + part, or layer * parts for a layer whose parts interleave; docs/transport.md,
/// "Region ids"), so both sides agree on names without exchanging tables.
using RegionId = std::uint32_t;
/// A connected peer, valid until Disconnect.
using PeerId = std::uint64_t;
/// A submitted batch, valid until Release.
using BatchId = std::uint64_t;

/// One read: `length` bytes at `remote_offset` of the peer's region `remote_region` into `local`.
/// `local` must lie inside a region this transport registered. A strided read (`count` > 1) is
/// `count` such pieces, piece i at remote_offset + i * remote_stride into local + i *
/// local_stride (each stride at least `length`): the token-major head slices of heterogeneous TP,
/// where only the bytes needed cross the wire (tcp's server gathers them, shm reads them as
/// iovecs, ucx gets each).
struct ReadOp {
  std::byte* local = nullptr;
  RegionId remote_region = 0;
  std::uint64_t remote_offset = 0;
  std::uint64_t length = 0;
  std::uint64_t count = 1;
  std::uint64_t remote_stride = 0;
  std::uint64_t local_stride = 0;
};

enum class BatchState : std::uint8_t {
  kInProgress = 0,  ///< reads may still be writing into the batch's local memory
  kDone = 1,        ///< every byte arrived; the local memory holds the peer's bytes
  kFailed = 2,      ///< ended with an error; no read of it runs any more
  kCancelled = 3,   ///< Cancel ended it; no read of it runs any more
};
const char* BatchStateName(BatchState state);

/// What Poll and Wait report. `status` is OK while in progress and when done.
struct BatchResult {
  BatchState state = BatchState::kInProgress;
  Status status;
};

/// What kind of memory a registered region is. Host memory today; the same value later names a
/// device's memory ("cuda", device 0 is written "cuda:0"). Backends say which kinds they can read
/// into which (Transport::SubmitReads refuses the rest), and descriptors carry each region's kind.
struct MemoryKind {
  /// Lower-case letters and digits, 1 to 16 of them. "host" is ordinary process memory.
  std::string type = "host";
  /// Which device of `type`; 0 for host memory.
  std::uint32_t device = 0;

  static MemoryKind Host() { return {}; }
  bool is_host() const { return type == "host"; }
  /// "host", or "<type>:<device>" for every other type.
  std::string ToString() const;
  friend bool operator==(const MemoryKind&, const MemoryKind&) = default;
};
/// Parses ToString's form ("host", "cuda:1"); InvalidArgument naming what was found otherwise.
Result<MemoryKind> ParseMemoryKind(std::string_view text);

/// Options owned by backends, by key "<backend>.<option>" (`tcp.connections` = "4"); the keys
/// each backend accepts are listed in docs/transport.md.
using TransportOptionMap = std::map<std::string, std::string>;

/// Every backend this build has ("shm", "tcp", ...), `auto`'s first, in the order it tries them.
std::vector<std::string> TransportBackendNames();
/// The backends `backend` (TransportOptions::backend) selects, in the order Connect tries them:
/// "auto" (the backends of this build that auto includes: shm, tcp), one name ("tcp"), or a
/// comma-separated preference order ("shm,ucx,tcp"). InvalidArgument for an unknown or repeated
/// name, listing the known ones.
Result<std::vector<std::string>> SelectedTransportBackends(std::string_view backend);
/// OK when SelectedTransportBackends(backend) is.
Status CheckTransportBackend(std::string_view backend);
/// Adds one "KEY=VALUE" (the CLI's --transport-opt) to `options`; InvalidArgument when it has no
/// '=' or an empty key. The key itself is checked by CreateTransport (or
/// CheckTransportOptions).
Status AddTransportOption(std::string_view key_value, TransportOptionMap* options);

/// What CreateTransport builds: the core's fields and, by key, every backend's options. A backend
/// owns its options (their parser, defaults and docs are in its folder, src/transport/<name>/),
/// so they are set only through `backend_options`.
struct TransportOptions {
  /// "auto" (shm and tcp, tried per peer in that order: shm when the peer is on this host, proves
  /// its instance, the kernel permits the read and shm can read every memory kind of the peer's
  /// regions into every kind registered here when Connect is called, else tcp), one backend's
  /// name, or a comma-separated preference order tried the same way ("shm,ucx,tcp"). A peer can
  /// be read over a backend only if that backend runs in both processes: give both the same list.
  std::string backend = "auto";
  /// "<backend>.<option>" = value ("tcp.connections" = "4", "shm.permit_any_tracer" = "true"); the
  /// keys, their defaults and meanings are docs/transport.md's "Options". An unknown backend or
  /// option, or a value that does not parse, is InvalidArgument naming the key.
  TransportOptionMap backend_options;
  /// Shared secret for tcp connections (challenge-response HMAC-SHA-256 both ways). Empty: the
  /// server accepts loopback clients only.
  std::string secret;
  /// Whether this process serves its registered memory to peers (the prefill side): tcp runs its
  /// read server, ucx publishes its keys, shm may permit tracers (shm.permit_any_tracer). A
  /// decode-only process may skip it.
  bool serve = true;
};

/// Counters for one transport. Monotonic; safe to read at any time.
struct TransportStats {
  std::uint64_t batches_submitted = 0;
  std::uint64_t batches_done = 0;
  std::uint64_t batches_failed = 0;
  std::uint64_t batches_cancelled = 0;
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_served = 0;
  std::uint64_t requests_refused = 0;  ///< reads outside registered memory, bad auth, bad frames
  /// Now: pinned host memory the backends hold to stage device memory (tcp's buffers at both ends,
  /// shm's lanes for host memory into a device); 0 with host memory only.
  std::uint64_t staging_bytes = 0;
  /// Now: bytes of the regions registered here, by memory kind ("host", "sim:0", "cuda:1").
  std::map<std::string, std::uint64_t> registered_bytes;
};

/// The data-plane interface every backend implements. All methods are thread-safe.
///
/// Lifetime: a transport must outlive every batch it returned; destroying it cancels them.
/// Completion: a batch ends exactly once, in kDone, kFailed or kCancelled, never later than its
/// deadline plus the short interval a backend needs to stop its in-flight I/O (well under a
/// second). After a batch has ended, nothing writes into its local memory.
class Transport {
 public:
  virtual ~Transport() = default;

  /// Registers [addr, addr + length) under `id`, so peers may read it and local reads may land
  /// in it. The memory must stay valid until DeregisterMemory returns, and longer while shm peers
  /// may still read it (see DeregisterMemory). InvalidArgument for a
  /// duplicate id, a null or empty range, or a range overlapping another region.
  /// `kind` says what memory the range is; a kind no backend of this transport can use is
  /// InvalidArgument naming it (host memory is always accepted).
  virtual Status RegisterMemory(RegionId id, void* addr, std::size_t length, MemoryKind kind) = 0;
  /// Registers host memory: RegisterMemory(id, addr, length, MemoryKind::Host()).
  Status RegisterMemory(RegionId id, void* addr, std::size_t length) {
    return RegisterMemory(id, addr, length, MemoryKind::Host());
  }
  /// Removes a region: new local reads landing in it, and new reads of it that the tcp server
  /// would serve, are refused from now on. Returns once every such read already running has
  /// ended. NotFound for an unknown id.
  ///
  /// Reads by shm peers are not seen: a same-host reader copies this process's memory with
  /// process_vm_readv, which the owner cannot observe or stop, using the addresses of the
  /// descriptor it was given, whether or not the region is still registered. So the caller must
  /// not free or reuse memory that a peer may still read until the agreement under which it was
  /// offered has ended (in the connector: until the hold on those blocks ends, because every
  /// reader reported or the hold's lease expired); deregistering does not end it. A shm read of
  /// memory freed and unmapped meanwhile fails in the reader; of memory reused, it returns the
  /// new bytes.
  virtual Status DeregisterMemory(RegionId id) = 0;

  /// Bytes a peer passes to Connect to read this process's registered regions. Call it after
  /// registering; it lists the regions registered at the time of the call.
  virtual Result<std::vector<std::uint8_t>> Descriptor() = 0;

  /// Connects to a peer described by `descriptor`, checking the descriptor first. Unavailable when
  /// the peer cannot be reached (or, for a forced shm transport, is not on this host, or the
  /// process at its pid is not the one that wrote the descriptor), Unauthenticated when the
  /// secrets differ, InvalidArgument for a malformed descriptor (a pid that is not positive too).
  virtual Result<PeerId> Connect(std::span<const std::uint8_t> descriptor, Deadline deadline) = 0;
  /// Forgets a peer. Its running batches are cancelled first. Unknown peers are ignored.
  virtual void Disconnect(PeerId peer) = 0;
  /// Which backend carries reads to `peer` (a name of TransportBackendNames()).
  virtual Result<std::string> PeerBackend(PeerId peer) = 0;

  /// Starts reading `ops` from `peer`. Every op is checked before any byte moves: its local range
  /// must lie inside one local registered region and its remote range inside the named remote
  /// region (InvalidArgument otherwise), and the peer's backend must be able to read the remote
  /// region's memory kind into the local region's kind (NotSupported, naming both, otherwise).
  /// The batch ends by `deadline` (Timeout).
  virtual Result<BatchId> SubmitReads(PeerId peer, std::vector<ReadOp> ops, Deadline deadline) = 0;
  /// Non-blocking state of a batch. NotFound for an unknown or released batch.
  virtual BatchResult Poll(BatchId batch) = 0;
  /// Waits until the batch ends or `deadline` passes; on the latter returns kInProgress (the
  /// batch itself still ends by its own deadline).
  virtual BatchResult Wait(BatchId batch, Deadline deadline) = 0;
  /// Ends a running batch as kCancelled. Returns once no read of it runs any more. A batch that
  /// had already ended keeps its state.
  virtual void Cancel(BatchId batch) = 0;
  /// Forgets an ended batch (cancelling it first if it still runs).
  virtual void Release(BatchId batch) = 0;

  virtual TransportStats Stats() = 0;
};

/// Creates the transport `options` describe ("auto": every backend, chosen per peer). Each
/// backend starts its own servers: with options.serve, tcp's read server (a busy port is
/// Unavailable naming it).
Result<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& options);

/// Checks `options` (backend name, every backend option) without creating anything.
Status CheckTransportOptions(const TransportOptions& options);

}  // namespace kvferry
