#include "common/work_queue.h"

#include <pthread.h>

#include <utility>

namespace kvferry {

WorkQueue::WorkQueue(int threads, const std::string& name, std::size_t capacity, OnStop on_stop)
    : capacity_(capacity), on_stop_(on_stop) {
  for (int i = 0; i < std::max(threads, 1); ++i) {
    threads_.emplace_back([this] { Run(); });
    // Thread names show in top and gdb; Linux allows 15 characters.
    pthread_setname_np(threads_.back().native_handle(), name.substr(0, 15).c_str());
  }
}

WorkQueue::~WorkQueue() {
  std::deque<std::function<void()>> dropped;
  {
    MutexLock lock(mu_);
    stopping_ = true;
    if (on_stop_ == OnStop::kDrop) dropped.swap(tasks_);
  }
  cv_.SignalAll();
  for (std::thread& t : threads_) t.join();
  // `dropped` is destroyed here, after the threads, without running.
}

Status WorkQueue::TryPost(std::function<void()> task) {
  {
    MutexLock lock(mu_);
    if (stopping_) return Status::Cancelled("the work queue is shutting down");
    if (tasks_.size() >= capacity_) {
      return Status::ResourceExhausted(std::to_string(tasks_.size()) +
                                       " tasks are queued already, the queue's cap; retry later");
    }
    tasks_.push_back(std::move(task));
  }
  cv_.Signal();
  return Status::Ok();
}

void WorkQueue::Post(std::function<void()> task) {
  {
    MutexLock lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.Signal();
}

std::size_t WorkQueue::queued() const {
  MutexLock lock(mu_);
  return tasks_.size();
}

void WorkQueue::Run() {
  for (;;) {
    std::function<void()> task;
    {
      MutexLock lock(mu_);
      while (!stopping_ && tasks_.empty()) cv_.Wait(mu_);
      if (tasks_.empty()) return;  // stopping and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace kvferry
