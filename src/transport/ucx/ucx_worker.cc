#include "transport/ucx/ucx_worker.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/errno_text.h"
#include "common/log.h"
#include "transport/ucx/ucx_api.h"

namespace kvferry {

std::string UcsText(ucs_status_t status) {
  Result<const UcxApi*> ucx = LoadUcx();
  return (ucx.ok() ? std::string((*ucx)->ucs_status_string(status)) + " " : std::string()) +
         "(UCS status " + std::to_string(static_cast<int>(status)) + ")";
}

namespace {

Status UcxCallFailed(const char* call, ucs_status_t status) {
  return Status::Unavailable(std::string(call) + " failed: " + UcsText(status) +
                             "; check UCX's configuration (UCX_TLS, UCX_NET_DEVICES; `ucx_info "
                             "-d` lists the transports this host has)");
}

// Whether UCX may open its tcp transport, as UCX_TLS and UCX_NET_DEVICES say (unset or "all":
// yes; a "^" list: unless it names tcp; a list: if it names tcp; devices: if one is a network
// interface of this host). kvferry sets tcp's segment sizes only then: UCX warns on stdout of
// every worker about a modified key that no transport took.
bool UcxMayUseTcp() {
  auto tokens = [](const char* list) {
    std::vector<std::string> out;
    std::string item;
    for (const char* c = list;; ++c) {
      if (*c == ',' || *c == '\0') {
        if (!item.empty()) out.push_back(item);
        item.clear();
        if (*c == '\0') break;
      } else if (*c != '\\') {
        item += *c;
      }
    }
    return out;
  };
  const char* tls = std::getenv("UCX_TLS");
  if (tls != nullptr && *tls != '\0') {
    const bool negated = tls[0] == '^';
    const std::vector<std::string> names = tokens(negated ? tls + 1 : tls);
    const bool named = std::find(names.begin(), names.end(), "tcp") != names.end();
    const bool all = std::find(names.begin(), names.end(), "all") != names.end();
    if (negated ? named : !(named || all)) return false;
  }
  const char* devices = std::getenv("UCX_NET_DEVICES");
  if (devices == nullptr || *devices == '\0' || devices[0] == '^') return true;
  for (const std::string& device : tokens(devices)) {
    const std::string name = device.substr(0, device.find(':'));
    if (name == "all" || access(("/sys/class/net/" + name).c_str(), F_OK) == 0) return true;
  }
  return false;
}

// UCX_TCP_TX_SEG_SIZE and UCX_TCP_RX_SEG_SIZE as the context will have them: one the environment
// sets stands (parsed for the section, 0 where it cannot be); one it leaves unset is kvferry's
// default, the tx no larger than a set rx and the rx no smaller than a set tx; where the other is
// set but unreadable, UCX's own default stays (and is reported unknown). Both unknown, and left
// alone, where UCX will not use tcp.
Result<UcxTcpSegments> ConfigureTcpSegments(ucp_config_t* config) {
  if (!UcxMayUseTcp()) return UcxTcpSegments{};
  const char* tx_env = std::getenv("UCX_TCP_TX_SEG_SIZE");
  const char* rx_env = std::getenv("UCX_TCP_RX_SEG_SIZE");
  UcxTcpSegments seg;
  if (tx_env != nullptr) seg.tx = ParseUcxMemunits(tx_env);
  if (rx_env != nullptr) seg.rx = ParseUcxMemunits(rx_env);
  if (tx_env == nullptr && (rx_env == nullptr || seg.rx != 0)) {
    seg.tx = rx_env == nullptr ? kUcxDefaultTcpSegBytes : std::min(kUcxDefaultTcpSegBytes, seg.rx);
  }
  if (rx_env == nullptr && (tx_env == nullptr || seg.tx != 0)) {
    seg.rx = std::max(kUcxDefaultTcpSegBytes, seg.tx);
  }
  // UCX applies a modified key to each transport's table by its name without the transport's
  // prefix (UCX 1.13 warns "invalid configuration" for "TCP_TX_SEG_SIZE"); only tcp has these two.
  auto set = [&](const char* name, std::uint64_t bytes) -> Status {
    const ucs_status_t s = Ucx().ucp_config_modify(config, name, std::to_string(bytes).c_str());
    return s == UCS_OK ? Status::Ok() : UcxCallFailed("ucp_config_modify", s);
  };
  if (tx_env == nullptr && seg.tx != 0) KVFERRY_RETURN_IF_ERROR(set("TX_SEG_SIZE", seg.tx));
  if (rx_env == nullptr && seg.rx != 0) KVFERRY_RETURN_IF_ERROR(set("RX_SEG_SIZE", seg.rx));
  return seg;
}

}  // namespace

Result<std::unique_ptr<UcxWorker>> UcxWorker::Create(std::chrono::milliseconds interval, Tick tick,
                                                     Tick stop) {
  KVFERRY_RETURN_IF_ERROR(LoadUcx().status());  // the first use of UCX in this process
  std::unique_ptr<UcxWorker> w(new UcxWorker(interval, std::move(tick), std::move(stop)));
  ucp_config_t* config = nullptr;
  ucs_status_t s = Ucx().ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return UcxCallFailed("ucp_config_read", s);
  Result<UcxTcpSegments> segments = ConfigureTcpSegments(config);
  if (!segments.ok()) {
    Ucx().ucp_config_release(config);
    return segments.status();
  }
  w->tcp_segments_ = *segments;
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  s = Ucx().ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &w->context_);
  Ucx().ucp_config_release(config);
  if (s != UCS_OK) {
    w->context_ = nullptr;
    return UcxCallFailed("ucp_init", s);
  }
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  s = Ucx().ucp_context_query(w->context_, &attr);
  if (s != UCS_OK) return UcxCallFailed("ucp_context_query", s);
  w->memory_types_ = attr.memory_types;
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches it
  s = Ucx().ucp_worker_create(w->context_, &wp, &w->worker_);
  if (s != UCS_OK) {
    w->worker_ = nullptr;
    return UcxCallFailed("ucp_worker_create", s);
  }
  s = Ucx().ucp_worker_get_efd(w->worker_, &w->worker_fd_);
  if (s != UCS_OK) return UcxCallFailed("ucp_worker_get_efd", s);
  ucp_address_t* address = nullptr;
  std::size_t length = 0;
  s = Ucx().ucp_worker_get_address(w->worker_, &address, &length);
  if (s != UCS_OK) return UcxCallFailed("ucp_worker_get_address", s);
  const auto* a = reinterpret_cast<const std::uint8_t*>(address);
  w->address_.assign(a, a + length);
  Ucx().ucp_worker_release_address(w->worker_, address);

