#include "connector/layer_announcer.h"

#include "common/clock.h"

namespace kvferry {

LayerAnnouncer::LayerAnnouncer(Written written, std::chrono::milliseconds timeout)
    : written_(std::move(written)), timeout_(timeout), thread_([this] { Run(); }) {}

LayerAnnouncer::~LayerAnnouncer() {
  {
    MutexLock lock(mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

void LayerAnnouncer::Add(Entry entry) {
  {
    MutexLock lock(mu_);
    queue_.push_back(std::move(entry));
  }
  cv_.SignalAll();
}

bool LayerAnnouncer::Idle() const {
  MutexLock lock(mu_);
  return queue_.empty() && !busy_;
}

void LayerAnnouncer::Run() {
  for (;;) {
    Entry entry;
    {
      MutexLock lock(mu_);
      busy_ = false;
      while (queue_.empty() && !stopping_) cv_.Wait(mu_);
      if (queue_.empty()) return;  // stopping, and everything handed on
      entry = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    Status s = entry.event == nullptr
                   ? Status::Ok()
                   : entry.event->Wait(DeadlineAfter(timeout_))
                         .WithContext("waiting for the device work that wrote layer " +
                                      std::to_string(entry.layer));
    written_(entry, s);
  }
}

}  // namespace kvferry
