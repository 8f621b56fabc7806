#include "transport/tcp/tcp_section.h"

#include <limits>

#include "wire/msgpack_reader.h"

namespace kvferry {

std::vector<std::uint8_t> EncodeTcpSection(const TcpEndpoint& e) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(4);
  pk.pack(std::string("v"));
  pk.pack_uint32(kTcpSectionVersion);
  pk.pack(std::string("host"));
  pk.pack(e.host);
  pk.pack(std::string("port"));
  pk.pack_uint16(e.port);
  pk.pack(std::string("instance"));
  pk.pack_uint64(e.instance);
  const auto* p = reinterpret_cast<const std::uint8_t*>(buffer.data());
  return {p, p + buffer.size()};
}

Result<TcpEndpoint> DecodeTcpSection(std::span<const std::uint8_t> bytes) {
  KVFERRY_ASSIGN_OR_RETURN(msgpack::object_handle handle, wire::SafeUnpack(bytes, {16, 16, 2}));
  KVFERRY_ASSIGN_OR_RETURN(wire::MapView m, wire::MapView::Of(handle.get(), "descriptor.tcp"));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t version, m.Uint("v", 255));
  if (version != kTcpSectionVersion) {
    return Status::NotSupported("tcp section version " + std::to_string(version) +
                                " is not supported; this build reads version " +
                                std::to_string(kTcpSectionVersion));
  }
  TcpEndpoint ep;
  KVFERRY_ASSIGN_OR_RETURN(ep.host, m.Str("host", 255));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t port, m.Uint("port", 65535));
  if (ep.host.empty() || port == 0) {
    return Status::InvalidArgument(m.path() + ": expected a host and a non-zero port");
  }
  ep.port = static_cast<std::uint16_t>(port);
  KVFERRY_ASSIGN_OR_RETURN(ep.instance,
                           m.Uint("instance", std::numeric_limits<std::uint64_t>::max()));
  return ep;
}

}  // namespace kvferry
