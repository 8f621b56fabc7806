#include "common/digest.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

namespace kvferry {

Sha256Digest Sha256(std::span<const std::uint8_t> bytes) {
  Sha256Digest out{};
  unsigned int len = 0;
  // EVP_Digest cannot fail for SHA-256 on valid buffers short of memory exhaustion, which
  // OpenSSL reports by aborting; the output is fully written when it returns.
  EVP_Digest(bytes.data(), bytes.size(), out.data(), &len, EVP_sha256(), nullptr);
  return out;
}

Sha256Digest Sha256(std::string_view bytes) {
  return Sha256(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(bytes.data()),
                                              bytes.size()));
}

Sha256Digest HmacSha256(std::string_view key, std::span<const std::uint8_t> bytes) {
  Sha256Digest out{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), bytes.data(), bytes.size(),
       out.data(), &len);
  return out;
}

bool DigestEquals(const Sha256Digest& a, const Sha256Digest& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string ToHex(std::span<const std::uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (std::uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 0xf]);
  }
  return out;
}

}  // namespace kvferry
