// Finished notices, batched per peer: a decode worker reports many requests to the same prefill
// worker in one message.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/work_queue.h"
#include "sidechannel/client.h"

namespace kvferry::sidechannel {

struct NotifierOptions {
  /// How long a notice may wait for others to the same peer before it is sent.
  std::chrono::milliseconds linger{2};
  std::size_t max_batch = 4096;
  /// Peers notified in parallel, so a dead peer does not delay notices to the others.
  int threads = 4;
};

/// Thread-safe.
class FinishedNotifier {
 public:
  /// Called once per sent batch, on a notifier thread, with the ids it carried and the outcome.
  using Callback =
      std::function<void(const std::string& endpoint, const std::vector<std::string>& request_ids,
                         const Status& result)>;

  /// `self` and `tp_size` identify this worker as the reader in every notice.
  FinishedNotifier(Client* client, wire::PeerRef self, std::uint32_t tp_size,
                   NotifierOptions options, Callback done);
  /// Sends what is pending (each within its deadline), then stops.
  ~FinishedNotifier();
  FinishedNotifier(const FinishedNotifier&) = delete;
  FinishedNotifier& operator=(const FinishedNotifier&) = delete;

  /// Queues a notice that this worker finished reading `request_id` from `endpoint`;
  /// `pp_readers` as wire::FinishedNotice's (one value per endpoint: a prefill instance's stages
  /// are read one way).
  void Finished(const std::string& endpoint, std::string request_id, Deadline deadline,
                std::uint32_t pp_readers = 1) EXCLUDES(mu_);
  /// Sends everything queued now and returns once all of it has been answered or has failed.
  void Flush() EXCLUDES(mu_);

  std::uint64_t batches_sent() const EXCLUDES(mu_);

 private:
  struct Pending {
    std::vector<std::string> ids;
    std::uint32_t pp_readers = 1;
    Deadline deadline = Deadline::max();
    Clock::time_point first = Clock::now();
  };
  void Run() EXCLUDES(mu_);
  void SendAll(std::map<std::string, Pending>&& batch) EXCLUDES(mu_);

  Client* client_;
  const wire::PeerRef self_;
  const std::uint32_t tp_size_;
  const NotifierOptions options_;
  Callback done_;
  std::unique_ptr<WorkQueue> senders_;

  mutable Mutex mu_;
  CondVar cv_;
  std::map<std::string, Pending> pending_ GUARDED_BY(mu_);
  int in_flight_ GUARDED_BY(mu_) = 0;
  bool flush_ GUARDED_BY(mu_) = false;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::uint64_t batches_ GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace kvferry::sidechannel
