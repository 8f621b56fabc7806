// One UCP context and worker with its own progress thread. Every UCX call of the ucx backend runs
// on that thread: other threads hand it closures (Post, Call), which wake it through an eventfd
// that it polls together with the worker's event fd (ucp_worker_get_efd + ucp_worker_arm). So the
// worker is created UCS_THREAD_MODE_SINGLE and no UCX handle is ever touched by two threads.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "kvferry/status.h"
#include "kvferry/transport.h"
#include "transport/ucx/ucx_section.h"

namespace kvferry {

/// "UCS_ERR_...: text" for messages.
std::string UcsText(ucs_status_t status);

/// Thread-safe, except where a member says "progress thread only".
class UcxWorker {
 public:
  /// Runs on the progress thread after every round of progress and at least every `tick`
  /// (deadlines, cancel, liveness); the backend's sweep.
  using Tick = std::function<void(ucp_worker_h)>;

  /// Reads UCX's configuration from its environment (UCX_TLS, UCX_NET_DEVICES, ... pass through
  /// untouched; of UCX_TCP_TX_SEG_SIZE and UCX_TCP_RX_SEG_SIZE, one the environment leaves unset
  /// is kUcxDefaultTcpSegBytes fitted to the other: docs/transport.md, "ucx"), creates the context
  /// (RMA and WAKEUP) and the worker, and starts the thread. `tick` runs there after every round of
  /// progress and at least every `interval`; `stop` runs there last, before the thread exits (the
  /// backend releases its UCX objects in it). Unavailable, naming the UCX call and its status, when
  /// UCX cannot start.
  static Result<std::unique_ptr<UcxWorker>> Create(std::chrono::milliseconds interval, Tick tick,
                                                   Tick stop);
  /// Stops the thread (which runs `stop` last), then destroys the worker and the context.
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  /// Queues `fn` to run on the progress thread; false (and `fn` is dropped) once it is stopping.
  bool Post(std::function<void()> fn) EXCLUDES(mu_);
  /// Runs `fn` on the progress thread and waits for it; runs it inline when called there.
  /// Timeout when the thread has not started it by `deadline` (it then never runs), Cancelled
  /// when the thread has stopped.
  Status Call(const std::function<void()>& fn, Deadline deadline) EXCLUDES(mu_);
  /// Wakes the progress thread for a sweep.
  void Wake();

  bool OnProgressThread() const { return std::this_thread::get_id() == thread_id_; }

  // Progress thread only (and construction/destruction).
  ucp_context_h context() const { return context_; }
  ucp_worker_h worker() const { return worker_; }
  /// The worker's packed address, taken once at creation.
  const std::vector<std::uint8_t>& address() const { return address_; }
  /// The memory types the loaded UCX supports (ucp_context_query: a bit per ucs_memory_type_t),
  /// taken once at creation. Any thread.
  std::uint64_t memory_types() const { return memory_types_; }
  /// The context's TCP segment sizes, as configured at creation. Any thread.
  const UcxTcpSegments& tcp_segments() const { return tcp_segments_; }

 private:
  UcxWorker(std::chrono::milliseconds interval, Tick tick, Tick stop)
      : interval_(interval), tick_(std::move(tick)), stop_(std::move(stop)) {}
  void Loop() EXCLUDES(mu_);
  // Runs the queued closures; false once stop was requested.
  // Runs what was posted; `*ran` tells whether there was anything. False once stopping.
  bool RunQueued(bool* ran) EXCLUDES(mu_);
  // Whether anything waits to be run.
  bool Queued() EXCLUDES(mu_);

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int worker_fd_ = -1;  // owned by the worker
  int wake_fd_ = -1;    // eventfd, ours
  std::vector<std::uint8_t> address_;
  std::uint64_t memory_types_ = 0;
  UcxTcpSegments tcp_segments_;
  const std::chrono::milliseconds interval_;
  const Tick tick_;
  const Tick stop_;

  Mutex mu_;
  std::vector<std::function<void()>> queue_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  std::thread thread_;
  std::thread::id thread_id_;  // set under mu_ before the thread first takes mu_, never again
};

}  // namespace kvferry
