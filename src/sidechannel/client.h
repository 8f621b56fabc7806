// Side-channel requests to peers' listeners: pooled sockets per endpoint, bounded timeouts and
// retries, authenticated replies.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "kvferry/transport.h"
#include "sidechannel/zmq_util.h"
#include "wire/messages.h"

namespace kvferry::sidechannel {

struct ClientOptions {
  std::string secret;
  /// Longest wait for one attempt (send and reply), within the call's deadline.
  std::chrono::milliseconds attempt_timeout{3000};
  /// Attempts per call; an attempt that failed to send or got no reply is retried after a backoff
  /// that doubles from `backoff`. Every message kvferry sends is idempotent at the receiver.
  int max_attempts = 3;
  std::chrono::milliseconds backoff{50};
  std::size_t max_idle_sockets_per_endpoint = 8;
  /// Endpoints with idle sockets kept at once; the least recently used endpoint's sockets are
  /// closed to make room (each idle socket holds a connection and ZeroMQ state).
  std::size_t max_idle_endpoints = 256;
  std::chrono::milliseconds max_clock_skew{30000};
};

struct ClientStats {
  std::uint64_t calls = 0;
  std::uint64_t retries = 0;
  std::uint64_t failures = 0;
  std::uint64_t idle_endpoints = 0;  ///< now, not monotonic
  std::uint64_t idle_sockets = 0;    ///< now, not monotonic
};

/// Thread-safe: calls to different endpoints, or to the same one, run in parallel and never wait
/// on each other (each call holds its own socket).
class Client {
 public:
  explicit Client(ClientOptions options) : options_(std::move(options)) {}

  /// Sends `request` to the listener at `endpoint` ("tcp://host:port") and returns its reply. An
  /// error reply from the peer becomes that error's Status; no reply by `deadline` is Timeout; a
  /// peer that cannot be reached is Unavailable.
  Result<wire::Message> Call(const std::string& endpoint, const wire::Message& request,
                             Deadline deadline) EXCLUDES(mu_);
  ClientStats Stats() EXCLUDES(mu_);

 private:
  Result<ZmqSocket> Acquire(const std::string& endpoint) EXCLUDES(mu_);
  void Return(const std::string& endpoint, ZmqSocket socket) EXCLUDES(mu_);

  const ClientOptions options_;
  Mutex mu_;
  struct Pool {
    std::vector<ZmqSocket> sockets;
    std::uint64_t last_used = 0;  // a tick of use_clock_, for LRU eviction
  };
  std::map<std::string, Pool> idle_ GUARDED_BY(mu_);
  std::uint64_t use_clock_ GUARDED_BY(mu_) = 0;
  std::atomic<std::uint64_t> calls_{0};
  std::atomic<std::uint64_t> retries_{0};
  std::atomic<std::uint64_t> failures_{0};
};

}  // namespace kvferry::sidechannel
