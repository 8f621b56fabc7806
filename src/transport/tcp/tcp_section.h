// The tcp backend's section of the descriptor: where the serving process's read server listens
// and which server instance a client must find there. Its own msgpack map, versioned here
// (docs/transport.md, "Descriptor").
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvferry/status.h"

namespace kvferry {

struct TcpEndpoint {
  std::string host;
  std::uint16_t port = 0;
  /// The serving process's random instance id (TcpServer::instance), proven in the handshake.
  std::uint64_t instance = 0;

  friend bool operator==(const TcpEndpoint&, const TcpEndpoint&) = default;
};

inline constexpr std::uint32_t kTcpSectionVersion = 1;

std::vector<std::uint8_t> EncodeTcpSection(const TcpEndpoint& endpoint);
/// Never trusts its input: malformed bytes, another version (NotSupported), an empty host or a
/// zero port are refused.
Result<TcpEndpoint> DecodeTcpSection(std::span<const std::uint8_t> bytes);

}  // namespace kvferry
