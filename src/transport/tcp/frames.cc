#include "transport/tcp/frames.h"

#include <openssl/rand.h>

#include <vector>

namespace kvferry::tcp {

void PutU32(std::uint8_t* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
void PutU64(std::uint8_t* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
std::uint32_t GetU32(const std::uint8_t* p) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
std::uint64_t GetU64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

Nonce RandomNonce() {
  Nonce n{};
  // RAND_bytes only fails without an entropy source, which OpenSSL treats as fatal at startup.
  RAND_bytes(n.data(), static_cast<int>(n.size()));
  return n;
}

namespace {
Sha256Digest Mac(std::string_view secret, std::string_view label, const Nonce& a, const Nonce& b) {
  std::vector<std::uint8_t> msg(label.begin(), label.end());
  msg.insert(msg.end(), a.begin(), a.end());
  msg.insert(msg.end(), b.begin(), b.end());
  return HmacSha256(secret, msg);
}
}  // namespace

Sha256Digest ClientMac(std::string_view secret, const Nonce& server, const Nonce& client) {
  return Mac(secret, "kvferry-tcp-v1 client", server, client);
}
Sha256Digest ServerMac(std::string_view secret, const Nonce& server, const Nonce& client,
                       std::uint64_t instance) {
  return Mac(secret, "kvferry-tcp-v1 server " + std::to_string(instance), client, server);
}

void EncodeRequestHeader(const RequestHeader& h, std::uint8_t* out) {
  PutU32(out, kRequestMagic);
  PutU32(out + 4, h.op_count);
  PutU64(out + 8, h.request_id);
}

void EncodeOp(const WireOp& op, std::uint8_t* out) {
  PutU32(out, op.region);
  PutU32(out + 4, 0);
  PutU64(out + 8, op.offset);
  PutU64(out + 16, op.length);
}

void EncodeResponseHeader(const ResponseHeader& h, std::uint8_t* out) {
  PutU32(out, kResponseMagic);
  PutU32(out + 4, h.status);
  PutU64(out + 8, h.request_id);
  PutU64(out + 16, h.payload_length);
}

Result<RequestHeader> ParseRequestHeader(std::span<const std::uint8_t, kRequestHeaderBytes> in) {
  if (GetU32(in.data()) != kRequestMagic) {
    return Status::InvalidArgument("read request does not start with the request magic");
  }
  RequestHeader h{GetU32(in.data() + 4), GetU64(in.data() + 8)};
  if (h.op_count == 0 || h.op_count > kMaxOpsPerRequest) {
    return Status::InvalidArgument("read request has " + std::to_string(h.op_count) +
                                   " ops; expected 1 to " + std::to_string(kMaxOpsPerRequest));
  }
  return h;
}

Result<WireOp> ParseOp(std::span<const std::uint8_t, kOpBytes> in) {
  if (GetU32(in.data() + 4) != 0) {
    return Status::InvalidArgument("read op has a non-zero reserved field");
  }
  return WireOp{GetU32(in.data()), GetU64(in.data() + 8), GetU64(in.data() + 16)};
}

Status CheckOpLength(const WireOp& op) {
  if (op.length == 0 || op.length > kMaxRequestBytes) {
    return Status::InvalidArgument("read op of " + std::to_string(op.length) +
                                   " bytes; expected 1 to " + std::to_string(kMaxRequestBytes));
  }
  return Status::Ok();
}

Result<ResponseHeader> ParseResponseHeader(std::span<const std::uint8_t, kResponseHeaderBytes> in) {
  if (GetU32(in.data()) != kResponseMagic) {
    return Status::InvalidArgument("read response does not start with the response magic");
  }
  ResponseHeader h{GetU32(in.data() + 4), GetU64(in.data() + 8), GetU64(in.data() + 16)};
  if (h.status != 0 && h.payload_length > kMaxErrorBytes) {
    return Status::InvalidArgument("error response claims a " + std::to_string(h.payload_length) +
                                   "-byte message; the limit is " + std::to_string(kMaxErrorBytes));
  }
  return h;
}

}  // namespace kvferry::tcp
