#include "transport/tcp/tcp_options.h"

#include "transport/backend_options.h"

namespace kvferry::tcp {

Result<TcpOptions> ParseTcpOptions(const TransportOptions& options, const TransportOptionMap& own) {
  TcpOptions o;
  o.client.secret = options.secret;
  BackendOptionReader r("tcp", own);
  constexpr std::uint64_t kDay = 24ull * 3600 * 1000;
  KVFERRY_RETURN_IF_ERROR(r.ReadString("bind_host", &o.bind_host));
  std::uint64_t port = o.port;
  KVFERRY_RETURN_IF_ERROR(r.ReadUint("port", 0, 65535, &port));
  o.port = static_cast<std::uint16_t>(port);
  KVFERRY_RETURN_IF_ERROR(r.ReadString("advertise_host", &o.advertise_host));
  auto connections = static_cast<std::uint64_t>(o.client.connections_per_peer);
  KVFERRY_RETURN_IF_ERROR(r.ReadUint("connections", 1, 1024, &connections));
  o.client.connections_per_peer = static_cast<int>(connections);
  KVFERRY_RETURN_IF_ERROR(
      r.ReadUint("max_request_bytes", 1, std::uint64_t{1} << 40, &o.client.max_request_bytes));
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
