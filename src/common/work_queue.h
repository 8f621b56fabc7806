// A fixed pool of threads running queued tasks in order of submission, with a bounded queue.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "kvferry/status.h"

namespace kvferry {

/// Thread-safe.
class WorkQueue {
 public:
  /// What the destructor does with tasks still queued: run them (a task that must report
  /// completion always does), or drop them (best-effort work such as network notices, which
  /// must not delay shutdown by their timeouts).
  enum class OnStop { kRun, kDrop };

  /// `capacity`: tasks queued (not yet running) at most; TryPost refuses past it.
  WorkQueue(int threads, const std::string& name, std::size_t capacity = kDefaultCapacity,
            OnStop on_stop = OnStop::kRun);
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  static constexpr std::size_t kDefaultCapacity = 65536;

  /// Queues `task`; ResourceExhausted (and the task is not run) when `capacity` tasks are queued
  /// already, Cancelled once the queue is being destroyed.
  Status TryPost(std::function<void()> task) EXCLUDES(mu_);
  /// Queues `task` past the capacity, for callers whose own caps already bound how many tasks
  /// they queue (a batch's units, the listener's pending handlers).
  void Post(std::function<void()> task) EXCLUDES(mu_);

  std::size_t queued() const EXCLUDES(mu_);

 private:
  void Run() EXCLUDES(mu_);

  const std::size_t capacity_;
  const OnStop on_stop_;
  mutable Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> tasks_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvferry
