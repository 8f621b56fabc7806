// The side-channel listener of one worker: a ROUTER socket whose thread only authenticates,
// decodes and hands requests on; handlers run on another thread.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/log.h"
#include "common/mutex.h"
#include "common/work_queue.h"
#include "kvferry/status.h"
#include "sidechannel/auth.h"
#include "sidechannel/zmq_util.h"
#include "wire/messages.h"

namespace kvferry::sidechannel {

/// Default base port: the reference's VLLM_ASCEND_LLMDD_RPC_PORT default.
inline constexpr int kDefaultBasePort = 5557;

struct ListenerOptions {
  /// Address to bind. Without a secret only loopback addresses are allowed, unless
  /// allow_insecure_remote is set explicitly.
  std::string bind_host = "127.0.0.1";
  int base_port = kDefaultBasePort;
  int dp_rank = 0;
  int tp_size = 1;
  int tp_rank = 0;
  /// Pipeline stage of pp_size (the stages of one DP rank take consecutive blocks of tp_size
  /// ports).
  int pp_size = 1;
  int pp_rank = 0;
  std::string secret;
  bool allow_insecure_remote = false;
  /// Requests whose timestamp is further than this from the local clock are refused.
  std::chrono::milliseconds max_clock_skew{30000};
  /// Requests waiting for a handler; more are refused with ResourceExhausted.
  std::size_t max_pending = 1024;
};

/// DESIGN rule 7: base_port + (dp_rank * pp_size + pp_rank) * tp_size + tp_rank; with one
/// pipeline stage, base_port + dp_rank * tp_size + tp_rank.
int ListenerPort(const ListenerOptions& options);

/// Runs on the handler thread for every authenticated, well-formed request (metadata_request,
/// finished, abort, lease, subscribe, progress) and returns the reply (agent_metadata, progress,
/// ack or error).
using RequestHandler = std::function<wire::Message(const wire::Message& request)>;

struct ListenerStats {
  std::uint64_t handled = 0;
  std::uint64_t malformed = 0;  ///< bad framing or undecodable body
  std::uint64_t oversized = 0;
  std::uint64_t unauthenticated = 0;  ///< bad MAC, stale timestamp, replayed nonce
  std::uint64_t overloaded = 0;       ///< refused because max_pending were waiting
};

/// Thread-safe. The destructor stops the thread and waits for handlers already running; the
/// handler must stay callable until then.
class Listener {
 public:
  /// Binds and starts. A busy port is Unavailable naming the port and the setting to change.
  static Result<std::unique_ptr<Listener>> Start(const ListenerOptions& options,
                                                 RequestHandler handler);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  /// "tcp://host:port", as peers should connect to it.
  const std::string& endpoint() const { return endpoint_; }
  ListenerStats Stats() const;

 private:
  struct Outgoing {
    std::vector<std::uint8_t> identity;
    std::vector<std::uint8_t> header;
    std::vector<std::uint8_t> body;
  };

  Listener(ListenerOptions options, RequestHandler handler, ZmqSocket router, int wake,
           std::string endpoint);
  void Run() EXCLUDES(out_mu_);
  void HandleIncoming();
  void Refuse(const std::vector<std::uint8_t>& identity, const AuthNonce& nonce,
              const Status& status, std::atomic<std::uint64_t>* counter);
  void Send(const Outgoing& out);
  void Post(Outgoing out) EXCLUDES(out_mu_);

  const ListenerOptions options_;
  RequestHandler handler_;
  ZmqSocket router_;  // used by the listener thread only, after construction
  int wake_;          // eventfd: replies waiting, or stop
  std::string endpoint_;
  ReplayGuard replay_;

  std::atomic<bool> stopping_{false};
  std::atomic<std::uint64_t> pending_{0};
  std::atomic<std::uint64_t> handled_{0};
  std::atomic<std::uint64_t> malformed_{0};
  std::atomic<std::uint64_t> oversized_{0};
  std::atomic<std::uint64_t> unauthenticated_{0};
  std::atomic<std::uint64_t> overloaded_{0};
  RateLimitedCounter log_limit_;

  Mutex out_mu_;
  std::deque<Outgoing> outbox_ GUARDED_BY(out_mu_);

  std::unique_ptr<WorkQueue> handlers_;
  std::thread thread_;
};

}  // namespace kvferry::sidechannel
