#include "connector/progress_pusher.h"

#include "common/clock.h"
#include "common/log.h"

namespace kvferry {

ProgressPusher::ProgressPusher(sidechannel::Client& client, ProgressPusherOptions options,
                               Gone gone)
    : client_(client), options_(options), gone_(std::move(gone)) {
  senders_ = std::make_unique<WorkQueue>(std::max(1, options_.threads), "kvferry-push",
                                         WorkQueue::kDefaultCapacity, WorkQueue::OnStop::kDrop);
}

ProgressPusher::~ProgressPusher() {
  {
    MutexLock lock(mu_);
    stopping_ = true;  // a batch a sender already took stops at its next push
    pending_.clear();
    count_ = 0;
  }
  senders_.reset();
}

void ProgressPusher::Push(std::vector<ProgressPush> pushes) {
  std::vector<std::string> start;
  {
    MutexLock lock(mu_);
    for (ProgressPush& p : pushes) {
      std::map<Key, ProgressPush>& queue = pending_[p.endpoint];
      Key key{p.progress.transfer_id, p.subscriber};
      auto it = queue.find(key);
      if (it != queue.end()) {
        // Cumulative: the newer one says all the older one did.
        if (p.progress.seq > it->second.progress.seq) it->second = std::move(p);
        continue;
      }
      if (count_ >= options_.max_pending) {
        if (++dropped_ % 1000 == 1) {
          Log().warn("dropped a layer-wise progress push ({} so far): {} are waiting already",
                     dropped_, options_.max_pending);
        }
        continue;
      }
      ++count_;
      const std::string endpoint = p.endpoint;
      queue.emplace(std::move(key), std::move(p));
      if (busy_.insert(endpoint).second) start.push_back(endpoint);
    }
  }
  for (const std::string& endpoint : start) {
    senders_->Post([this, endpoint] { Drain(endpoint); });
  }
}

void ProgressPusher::Drain(const std::string& endpoint) {
  for (;;) {
    std::map<Key, ProgressPush> batch;
    {
      MutexLock lock(mu_);
      auto it = pending_.find(endpoint);
      if (it == pending_.end() || it->second.empty()) {
        if (it != pending_.end()) pending_.erase(it);
        busy_.erase(endpoint);
        return;
      }
      batch.swap(it->second);
      count_ -= batch.size();
    }
    std::size_t done = 0;
    for (auto& [key, push] : batch) {
      {
        MutexLock lock(mu_);
        if (stopping_) return;
      }
      Result<wire::Message> reply =
          client_.Call(endpoint, push.progress, DeadlineAfter(options_.timeout));
      ++done;
      {
        MutexLock lock(mu_);
        ++sent_;
      }
      if (reply.ok()) continue;
      if (reply.status().code() == StatusCode::kNotFound) {
        gone_(key.first, key.second);
        continue;
      }
      // The endpoint did not answer (gone, or stalled): the rest of its batch would wait the
      // same timeout each, one after another (1,024 subscribers on one decode worker held a
      // sender, and a worker's shutdown, for minutes). They are dropped, as past max_pending:
      // each subscriber gets its next push, or fails its load by its progress deadline.
      Log().debug(
          "layer-wise progress of transfer {} to {} failed: {}; dropping the {} other "
          "pushes to it in this batch",
          key.first, endpoint, reply.status().ToString(), batch.size() - done);
      MutexLock lock(mu_);
      dropped_ += batch.size() - done;
      break;
    }
  }
}

std::uint64_t ProgressPusher::sent() const {
  MutexLock lock(mu_);
  return sent_;
}

std::uint64_t ProgressPusher::dropped() const {
  MutexLock lock(mu_);
  return dropped_;
}

}  // namespace kvferry
