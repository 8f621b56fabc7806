// The HTTP endpoint of `kvferry serve --metrics-port`: GET /metrics in the Prometheus text
// format (docs/observability.md), served by cpp-httplib on threads of its own.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "kvferry/status.h"

namespace kvferry::cli {

class MetricsServer {
 public:
  /// Binds host:port (port 0: any free port) and serves GET /metrics with the text `render`
  /// returns, called on a server thread for every scrape: it must be thread-safe. Other paths
  /// get 404, other methods 405. Unavailable when the address cannot be bound.
  static Result<std::unique_ptr<MetricsServer>> Start(const std::string& host, int port,
                                                      std::function<std::string()> render);
  /// Stops listening, finishes the scrape in progress and joins the server threads.
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const;
  /// http://host:port/metrics (IPv6 hosts in brackets).
  std::string url() const;

 private:
  struct State;
  explicit MetricsServer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace kvferry::cli
