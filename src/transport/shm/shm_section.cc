#include "transport/shm/shm_section.h"

#include <sys/stat.h>
#include <unistd.h>

#include <charconv>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>

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
    pk.pack_array(static_cast<std::uint32_t>(s.ipc.size()));
    for (const ShmIpcRegion& r : s.ipc) {
      pk.pack_array(2);
      pk.pack_uint32(r.region);
      pk.pack_bin(static_cast<std::uint32_t>(r.handle.size()));
      pk.pack_bin_body(reinterpret_cast<const char*>(r.handle.data()),
                       static_cast<std::uint32_t>(r.handle.size()));
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
    const std::string path = m.At("ipc");
    if (ipc->type != msgpack::type::ARRAY) {
      return Status::InvalidArgument(path + ": expected an array, found " +
                                     wire::ObjectTypeName(*ipc));
    }
    for (std::uint32_t i = 0; i < ipc->via.array.size; ++i) {
      const msgpack::object& e = ipc->via.array.ptr[i];
      const bool shaped = e.type == msgpack::type::ARRAY && e.via.array.size == 2 &&
                          e.via.array.ptr[0].type == msgpack::type::POSITIVE_INTEGER &&
                          e.via.array.ptr[0].via.u64 <= std::numeric_limits<std::uint32_t>::max() &&
                          e.via.array.ptr[1].type == msgpack::type::BIN &&
                          e.via.array.ptr[1].via.bin.size <= 4096 + 64;
      if (!shaped) {
        return Status::InvalidArgument(path + "[" + std::to_string(i) +
                                       "]: expected [region id, handle bytes (at most 4 KiB)]");
      }
      const msgpack::object_bin& bin = e.via.array.ptr[1].via.bin;
      const auto* b = reinterpret_cast<const std::uint8_t*>(bin.ptr);
      s.ipc.push_back({static_cast<std::uint32_t>(e.via.array.ptr[0].via.u64), {b, b + bin.size}});
    }
  }
  return s;
}

void PackProcessFields(msgpack::packer<msgpack::sbuffer>& pk, const HostIdentity& host,
                       std::uint64_t start_time) {
  pk.pack(std::string("boot_id"));
  pk.pack(host.boot_id);
  pk.pack(std::string("pidns"));
  pk.pack_uint64(host.pid_namespace);
  pk.pack(std::string("pid"));
  pk.pack_int64(host.pid);
  pk.pack(std::string("start"));
  pk.pack_uint64(start_time);
}

Status ReadProcessFields(const wire::MapView& m, HostIdentity* host, std::uint64_t* start_time) {
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  KVFERRY_ASSIGN_OR_RETURN(host->boot_id, m.Str("boot_id", 64));
  KVFERRY_ASSIGN_OR_RETURN(host->pid_namespace, m.Uint("pidns", kMax));
  if (const msgpack::object* pid = m.Find("pid");
      pid != nullptr && pid->type == msgpack::type::NEGATIVE_INTEGER) {
    return Status::InvalidArgument(m.At("pid") +
                                   ": expected the serving process's pid (> 0), found " +
                                   std::to_string(pid->via.i64));
  }
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t pid,
                           m.Uint("pid", std::numeric_limits<std::int32_t>::max()));
  if (pid == 0) {
    // Pid 0 names no process a reader could prove.
    return Status::InvalidArgument(m.At("pid") +
                                   ": expected the serving process's pid (> 0), found 0");
  }
  host->pid = static_cast<std::int64_t>(pid);
  KVFERRY_ASSIGN_OR_RETURN(*start_time, m.Uint("start", kMax));
  return Status::Ok();
}

// The command name (field 2) may hold spaces and parentheses, so fields are counted after the
// last ')'.
Result<std::uint64_t> ProcessStartTime(pid_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  std::ifstream file(path);
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (text.empty()) {
    return Status::PeerDisconnected("cannot read " + path + ": process " + std::to_string(pid) +
                                    " does not exist (any more)");
  }
  const std::size_t name_end = text.rfind(')');
  std::istringstream rest(name_end == std::string::npos ? std::string()
                                                        : text.substr(name_end + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i) {
    if (!(rest >> field)) {
      return Status::Internal(path + " has fewer than 22 fields; is /proc a procfs?");
    }
  }
  std::uint64_t ticks = 0;
  const auto [end, ec] = std::from_chars(field.data(), field.data() + field.size(), ticks);
  if (ec != std::errc() || end != field.data() + field.size()) {
    return Status::Internal(path + ": field 22 (start time) is '" + field + "', expected a number");
  }
  return ticks;
}

Result<HostIdentity> LocalHostIdentity() {
  HostIdentity id;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  if (!(boot >> id.boot_id)) {
    return Status::Unavailable("cannot read /proc/sys/kernel/random/boot_id: is /proc mounted?");
  }
  struct stat st {};
  if (stat("/proc/self/ns/pid", &st) != 0) {
    return Status::Unavailable("cannot stat /proc/self/ns/pid: is /proc mounted?");
  }
  id.pid_namespace = st.st_ino;
  id.pid = getpid();
  return id;
}

}  // namespace kvferry
