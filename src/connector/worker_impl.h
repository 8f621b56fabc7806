// The connector Worker's implementation (Worker in include/kvferry/connector.h is its facade):
// its side channel, transport, holds (prefill) and loads (decode). worker.cc has its life, the
// registration of caches and the engine-facing calls; worker_requests.cc what it answers peers
// on its side channel.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/mutex.h"
#include "connector/agent_cache.h"
#include "connector/hold_table.h"
#include "connector/layer_announcer.h"
#include "connector/layerwise_table.h"
#include "connector/load_runner.h"
#include "connector/progress_pusher.h"
#include "kvferry/connector.h"
#include "sidechannel/client.h"
#include "sidechannel/listener.h"

namespace kvferry {

class WorkerImpl {
 public:
  explicit WorkerImpl(WorkerConfig config)
      : cfg_(std::move(config)),
        holds_(HoldLimits{cfg_.hold_lease, cfg_.max_early_notices, cfg_.hold_lease},
               [this](std::uint32_t reader_tp) {
                 // HoldTable calls it only from its own methods, which run under mu_.
                 mu_.AssertHeld();
                 return ExpectedReadersLocked(reader_tp);
               }) {}
  ~WorkerImpl();

  Status Init();
  Status RegisterKvCaches(const CacheGroups& caches,
                          std::vector<std::vector<std::vector<std::uint64_t>>> bases,
                          const MemoryKind& memory);
  void StartLoadKv(const ConnectorMetadata& metadata) EXCLUDES(mu_);
  Status SaveKvLayer(int layer, std::uint64_t stream) EXCLUDES(mu_);
  FinishedRequests GetFinished() EXCLUDES(mu_);
  FinishedRequests GetFinishedLocked(std::vector<ProgressPush>& pushes) REQUIRES(mu_);
  std::vector<LoadError> TakeLoadErrors() EXCLUDES(mu_);
  std::vector<LoadTransfer> TakeLoadTransfers() { return loads_->TakeTransfers(); }
  // The load runner cancels outside any lock of the worker's.
  Status AbortLoad(const std::string& request_id, const std::string& reason) EXCLUDES(mu_);
  WorkerStats Stats() const EXCLUDES(mu_);
  WorkerMetrics Metrics() const {
    return {self_.engine_id, cfg_.role, static_cast<int>(self_.dp_rank),
            static_cast<int>(self_.tp_rank), Stats()};
  }
  const std::string& endpoint() const { return listener_->endpoint(); }

 private:
  wire::Message Handle(const wire::Message& request) EXCLUDES(mu_);
  wire::Message HandleLocked(const wire::Message& request, std::vector<ProgressPush>& pushes)
      REQUIRES(mu_);
  int ExpectedReadersLocked(std::uint32_t reader_tp) const REQUIRES(mu_);
  // Layer `entry.layer` of a step is written (status OK) or its device work failed.
  void LayerWritten(const LayerAnnouncer::Entry& entry, const Status& status) EXCLUDES(mu_);

  const WorkerConfig cfg_;
  wire::PeerRef self_;
  wire::AgentIdentity identity_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<sidechannel::Client> client_;
  std::unique_ptr<AgentCache> agents_;         // decode: the prefill ranks loads read from
  std::unique_ptr<LoadRunner> loads_;          // decode: the loads
  std::unique_ptr<ProgressPusher> pusher_;     // prefill: layer-wise progress to subscribers
  std::unique_ptr<LayerAnnouncer> announcer_;  // prefill: layers written by device work
  std::unique_ptr<sidechannel::Listener> listener_;

  // Prefill side: holds, and what a metadata request is answered with.
  mutable Mutex mu_;
  std::optional<CacheGroups> caches_ GUARDED_BY(mu_);
  std::optional<wire::AgentMetadata> metadata_ GUARDED_BY(mu_);
  HoldTable holds_ GUARDED_BY(mu_);
  // Layer-wise transfers (docs/layerwise.md): made when the caches are registered; the saves of
  // the step StartLoadKv last began, which SaveKvLayer announces.
  std::optional<LayerwiseTable> layerwise_ GUARDED_BY(mu_);
  std::shared_ptr<const std::vector<LayerwiseSave>> step_saves_ GUARDED_BY(mu_);
  MemoryKind memory_ GUARDED_BY(mu_);
  Clock::time_point last_stats_log_ GUARDED_BY(mu_) = Clock::now();
  std::map<std::string, std::uint64_t> notices_received_ GUARDED_BY(mu_);  // by message type
};

}  // namespace kvferry
