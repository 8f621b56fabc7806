// A deterministic byte pattern for verifying transfers without shipping the expected bytes: the
// 8-byte word at index i of a region is a hash of (seed, region, i).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvferry {

inline std::uint64_t SplitMix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline std::uint64_t PatternWord(std::uint64_t seed, std::uint32_t region, std::uint64_t word) {
  return SplitMix64(seed ^ (static_cast<std::uint64_t>(region) << 40) ^ word);
}

/// Fills [out, out + length) with the pattern of `region` starting at byte `offset`.
inline void FillPattern(std::byte* out, std::uint64_t length, std::uint64_t seed,
                        std::uint32_t region, std::uint64_t offset) {
  for (std::uint64_t i = 0; i < length;) {
    const std::uint64_t pos = offset + i;
    const std::uint64_t word = PatternWord(seed, region, pos / 8);
    const std::uint64_t in_word = pos % 8;
    const std::uint64_t n = std::min<std::uint64_t>(8 - in_word, length - i);
    std::memcpy(out + i, reinterpret_cast<const std::byte*>(&word) + in_word, n);
    i += n;
  }
}

/// Index of the first byte of [p, p + length) that differs from the pattern, or -1.
inline std::int64_t FirstPatternMismatch(const std::byte* p, std::uint64_t length,
                                         std::uint64_t seed, std::uint32_t region,
                                         std::uint64_t offset) {
  std::byte expect[4096];
  for (std::uint64_t done = 0; done < length;) {
    const std::uint64_t n = std::min<std::uint64_t>(sizeof(expect), length - done);
    FillPattern(expect, n, seed, region, offset + done);
    if (std::memcmp(expect, p + done, n) != 0) {
      for (std::uint64_t k = 0; k < n; ++k) {
        if (expect[k] != p[done + k]) return static_cast<std::int64_t>(done + k);
      }
    }
    done += n;
  }
  return -1;
}

}  // namespace kvferry
