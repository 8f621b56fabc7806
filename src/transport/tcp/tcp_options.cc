// The tcp backend's options: TransportOptions' typed defaults, overridden by the tcp.* keys.
#include "transport/backend_options.h"
#include "transport/tcp/tcp_backend.h"

namespace kvferry::tcp {

Result<TcpOptions> ParseTcpOptions(const TransportOptions& options, const TransportOptionMap& own) {
  TcpOptions o;
  o.client = ClientOptions{options.secret, options.tcp_connections_per_peer,
                           options.max_request_bytes, options.tcp_user_timeout};
  o.bind_host = options.tcp_bind_host;
  o.port = options.tcp_port;
  o.advertise_host = options.tcp_advertise_host;
  o.limits = ServerLimits{options.tcp_handshake_timeout, options.tcp_idle_timeout,
                          options.tcp_send_stall_timeout, options.tcp_max_connections,
                          options.tcp_max_connections_per_source};
  BackendOptionReader r("tcp", own);
  constexpr std::uint64_t kDay = 24ull * 3600 * 1000;
  KVFERRY_RETURN_IF_ERROR(r.ReadString("bind_host", &o.bind_host));
  std::uint64_t port = o.port;
  KVFERRY_RETURN_IF_ERROR(r.ReadUint("port", 0, 65535, &port));
  o.port = static_cast<std::uint16_t>(port);
  KVFERRY_RETURN_IF_ERROR(r.ReadString("advertise_host", &o.advertise_host));
  auto connections = static_cast<std::uint64_t>(std::max(o.client.connections_per_peer, 0));
  KVFERRY_RETURN_IF_ERROR(r.ReadUint("connections", 1, 1024, &connections));
  KVFERRY_RETURN_IF_ERROR(r.Require(connections >= 1 && connections <= 1024, "connections",
                                    "1 to 1024 connections per peer", std::to_string(connections)));
  o.client.connections_per_peer = static_cast<int>(connections);
  KVFERRY_RETURN_IF_ERROR(
      r.ReadUint("max_request_bytes", 1, std::uint64_t{1} << 40, &o.client.max_request_bytes));
  KVFERRY_RETURN_IF_ERROR(r.Require(o.client.max_request_bytes > 0, "max_request_bytes",
                                    "a positive request size", "0"));
  KVFERRY_RETURN_IF_ERROR(r.ReadMillis("user_timeout_ms", 1, kDay, &o.client.user_timeout));
  KVFERRY_RETURN_IF_ERROR(
      r.ReadMillis("handshake_timeout_ms", 1, kDay, &o.limits.handshake_timeout));
  KVFERRY_RETURN_IF_ERROR(r.ReadMillis("idle_timeout_ms", 1, kDay, &o.limits.idle_timeout));
  KVFERRY_RETURN_IF_ERROR(
      r.ReadMillis("send_stall_timeout_ms", 1, kDay, &o.limits.send_stall_timeout));
  std::uint64_t max_connections = o.limits.max_connections;
  KVFERRY_RETURN_IF_ERROR(r.ReadUint("max_connections", 1, 1u << 20, &max_connections));
  o.limits.max_connections = max_connections;
  std::uint64_t per_source = o.limits.max_connections_per_source;
  KVFERRY_RETURN_IF_ERROR(r.ReadUint("max_connections_per_source", 1, 1u << 20, &per_source));
  o.limits.max_connections_per_source = per_source;
  KVFERRY_RETURN_IF_ERROR(r.RejectUnknown());
  return o;
}

}  // namespace kvferry::tcp
