// The ucx backend's section of the descriptor: the serving process's packed UCP worker address,
// one packed remote key per registered host region, and who the process is (so that a same-host
// reader can watch it through a pidfd). Its own msgpack map, versioned here (docs/transport.md,
// "The descriptor").
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"
#include "transport/peer_process.h"
#include "transport/section_fields.h"

namespace kvferry {

/// One region's packed remote key (ucp_rkey_pack), its bytes. It is a capability: whoever holds
/// it and the worker address can read the region (docs/transport.md, "ucx", Security).
using UcxRegionKey = RegionBlob;

/// The TCP segment sizes of a process's UCX context (UCX_TCP_TX_SEG_SIZE, UCX_TCP_RX_SEG_SIZE), in
/// bytes; 0 where unknown. Over UCX's tcp transport a reply to a get is sent in segments of the
/// server's tx size, and a receiver whose rx size is smaller aborts the process (UCX asserts), so
/// the reader checks them before it connects (CheckUcxTcpSegments).
struct UcxTcpSegments {
  std::uint64_t tx = 0;
  std::uint64_t rx = 0;

  friend bool operator==(const UcxTcpSegments&, const UcxTcpSegments&) = default;
};

/// The segment size kvferry gives both where the environment sets neither: a 64 KiB block then
/// goes in one segment instead of eight of UCX's default 8 KiB (docs/performance.md: about 2.5x
/// the rate of ucx over tcp, 2026-12-02).
inline constexpr std::uint64_t kUcxDefaultTcpSegBytes = 256u << 10;

/// A UCX memory-units value ("8K", "64kb", "1M", "262144"): bytes, or 0 for what it does not
/// understand ("auto", "inf", garbage) and for more than kMaxUcxTcpSegBytes, which
/// CheckUcxTcpSegments takes as unknown (and a section can always carry).
std::uint64_t ParseUcxMemunits(std::string_view text);

/// Ok when this process receives the segments the peer sends (or a size is unknown); otherwise
/// Unavailable naming both sizes and the variables to set alike on both sides. Only that way:
/// a reader sends the server nothing but get requests of a few dozen bytes.
Status CheckUcxTcpSegments(const UcxTcpSegments& self, const UcxTcpSegments& peer);

struct UcxSection {
  /// ucp_worker_get_address of the serving worker.
  std::vector<std::uint8_t> worker_address;
  /// The serving process: boot id, PID namespace, pid (> 0).
  HostIdentity host;
  /// Its start time, field 22 of /proc/PID/stat, so that a pidfd opened on `host.pid` is proven to
  /// name the process that wrote the section.
  std::uint64_t start_time = 0;
  std::vector<UcxRegionKey> keys;
  /// The serving process's TCP segment sizes (version 2; a version 1 section has them unknown).
  UcxTcpSegments tcp_segments;

  friend bool operator==(const UcxSection&, const UcxSection&) = default;
};

/// The TCP segment sizes are in every section this build writes (a version 1 reader ignores them).
/// Version 2 marks a server that sends segments larger than UCX's default 64 KiB rx segment: a
/// version 1 reader would connect and abort on its first reply, so it must refuse the section (it
/// refuses the whole descriptor), and the version is 2 only then (UcxSectionVersionFor). This
/// build reads both.
inline constexpr std::uint32_t kUcxSectionVersion = 2;
/// UCX's default UCX_TCP_RX_SEG_SIZE: what a reader that knows nothing of segments receives.
inline constexpr std::uint64_t kUcxDefaultTcpRxSegBytes = 64u << 10;

/// The version `EncodeUcxSection` writes for `segments`: 1 where a version 1 reader may read the
/// server safely (tx unknown or at most kUcxDefaultTcpRxSegBytes), else kUcxSectionVersion.
std::uint32_t UcxSectionVersionFor(const UcxTcpSegments& segments);
inline constexpr std::size_t kMaxUcxWorkerAddressBytes = 16u << 10;
inline constexpr std::size_t kMaxUcxRkeyBytes = 1024;
inline constexpr std::uint64_t kMaxUcxTcpSegBytes = std::uint64_t{1} << 30;

std::vector<std::uint8_t> EncodeUcxSection(const UcxSection& section);
/// Never trusts its input: malformed bytes, another version (NotSupported), an empty or oversized
/// worker address, a pid that is not positive, and an "rkeys" list that ReadRegionList refuses (an
/// entry that is not [region id, rkey bytes (1..1024)], a region listed twice) are refused
/// (InvalidArgument).
Result<UcxSection> DecodeUcxSection(std::span<const std::uint8_t> bytes);

}  // namespace kvferry
