// SHA-256 and HMAC-SHA-256 over OpenSSL, for compatibility hashes and message authentication.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"

namespace kvferry {

using Sha256Digest = std::array<std::uint8_t, 32>;

/// SHA-256 of `bytes`. Thread-safe.
Sha256Digest Sha256(std::span<const std::uint8_t> bytes);
Sha256Digest Sha256(std::string_view bytes);

/// HMAC-SHA-256 of `bytes` under `key`. Thread-safe.
Sha256Digest HmacSha256(std::string_view key, std::span<const std::uint8_t> bytes);

/// Compares two digests in time independent of where they differ.
bool DigestEquals(const Sha256Digest& a, const Sha256Digest& b);

/// Lower-case hexadecimal of any bytes.
std::string ToHex(std::span<const std::uint8_t> bytes);
/// The bytes of hexadecimal text (either case); InvalidArgument for an odd length or a non-hex
/// character, naming its offset.
Result<std::vector<std::uint8_t>> FromHex(std::string_view hex);

}  // namespace kvferry
