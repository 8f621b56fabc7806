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
    for (auto& [key, push] : batch) {
      Result<wire::Message> reply =
          client_.Call(endpoint, push.progress, DeadlineAfter(options_.timeout));
      {
        MutexLock lock(mu_);
        ++sent_;
      }
      if (reply.ok()) continue;
      if (reply.status().code() == StatusCode::kNotFound) {
        gone_(key.first, key.second);
      } else {
        Log().debug("layer-wise progress of transfer {} to {} failed: {}", key.first, endpoint,
                    reply.status().ToString());
      }
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
