// The prefill side of the tcp backend: one epoll thread that authenticates every connection and
// serves read requests with vectored writes straight from registered memory.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "transport/region_registry.h"
#include "transport/tcp/socket.h"

namespace kvferry::tcp {

struct ServerCounters {
  std::atomic<std::uint64_t> bytes_served{0};
  std::atomic<std::uint64_t> refused{0};
};

class TcpServer {
 public:
  /// Binds and starts serving. `registry` and `counters` must outlive the server. With an empty
  /// secret only loopback clients are accepted.
  static Result<std::unique_ptr<TcpServer>> Start(RegionRegistry* registry, const std::string& host,
                                                  std::uint16_t port, std::string secret,
                                                  ServerCounters* counters);
  ~TcpServer();
  TcpServer(const TcpServer&) = delete;
  TcpServer& operator=(const TcpServer&) = delete;

  std::uint16_t port() const { return port_; }
  /// Random per server: a restarted process listening on the same port has another.
  std::uint64_t instance() const { return instance_; }

 private:
  TcpServer(RegionRegistry* registry, Fd listener, std::uint16_t port, std::string secret,
            ServerCounters* counters, Fd epoll, Fd wake);
  void Run();

  RegionRegistry* registry_;
  Fd listener_;
  std::uint16_t port_;
  std::uint64_t instance_;
  std::string secret_;
  ServerCounters* counters_;
  Fd epoll_;
  Fd wake_;  // eventfd: wakes the loop to stop
  std::thread thread_;
};

}  // namespace kvferry::tcp
