// Authentication of side-channel messages (docs/protocol.md, "Framing and authentication"):
// every message carries a header with a timestamp, a nonce and an HMAC-SHA-256 over the header
// and the body; replies also bind the nonce of the request they answer.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::sidechannel {

inline constexpr std::uint8_t kAuthVersion = 1;
inline constexpr std::size_t kAuthNonceBytes = 16;
inline constexpr std::size_t kAuthHeaderBytes = 4 + 8 + kAuthNonceBytes + 32;  // 60

/// The largest ZeroMQ frame a side-channel socket accepts: a message body at its protocol limit
/// (wire::kMaxMessageBytes, 8 MiB) plus the authentication header. ZeroMQ closes the connection
/// of a peer that announces a larger frame, before buffering any of it.
inline constexpr std::int64_t kMaxFrameBytes = (std::int64_t{8} << 20) + kAuthHeaderBytes;

using AuthNonce = std::array<std::uint8_t, kAuthNonceBytes>;

enum class AuthKind : std::uint8_t { kRequest = 0, kReply = 1 };

struct AuthHeader {
  AuthKind kind = AuthKind::kRequest;
  std::uint64_t timestamp_ms = 0;  // Unix epoch
  AuthNonce nonce{};
};

/// Builds the header for `body`. For a reply, `request_nonce` is the nonce of the request it
/// answers; for a request it is ignored.
std::vector<std::uint8_t> SignMessage(std::string_view secret, AuthKind kind,
                                      std::span<const std::uint8_t> body,
                                      const AuthNonce& request_nonce, AuthNonce* nonce_out);

/// SignMessage with a given timestamp and nonce; for tests of stale and replayed messages.
std::vector<std::uint8_t> SignMessageAt(std::string_view secret, AuthKind kind,
                                        std::span<const std::uint8_t> body,
                                        const AuthNonce& request_nonce, std::uint64_t timestamp_ms,
                                        const AuthNonce& nonce);

/// Checks the header's form, its MAC over `body` (and `request_nonce` for replies) and, for a
/// request, that its timestamp is within `max_skew` of now. Unauthenticated with the reason
/// otherwise. A reply's freshness comes from the request nonce its MAC binds, so its timestamp is
/// not compared with this host's clock: a peer whose clock is off can still tell us so.
Result<AuthHeader> VerifyMessage(std::string_view secret, AuthKind kind,
                                 std::span<const std::uint8_t> header,
                                 std::span<const std::uint8_t> body, const AuthNonce& request_nonce,
                                 std::chrono::milliseconds max_skew);

/// The nonce of a request header that is well-formed (size, version, kind), whether or not its
/// MAC verifies; nullopt otherwise. A refusal of such a request is bound to this nonce, so its
/// sender can verify the refusal and read the reason.
std::optional<AuthNonce> RequestNonceOf(std::span<const std::uint8_t> header);

/// Remembers the nonces of recently accepted requests so a captured message cannot be replayed
/// within the freshness window. Memory is bounded: nonces older than the window are forgotten
/// (their timestamps are stale by then), and at most `capacity` are kept. Thread-safe.
class ReplayGuard {
 public:
  ReplayGuard(std::chrono::milliseconds window, std::size_t capacity)
      : window_(window), capacity_(capacity) {}
  /// True if the nonce is new (and records it); false for a replay.
  bool Accept(const AuthHeader& header);

 private:
  struct Seen {
    std::uint64_t timestamp_ms;
    std::string nonce;
  };
  std::chrono::milliseconds window_;
  std::size_t capacity_;
  std::mutex mu_;
  std::deque<Seen> order_;                  // guarded by mu_
  std::unordered_set<std::string> nonces_;  // guarded by mu_
};

std::uint64_t UnixMillis();

}  // namespace kvferry::sidechannel
