// The prefill side's announcements of layers written by device work still in flight
// (Worker::SaveKvLayer with a stream): one thread waits for each layer's event, in the order the
// layers were saved, and then hands the layer on, so the engine's forward pass never waits for
// its own stream.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "device/device.h"
#include "kvferry/connector.h"

namespace kvferry {

class LayerAnnouncer {
 public:
  /// Entry::layer of a step's begin, queued behind the layers of the steps before it.
  static constexpr int kBegin = -1;
  struct Entry {
    std::shared_ptr<const std::vector<LayerwiseSave>> saves;  // the step's, when it was saved
    int layer = 0;                                            // or kBegin
    std::unique_ptr<device::Event> event;  // null: written already (always for kBegin)
  };
  /// Called on the announcer's thread for each entry, in order, once its event completed (OK),
  /// failed or did not complete within `timeout` (the error); at once for an entry without one.
  using Written = std::function<void(const Entry& entry, const Status& status)>;

  LayerAnnouncer(Written written, std::chrono::milliseconds timeout);
  /// Hands on what is queued (waiting for each event up to its timeout), then stops.
  ~LayerAnnouncer();
  LayerAnnouncer(const LayerAnnouncer&) = delete;
  LayerAnnouncer& operator=(const LayerAnnouncer&) = delete;

  void Add(Entry entry) EXCLUDES(mu_);
  /// Nothing queued or being handed on: an entry without an event may be handed on by the caller
  /// itself without overtaking one.
  bool Idle() const EXCLUDES(mu_);

 private:
  void Run() EXCLUDES(mu_);

  const Written written_;
  const std::chrono::milliseconds timeout_;
  mutable Mutex mu_;
  CondVar cv_;
  std::deque<Entry> queue_ GUARDED_BY(mu_);
  bool busy_ GUARDED_BY(mu_) = false;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: it uses the rest
};

}  // namespace kvferry
