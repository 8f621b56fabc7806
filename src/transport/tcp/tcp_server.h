// The prefill side of the tcp backend: one epoll thread that authenticates every connection and
// serves read requests with vectored writes straight from registered memory.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "transport/region_registry.h"
#include "transport/tcp/socket.h"

namespace kvferry::tcp {

struct ServerCounters {
  std::atomic<std::uint64_t> bytes_served{0};
  std::atomic<std::uint64_t> refused{0};
  /// Connections closed by a cap or deadline (part of `refused` too); for tests and stats.
  std::atomic<std::uint64_t> connections_refused{0};
  std::atomic<std::uint64_t> handshake_timeouts{0};
  std::atomic<std::uint64_t> idle_closed{0};
  std::atomic<std::uint64_t> stalled_closed{0};
  std::atomic<std::uint64_t> accept_exhausted{0};  ///< accept4 failed with EMFILE/ENFILE
  std::atomic<std::uint64_t> connections_open{0};  ///< now, not monotonic
  /// Now: pinned bytes held to stage device memory, by the server's connections and by the
  /// backend's client connections (TransportStats::staging_bytes).
  std::atomic<std::uint64_t> staging_bytes{0};
};

/// What one server allows each client (docs/reliability.md, "Hostile input"). Every connection
/// is closed by one of these deadlines unless it is authenticated and busy.
struct ServerLimits {
  /// A client must finish the handshake within this time after it connected.
  std::chrono::milliseconds handshake_timeout{3000};
  /// An authenticated connection with nothing to send or receive for this long is closed; the
  /// client reconnects on its next read without counting a failed attempt.
  std::chrono::milliseconds idle_timeout{120000};
  /// A connection whose responses make no progress (the client stopped reading) for this long is
  /// closed, so that memory pinned for its responses is released.
  std::chrono::milliseconds send_stall_timeout{10000};
  /// Connections open at once, in total and from one source address; past either the new one is
  /// closed at once.
  std::size_t max_connections = 512;
  std::size_t max_connections_per_source = 128;
};

class TcpServer {
 public:
  /// Binds and starts serving. `registry` and `counters` must outlive the server. With an empty
  /// secret only loopback clients are accepted.
  static Result<std::unique_ptr<TcpServer>> Start(RegionRegistry* registry, const std::string& host,
                                                  std::uint16_t port, std::string secret,
                                                  ServerCounters* counters,
                                                  ServerLimits limits = {});
  ~TcpServer();
  TcpServer(const TcpServer&) = delete;
  TcpServer& operator=(const TcpServer&) = delete;

  std::uint16_t port() const { return port_; }
  /// Random per server: a restarted process listening on the same port has another.
  std::uint64_t instance() const { return instance_; }

  /// Closes, soon and on the server's thread, every connection with a queued response that pins
  /// `region`, so that removing the region does not wait for a slow client. Thread-safe.
  void RevokeRegion(RegionId region) EXCLUDES(revoke_mu_);

 private:
  TcpServer(RegionRegistry* registry, Fd listener, std::uint16_t port, std::string secret,
            ServerCounters* counters, ServerLimits limits, Fd epoll, Fd wake);
  void Run() EXCLUDES(revoke_mu_);
  std::vector<RegionId> TakeRevoked() EXCLUDES(revoke_mu_);

  RegionRegistry* registry_;
  Fd listener_;
  std::uint16_t port_;
  std::uint64_t instance_;
  std::string secret_;
  ServerCounters* counters_;
  ServerLimits limits_;
  Fd epoll_;
  Fd wake_;  // eventfd: wakes the loop to stop or to revoke regions
  std::atomic<bool> stopping_{false};
  Mutex revoke_mu_;
  std::vector<RegionId> revoked_ GUARDED_BY(revoke_mu_);
  std::thread thread_;
};

}  // namespace kvferry::tcp
