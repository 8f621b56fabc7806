// The sim device's stream: one thread that runs copies in order and completes events.
#include <cstring>
#include <deque>
#include <thread>
#include <variant>

#include "common/mutex.h"
#include "device/sim/sim_device.h"
#include "device/sim/sim_table.h"

namespace kvferry::device {
namespace {

// Completion of one sim event. Set once by the stream thread.
struct SimEventState {
  Mutex mu;
  CondVar done_cv;
  bool done GUARDED_BY(mu) = false;
};

class SimEvent final : public Event {
 public:
  explicit SimEvent(std::shared_ptr<SimEventState> state) : state_(std::move(state)) {}
  EventPoll Poll() override {
    MutexLock lock(state_->mu);
    return {state_->done ? EventState::kComplete : EventState::kPending, Status::Ok()};
  }
  Status Wait(Deadline deadline) override {
    MutexLock lock(state_->mu);
    while (!state_->done) {
      if (state_->done_cv.WaitUntil(state_->mu, deadline)) break;  // timed out
    }
    if (!state_->done) {
      return Status::Timeout("sim event: the copies before it had not finished by the deadline");
    }
    return Status::Ok();
  }

 private:
  std::shared_ptr<SimEventState> state_;
};

struct CopyOp {
  std::byte* dst;
  const std::byte* src;
  std::uint64_t size;
  // Keep the device sides mapped while the copy is queued (null for a host side).
  std::shared_ptr<SimMapping> dst_keep;
  std::shared_ptr<SimMapping> src_keep;
};
using Op = std::variant<CopyOp, std::shared_ptr<SimEventState>>;

class SimStream final : public Stream {
 public:
  SimStream(std::shared_ptr<SimTable> table, const SimOptions& options)
      : table_(std::move(table)),
        latency_(options.copy_latency),
        bytes_per_second_(options.bytes_per_second),
        thread_([this] { Run(); }) {
    table_->AddStream(native_handle(), this);
  }

  ~SimStream() override {
    table_->RemoveStream(native_handle());
    {
      MutexLock lock(mu_);
      stopping_ = true;
    }
    queued_.Signal();
    thread_.join();  // runs what is queued first: bounded by the copies already enqueued
  }

  Status CopyHostToDevice(DeviceAddress dst, const std::byte* src, std::uint64_t size) override {
    KVFERRY_RETURN_IF_ERROR(CheckHost(src, size, "sim copy host->device source"));
    KVFERRY_ASSIGN_OR_RETURN(auto d, table_->Resolve(dst, size, "sim copy host->device"));
    return Push(CopyOp{d.backing, src, size, std::move(d.mapping), nullptr});
  }
  Status CopyDeviceToHost(std::byte* dst, DeviceAddress src, std::uint64_t size) override {
    KVFERRY_RETURN_IF_ERROR(CheckHost(dst, size, "sim copy device->host destination"));
    KVFERRY_ASSIGN_OR_RETURN(auto s, table_->Resolve(src, size, "sim copy device->host"));
    return Push(CopyOp{dst, s.backing, size, nullptr, std::move(s.mapping)});
  }
  Status CopyDeviceToDevice(DeviceAddress dst, DeviceAddress src, std::uint64_t size) override {
    KVFERRY_ASSIGN_OR_RETURN(auto d, table_->Resolve(dst, size, "sim copy device->device"));
    KVFERRY_ASSIGN_OR_RETURN(auto s, table_->Resolve(src, size, "sim copy device->device"));
    return Push(CopyOp{d.backing, s.backing, size, std::move(d.mapping), std::move(s.mapping)});
  }
  Result<std::unique_ptr<Event>> RecordEvent() override {
    auto state = std::make_shared<SimEventState>();
    KVFERRY_RETURN_IF_ERROR(Push(state));
    return std::unique_ptr<Event>(new SimEvent(std::move(state)));
  }
  std::uint64_t native_handle() const override { return reinterpret_cast<std::uint64_t>(this); }

 private:
  // A host side must be host memory: a sim address there is the bug this device exists to catch.
  Status CheckHost(const std::byte* p, std::uint64_t size, const char* what) const {
    if (p == nullptr && size > 0) return Status::InvalidArgument(std::string(what) + " is null");
    const auto a = reinterpret_cast<DeviceAddress>(p);
    if (table_->Find(a) != nullptr || (size > 0 && table_->Find(a + size - 1) != nullptr)) {
      return Status::InvalidArgument(std::string(what) + ": expected host memory; found " +
                                     table_->device_name() +
                                     " device memory (use a device->device copy)");
    }
    return Status::Ok();
  }

  Status Push(Op op) EXCLUDES(mu_) {
    bool wake = false;
    {
      MutexLock lock(mu_);
      queue_.push_back(std::move(op));
      wake = idle_;  // the thread sleeps only when it found the queue empty
      idle_ = false;
    }
    if (wake) queued_.Signal();
    return Status::Ok();
  }

  // Takes everything queued at once, runs it in order, and sleeps only when nothing is left: a
  // burst of copies costs one wake-up, not one per copy.
  void Run() EXCLUDES(mu_) {
    std::deque<Op> ops;
    for (;;) {
      {
        MutexLock lock(mu_);
        while (!stopping_ && queue_.empty()) {
          idle_ = true;
          queued_.Wait(mu_);
        }
        idle_ = false;
        if (queue_.empty()) return;  // stopping and drained
        ops.swap(queue_);
      }
      for (Op& op : ops) {
        if (auto* copy = std::get_if<CopyOp>(&op)) {
          const auto start = Clock::now();
          std::memmove(copy->dst, copy->src, copy->size);
          Throttle(start, copy->size);
        } else {
          auto& state = std::get<std::shared_ptr<SimEventState>>(op);
          {
            MutexLock lock(state->mu);
            state->done = true;
          }
          state->done_cv.SignalAll();
        }
      }
      ops.clear();  // drops the mappings the copies kept alive
    }
  }

  // The simulated cost of a copy: latency plus size at the configured bandwidth. This models the
  // device's time, it synchronises nothing.
  void Throttle(Clock::time_point start, std::uint64_t size) const {
    auto cost = std::chrono::duration_cast<Clock::duration>(latency_);
    if (bytes_per_second_ > 0) {
      cost += std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(static_cast<double>(size) / bytes_per_second_));
    }
    if (cost.count() > 0) std::this_thread::sleep_until(start + cost);
  }

  const std::shared_ptr<SimTable> table_;
  const std::chrono::nanoseconds latency_;
  const double bytes_per_second_;
  Mutex mu_;
  CondVar queued_;
  std::deque<Op> queue_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  bool idle_ GUARDED_BY(mu_) = false;  // the thread waits for queued_
  std::thread thread_;                 // last: starts after the members it uses
};

}  // namespace

Result<std::unique_ptr<Stream>> CreateSimStream(std::shared_ptr<SimTable> table,
                                                const SimOptions& options) {
  return std::unique_ptr<Stream>(new SimStream(std::move(table), options));
}

}  // namespace kvferry::device
