// The tcp backend's frames (docs/transport.md): a mutual challenge-response handshake, then read
// requests and responses. Fixed-size little-endian fields; parsers never trust their input.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "common/digest.h"
#include "kvferry/status.h"
#include "kvferry/transport.h"

namespace kvferry::tcp {

inline constexpr std::uint32_t kHelloMagic = 0x4846564Bu;     // "KVFH"
inline constexpr std::uint32_t kAuthMagic = 0x4146564Bu;      // "KVFA"
inline constexpr std::uint32_t kResultMagic = 0x5246564Bu;    // "KVFR"
inline constexpr std::uint32_t kRequestMagic = 0x5152564Bu;   // "KVRQ"
inline constexpr std::uint32_t kResponseMagic = 0x5352564Bu;  // "KVRS"
inline constexpr std::uint32_t kVersion = 1;

inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kHelloBytes = 8 + kNonceBytes;      // magic, version, nonce
inline constexpr std::size_t kAuthBytes = 8 + kNonceBytes + 32;  // + client nonce, mac
inline constexpr std::size_t kResultBytes = 8 + 32;              // magic, status, mac
inline constexpr std::size_t kRequestHeaderBytes = 16;           // magic, count, id
inline constexpr std::size_t kOpBytes = 24;                      // region, 0, off, len
inline constexpr std::size_t kResponseHeaderBytes = 24;          // magic, status, id, len
inline constexpr std::uint32_t kMaxOpsPerRequest = 1024;
inline constexpr std::uint64_t kMaxRequestBytes = 64u << 20;
inline constexpr std::uint64_t kMaxErrorBytes = 4096;

using Nonce = std::array<std::uint8_t, kNonceBytes>;

void PutU32(std::uint8_t* p, std::uint32_t v);
void PutU64(std::uint8_t* p, std::uint64_t v);
std::uint32_t GetU32(const std::uint8_t* p);
std::uint64_t GetU64(const std::uint8_t* p);

Nonce RandomNonce();
/// What the client proves: HMAC(secret, "kvferry-tcp-v1 client" || server_nonce || client_nonce).
Sha256Digest ClientMac(std::string_view secret, const Nonce& server, const Nonce& client);
/// What the server proves back: HMAC(secret, "kvferry-tcp-v1 server <instance>" || client_nonce ||
/// server_nonce). `instance` is the server's random id, also in its transport descriptor: a
/// client that reconnects to the same address learns whether it reached the same server.
Sha256Digest ServerMac(std::string_view secret, const Nonce& server, const Nonce& client,
                       std::uint64_t instance);

struct RequestHeader {
  std::uint32_t op_count = 0;
  std::uint64_t request_id = 0;
};
struct WireOp {
  RegionId region = 0;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};
struct ResponseHeader {
  std::uint32_t status = 0;  // a StatusCode wire value; 0 = the payload is the requested bytes
  std::uint64_t request_id = 0;
  std::uint64_t payload_length = 0;
};

void EncodeRequestHeader(const RequestHeader& h, std::uint8_t* out);
void EncodeOp(const WireOp& op, std::uint8_t* out);
void EncodeResponseHeader(const ResponseHeader& h, std::uint8_t* out);

/// Malformed frames are InvalidArgument; the server closes the connection that sent one.
Result<RequestHeader> ParseRequestHeader(std::span<const std::uint8_t, kRequestHeaderBytes> in);
Result<WireOp> ParseOp(std::span<const std::uint8_t, kOpBytes> in);
/// A well-formed op whose length is 0 or above kMaxRequestBytes is InvalidArgument; the server
/// answers it with an error response and keeps the connection.
Status CheckOpLength(const WireOp& op);
Result<ResponseHeader> ParseResponseHeader(std::span<const std::uint8_t, kResponseHeaderBytes> in);

}  // namespace kvferry::tcp
