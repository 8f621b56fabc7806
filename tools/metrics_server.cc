#include "tools/metrics_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <thread>

#include "common/clock.h"
#include "kvferry/metrics.h"

namespace kvferry::cli {

struct MetricsServer::State {
  httplib::Server server;
  std::thread thread;
  std::atomic<bool> listen_returned{false};  // set by `thread` when listen_after_bind returns
  std::string host;
  int port = 0;
};

Result<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& host, int port,
                                                            std::function<std::string()> render) {
  auto state = std::make_unique<State>();
  httplib::Server& s = state->server;
  // A scrape is small: a short request, one reply. Bounded threads and timeouts, so a client
  // that connects and stalls holds one thread for two seconds at most.
  s.new_task_queue = [] { return new httplib::ThreadPool(2); };
  s.set_read_timeout(2, 0);
  s.set_write_timeout(2, 0);
  s.set_keep_alive_timeout(2);
  s.set_keep_alive_max_count(16);
  s.set_payload_max_length(4096);
  // httplib's default also sets SO_REUSEPORT, which would let a second instance bind the same
  // port and take half the scrapes: SO_REUSEADDR only, so a busy port is an error.
  s.set_socket_options([](socket_t sock) {
    int yes = 1;
    (void)setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  s.Get("/metrics", [render](const httplib::Request&, httplib::Response& res) {
    res.set_content(render(), kPrometheusContentType);
  });
  s.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (res.status == 404 && req.method != "GET" && req.method != "HEAD") res.status = 405;
    res.set_content(
        res.status == 404 ? "only /metrics is served here\n" : "only GET /metrics is served here\n",
        "text/plain");
  });
  if (port == 0) {
    state->port = s.bind_to_any_port(host);
    if (state->port < 0) state->port = 0;
  } else if (s.bind_to_port(host, port)) {
    state->port = port;
  }
  if (state->port == 0) {
    return Status::Unavailable("cannot bind the metrics endpoint to " + host + ":" +
                               std::to_string(port) +
                               ": expected a free port on a local address; pick another "
                               "--metrics-port or --metrics-host");
  }
  state->host = host;
  State* raw = state.get();
  state->thread = std::thread([raw] {
    raw->server.listen_after_bind();
    raw->listen_returned = true;
  });
  // stop() only ends a loop that has started: wait (bounded) until it runs or gave up, so the
  // destructor cannot miss it.
  const Deadline deadline = DeadlineAfter(std::chrono::seconds(5));
  while (!raw->server.is_running() && !raw->listen_returned && !Expired(deadline)) {
    std::this_thread::yield();
  }
  if (!raw->server.is_running()) {
    raw->server.stop();
    raw->thread.join();
    return Status::Internal("the metrics endpoint on " + host + ":" + std::to_string(state->port) +
                            " stopped as it started");
  }
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(state)));
}

MetricsServer::MetricsServer(std::unique_ptr<State> state) : state_(std::move(state)) {}

MetricsServer::~MetricsServer() {
  state_->server.stop();
  if (state_->thread.joinable()) state_->thread.join();
}

int MetricsServer::port() const { return state_->port; }

std::string MetricsServer::url() const {
  const bool v6 = state_->host.find(':') != std::string::npos;
  return "http://" + (v6 ? "[" + state_->host + "]" : state_->host) + ":" +
         std::to_string(state_->port) + "/metrics";
}

}  // namespace kvferry::cli
