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
#include "transport/peer_process.h"
#include "transport/section_fields.h"

namespace kvferry {

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

/// A registered device region exported for same-host readers: its bytes are an encoded
/// device::IpcHandle (at most kMaxShmIpcHandleBytes).
using ShmIpcRegion = RegionBlob;
inline constexpr std::size_t kMaxShmIpcHandleBytes = 4096 + 64;

/// A registered host region that lies inside memory kvferry allocated (HostMemory): the serving
/// process's read-only descriptor of its memfd and the offset of the region's first byte in it.
struct ShmServedRegion {
  std::uint32_t region = 0;
  std::int32_t fd = 0;
  std::uint64_t offset = 0;

  friend bool operator==(const ShmServedRegion&, const ShmServedRegion&) = default;
};

struct ShmSection {
  HostIdentity host;
  ShmProof proof;
  /// Optional ("ipc"; absent when empty): the device regions a same-host reader may open.
  std::vector<ShmIpcRegion> ipc;
  /// Optional ("memfd"; absent when empty; readers before it ignore it and use process_vm_readv):
  /// the host regions a same-host reader may map read-only (served_memory.h).
  std::vector<ShmServedRegion> served;

  friend bool operator==(const ShmSection&, const ShmSection&) = default;
};

inline constexpr std::uint32_t kShmSectionVersion = 1;

std::vector<std::uint8_t> EncodeShmSection(const ShmSection& section);
/// Never trusts its input: malformed bytes, another version (NotSupported), a pid that is not
/// positive, a zero nonce address and an "ipc" list that ReadRegionList refuses (an entry that is
/// not [region id, handle bytes (1 to 4160)], a region listed twice) are refused, as is a "memfd"
/// list whose entry is not [region id, descriptor (0 to 2^31-1), offset] or names a region twice.
Result<ShmSection> DecodeShmSection(std::span<const std::uint8_t> bytes);

}  // namespace kvferry
