#include "transport/shm/shm_section.h"

#include <limits>
#include <set>
#include <string>

#include "wire/msgpack_reader.h"

namespace kvferry {
namespace {

Result<std::vector<ShmServedRegion>> ReadServedRegions(const msgpack::object& list,
                                                       const std::string& path) {
  if (list.type != msgpack::type::ARRAY) {
    return Status::InvalidArgument(path + ": expected an array, found " +
                                   wire::ObjectTypeName(list));
  }
  std::vector<ShmServedRegion> out;
  std::set<std::uint32_t> seen;
  for (std::uint32_t i = 0; i < list.via.array.size; ++i) {
    const msgpack::object& e = list.via.array.ptr[i];
    const auto uint_at = [&](std::uint32_t k, std::uint64_t max) {
      const msgpack::object& v = e.via.array.ptr[k];
      return v.type == msgpack::type::POSITIVE_INTEGER && v.via.u64 <= max;
    };
    const bool shaped = e.type == msgpack::type::ARRAY && e.via.array.size == 3 &&
                        uint_at(0, std::numeric_limits<std::uint32_t>::max()) &&
                        uint_at(1, std::numeric_limits<std::int32_t>::max()) &&
                        uint_at(2, std::numeric_limits<std::uint64_t>::max());
    const std::string at = path + "[" + std::to_string(i) + "]";
    if (!shaped) {
      return Status::InvalidArgument(
          at + ": expected [region id, descriptor (0 to 2^31-1), offset in the memfd]");
    }
    ShmServedRegion r{static_cast<std::uint32_t>(e.via.array.ptr[0].via.u64),
                      static_cast<std::int32_t>(e.via.array.ptr[1].via.u64),
                      e.via.array.ptr[2].via.u64};
    if (!seen.insert(r.region).second) {
      return Status::InvalidArgument(at + ": region " + std::to_string(r.region) +
                                     " is listed twice; expected one memfd per region");
    }
    out.push_back(r);
  }
  return out;
}

}  // namespace

std::vector<std::uint8_t> EncodeShmSection(const ShmSection& s) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(7 + (s.ipc.empty() ? 0 : 1) + (s.served.empty() ? 0 : 1));
  pk.pack(std::string("v"));
  pk.pack_uint32(kShmSectionVersion);
  PackProcessFields(pk, s.host, s.proof.start_time);
  pk.pack(std::string("nonce_at"));
  pk.pack_uint64(s.proof.nonce_addr);
  pk.pack(std::string("nonce"));
  pk.pack_uint64(s.proof.nonce);
  if (!s.ipc.empty()) {
    pk.pack(std::string("ipc"));
    PackRegionList(pk, s.ipc);
  }
  if (!s.served.empty()) {
    pk.pack(std::string("memfd"));
    pk.pack_array(static_cast<std::uint32_t>(s.served.size()));
    for (const ShmServedRegion& r : s.served) {
      pk.pack_array(3);
      pk.pack_uint32(r.region);
      pk.pack_uint32(static_cast<std::uint32_t>(r.fd));
      pk.pack_uint64(r.offset);
    }
  }
  const auto* p = reinterpret_cast<const std::uint8_t*>(buffer.data());
  return {p, p + buffer.size()};
}

Result<ShmSection> DecodeShmSection(std::span<const std::uint8_t> bytes) {
  KVFERRY_ASSIGN_OR_RETURN(msgpack::object_handle handle, wire::SafeUnpack(bytes, {65536, 16, 3}));
  KVFERRY_ASSIGN_OR_RETURN(wire::MapView m, wire::MapView::Of(handle.get(), "descriptor.shm"));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t version, m.Uint("v", 255));
  if (version != kShmSectionVersion) {
    return Status::NotSupported("shm section version " + std::to_string(version) +
                                " is not supported; this build reads version " +
                                std::to_string(kShmSectionVersion));
  }
  ShmSection s;
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  KVFERRY_RETURN_IF_ERROR(ReadProcessFields(m, &s.host, &s.proof.start_time));
  KVFERRY_ASSIGN_OR_RETURN(s.proof.nonce_addr, m.Uint("nonce_at", kMax));
  KVFERRY_ASSIGN_OR_RETURN(s.proof.nonce, m.Uint("nonce", kMax));
  if (s.proof.nonce_addr == 0) {
    return Status::InvalidArgument(m.At("nonce_at") +
                                   ": expected a non-zero address of the instance nonce");
  }
  if (const msgpack::object* ipc = m.Find("ipc"); ipc != nullptr) {
    KVFERRY_ASSIGN_OR_RETURN(
        s.ipc, ReadRegionList(*ipc, m.At("ipc"), kMaxShmIpcHandleBytes, "IPC handle"));
  }
  if (const msgpack::object* served = m.Find("memfd"); served != nullptr) {
    KVFERRY_ASSIGN_OR_RETURN(s.served, ReadServedRegions(*served, m.At("memfd")));
  }
  return s;
}

}  // namespace kvferry
