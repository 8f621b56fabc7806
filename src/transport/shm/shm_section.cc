#include "transport/shm/shm_section.h"

#include <limits>

#include "wire/msgpack_reader.h"

namespace kvferry {

std::vector<std::uint8_t> EncodeShmSection(const ShmSection& s) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(s.ipc.empty() ? 7 : 8);
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
  return s;
}

}  // namespace kvferry
