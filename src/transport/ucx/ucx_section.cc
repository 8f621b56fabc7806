#include "transport/ucx/ucx_section.h"

#include <limits>
#include <set>

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
  pk.pack_array(static_cast<std::uint32_t>(s.keys.size()));
  for (const UcxRegionKey& k : s.keys) {
    pk.pack_array(2);
    pk.pack_uint32(k.region);
    pk.pack_bin(static_cast<std::uint32_t>(k.rkey.size()));
    pk.pack_bin_body(reinterpret_cast<const char*>(k.rkey.data()),
                     static_cast<std::uint32_t>(k.rkey.size()));
  }
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
  const std::string path = m.At("rkeys");
  if (keys->type != msgpack::type::ARRAY) {
    return Status::InvalidArgument(path + ": expected an array, found " +
                                   wire::ObjectTypeName(*keys));
  }
  std::set<std::uint32_t> seen;
  for (std::uint32_t i = 0; i < keys->via.array.size; ++i) {
    const msgpack::object& e = keys->via.array.ptr[i];
    const bool shaped = e.type == msgpack::type::ARRAY && e.via.array.size == 2 &&
                        e.via.array.ptr[0].type == msgpack::type::POSITIVE_INTEGER &&
                        e.via.array.ptr[0].via.u64 <= std::numeric_limits<std::uint32_t>::max() &&
                        e.via.array.ptr[1].type == msgpack::type::BIN &&
                        e.via.array.ptr[1].via.bin.size >= 1 &&
                        e.via.array.ptr[1].via.bin.size <= kMaxUcxRkeyBytes;
    if (!shaped) {
      return Status::InvalidArgument(path + "[" + std::to_string(i) +
                                     "]: expected [region id, packed rkey (1 to 1024 bytes)]");
    }
    const auto region = static_cast<std::uint32_t>(e.via.array.ptr[0].via.u64);
    if (!seen.insert(region).second) {
      return Status::InvalidArgument(path + "[" + std::to_string(i) + "]: region " +
                                     std::to_string(region) + " has a key already");
    }
    const msgpack::object_bin& bin = e.via.array.ptr[1].via.bin;
    const auto* b = reinterpret_cast<const std::uint8_t*>(bin.ptr);
    s.keys.push_back({region, {b, b + bin.size}});
  }
  return s;
}

}  // namespace kvferry
