#include "connector/agent_cache.h"

#include <utility>

#include "common/clock.h"
#include "common/log.h"

namespace kvferry {

std::string SideChannelEndpoint(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos;
  return "tcp://" + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

void AgentCache::SetLocalCache(const CacheGroups& caches) {
  MutexLock lock(mu_);
  local_ = caches;
}

AgentCacheStats AgentCache::Stats() const {
  MutexLock lock(mu_);
  return stats_;
}

Result<std::shared_ptr<RemoteAgent>> AgentCache::Get(const AgentKey& key, Deadline deadline) {
  // At most two passes: the second runs only when the first found an agent made for another
  // engine at this endpoint (a prefill instance restarted on the same ports).
  for (int pass = 0;; ++pass) {
    std::shared_ptr<RemoteAgent> agent;
    std::shared_ptr<RemoteAgent> evicted;
    bool owner = false;
    {
      MutexLock lock(mu_);
      auto it = agents_.find(key.endpoint);
      if (it != agents_.end() && it->second->Failed()) {
        agents_.erase(it);  // its owner is about to drop it: not cached
        it = agents_.end();
      }
      if (it == agents_.end()) {
        if (agents_.size() >= static_cast<std::size_t>(max_agents_)) {
          // Rule 14: the cache is bounded; the least recently used agent that no load is using
          // makes room. Its data-plane connections close with it.
          auto lru = agents_.end();
          for (auto a = agents_.begin(); a != agents_.end(); ++a) {
            if (a->second.use_count() != 1) continue;  // a load or a handshake holds it
            if (lru == agents_.end() || a->second->last_used < lru->second->last_used) lru = a;
          }
          if (lru == agents_.end()) {
            return Status::ResourceExhausted(
                "this worker talks to " + std::to_string(agents_.size()) +
                " prefill ranks at once, its cap (max_agents); " + key.endpoint +
                " must wait until a load from another one ends");
          }
          evicted = std::move(lru->second);
          agents_.erase(lru);
          ++stats_.evicted;
        }
        auto fresh = std::make_shared<RemoteAgent>();
        fresh->engine_id = key.engine_id;
        it = agents_.emplace(key.endpoint, std::move(fresh)).first;
        owner = true;
      }
      it->second->last_used = Clock::now();
      agent = it->second;
    }
    if (evicted) transport_.Disconnect(evicted->peer);
    if (owner) {
      // Rule 9: one handshake per remote agent at a time; concurrent loads wait for this one.
      const Clock::time_point start = Clock::now();
      Status s = Handshake(*agent, key, deadline);
      {
        MutexLock lock(agent->mu);
        agent->state = s.ok() ? RemoteAgent::State::kReady : RemoteAgent::State::kFailed;
        agent->status = s;
      }
      agent->cv.SignalAll();
      MutexLock lock(mu_);
      ++stats_.handshakes;
      stats_.handshake_latency.Add(
          std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start));
      if (!s.ok()) {
        // A failed handshake is not cached: the next load tries again.
        auto it = agents_.find(key.endpoint);
        if (it != agents_.end() && it->second == agent) agents_.erase(it);
        return s;
      }
      return agent;
    }
    UniqueLock lock(agent->mu);
    while (agent->state == RemoteAgent::State::kConnecting) {
      if (agent->cv.WaitUntil(agent->mu, deadline)) break;
    }
    if (agent->state == RemoteAgent::State::kConnecting) {
      return Status::Timeout("waiting for the handshake with " + key.endpoint + " timed out");
    }
    const bool same_engine = agent->engine_id == key.engine_id;
    if (agent->state == RemoteAgent::State::kFailed) {
      // A handshake for another engine failed (it named the engine that was here before a
      // restart, say): that says nothing about this key's engine; handshake for it.
      if (!same_engine && pass == 0) continue;
      return agent->status;
    }
    if (same_engine || pass > 0) return agent;  // the caller refuses an engine mismatch
    lock.Unlock();
    // The agent was made for another engine. When this endpoint now answers as the engine the
    // key names, the prefill instance restarted: the cached agent is stale (its engine and its
    // blocks are gone), so it is dropped and a fresh handshake made. Otherwise the key names an
    // engine that is gone, and the caller refuses it without disturbing the cached agent.
    Result<wire::Message> reply =
        client_.Call(key.endpoint, wire::MetadataRequest{self_}, deadline);
    const auto* md = reply.ok() ? std::get_if<wire::AgentMetadata>(&*reply) : nullptr;
    if (md == nullptr || md->agent.peer.engine_id != key.engine_id) return agent;
    Log().info("{} is now engine {} (was {}): dropping the cached agent", key.endpoint,
               key.engine_id, agent->engine_id);
    Invalidate(key.endpoint, agent);
  }
}

Status AgentCache::Handshake(RemoteAgent& agent, const AgentKey& key, Deadline deadline) {
  KVFERRY_ASSIGN_OR_RETURN(wire::Message reply,
                           client_.Call(key.endpoint, wire::MetadataRequest{self_}, deadline));
  auto* md = std::get_if<wire::AgentMetadata>(&reply);
  if (md == nullptr) {
    return Status::Internal("peer " + key.endpoint + " answered a metadata request with '" +
                            wire::MessageTypeName(reply) + "'");
  }
  if (md->agent.peer.engine_id != key.engine_id ||
      static_cast<int>(md->agent.peer.tp_rank) != key.tp_rank ||
      static_cast<int>(md->agent.tp_size) != key.tp_size) {
    return Status::InvalidArgument(
        "peer " + key.endpoint + " is engine " + md->agent.peer.engine_id + " TP rank " +
        std::to_string(md->agent.peer.tp_rank) + " of " + std::to_string(md->agent.tp_size) +
        ", but the request names engine " + key.engine_id + " TP rank " +
        std::to_string(key.tp_rank) + " of " + std::to_string(key.tp_size) +
        "; check remote_host, remote_port and the instances' base ports");
  }
  std::optional<CacheGroups> ours;
  {
    MutexLock lock(mu_);
    ours = local_;
  }
  if (!ours) {
    return Status::InvalidArgument("KV caches are not registered; call RegisterKvCaches first");
  }
  if (md->cache_hash != ours->Hash()) {
    return Status::NotSupported("the KV cache layouts of this worker and peer " + key.endpoint +
                                " differ, so no byte may move; " +
                                FirstDifference(*ours, md->caches));
  }
  const wire::TransportDescriptor* desc = nullptr;
  for (const auto& t : md->transports) {
    if (t.kind == kTransportKind) desc = &t;
  }
  if (desc == nullptr) {
    return Status::NotSupported("peer " + key.endpoint + " offers no kvferry data plane");
  }
  KVFERRY_ASSIGN_OR_RETURN(agent.peer, transport_.Connect(desc->blob, deadline));
  agent.metadata = *md;
  return Status::Ok();
}

void AgentCache::Invalidate(const std::string& endpoint,
                            const std::shared_ptr<RemoteAgent>& agent) {
  {
    MutexLock lock(mu_);
    auto it = agents_.find(endpoint);
    if (it == agents_.end() || it->second != agent) return;  // already replaced
    agents_.erase(it);
  }
  transport_.Disconnect(agent->peer);
}

}  // namespace kvferry
