// The proxy's side of the serve control protocol (docs/control.md): one DEALER connection to a
// kvferry serve instance, requests signed with the instance's secret, replies accepted only when
// they verify and answer a request this client sent.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "common/clock.h"
#include "sidechannel/auth.h"
#include "sidechannel/zmq_util.h"

namespace kvferry::cli {

/// Not thread-safe: one thread sends and receives.
class ControlClient {
 public:
  /// Connects (lazily, as ZeroMQ does) to `endpoint` (tcp://host:port). `secret` is the
  /// instance's KVFERRY_SECRET; empty for an instance without one.
  ControlClient(const std::string& endpoint, std::string secret);

  /// Signs and sends one request; remembers its nonce so its reply can be verified. Unavailable
  /// if the instance did not take it within 5 s.
  Status Send(const nlohmann::json& request);
  /// The next reply that is ready, verified: signed with the secret, bound to the nonce of a
  /// request this client sent, each accepted once. Others are dropped and counted (rejected()).
  /// Carries "request_nonce" (hex) as the instance sent it.
  std::optional<nlohmann::json> TryRecv();
  /// Sends `request` and waits for its reply (other replies that arrive meanwhile are dropped:
  /// call it with no generate in flight). Timeout if none within `timeout`.
  Result<nlohmann::json> Call(const nlohmann::json& request, std::chrono::milliseconds timeout);

  void* socket() const { return socket_.get(); }
  /// Replies dropped because they failed verification or answered no request of ours.
  std::uint64_t rejected() const { return rejected_; }

 private:
  // Forgets nonces of requests sent longer ago than any reply can be awaited (aborts are
  // answered only when refused).
  void Prune();

  std::string secret_;
  std::string endpoint_;
  sidechannel::ZmqSocket socket_;
  std::map<sidechannel::AuthNonce, Clock::time_point> outstanding_;
  std::optional<sidechannel::AuthNonce> last_sent_;
  std::uint64_t rejected_ = 0;
};

}  // namespace kvferry::cli
