#include "transport/ucx/ucx_section.h"

#include "wire/msgpack_reader.h"

namespace kvferry {

std::vector<std::uint8_t> EncodeUcxSection(const UcxSection& s) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(7);
  pk.pack(std::string("v"));
  pk.pack_uint32(kUcxSectionVersion);
  pk.pack(std::string("worker"));
  pk.pack_bin(static_cast<std::uint32_t>(s.worker_address.size()));
  pk.pack_bin_body(reinterpret_cast<const char*>(s.worker_address.data()),
                   static_cast<std::uint32_t>(s.worker_address.size()));
  PackProcessFields(pk, s.host, s.start_time);
  pk.pack(std::string("rkeys"));
  PackRegionList(pk, s.keys);
  const auto* p = reinterpret_cast<const std::uint8_t*>(buffer.data());
  return {p, p + buffer.size()};
}

Result<UcxSection> DecodeUcxSection(std::span<const std::uint8_t> bytes) {
  KVFERRY_ASSIGN_OR_RETURN(msgpack::object_handle handle, wire::SafeUnpack(bytes, {65536, 16, 3}));
  KVFERRY_ASSIGN_OR_RETURN(wire::MapView m, wire::MapView::Of(handle.get(), "descriptor.ucx"));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t version, m.Uint("v", 255));
  if (version != kUcxSectionVersion) {
    return Status::NotSupported("ucx section version " + std::to_string(version) +
                                " is not supported; this build reads version " +
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
  return s;
}

}  // namespace kvferry
