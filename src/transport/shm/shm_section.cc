#include "transport/shm/shm_section.h"

#include <limits>
#include <string>

#include "wire/msgpack_reader.h"

namespace kvferry {
namespace {

Result<std::vector<ShmServedRegion>> ReadServedRegions(const msgpack::object& list,
                                                       const std::string& path) {
  const auto uint_at = [](const msgpack::object& v, std::uint64_t max) {
    return v.type == msgpack::type::POSITIVE_INTEGER && v.via.u64 <= max;
  };
  std::vector<ShmServedRegion> out;
  KVFERRY_RETURN_IF_ERROR(ReadRegionEntries(
      list, path, 3,
      [&](const msgpack::object* items) {
        return uint_at(items[1], std::numeric_limits<std::int32_t>::max()) &&
               uint_at(items[2], std::numeric_limits<std::uint64_t>::max());
      },
      "descriptor (0 to 2^31-1), offset in the memfd", "memfd",
      [&](std::uint32_t region, const msgpack::object* items) {
        out.push_back({region, static_cast<std::int32_t>(items[1].via.u64), items[2].via.u64});
      }));
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
