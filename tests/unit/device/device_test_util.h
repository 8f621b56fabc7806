// Helpers for the device tests: move bytes in and out of device memory through a stream and wait.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/pattern.h"
#include "device/device.h"

namespace kvferry::device::testing {

inline std::vector<std::byte> PatternBytes(std::uint64_t size, std::uint64_t seed,
                                           std::uint64_t offset = 0) {
  std::vector<std::byte> out(size);
  FillPattern(out.data(), size, seed, 0, offset);
  return out;
}

// Records an event on `stream` and waits for it (10 s).
inline Status Sync(Stream& stream) {
  auto event = stream.RecordEvent();
  if (!event.ok()) return event.status();
  return (*event)->Wait(DeadlineAfter(std::chrono::seconds(10)));
}

inline Status Upload(Stream& stream, DeviceAddress dst, const std::vector<std::byte>& bytes) {
  KVFERRY_RETURN_IF_ERROR(stream.CopyHostToDevice(dst, bytes.data(), bytes.size()));
  return Sync(stream);
}

inline Result<std::vector<std::byte>> Download(Stream& stream, DeviceAddress src,
                                               std::uint64_t size) {
  std::vector<std::byte> out(size);
  KVFERRY_RETURN_IF_ERROR(stream.CopyDeviceToHost(out.data(), src, size));
  KVFERRY_RETURN_IF_ERROR(Sync(stream));
  return out;
}

inline std::string ToHex(const std::vector<std::uint8_t>& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  for (std::uint8_t b : bytes) {
    s += kDigits[b >> 4];
    s += kDigits[b & 15];
  }
  return s;
}

inline std::vector<std::uint8_t> FromHex(const std::string& s) {
  std::vector<std::uint8_t> out;
  const auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (std::size_t i = 0; i + 1 < s.size(); i += 2) {
    const int hi = nibble(s[i]);
    const int lo = nibble(s[i + 1]);
    if (hi < 0 || lo < 0) return {};
    out.push_back(static_cast<std::uint8_t>(hi * 16 + lo));
  }
  return out;
}

#ifdef KVFERRY_DEVICE_IPC_PEER_PATH
// The device_ipc_peer program: $KVFERRY_DEVICE_IPC_PEER if set, else the one of the build, else
// (in a bundle made by make device-bundle, where the build's path does not exist) the one beside
// this test.
inline std::string DeviceIpcPeerPath() {
  if (const char* v = std::getenv("KVFERRY_DEVICE_IPC_PEER"); v != nullptr && *v != '\0') {
    return v;
  }
  if (::access(KVFERRY_DEVICE_IPC_PEER_PATH, X_OK) == 0) return KVFERRY_DEVICE_IPC_PEER_PATH;
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return (self.parent_path() / "device_ipc_peer").string();
}
#endif

}  // namespace kvferry::device::testing
