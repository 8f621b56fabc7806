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
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
  senders_.reset();
}

void FinishedNotifier::Finished(const std::string& endpoint, std::string request_id,
                                Deadline deadline) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Pending& p = pending_[endpoint];
    if (p.ids.empty()) p.first = Clock::now();
    p.ids.push_back(std::move(request_id));
    p.deadline = std::min(p.deadline, deadline);
  }
  cv_.notify_all();
}

void FinishedNotifier::Flush() {
  std::unique_lock<std::mutex> lock(mu_);
  flush_ = true;
  cv_.notify_all();
  cv_.wait(lock, [&] { return pending_.empty() && in_flight_ == 0; });
  flush_ = false;
}

std::uint64_t FinishedNotifier::batches_sent() const {
  std::lock_guard<std::mutex> lock(mu_);
  return batches_;
}

void FinishedNotifier::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
    if (stopping_ && pending_.empty()) return;
    // Wait out the linger of the oldest notice, unless a flush or a full batch asks for now.
    Clock::time_point due = Clock::time_point::max();
    bool full = false;
    for (const auto& [endpoint, p] : pending_) {
      due = std::min(due, p.first + options_.linger);
      full = full || p.ids.size() >= options_.max_batch;
    }
    if (!flush_ && !stopping_ && !full && Clock::now() < due) {
      cv_.wait_until(lock, due);
      continue;
    }
    std::map<std::string, Pending> batch;
    batch.swap(pending_);
    in_flight_ += static_cast<int>(batch.size());
    lock.unlock();
    SendAll(std::move(batch));
    lock.lock();
  }
}

void FinishedNotifier::SendAll(std::map<std::string, Pending>&& batch) {
  for (auto& [endpoint, pending] : batch) {
    senders_->Post([this, endpoint = endpoint, p = std::move(pending)] {
      for (std::size_t start = 0; start < p.ids.size(); start += options_.max_batch) {
        const std::size_t end = std::min(p.ids.size(), start + options_.max_batch);
        std::vector<std::string> ids(p.ids.begin() + static_cast<std::ptrdiff_t>(start),
                                     p.ids.begin() + static_cast<std::ptrdiff_t>(end));
        Result<wire::Message> reply =
            client_->Call(endpoint, wire::FinishedNotice{self_, ids, tp_size_}, p.deadline);
        Status s = reply.status();
        if (s.ok() && !std::holds_alternative<wire::Ack>(*reply)) {
          s = Status::Internal("peer " + endpoint + " answered a finished notice with '" +
                               wire::MessageTypeName(*reply) + "'");
        }
        {
          std::lock_guard<std::mutex> lock(mu_);
          ++batches_;
        }
        if (done_) done_(endpoint, ids, s);
      }
      std::lock_guard<std::mutex> lock(mu_);
      --in_flight_;
      cv_.notify_all();
    });
  }
}

}  // namespace kvferry::sidechannel
