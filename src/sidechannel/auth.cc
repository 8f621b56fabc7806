#include "sidechannel/auth.h"

#include <openssl/rand.h>

#include <algorithm>
#include <cstring>

#include "common/digest.h"

namespace kvferry::sidechannel {
namespace {

constexpr std::string_view kLabel = "kvferry-sc-v1";
constexpr std::size_t kSignedBytes = 4 + 8 + kAuthNonceBytes;  // the header before its MAC

Sha256Digest Mac(std::string_view secret, std::span<const std::uint8_t> signed_part,
                 const AuthNonce& bound, std::span<const std::uint8_t> body) {
  std::vector<std::uint8_t> msg;
  msg.reserve(kLabel.size() + signed_part.size() + bound.size() + body.size());
  msg.insert(msg.end(), kLabel.begin(), kLabel.end());
  msg.insert(msg.end(), signed_part.begin(), signed_part.end());
  msg.insert(msg.end(), bound.begin(), bound.end());
  msg.insert(msg.end(), body.begin(), body.end());
  return HmacSha256(secret, msg);
}

}  // namespace

std::uint64_t UnixMillis() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
}

std::vector<std::uint8_t> SignMessageAt(std::string_view secret, AuthKind kind,
                                        std::span<const std::uint8_t> body,
                                        const AuthNonce& request_nonce, std::uint64_t timestamp_ms,
                                        const AuthNonce& nonce) {
  std::vector<std::uint8_t> h(kAuthHeaderBytes, 0);
  h[0] = kAuthVersion;
  h[1] = static_cast<std::uint8_t>(kind);
  for (int i = 0; i < 8; ++i) h[4 + i] = static_cast<std::uint8_t>(timestamp_ms >> (8 * i));
  std::memcpy(h.data() + 12, nonce.data(), nonce.size());
  const AuthNonce bound = kind == AuthKind::kReply ? request_nonce : AuthNonce{};
  const Sha256Digest mac = Mac(secret, std::span(h.data(), kSignedBytes), bound, body);
  std::memcpy(h.data() + kSignedBytes, mac.data(), mac.size());
  return h;
}

std::vector<std::uint8_t> SignMessage(std::string_view secret, AuthKind kind,
                                      std::span<const std::uint8_t> body,
                                      const AuthNonce& request_nonce, AuthNonce* nonce_out) {
  AuthNonce nonce{};
  RAND_bytes(nonce.data(), static_cast<int>(nonce.size()));
  if (nonce_out != nullptr) *nonce_out = nonce;
  return SignMessageAt(secret, kind, body, request_nonce, UnixMillis(), nonce);
}

Result<AuthHeader> VerifyMessage(std::string_view secret, AuthKind kind,
                                 std::span<const std::uint8_t> header,
                                 std::span<const std::uint8_t> body, const AuthNonce& request_nonce,
                                 std::chrono::milliseconds max_skew) {
  if (header.size() != kAuthHeaderBytes) {
    return Status::Unauthenticated("authentication header of " + std::to_string(header.size()) +
                                   " bytes; expected " + std::to_string(kAuthHeaderBytes));
  }
  if (header[0] != kAuthVersion || header[1] != static_cast<std::uint8_t>(kind)) {
    return Status::Unauthenticated("authentication header of an unknown version or kind");
  }
  AuthHeader h;
  h.kind = kind;
  for (int i = 7; i >= 0; --i) h.timestamp_ms = (h.timestamp_ms << 8) | header[4 + i];
  std::memcpy(h.nonce.data(), header.data() + 12, h.nonce.size());
  const AuthNonce bound = kind == AuthKind::kReply ? request_nonce : AuthNonce{};
  Sha256Digest mac{};
  std::memcpy(mac.data(), header.data() + kSignedBytes, mac.size());
  if (!DigestEquals(mac, Mac(secret, header.first(kSignedBytes), bound, body))) {
    return Status::Unauthenticated(
        "message authentication failed: the sender does not hold this side channel's secret, or "
        "the message was altered");
  }
  if (kind == AuthKind::kReply) return h;
  const auto now = static_cast<std::int64_t>(UnixMillis());
  const auto skew = now - static_cast<std::int64_t>(h.timestamp_ms);
  if (skew > max_skew.count() || -skew > max_skew.count()) {
    return Status::Unauthenticated("message timestamp is " + std::to_string(skew) +
                                   " ms from this host's clock, beyond the allowed " +
                                   std::to_string(max_skew.count()) +
                                   " ms: a stale or replayed message, or unsynchronised clocks");
  }
  return h;
}

std::optional<AuthNonce> RequestNonceOf(std::span<const std::uint8_t> header) {
  if (header.size() != kAuthHeaderBytes || header[0] != kAuthVersion ||
      header[1] != static_cast<std::uint8_t>(AuthKind::kRequest)) {
    return std::nullopt;
  }
  AuthNonce nonce{};
  std::memcpy(nonce.data(), header.data() + 12, nonce.size());
  return nonce;
}

void ReplayGuard::ForgetOldest() {
  nonces_.erase(by_time_.begin()->second);
  by_time_.erase(by_time_.begin());
}

bool ReplayGuard::Accept(const AuthHeader& header) {
  MutexLock lock(mu_);
  const std::uint64_t now = UnixMillis();
  const auto window = static_cast<std::uint64_t>(window_.count());
  while (!by_time_.empty() && by_time_.begin()->first + 2 * window < now) ForgetOldest();
  // Not newer than a nonce forgotten while still fresh: it may be that message's replay.
  if (header.timestamp_ms <= low_water_ms_) return false;
  // The nonce alone decides: the same nonce under another timestamp is refused too.
  if (nonces_.count(header.nonce) != 0) return false;
  if (by_time_.size() >= capacity_) {
    // Full of fresh nonces. A message older than all of them is refused as if it were the
    // oldest forgotten; otherwise the oldest is forgotten and its timestamp refused from now on.
    const std::uint64_t oldest = by_time_.begin()->first;
    if (header.timestamp_ms <= oldest) return false;
    low_water_ms_ = std::max(low_water_ms_, oldest);
    // Every nonce that came with the oldest timestamp goes too: the mark refuses their replays.
    while (!by_time_.empty() && by_time_.begin()->first <= low_water_ms_) ForgetOldest();
  }
  nonces_.insert(header.nonce);
  by_time_.emplace(header.timestamp_ms, header.nonce);
  return true;
}

std::size_t ReplayGuard::size() const {
  MutexLock lock(mu_);
  return nonces_.size();
}

std::uint64_t ReplayGuard::low_water_ms() const {
  MutexLock lock(mu_);
  return low_water_ms_;
}

}  // namespace kvferry::sidechannel
