// What an npu IpcHandle carries, and the exporter's table of what it exported and to whom
// (docs/device.md, "The acl device", IPC). Pure logic: no runtime calls, no sockets.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "device/device.h"
#include "kvferry/status.h"

namespace kvferry::device {

/// The opaque bytes of an npu IpcHandle. Format version 1, native byte order (same host only):
/// u8 version, 65 bytes of key (aclrtIpcMemGetExportKey's NUL-terminated string, NUL padded),
/// i32 the exporter's pid (for messages), u8 length (1..100) and the bytes of the exporter's
/// permit socket name (a Linux abstract unix socket, without its leading NUL byte).
struct AclExportRef {
  std::string key;  ///< at most 64 characters, no NUL
  std::int32_t exporter_pid = 0;
  std::string permit_socket;  ///< 1..100 bytes

  std::vector<std::uint8_t> Encode() const;
  /// Never trusts `bytes`: anything malformed is InvalidArgument.
  static Result<AclExportRef> Decode(std::span<const std::uint8_t> bytes);
};

/// The allocations this process exported, by the first byte of the exported (page-aligned) range,
/// and the readers each one admits. Thread-safe.
class AclExportTable {
 public:
  /// The most readers (bare tgids) one export admits: a peer cannot grow the whitelist without
  /// bound (DESIGN.md rule 14). A decode instance has one reader per worker process.
  static constexpr std::size_t kMaxReadersPerExport = 256;

  /// The key of the export of exactly [start, start + size), if there is one.
  std::optional<std::string> Find(DeviceAddress start, std::uint64_t size) const EXCLUDES(mu_);
  /// Records an export. An export at the same start with another size (the memory was freed and
  /// allocated again) must have been taken out first (TakeOverlapping).
  void Add(DeviceAddress start, std::uint64_t size, std::string key) EXCLUDES(mu_);
  /// Removes every export that overlaps [start, start + size) and returns their keys, which the
  /// caller closes (aclrtIpcMemClose) before the memory is freed.
  std::vector<std::string> TakeOverlapping(DeviceAddress start, std::uint64_t size) EXCLUDES(mu_);
  std::vector<std::string> TakeAll() EXCLUDES(mu_);

  /// Whether `pid` may be added to `key`'s whitelist: true if it is new (the caller then calls
  /// aclrtIpcMemSetImportPid, and Unreserve if that fails), false if it was already admitted.
  /// NotFound for a key this process does not export (any more); ResourceExhausted past
  /// kMaxReadersPerExport readers.
  Result<bool> Reserve(const std::string& key, std::int32_t pid) EXCLUDES(mu_);
  void Unreserve(const std::string& key, std::int32_t pid) EXCLUDES(mu_);

 private:
  struct Export {
    std::uint64_t size = 0;
    std::string key;
    std::set<std::int32_t> readers;
  };
  mutable Mutex mu_;
  std::map<DeviceAddress, Export> exports_ GUARDED_BY(mu_);
};

}  // namespace kvferry::device
