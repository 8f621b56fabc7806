#include "transport/ucx/ucx_section.h"

#include <cctype>

#include "wire/msgpack_reader.h"

namespace kvferry {

std::uint32_t UcxSectionVersionFor(const UcxTcpSegments& segments) {
  return segments.tx != 0 && segments.tx > kUcxDefaultTcpRxSegBytes ? kUcxSectionVersion : 1;
}

std::vector<std::uint8_t> EncodeUcxSection(const UcxSection& s) {
  const std::uint32_t version = UcxSectionVersionFor(s.tcp_segments);
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(9);
  pk.pack(std::string("v"));
  pk.pack_uint32(version);
  pk.pack(std::string("worker"));
  pk.pack_bin(static_cast<std::uint32_t>(s.worker_address.size()));
  pk.pack_bin_body(reinterpret_cast<const char*>(s.worker_address.data()),
                   static_cast<std::uint32_t>(s.worker_address.size()));
  PackProcessFields(pk, s.host, s.start_time);
  pk.pack(std::string("rkeys"));
  PackRegionList(pk, s.keys);
  // In version 1 too: its readers ignore keys they do not know, and newer readers check them.
  pk.pack(std::string("tcp_tx_seg"));
  pk.pack_uint64(s.tcp_segments.tx);
  pk.pack(std::string("tcp_rx_seg"));
  pk.pack_uint64(s.tcp_segments.rx);
  const auto* p = reinterpret_cast<const std::uint8_t*>(buffer.data());
  return {p, p + buffer.size()};
}

Result<UcxSection> DecodeUcxSection(std::span<const std::uint8_t> bytes) {
  KVFERRY_ASSIGN_OR_RETURN(msgpack::object_handle handle, wire::SafeUnpack(bytes, {65536, 16, 3}));
  KVFERRY_ASSIGN_OR_RETURN(wire::MapView m, wire::MapView::Of(handle.get(), "descriptor.ucx"));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t version, m.Uint("v", 255));
  if (version != 1 && version != kUcxSectionVersion) {
    return Status::NotSupported("ucx section version " + std::to_string(version) +
                                " is not supported; this build reads versions 1 to " +
                                std::to_string(kUcxSectionVersion));
  }
  UcxSection s;
  KVFERRY_ASSIGN_OR_RETURN(s.worker_address, m.Bin("worker", kMaxUcxWorkerAddressBytes));
  if (s.worker_address.empty()) {
    return Status::InvalidArgument(m.At("worker") + ": expected a packed UCP worker address");
  }
  KVFERRY_RETURN_IF_ERROR(ReadProcessFields(m, &s.host, &s.start_time));
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* keys, m.Require("rkeys"));
  KVFERRY_ASSIGN_OR_RETURN(s.keys,
                           ReadRegionList(*keys, m.At("rkeys"), kMaxUcxRkeyBytes, "packed rkey"));
  // Required in version 2; in version 1 present from this build on, absent before (unknown).
  if (version >= 2 || m.Find("tcp_tx_seg") != nullptr) {
    KVFERRY_ASSIGN_OR_RETURN(s.tcp_segments.tx, m.Uint("tcp_tx_seg", kMaxUcxTcpSegBytes));
  }
  if (version >= 2 || m.Find("tcp_rx_seg") != nullptr) {
    KVFERRY_ASSIGN_OR_RETURN(s.tcp_segments.rx, m.Uint("tcp_rx_seg", kMaxUcxTcpSegBytes));
  }
  return s;
}

std::uint64_t ParseUcxMemunits(std::string_view text) {
  std::uint64_t value = 0;
  std::size_t i = 0;
  for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
    if (value > kMaxUcxTcpSegBytes) return 0;  // and no multiplication below can wrap
    value = value * 10 + static_cast<std::uint64_t>(text[i] - '0');
  }
  if (i == 0) return 0;
  std::string unit;
  for (; i < text.size(); ++i) unit += static_cast<char>(std::tolower(text[i]));
  int shift = -1;
  if (unit.empty() || unit == "b") shift = 0;
  if (unit == "k" || unit == "kb") shift = 10;
  if (unit == "m" || unit == "mb") shift = 20;
  if (unit == "g" || unit == "gb") shift = 30;
  if (shift < 0 || value > (kMaxUcxTcpSegBytes >> shift)) return 0;
  return value << shift;
}

Status CheckUcxTcpSegments(const UcxTcpSegments& self, const UcxTcpSegments& peer) {
  if (peer.tx == 0 || self.rx == 0 || peer.tx <= self.rx) return Status::Ok();
  return Status::Unavailable(
      "the peer's UCX sends TCP segments of " + std::to_string(peer.tx) +
      " bytes and this process's receives at most " + std::to_string(self.rx) +
      "; UCX's tcp transport aborts a process that receives a segment larger than its "
      "UCX_TCP_RX_SEG_SIZE, so this peer is not read over ucx: set UCX_TCP_TX_SEG_SIZE and "
      "UCX_TCP_RX_SEG_SIZE alike on both sides (or unset them: kvferry then uses " +
      std::to_string(kUcxDefaultTcpSegBytes) + " bytes for both)");
}

}  // namespace kvferry
