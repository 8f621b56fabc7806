// Overflow-checked 64-bit arithmetic for sizes and offsets computed from untrusted input.
#pragma once

#include <cstdint>
#include <optional>

namespace kvferry {

/// a * b, or nullopt when the product does not fit in int64 (or an operand is negative).
inline std::optional<std::int64_t> CheckedMul(std::int64_t a, std::int64_t b) {
  std::int64_t out = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

/// a + b, or nullopt when the sum does not fit in int64 (or an operand is negative).
inline std::optional<std::int64_t> CheckedAdd(std::int64_t a, std::int64_t b) {
  std::int64_t out = 0;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

}  // namespace kvferry
