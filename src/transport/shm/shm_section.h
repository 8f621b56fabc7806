// The shm backend's section of the descriptor: who the serving process is (to decide same-host)
// and how a same-host reader proves that the process at its pid is still the one that wrote the
// descriptor. Its own msgpack map, versioned here (docs/transport.md, "Descriptor").
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvferry/status.h"
#include "wire/msgpack_reader.h"

namespace kvferry {

/// Same boot id and PID namespace means a peer's PID names a process on this kernel. A decoded
/// section always has pid > 0.
struct HostIdentity {
  std::string boot_id;
  std::uint64_t pid_namespace = 0;
  std::int64_t pid = 0;

  friend bool operator==(const HostIdentity&, const HostIdentity&) = default;
};

/// What a same-host reader checks before its first read of the process at `HostIdentity::pid`,
/// so that a pid reused by another process (a restarted instance) is never read as the old peer.
/// Filled by ShmBackend::LocalProof.
struct ShmProof {
  /// The process's start time: field 22 of /proc/PID/stat (clock ticks since boot).
  std::uint64_t start_time = 0;
  /// Where, in the serving process's address space, its 8-byte instance nonce lives (non-zero).
  std::uint64_t nonce_addr = 0;
  /// The value of that nonce: random, chosen once per process.
  std::uint64_t nonce = 0;

  friend bool operator==(const ShmProof&, const ShmProof&) = default;
};

/// A registered device region exported for same-host readers: an encoded device::IpcHandle.
struct ShmIpcRegion {
  std::uint32_t region = 0;
  std::vector<std::uint8_t> handle;

  friend bool operator==(const ShmIpcRegion&, const ShmIpcRegion&) = default;
};

struct ShmSection {
  HostIdentity host;
  ShmProof proof;
  /// Optional ("ipc"; absent when empty): the device regions a same-host reader may open.
  std::vector<ShmIpcRegion> ipc;

  friend bool operator==(const ShmSection&, const ShmSection&) = default;
};

inline constexpr std::uint32_t kShmSectionVersion = 1;

std::vector<std::uint8_t> EncodeShmSection(const ShmSection& section);
/// Never trusts its input: malformed bytes, another version (NotSupported), a pid that is not
/// positive, a zero nonce address and an "ipc" entry that is not [region id, handle bytes of at
/// most 4 KiB] are refused.
Result<ShmSection> DecodeShmSection(std::span<const std::uint8_t> bytes);

/// The fields of a section that names the process serving it, four map entries: "boot_id",
/// "pidns", "pid" (of `host`) and "start" (the process's start time). The shm and ucx sections
/// both carry them, so that a same-host reader can tell the very process that wrote them.
void PackProcessFields(msgpack::packer<msgpack::sbuffer>& pk, const HostIdentity& host,
                       std::uint64_t start_time);
/// Reads those fields of `m`; a pid that is not positive is InvalidArgument naming the field.
Status ReadProcessFields(const wire::MapView& m, HostIdentity* host, std::uint64_t* start_time);

/// Field 22 of /proc/PID/stat: the process's start time in clock ticks since boot.
/// PeerDisconnected when the process does not exist (any more). Shared with the ucx backend's
/// liveness check.
Result<std::uint64_t> ProcessStartTime(pid_t pid);

/// This process's identity: /proc/sys/kernel/random/boot_id, the inode of /proc/self/ns/pid, and
/// getpid().
Result<HostIdentity> LocalHostIdentity();

}  // namespace kvferry
