// What one transport tells its peers: who it is (to decide same-host), how a same-host reader
// proves that the process at its pid is still the one that wrote the descriptor, where its tcp
// read server listens, and the regions it registered. Encoded as a msgpack map
// (docs/transport.md).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvferry/status.h"
#include "kvferry/transport.h"

namespace kvferry {

/// Same boot id and PID namespace means a peer's PID names a process on this kernel. A decoded
/// descriptor always has pid > 0.
struct HostIdentity {
  std::string boot_id;
  std::uint64_t pid_namespace = 0;
  std::int64_t pid = 0;

  friend bool operator==(const HostIdentity&, const HostIdentity&) = default;
};

struct TcpEndpoint {
  std::string host;
  std::uint16_t port = 0;
  /// The serving process's random instance id (TcpServer::instance), proven in the handshake.
  std::uint64_t instance = 0;

  friend bool operator==(const TcpEndpoint&, const TcpEndpoint&) = default;
};

/// The shm section: what a same-host reader checks before its first read of the process at
/// `HostIdentity::pid`, so that a pid reused by another process (a restarted instance) is never
/// read as the old peer. Filled by ShmBackend::LocalProof.
struct ShmProof {
  /// The process's start time: field 22 of /proc/PID/stat (clock ticks since boot).
  std::uint64_t start_time = 0;
  /// Where, in the serving process's address space, its 8-byte instance nonce lives (non-zero).
  std::uint64_t nonce_addr = 0;
  /// The value of that nonce: random, chosen once per process.
  std::uint64_t nonce = 0;

  friend bool operator==(const ShmProof&, const ShmProof&) = default;
};

struct RemoteRegion {
  RegionId id = 0;
  std::uint64_t addr = 0;
  std::uint64_t length = 0;

  friend bool operator==(const RemoteRegion&, const RemoteRegion&) = default;
};

struct PeerDescriptor {
  HostIdentity host;
  std::optional<TcpEndpoint> tcp;
  std::vector<RemoteRegion> regions;
  std::optional<ShmProof> shm;

  const RemoteRegion* FindRegion(RegionId id) const;
  friend bool operator==(const PeerDescriptor&, const PeerDescriptor&) = default;
};

inline constexpr std::size_t kMaxDescriptorRegions = 65536;

std::vector<std::uint8_t> EncodeDescriptor(const PeerDescriptor& descriptor);
/// Never trusts its input: malformed bytes, a pid that is not positive, an shm section without a
/// nonce address, duplicate region ids and regions that wrap the address space are
/// InvalidArgument.
Result<PeerDescriptor> DecodeDescriptor(std::span<const std::uint8_t> bytes);

/// This process's identity: /proc/sys/kernel/random/boot_id, the inode of /proc/self/ns/pid, and
/// getpid().
Result<HostIdentity> LocalHostIdentity();

/// A peer's regions by id.
using RemoteRegionTable = std::unordered_map<RegionId, RemoteRegion>;
RemoteRegionTable IndexRegions(const PeerDescriptor& peer);

/// Checks that [offset, offset + length) lies inside the peer's region `id` and is not empty.
Status CheckRemoteRange(const RemoteRegionTable& regions, RegionId id, std::uint64_t offset,
                        std::uint64_t length);

}  // namespace kvferry
