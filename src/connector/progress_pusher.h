// The prefill side's sender of layer-wise progress (docs/layerwise.md): each push goes to a
// subscriber's listener on a thread of its own, so an engine that announces a layer never waits on
// the network. Progress is cumulative, so pushes coalesce: per (subscriber, transfer) only the
// newest waits to be sent, and one endpoint has one push in flight at a time, so a dead subscriber
// ties up one thread, not one per announcement.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/work_queue.h"
#include "connector/layerwise_table.h"
#include "sidechannel/client.h"

namespace kvferry {

struct ProgressPusherOptions {
  /// Threads sending pushes; endpoints beyond it wait their turn.
  int threads = 4;
  /// Pushes waiting to be sent, over all endpoints; past it a push is dropped (and counted): its
  /// subscriber gets the next one, or fails its load by its progress deadline.
  std::size_t max_pending = 16384;
  /// Longest wait for one push's reply.
  std::chrono::milliseconds timeout{1000};
};

/// Thread-safe. `client` must outlive it.
class ProgressPusher {
 public:
  /// `gone(transfer_id, subscriber)`: a subscriber answered NotFound (it no longer reads the
  /// transfer); called on a pusher thread, without the pusher's lock.
  using Gone = std::function<void(const std::string& transfer_id, const std::string& subscriber)>;
  ProgressPusher(sidechannel::Client& client, ProgressPusherOptions options, Gone gone);
  /// Drops what waits, including the rest of a batch a sender took; waits for the push in
  /// flight on each sender (bounded by the timeout).
  ~ProgressPusher();
  ProgressPusher(const ProgressPusher&) = delete;
  ProgressPusher& operator=(const ProgressPusher&) = delete;

  void Push(std::vector<ProgressPush> pushes) EXCLUDES(mu_);

  std::uint64_t sent() const EXCLUDES(mu_);
  std::uint64_t dropped() const EXCLUDES(mu_);

 private:
  using Key = std::pair<std::string, std::string>;  // transfer id, subscriber
  void Drain(const std::string& endpoint) EXCLUDES(mu_);

  sidechannel::Client& client_;
  const ProgressPusherOptions options_;
  const Gone gone_;
  mutable Mutex mu_;
  std::map<std::string, std::map<Key, ProgressPush>> pending_ GUARDED_BY(mu_);  // by endpoint
  std::set<std::string> busy_ GUARDED_BY(mu_);  // endpoints with a Drain queued or running
  std::size_t count_ GUARDED_BY(mu_) = 0;
  std::uint64_t sent_ GUARDED_BY(mu_) = 0;
  std::uint64_t dropped_ GUARDED_BY(mu_) = 0;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::unique_ptr<WorkQueue> senders_;  // last: its threads use the rest
};

}  // namespace kvferry
