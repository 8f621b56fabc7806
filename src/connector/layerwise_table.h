// The prefill side of layer-wise transfer (DESIGN rule 16, docs/layerwise.md): which transfers
// this worker writes, how far each has been written, who subscribed to it and what to tell them.
// Pure logic with an injected clock value, so a unit test reaches every rule without threads or
// sockets; the worker calls it under its lock and sends the pushes it returns outside the lock.
// Not thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/clock.h"
#include "kvferry/connector.h"
#include "wire/messages.h"

namespace kvferry {

struct LayerwiseLimits {
  /// The layers of each KV cache group of the cache, in group order (one entry for a uniform
  /// model). The engine's layer index (LayerWritten) runs over them group after group.
  std::vector<int> group_layers{1};
  /// One announcement per this many layers written, and one after the last layer.
  int layers_per_notice = 1;
  /// Transfers subscribed to before this worker started them (the only entries a peer can
  /// create); past it a subscription is ResourceExhausted.
  std::size_t max_waiting = 4096;
  /// Subscribers of one transfer (distinct readers); past it ResourceExhausted.
  std::size_t max_subscribers = 256;
  /// The longest a subscription waits for its transfer to start: Subscribe::wait_ms is clamped.
  std::chrono::milliseconds max_wait{120000};
};

/// A progress message for one subscriber, to be sent outside the caller's lock.
struct ProgressPush {
  std::string endpoint;
  std::string subscriber;  // the reader's key (engine/dp/tp)
  wire::Progress progress;
};

class LayerwiseTable {
 public:
  /// `self`: this worker, the `from` of every progress message.
  LayerwiseTable(LayerwiseLimits limits, wire::PeerRef self);

  // The engine's side.

  /// A step writes `save`'s tokens [first_token, end_token). Starts the transfer (answering
  /// subscribers that waited for it), or goes on with it; tokens before first_token count as
  /// written in every layer. A save whose first token lies before what was already written, or
  /// whose request or prompt length differs from the transfer's, fails the transfer.
  std::vector<ProgressPush> Begin(const LayerwiseSave& save, Clock::time_point now);
  /// Layer `layer` of the step that wrote `saves` is written: pushes the progress of each to its
  /// subscribers every layers_per_notice layers and after the last layer. With several KV cache
  /// groups `layer` runs over group 0's layers, then group 1's, ...; a group's layers come in
  /// order, the groups in any order among each other (the model interleaves them).
  std::vector<ProgressPush> LayerWritten(std::span<const LayerwiseSave> saves, int layer);
  /// The request's hold started: every layer of every prompt token is written.
  std::vector<ProgressPush> Complete(const std::string& transfer_id);
  /// The transfer ends without its KV (request aborted or preempted, or its device work failed):
  /// its subscribers are told, and later subscriptions get the same answer.
  std::vector<ProgressPush> Fail(const std::string& transfer_id, const std::string& reason);
  /// The transfer's hold ended: its entry goes; a later subscription is told it ended.
  void Remove(const std::string& transfer_id);

  // The peers' side.

  /// A reader subscribes: the reply is the transfer's progress now (state kWaiting when it has
  /// not started here: the subscription then waits up to min(wait_ms, max_wait); kFailed when it
  /// ended, or was removed, before). ResourceExhausted past max_waiting or max_subscribers;
  /// a repeated subscription by the same reader replaces its endpoint. NotSupported for a reader
  /// that reads another number of KV cache groups than this cache has (an older kvferry reads
  /// one), before anything is kept.
  Result<wire::Progress> Subscribe(const wire::Subscribe& s, Clock::time_point now);
  /// The reader gave up (its abort notice) or said it no longer reads (a push answered NotFound).
  void Unsubscribe(const std::string& transfer_id, const std::string& subscriber);

  /// Subscriptions that waited past their time for a transfer that never started: removed, their
  /// subscribers told.
  std::vector<ProgressPush> Expire(Clock::time_point now);

  std::size_t transfers() const { return transfers_.size(); }
  std::size_t waiting() const { return waiting_; }
  std::uint64_t refused() const { return refused_; }

 private:
  struct Transfer {
    std::string request_id;  // empty while waiting for the engine to start it
    wire::Progress progress;
    std::map<std::string, std::string> subscribers;  // reader key -> endpoint
    Clock::time_point wait_until;                    // while waiting
  };
  std::vector<ProgressPush> PushAll(Transfer& t);
  int total_layers() const;
  void RememberEnded(const std::string& transfer_id);
  wire::Progress EndedProgress(const std::string& transfer_id) const;

  const LayerwiseLimits limits_;
  const wire::PeerRef self_;
  std::map<std::string, Transfer> transfers_;
  std::size_t waiting_ = 0;  // entries with an empty request_id
  std::uint64_t refused_ = 0;
  // Transfers that ended (failed or their hold ended), the latest 65,536: a late subscriber is
  // told so instead of waiting.
  std::unordered_set<std::string> ended_;
  std::deque<std::string> ended_order_;
};

/// The reader key of a PeerRef in subscriptions and holds: "engine/dp/tp".
std::string ReaderKey(const wire::PeerRef& p);

}  // namespace kvferry
