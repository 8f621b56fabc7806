// What one transport tells its peers (docs/transport.md, "Descriptor"): the regions it registered,
// with their memory kinds, and one opaque section per backend that has something to publish
// (where its server listens, how a same-host reader proves the process). The core reads only the
// regions; each backend encodes and versions its own section. Encoded as a msgpack map, version 2.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvferry/status.h"
#include "kvferry/transport.h"

namespace kvferry {

struct RemoteRegion {
  RegionId id = 0;
  std::uint64_t addr = 0;
  std::uint64_t length = 0;
  MemoryKind kind;

  friend bool operator==(const RemoteRegion&, const RemoteRegion&) = default;
};

struct PeerDescriptor {
  std::vector<RemoteRegion> regions;
  /// Backend name -> that backend's section, opaque here.
  std::map<std::string, std::vector<std::uint8_t>> sections;

  const RemoteRegion* FindRegion(RegionId id) const;
  /// The section of backend `name`; empty when the peer published none.
  std::span<const std::uint8_t> Section(const std::string& name) const;
  friend bool operator==(const PeerDescriptor&, const PeerDescriptor&) = default;
};

inline constexpr std::uint32_t kDescriptorVersion = 2;
inline constexpr std::size_t kMaxDescriptorRegions = 65536;
inline constexpr std::size_t kMaxDescriptorSections = 16;
inline constexpr std::size_t kMaxSectionBytes = 64u << 10;

std::vector<std::uint8_t> EncodeDescriptor(const PeerDescriptor& descriptor);
/// Never trusts its input: malformed bytes, another version, duplicate region ids, regions that
/// wrap the address space, a memory kind that does not parse, a section that is not binary or
/// too large are InvalidArgument (another version: NotSupported).
Result<PeerDescriptor> DecodeDescriptor(std::span<const std::uint8_t> bytes);

/// Checks a memory kind's type: 1 to 16 lower-case letters and digits.
bool IsValidMemoryKindType(std::string_view type);

/// A peer's regions by id.
using RemoteRegionTable = std::unordered_map<RegionId, RemoteRegion>;
RemoteRegionTable IndexRegions(const std::vector<RemoteRegion>& regions);

/// Checks that [offset, offset + length) lies inside the peer's region `id` and is not empty.
Status CheckRemoteRange(const RemoteRegionTable& regions, RegionId id, std::uint64_t offset,
                        std::uint64_t length);

}  // namespace kvferry