  w->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (w->wake_fd_ < 0) {
    return Status::Unavailable(std::string("eventfd failed: ") + ErrnoText(errno));
  }
  {
    // The thread's first RunQueued waits for this lock, so it sees thread_id_.
    MutexLock lock(w->mu_);
    UcxWorker* raw = w.get();
    w->thread_ = std::thread([raw] { raw->Loop(); });
    pthread_setname_np(w->thread_.native_handle(), "kvferry-ucx");
    w->thread_id_ = w->thread_.get_id();
  }
  return w;
}

UcxWorker::~UcxWorker() {
  if (thread_.joinable()) {
    {
      MutexLock lock(mu_);
      stopping_ = true;
    }
    Wake();
    thread_.join();
  }
  if (wake_fd_ >= 0) close(wake_fd_);
  if (worker_ != nullptr) Ucx().ucp_worker_destroy(worker_);
  if (context_ != nullptr) Ucx().ucp_cleanup(context_);
}

bool UcxWorker::Post(std::function<void()> fn) {
  {
    MutexLock lock(mu_);
    if (stopping_) return false;
    queue_.push_back(std::move(fn));
  }
  Wake();
  return true;
}

Status UcxWorker::Call(const std::function<void()>& fn, Deadline deadline) {
  if (OnProgressThread()) {
    fn();
    return Status::Ok();
  }
  // The closure runs `fn` only while the caller still waits: it holds slot->mu while `fn` runs,
  // and a caller that gives up marks the slot abandoned under that lock.
  struct Slot {
    Mutex mu;
    CondVar cv;
    bool done GUARDED_BY(mu) = false;
    bool abandoned GUARDED_BY(mu) = false;
  };
  auto slot = std::make_shared<Slot>();
  const std::function<void()>* f = &fn;
  const bool posted = Post([slot, f] {
    MutexLock lock(slot->mu);
    if (slot->abandoned) return;
    (*f)();
    slot->done = true;
    slot->cv.SignalAll();
  });
  if (!posted) return Status::Cancelled("the ucx progress thread has stopped");
  MutexLock lock(slot->mu);
  while (!slot->done) {
    if (slot->cv.WaitUntil(slot->mu, deadline) && !slot->done) {
      slot->abandoned = true;
      return Status::Timeout(
          "the ucx progress thread did not take the work before its deadline; it is busy or "
          "stuck in a UCX call");
    }
  }
  return Status::Ok();
}

