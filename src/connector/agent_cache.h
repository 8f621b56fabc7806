// The decode side's cache of prefill-rank agents (rule 9, rule 12, rule 14): one handshake per
// remote agent at a time, its result kept for later loads, the least recently used agent dropped
// past a bound, and a stale agent (the prefill instance restarted on the same ports under a new
// engine id) replaced. Used by the worker's load path; knows nothing of loads or holds.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "common/mutex.h"
#include "kvferry/cache_spec.h"
#include "kvferry/histogram.h"
#include "kvferry/transport.h"
#include "sidechannel/client.h"
#include "wire/messages.h"

namespace kvferry {

/// The data-plane kind a worker offers in its agent metadata (docs/protocol.md).
inline constexpr const char* kTransportKind = "kvferry";

/// "tcp://host:port", with brackets around an IPv6 host.
std::string SideChannelEndpoint(const std::string& host, int port);

/// Which prefill rank a load wants, as its kv_transfer_params name it.
struct AgentKey {
  std::string endpoint;   ///< the rank's side channel: remote_host, remote_port + rank
  std::string engine_id;  ///< the engine the request names (remote_engine_id)
  int tp_rank = 0;
  int tp_size = 1;
};

/// A handshaken prefill rank: its metadata and the data-plane peer connected to it.
struct RemoteAgent {
  Mutex mu;
  CondVar cv;
  enum class State { kConnecting, kReady, kFailed } state GUARDED_BY(mu) = State::kConnecting;
  Status status GUARDED_BY(mu);                 // the handshake's, once it ended
  std::optional<wire::AgentMetadata> metadata;  // set by the handshake before kReady
  PeerId peer = 0;                              // set by the handshake before kReady
  std::string engine_id;        // the engine the first load named; set before it is shared
  Clock::time_point last_used;  // guarded by the cache's mu_; for LRU eviction

  bool Failed() EXCLUDES(mu) {  // lock order: the cache's mu_, then this mu
    MutexLock lock(mu);
    return state == State::kFailed;
  }
};

/// Counters of one cache; a snapshot.
struct AgentCacheStats {
  std::uint64_t handshakes = 0;
  std::uint64_t evicted = 0;
  LatencyHistogram handshake_latency;
};

/// Thread-safe. `client` and `transport` must outlive it. No network wait happens while its lock
/// is held: handshakes and metadata queries run outside it.
class AgentCache {
 public:
  /// At most `max_agents` cached agents (>= 1). `self` is this worker's identity in requests.
  AgentCache(sidechannel::Client& client, Transport& transport, wire::PeerRef self, int max_agents)
      : client_(client), transport_(transport), self_(std::move(self)), max_agents_(max_agents) {}
  AgentCache(const AgentCache&) = delete;
  AgentCache& operator=(const AgentCache&) = delete;

  /// The local caches' layout, which a peer's must equal (rule 9). Set once, before Get.
  void SetLocalCache(const CacheGroups& caches) EXCLUDES(mu_);

  /// The agent for `key`, handshaking first when none is cached: the peer must be the engine,
  /// rank and TP size the key names and have this layout (InvalidArgument or NotSupported
  /// otherwise, before any byte moves). Concurrent calls for one endpoint wait for the one
  /// handshake (Timeout at `deadline`). A failed handshake is not cached. An agent cached for
  /// another engine at the endpoint is replaced when the endpoint now answers as the key's engine
  /// (a restarted instance); otherwise it is returned as it is and the caller must refuse the
  /// mismatch (the key names an engine that is gone). ResourceExhausted when max_agents agents
  /// are all in use.
  Result<std::shared_ptr<RemoteAgent>> Get(const AgentKey& key, Deadline deadline) EXCLUDES(mu_);

  /// Drops `agent` (if still cached under `endpoint`) and disconnects its data-plane peer: its
  /// peer died or refused us (rule 12). The next Get handshakes again.
  void Invalidate(const std::string& endpoint, const std::shared_ptr<RemoteAgent>& agent)
      EXCLUDES(mu_);

  AgentCacheStats Stats() const EXCLUDES(mu_);

 private:
  // Network waits: never under mu_.
  Status Handshake(RemoteAgent& agent, const AgentKey& key, Deadline deadline) EXCLUDES(mu_);

  sidechannel::Client& client_;
  Transport& transport_;
  const wire::PeerRef self_;
  const int max_agents_;

  mutable Mutex mu_;
  std::optional<CacheGroups> local_ GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<RemoteAgent>> agents_ GUARDED_BY(mu_);  // by endpoint
  AgentCacheStats stats_ GUARDED_BY(mu_);
};

}  // namespace kvferry
