// The ucx backend's section of the descriptor: the serving process's packed UCP worker address,
// one packed remote key per registered host region, and who the process is (so that a same-host
// reader can watch it through a pidfd). Its own msgpack map, versioned here (docs/transport.md,
// "The descriptor").
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvferry/status.h"
#include "transport/peer_process.h"
#include "transport/section_fields.h"

namespace kvferry {

/// One region's packed remote key (ucp_rkey_pack), its bytes. It is a capability: whoever holds
/// it and the worker address can read the region (docs/transport.md, "ucx", Security).
using UcxRegionKey = RegionBlob;

struct UcxSection {
  /// ucp_worker_get_address of the serving worker.
  std::vector<std::uint8_t> worker_address;
  /// The serving process: boot id, PID namespace, pid (> 0).
  HostIdentity host;
  /// Its start time, field 22 of /proc/PID/stat, so that a pidfd opened on `host.pid` is proven to
  /// name the process that wrote the section.
  std::uint64_t start_time = 0;
  std::vector<UcxRegionKey> keys;

  friend bool operator==(const UcxSection&, const UcxSection&) = default;
};

inline constexpr std::uint32_t kUcxSectionVersion = 1;
inline constexpr std::size_t kMaxUcxWorkerAddressBytes = 16u << 10;
inline constexpr std::size_t kMaxUcxRkeyBytes = 1024;

std::vector<std::uint8_t> EncodeUcxSection(const UcxSection& section);
/// Never trusts its input: malformed bytes, another version (NotSupported), an empty or oversized
/// worker address, a pid that is not positive, and an "rkeys" list that ReadRegionList refuses (an
/// entry that is not [region id, rkey bytes (1..1024)], a region listed twice) are refused
/// (InvalidArgument).
Result<UcxSection> DecodeUcxSection(std::span<const std::uint8_t> bytes);

}  // namespace kvferry