void UcxWorker::Wake() {
  const std::uint64_t one = 1;
  // EAGAIN: the counter is saturated, so the thread will wake anyway.
  [[maybe_unused]] const ssize_t n = write(wake_fd_, &one, sizeof(one));
}

bool UcxWorker::Queued() {
  MutexLock lock(mu_);
  return !queue_.empty();
}

bool UcxWorker::RunQueued(bool* ran) {
  std::vector<std::function<void()>> work;
  {
    MutexLock lock(mu_);
    if (stopping_) return false;
    work.swap(queue_);
  }
  *ran = !work.empty();
  for (std::function<void()>& fn : work) fn();
  return true;
}

void UcxWorker::Loop() {
  const int timeout_ms = static_cast<int>(interval_.count());
  // Adaptive polling: after any activity the thread keeps polling the worker for kSpin before it
  // arms it and sleeps. While gets flow, the next event is usually a few microseconds away, and a
  // sleep and wake-up per event (over UCX's tcp transport: one per emulated get, on both sides)
  // cost more than the event itself; idle, it sleeps after kSpin, so an idle peer costs nothing.
  constexpr auto kSpin = std::chrono::microseconds(100);
  Clock::time_point active = Clock::now();
  bool ran = false;
  while (RunQueued(&ran)) {
    unsigned progressed = ran ? 1 : 0;
    while (Ucx().ucp_worker_progress(worker_) != 0) ++progressed;
    tick_(worker_);
    // The tick may have issued operations or completed some: progress before sleeping.
    if (Ucx().ucp_worker_progress(worker_) != 0) {
      active = Clock::now();
      continue;
    }
    const Clock::time_point now = Clock::now();
    if (progressed != 0 || Queued()) active = now;
    if (now - active < kSpin) continue;  // still busy a moment ago: poll again
    const ucs_status_t armed = Ucx().ucp_worker_arm(worker_);
    if (armed == UCS_ERR_BUSY) continue;  // events arrived meanwhile
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {worker_fd_, POLLIN, 0}};
    // Bounded: the tick sweeps deadlines, cancels and liveness at least this often.
    if (poll(fds, 2, timeout_ms) > 0 && (fds[0].revents & POLLIN) != 0) {
      std::uint64_t count = 0;
      [[maybe_unused]] const ssize_t n = read(wake_fd_, &count, sizeof(count));
    }
  }
  // Closures queued after stop are dropped; Call's callers never wait for them (see ~UcxWorker).
  stop_(worker_);
}

}  // namespace kvferry
