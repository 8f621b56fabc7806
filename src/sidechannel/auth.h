// Authentication of side-channel messages (docs/protocol.md, "Framing and authentication"):
// every message carries a header with a timestamp, a nonce and an HMAC-SHA-256 over the header
// and the body; replies also bind the nonce of the request they answer.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/mutex.h"
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

/// Remembers the nonces of recently accepted requests, so that a nonce is accepted once: a
/// captured message cannot be replayed while its timestamp is still fresh, and a message that
/// repeats an accepted nonce under another timestamp (only a holder of the secret can sign one)
/// is refused as well. Shared by the side channel's listener and `kvferry serve`'s control
/// socket (docs/protocol.md, docs/control.md). Thread-safe.
///
/// Memory is bounded: at most `capacity` nonces are kept (size() <= capacity() always). A nonce
/// is forgotten once the timestamp it came with is more than 2 * `window` old; by then a replay
/// is stale (the extra window is a margin for clock steps). When more than `capacity` fresh
/// requests arrive within that time, the nonce with the oldest timestamp is forgotten and that
/// timestamp becomes a low-water mark: from then on every message whose timestamp is not newer
/// than the mark is refused, because it could be the replay of a forgotten one. Eviction therefore
/// never lets a replay (same timestamp and nonce) through; it refuses late messages (timestamps
/// not newer than the newest forgotten one) while the guard is full, and a forgotten nonce signed
/// again under a newer timestamp is accepted.
class ReplayGuard {
 public:
  ReplayGuard(std::chrono::milliseconds window, std::size_t capacity)
      : window_(window), capacity_(capacity > 0 ? capacity : 1) {}
  /// True if the message's nonce is new (and records it); false for a nonce accepted before
  /// (whatever the timestamp), or for a message not newer than the low-water mark.
  bool Accept(const AuthHeader& header) EXCLUDES(mu_);
  /// Nonces remembered now.
  std::size_t size() const EXCLUDES(mu_);
  std::size_t capacity() const { return capacity_; }
  /// Messages with timestamps at or below this are refused (0: nothing was forgotten early).
  std::uint64_t low_water_ms() const EXCLUDES(mu_);

 private:
  // Forgets the oldest remembered nonce.
  void ForgetOldest() REQUIRES(mu_);

  std::chrono::milliseconds window_;
  std::size_t capacity_;
  mutable Mutex mu_;
  // The accepted nonces (the rule) and, by the timestamp each came with, the order in which they
  // are forgotten; the two always hold the same nonces.
  std::set<AuthNonce> nonces_ GUARDED_BY(mu_);
  std::set<std::pair<std::uint64_t, AuthNonce>> by_time_ GUARDED_BY(mu_);
  std::uint64_t low_water_ms_ GUARDED_BY(mu_) = 0;
};

std::uint64_t UnixMillis();

}  // namespace kvferry::sidechannel
