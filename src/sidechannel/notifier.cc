#include "sidechannel/notifier.h"

#include <pthread.h>

#include <algorithm>

namespace kvferry::sidechannel {

FinishedNotifier::FinishedNotifier(Client* client, wire::PeerRef self, std::uint32_t tp_size,
                                   NotifierOptions options, Callback done)
    : client_(client),
      self_(std::move(self)),
      tp_size_(tp_size),
      options_(options),
      done_(std::move(done)),
      senders_(std::make_unique<WorkQueue>(options.threads, "kvferry-notify")) {
  thread_ = std::thread([this] { Run(); });
  pthread_setname_np(thread_.native_handle(), "kvferry-notices");
}

FinishedNotifier::~FinishedNotifier() {
  Flush();
  {
    MutexLock lock(mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  thread_.join();
  senders_.reset();
}

void FinishedNotifier::Finished(const std::string& endpoint, std::string request_id,
                                Deadline deadline, std::uint32_t pp_readers) {
  {
    MutexLock lock(mu_);
    Pending& p = pending_[endpoint];
    if (p.ids.empty()) p.first = Clock::now();
    p.pp_readers = pp_readers;
    p.ids.push_back(std::move(request_id));
    p.deadline = std::min(p.deadline, deadline);
  }
  cv_.SignalAll();
}

void FinishedNotifier::Flush() {
  MutexLock lock(mu_);
  flush_ = true;
  cv_.SignalAll();
  while (!pending_.empty() || in_flight_ != 0) cv_.Wait(mu_);
  flush_ = false;
}

std::uint64_t FinishedNotifier::batches_sent() const {
  MutexLock lock(mu_);
  return batches_;
}

void FinishedNotifier::Run() {
  UniqueLock lock(mu_);
  for (;;) {
    while (!stopping_ && pending_.empty()) cv_.Wait(mu_);
    if (stopping_ && pending_.empty()) return;
    // Wait out the linger of the oldest notice, unless a flush or a full batch asks for now.
    Clock::time_point due = Clock::time_point::max();
    bool full = false;
    for (const auto& [endpoint, p] : pending_) {
      due = std::min(due, p.first + options_.linger);
      full = full || p.ids.size() >= options_.max_batch;
    }
    if (!flush_ && !stopping_ && !full && Clock::now() < due) {
      cv_.WaitUntil(mu_, due);
      continue;
    }
    std::map<std::string, Pending> batch;
    batch.swap(pending_);
    in_flight_ += static_cast<int>(batch.size());
    lock.Unlock();
    SendAll(std::move(batch));
    lock.Lock();
  }
}

void FinishedNotifier::SendAll(std::map<std::string, Pending>&& batch) {
  for (auto& [endpoint, pending] : batch) {
    senders_->Post([this, endpoint = endpoint, p = std::move(pending)] {
      for (std::size_t start = 0; start < p.ids.size(); start += options_.max_batch) {
        const std::size_t end = std::min(p.ids.size(), start + options_.max_batch);
        std::vector<std::string> ids(p.ids.begin() + static_cast<std::ptrdiff_t>(start),
                                     p.ids.begin() + static_cast<std::ptrdiff_t>(end));
        Result<wire::Message> reply = client_->Call(
            endpoint, wire::FinishedNotice{self_, ids, tp_size_, p.pp_readers}, p.deadline);
        Status s = reply.status();
        if (s.ok() && !std::holds_alternative<wire::Ack>(*reply)) {
          s = Status::Internal("peer " + endpoint + " answered a finished notice with '" +
                               wire::MessageTypeName(*reply) + "'");
        }
        {
          MutexLock lock(mu_);
          ++batches_;
        }
        if (done_) done_(endpoint, ids, s);
      }
      MutexLock lock(mu_);
      --in_flight_;
      cv_.SignalAll();
    });
  }
}

}  // namespace kvferry::sidechannel
