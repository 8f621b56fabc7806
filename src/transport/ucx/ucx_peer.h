// One connected peer of the ucx backend: its endpoint, remote keys, units and gets. Everything
// but Enter/Leave/WaitIdle runs on the progress thread (ucx_worker.h), which is what makes the
// UCX handles safe without locks.
//
// Endpoints are created with UCP_ERR_HANDLING_MODE_PEER where UCX allows it. UCX 1.13 refuses it
// for its shared-memory transports (posix, sysv, cma, self: "no peer failure handler"), so when
// ep creation fails with UCS_ERR_UNREACHABLE the endpoint is created with
// UCP_ERR_HANDLING_MODE_NONE instead. Such an endpoint can neither report a dead peer nor be force
// closed (ucp_ep_close_nbx refuses UCP_EP_CLOSE_FLAG_FORCE with UCS_ERR_INVALID_PARAM), and its
// gets never complete when the peer dies or stops. Its gets therefore land in staging buffers
// owned by the get, copied into the destination on completion; a unit that stops abandons them
// (they complete or not, later, into memory no caller sees) and ends at once.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/mutex.h"
#include "transport/batch.h"
#include "transport/descriptor.h"
#include "transport/peer_process.h"
#include "transport/ucx/ucx_section.h"

namespace kvferry {

struct UcxChunk {
  std::byte* local;
  std::uint64_t remote;
  std::uint64_t length;
  RegionId region;
  ucs_memory_type_t local_type;  // of the destination: host, or cuda where UCX reads it
};

class UcxPeerState;
struct UcxUnit;

// One outstanding ucp_get_nbx. Owned by its peer's gets_ until it completes.
struct UcxGet {
  UcxPeerState* peer = nullptr;
  UcxUnit* unit = nullptr;  // null once abandoned
  UcxChunk chunk{};
  std::unique_ptr<std::byte[]> stage;  // without peer error handling only: where it lands
  void* request = nullptr;
  std::uint64_t generation = 0;  // of the endpoint it was issued on
  ucs_status_t status = UCS_OK;
};

// One BackendPeer::Start call: its chunks, issued in order.
struct UcxUnit {
  std::shared_ptr<Batch> batch;
  std::vector<UcxChunk> chunks;
  std::size_t next = 0;
  std::vector<UcxChunk> retry;       // cancelled by our own endpoint close: issued again
  std::unordered_set<UcxGet*> gets;  // issued, not completed, not abandoned
  std::uint64_t bytes = 0;
  Status error;  // the failure that stops it, if it failed
  bool stopping = false;
  bool cancel_sent = false;
  std::chrono::steady_clock::time_point stop_since;
};

class UcxPeerState {
 public:
  // `process`: the peer proven through a pidfd (PeerProcess::Prove) when it runs on this kernel
  // and PID namespace; empty on another host.
  UcxPeerState(UcxSection section, RemoteRegionTable regions, std::optional<PeerProcess> process,
               std::uint64_t max_inflight);
  ~UcxPeerState();
  UcxPeerState(const UcxPeerState&) = delete;
  UcxPeerState& operator=(const UcxPeerState&) = delete;

  // Any thread. Enter counts a unit about to be handed to the progress thread; false once
  // CloseEntry ran. Leave (progress thread) uncounts it when it ends.
  bool Enter() EXCLUDES(mu_);
  void Leave() EXCLUDES(mu_);
  void CloseEntry() EXCLUDES(mu_);
  // Waits until no unit runs, at most until `deadline`; false if some still ran then.
  bool WaitIdle(Deadline deadline) EXCLUDES(mu_);

  const RemoteRegionTable& regions() const { return regions_; }
  bool HasKey(RegionId id) const { return keyed_.count(id) != 0; }

  // Progress thread only.
  Status EnsureEp(ucp_worker_h worker);
  // Takes a unit that Enter counted; ends it at once (PeerDisconnected) after Release.
  void Adopt(std::shared_ptr<UcxUnit> unit);
  // Drains completions, checks liveness, stops, finishes and issues units.
  void Pump(ucp_worker_h worker, std::chrono::steady_clock::time_point now);
  // Shut: every unit stops PeerDisconnected at the next Pump.
  void SetShut() { shut_ = true; }
  // True once shut, with no unit left and no get outstanding: Release may run.
  bool Finished() const { return shut_ && units_.empty() && gets_.empty(); }
  // Closes the endpoint and destroys the keys. Gets still outstanding (abandoned, on an
  // endpoint without error handling) keep their staging buffers until the worker is destroyed.
  void Release();
  bool released() const { return released_; }

  // Called by UCX during progress: record only.
  static void OnGetDone(void* request, ucs_status_t status, void* user_data);
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status);

  // How long a stopped unit waits for its cancelled gets before the endpoint is force closed.
  static constexpr std::chrono::milliseconds kStopGrace{100};

 private:
  void Drain();
  void Issue(UcxUnit& unit, const UcxChunk& chunk);
  // Closes ep_ (forced where it has peer error handling, so its gets complete now with
  // UCS_ERR_CANCELED) and destroys its keys; false when there was none.
  bool CloseEp();
  // One pass over the units; true when a stopped unit has waited kStopGrace for its gets.
  bool SweepUnits(ucp_worker_h worker, std::chrono::steady_clock::time_point now);

  const UcxSection section_;
  const RemoteRegionTable regions_;
  const std::set<RegionId> keyed_;
  const std::optional<PeerProcess> process_;  // empty on another host
  const std::uint64_t max_inflight_;

  // Progress thread only.
  ucp_ep_h ep_ = nullptr;
  bool peer_mode_ = true;         // UCP_ERR_HANDLING_MODE_PEER; false after UCX refused it
  std::uint64_t generation_ = 0;  // bumped by every close of ep_
  std::map<RegionId, ucp_rkey_h> rkeys_;
  std::list<std::shared_ptr<UcxUnit>> units_;
  std::unordered_set<UcxGet*> gets_;  // every outstanding get, abandoned ones too; owned
  std::vector<UcxGet*> completed_;    // recorded by OnGetDone
  ucs_status_t ep_error_ = UCS_OK;    // recorded by OnEpError
  Status failed_;                     // the peer failed: every unit ends with this
  bool shut_ = false;
  bool released_ = false;
  std::chrono::steady_clock::time_point next_liveness_check_;

  Mutex mu_;
  CondVar idle_;
  int running_ GUARDED_BY(mu_) = 0;
  bool closed_ GUARDED_BY(mu_) = false;
};

}  // namespace kvferry
