#include "device/acl/acl_ipc.h"

#include <algorithm>
#include <cstring>

#include "device/acl/acl_api.h"

namespace kvferry::device {
namespace {

constexpr std::uint8_t kRefVersion = 1;
constexpr std::size_t kMaxSocketName = 100;

}  // namespace

std::vector<std::uint8_t> AclExportRef::Encode() const {
  const std::size_t name_len = std::min(permit_socket.size(), kMaxSocketName);
  std::vector<std::uint8_t> out(1 + acl::kIpcKeyLength + sizeof(exporter_pid) + 1 + name_len, 0);
  std::uint8_t* p = out.data();
  *p++ = kRefVersion;
  std::memcpy(p, key.data(), std::min(key.size(), acl::kIpcKeyLength - 1));  // NUL padded
  p += acl::kIpcKeyLength;
  std::memcpy(p, &exporter_pid, sizeof(exporter_pid));
  p += sizeof(exporter_pid);
  *p++ = static_cast<std::uint8_t>(name_len);
  std::memcpy(p, permit_socket.data(), name_len);
  return out;
}

Result<AclExportRef> AclExportRef::Decode(std::span<const std::uint8_t> bytes) {
  const auto bad = [&](const char* what) {
    return Status::InvalidArgument(std::string("npu IPC handle: expected ") + what +
                                   " (format version 1); found " + std::to_string(bytes.size()) +
                                   " bytes that do not parse: was it made by an npu ExportIpc?");
  };
  constexpr std::size_t kFixed = 1 + acl::kIpcKeyLength + sizeof(std::int32_t) + 1;
  if (bytes.size() < kFixed) return bad("at least 71 bytes");
  if (bytes[0] != kRefVersion) return bad("version 1");
  AclExportRef ref;
  const auto* key = reinterpret_cast<const char*>(bytes.data() + 1);
  const std::size_t key_len = strnlen(key, acl::kIpcKeyLength);
  if (key_len == 0 || key_len == acl::kIpcKeyLength) return bad("a NUL-terminated key");
  ref.key.assign(key, key_len);
  std::memcpy(&ref.exporter_pid, bytes.data() + 1 + acl::kIpcKeyLength, sizeof(ref.exporter_pid));
  if (ref.exporter_pid <= 0) return bad("a positive exporter pid");
  const std::size_t name_len = bytes[kFixed - 1];
  if (name_len == 0 || name_len > kMaxSocketName) return bad("a socket name of 1 to 100 bytes");
  if (bytes.size() != kFixed + name_len) return bad("the socket name and nothing after it");
  ref.permit_socket.assign(reinterpret_cast<const char*>(bytes.data() + kFixed), name_len);
  return ref;
}

std::optional<std::string> AclExportTable::Find(DeviceAddress start, std::uint64_t size) const {
  MutexLock lock(mu_);
  auto it = exports_.find(start);
  if (it == exports_.end() || it->second.size != size) return std::nullopt;
  return it->second.key;
}

void AclExportTable::Add(DeviceAddress start, std::uint64_t size, std::string key) {
  MutexLock lock(mu_);
  exports_[start] = Export{size, std::move(key), {}};
}

std::vector<std::string> AclExportTable::TakeOverlapping(DeviceAddress start, std::uint64_t size) {
  std::vector<std::string> keys;
  MutexLock lock(mu_);
  for (auto it = exports_.begin(); it != exports_.end();) {
    const bool overlaps = it->first < start + size && start < it->first + it->second.size;
    if (!overlaps) {
      ++it;
      continue;
    }
    keys.push_back(std::move(it->second.key));
    it = exports_.erase(it);
  }
  return keys;
}

std::vector<std::string> AclExportTable::TakeAll() {
  std::vector<std::string> keys;
  MutexLock lock(mu_);
  for (auto& [start, e] : exports_) keys.push_back(std::move(e.key));
  exports_.clear();
  return keys;
}

Result<bool> AclExportTable::Reserve(const std::string& key, std::int32_t pid) {
  MutexLock lock(mu_);
  for (auto& [start, e] : exports_) {
    if (e.key != key) continue;
    if (e.readers.count(pid) != 0) return false;
    if (e.readers.size() >= kMaxReadersPerExport) {
      return Status::ResourceExhausted(
          "this export already admits " + std::to_string(kMaxReadersPerExport) +
          " readers (kvferry's cap per exported allocation); pid " + std::to_string(pid) +
          " is refused: restart readers that are gone, or read over tcp");
    }
    e.readers.insert(pid);
    return true;
  }
  return Status::NotFound(
      "the key is not exported by this process (any more): the allocation "
      "was freed, or the handle is stale; fetch a fresh descriptor");
}

void AclExportTable::Unreserve(const std::string& key, std::int32_t pid) {
  MutexLock lock(mu_);
  for (auto& [start, e] : exports_) {
    if (e.key == key) e.readers.erase(pid);
  }
}

}  // namespace kvferry::device
