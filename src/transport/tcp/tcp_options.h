// The tcp backend's options: the tcp.* keys of TransportOptions::backend_options, their defaults
// (the members' initialisers below) and their parser. docs/transport.md, "Options", lists them.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "kvferry/status.h"
#include "kvferry/transport.h"
#include "transport/tcp/tcp_server.h"

namespace kvferry::tcp {

/// The reading side's options.
struct ClientOptions {
  /// TransportOptions::secret (the core's).
  std::string secret;
  /// tcp.connections: connections per peer (1..1024); requests are striped across them.
  int connections_per_peer = 4;
  /// tcp.max_request_bytes: the largest read request sent as one unit; larger reads are split.
  std::uint64_t max_request_bytes = 8u << 20;
  /// tcp.user_timeout_ms: how long a peer may go without progress on a read before the
  /// connection counts as dead (TCP_USER_TIMEOUT and keepalive), besides each batch's deadline.
  std::chrono::milliseconds user_timeout{5000};
};

/// Every option of the tcp backend. The serving side's limits (tcp.handshake_timeout_ms,
/// tcp.idle_timeout_ms, tcp.send_stall_timeout_ms, tcp.max_connections,
/// tcp.max_connections_per_source) are ServerLimits' (tcp_server.h).
struct TcpOptions {
  ClientOptions client;
  /// tcp.bind_host: where the read server listens.
  std::string bind_host = "127.0.0.1";
  /// tcp.port: its port; 0 picks a free one.
  std::uint16_t port = 0;
  /// tcp.advertise_host: what peers are told; the bind address when empty. Required for 0.0.0.0
  /// and ::.
  std::string advertise_host;
  ServerLimits limits;
};

/// The defaults above overridden by `own` (the tcp.* keys without their prefix), with the core's
/// secret from `options`. InvalidArgument naming the key for an unknown key or a value that does
/// not parse or is out of range (a serving wildcard bind address without tcp.advertise_host is
/// refused when the backend is created).
Result<TcpOptions> ParseTcpOptions(const TransportOptions& options, const TransportOptionMap& own);

}  // namespace kvferry::tcp
