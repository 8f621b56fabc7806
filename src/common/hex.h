// "0x..." text of an address or other 64-bit value, for error messages.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace kvferry {

inline std::string Hex(std::uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace kvferry
