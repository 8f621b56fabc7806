// The decode side of a layer-wise load (DESIGN rule 16, docs/layerwise.md): subscribe at every
// prefill rank the load reads, then read each group of layers as soon as the rank announces it
// written, until every layer of every prompt token is read; then confirm, as a whole-request load
// does. The load fails (to be recomputed) when the prefill side does not start the request in
// time, stops announcing, announces a failure, or the load's own deadline passes. A load is a
// state machine: a few threads step thousands of them, each when an announcement arrives, a
// deadline or poll falls due or the engine aborts it; none holds a thread while it waits.
#include <algorithm>

#include "common/clock.h"
#include "common/log.h"
#include "connector/layerwise_table.h"
#include "connector/load_runner.h"

namespace kvferry {
namespace {

std::string Ms(std::chrono::milliseconds d) { return std::to_string(d.count()) + " ms"; }

// `load` with the remote blocks of every group `p` names.
LoadSpec WithAnnouncedBlocks(const LoadSpec& load, const wire::Progress& p) {
  LoadSpec out = load;
  out.remote_block_ids = p.block_ids;
  for (std::size_t g = 0; g < out.more_groups.size() && g < p.group_block_ids.size(); ++g) {
    out.more_groups[g].remote = p.group_block_ids[g];
  }
  return out;
}

// How the load reads each KV cache group layer by layer: full attention as announced, a sliding
// window and a state once written to the prompt's end; local blocks from the load's first token
// where it gives it (else the tail rule).
std::vector<LayerwiseGroup> LayerwiseGroupsOf(const LoadSpec& load, const CacheGroups& caches) {
  std::vector<LayerwiseGroup> out;
  for (int g = 0; g < caches.size(); ++g) {
    const CacheSpec& spec = caches[g];
    LayerwiseGroup lg;
    lg.num_layers = spec.num_layers();
    lg.tokens_per_block = spec.tokens_per_id();  // announcements name engine block ids
    lg.state = spec.is_state();
    lg.progressive = !spec.is_state() && spec.sliding_window() == 0;
    lg.local_block_ids = load.LocalIds(g);
    if (load.first_token >= 0 && load.first_token % lg.tokens_per_block == 0) {
      lg.first_block = load.first_token / lg.tokens_per_block;
    }
    if (load.first_token >= 0 && load.num_tokens >= 0) {
      lg.end_token = load.first_token + load.num_tokens;
    }
    out.push_back(std::move(lg));
  }
  return out;
}

}  // namespace

void LoadRunner::WakeWatch(const std::string& transfer_id) {
  auto it = watches_.find(transfer_id);
  if (it != watches_.end()) Wake(it->second);
}

void LoadRunner::Wake(const std::shared_ptr<ProgressWatch>& w) {
  {
    MutexLock lock(w->mu);
    if (w->ended) return;
    if (w->running) {
      w->dirty = true;  // the running step looks again before it parks
      return;
    }
    if (w->queued) return;
    w->queued = true;
  }
  // Past the queue's capacity: each load has at most one step queued, and StartLayerwise caps the
  // loads, so the queue is bounded by them; a step never fails to be queued.
  layerwise_->Post([this, w] { Step(w); });
}

void LoadRunner::AddTimer(Clock::time_point at, const std::shared_ptr<ProgressWatch>& w) {
  MutexLock lock(timer_mu_);
  const bool first = timers_.empty() || at < timers_.begin()->first;
  timers_.emplace(at, w);
  if (first) timer_cv_.Signal();
}

void LoadRunner::RunTimers() {
  for (;;) {
    std::vector<std::shared_ptr<ProgressWatch>> due;
    {
      MutexLock lock(timer_mu_);
      while (!timers_stopping_ && (timers_.empty() || timers_.begin()->first > Clock::now())) {
        (void)timer_cv_.WaitUntil(timer_mu_, timers_.empty()
                                                 ? Clock::now() + std::chrono::seconds(1)
                                                 : timers_.begin()->first);
      }
      if (timers_stopping_) return;
      const Clock::time_point now = Clock::now();
      while (!timers_.empty() && timers_.begin()->first <= now) {
        if (std::shared_ptr<ProgressWatch> w = timers_.begin()->second.lock()) {
          due.push_back(std::move(w));
        }
        timers_.erase(timers_.begin());
      }
    }
    const Clock::time_point now = Clock::now();
    for (const std::shared_ptr<ProgressWatch>& w : due) {
      {
        MutexLock lock(w->mu);
        if (w->wake_at > now) continue;  // parked again since, until later
      }
      Wake(w);
    }
  }
}

Status LoadRunner::StartLayerwise(const LoadSpec& load) {
  auto w = std::make_shared<ProgressWatch>();
  w->engine_id = load.remote_engine_id;
  w->state.load = load;
  w->state.start = Clock::now();
  {
    MutexLock lock(mu_);
    if (watches_.size() >= cfg_.max_queued_loads) {
      return Status::ResourceExhausted(
          "this decode worker already runs " + std::to_string(watches_.size()) +
          " layer-wise loads (max_queued_loads); request " + load.request_id + " is recomputed");
    }
    if (!watches_.emplace(load.transfer_id, w).second) {
      return Status::InvalidArgument("transfer " + load.transfer_id +
                                     " is already being loaded on this worker by another request; "
                                     "a transfer id must be unique per request");
    }
    Wake(w);  // under mu_, so an Abort that finds the watch finds its step queued
  }
  return Status::Ok();
}

void LoadRunner::Step(const std::shared_ptr<ProgressWatch>& w) {
  {
    MutexLock lock(w->mu);
    if (w->ended) return;
    w->queued = false;
    w->running = true;
    w->dirty = false;
  }
  LayerwiseState& st = w->state;
  Status s;
  for (;;) {
    Result<std::optional<Clock::time_point>> next = AdvanceLayerwise(*w);
    if (!next.ok()) {
      s = next.status();
      break;
    }
    if (!next->has_value()) {
      // Every layer read: confirm, as a whole-request load does.
      std::set<std::string> read_from;
      for (const SourceAgent& a : st.agents) read_from.insert(a.endpoint);
      s = Confirm(st.load, st.plan->endpoints, read_from);
      break;
    }
    {
      MutexLock lock(w->mu);
      if (w->dirty) {  // an announcement, an abort or a stop came while it stepped
        w->dirty = false;
        continue;
      }
      w->running = false;
      w->wake_at = **next;
    }
    AddTimer(**next, w);
    return;
  }
  // The load ends: later pushes get NotFound, and it is never stepped again.
  {
    MutexLock lock(mu_);
    auto it = watches_.find(st.load.transfer_id);
    if (it != watches_.end() && it->second == w) watches_.erase(it);
  }
  {
    MutexLock lock(w->mu);
    w->ended = true;
    w->running = false;
  }
  EndLoad(st.load, st.start, std::move(s), st.moved);
}

wire::Message LoadRunner::OnProgress(const wire::Progress& p) {
  std::shared_ptr<ProgressWatch> watch;
  {
    MutexLock lock(mu_);
    auto it = watches_.find(p.transfer_id);
    if (it == watches_.end() || !caches_) {
      return wire::ErrorReply{StatusCode::kNotFound,
                              "no layer-wise load of transfer " + p.transfer_id +
                                  " runs on this decode worker (it ended, or never started); "
                                  "stop sending its progress"};
    }
    watch = it->second;
  }
  {
    MutexLock lock(watch->mu);
    auto source = watch->latest.find(static_cast<int>(p.from.tp_rank));
    auto peer = watch->peers.find(static_cast<int>(p.from.tp_rank));
    if (p.from.engine_id != watch->engine_id || source == watch->latest.end() ||
        peer == watch->peers.end() || !(peer->second == p.from)) {
      return wire::ErrorReply{StatusCode::kInvalidArgument,
                              "transfer " + p.transfer_id + " is read from " +
                                  (peer != watch->peers.end()
                                       ? ReaderKey(peer->second)
                                       : "engine " + watch->engine_id + " (not handshaken yet)") +
                                  ", not from " + ReaderKey(p.from) + "; progress refused"};
    }
    if (p.seq <= source->second.seq) return wire::Ack{0};  // a duplicate, or out of order
    if (p.state == wire::Progress::State::kRunning) {
      // Announcements only go forward, within the request and the caches; a bad one is refused
      // and changes nothing (the load goes on, and fails by its deadlines if nothing good comes).
      const bool running = source->second.state == wire::Progress::State::kRunning;
      auto blocks = watch->remote_blocks.find(source->first);
      if (Status s = CheckLayerwiseProgress(
              p, watch->groups,
              blocks == watch->remote_blocks.end() ? std::span<const std::int64_t>()
                                                   : std::span<const std::int64_t>(blocks->second),
              running ? AnnouncedCursor(source->second, watch->groups) : LayerwiseCursor{});
          !s.ok()) {
        return wire::ErrorReply{s.code(), std::string(s.message())};
      }
    }
    source->second = p;
  }
  Wake(watch);
  return wire::Ack{1};
}

Status LoadRunner::SetUpLayerwise(ProgressWatch& w) {
  LayerwiseState& st = w.state;
  const LoadSpec& load = st.load;
  st.deadline = st.start + cfg_.transfer_timeout;
  KVFERRY_ASSIGN_OR_RETURN(LoadPlan plan, Plan(load));
  st.plan = std::move(plan);
  {
    MutexLock lock(w.mu);
    w.groups = LayerwiseGroupsOf(load, st.plan->caches);
    for (const TpSource& s : st.plan->sources) w.latest[s.prefill_rank] = wire::Progress{};
  }
  const LoadPlan& p = *st.plan;
  // A hybrid cache's progress has fields an older prefill worker does not send.
  const bool grouped = p.caches.size() > 1;
  KVFERRY_ASSIGN_OR_RETURN(
      st.agents, ResolveSources(load, p, st.deadline,
                                grouped ? wire::kFeatureLayerwiseGroups : wire::kFeatureLayerwise));
  for (const SourceAgent& a : st.agents) {
    for (int g = 0; g < p.caches.size(); ++g) {
      // Announcements name blocks of the prefill side's size, read into ours one for one.
      const CacheSpec& theirs = a.agent->metadata->caches[g];
      const CacheSpec& ours = p.caches[g];
      if (ours.is_state() || (theirs.tokens_per_block() == ours.tokens_per_block() &&
                              theirs.blocks_per_id() == ours.blocks_per_id())) {
        continue;
      }
      auto blocks = [](const CacheSpec& c) {
        return std::to_string(c.tokens_per_id()) + " tokens (" + std::to_string(c.blocks_per_id()) +
               " kernel blocks of " + std::to_string(c.tokens_per_block()) + ")";
      };
      return Status::NotSupported(
          "request " + load.request_id + ": the prefill worker at " + a.endpoint +
          " has blocks of " + blocks(theirs) +
          (grouped ? " in KV cache group " + std::to_string(g) : "") +
          " and this decode worker of " + blocks(ours) +
          "; layer-wise transfer needs one block size on both sides (whole-request loads take "
          "any): give both instances one block size, or send whole-request legs (the proxy's "
          "--layerwise off)");
    }
  }
  // Rule 17: announcements name the prefill stage's own layers, which must be this stage's.
  for (int g = 0; g < p.caches.size(); ++g) {
    KVFERRY_ASSIGN_OR_RETURN(std::vector<StageRead> layers,
                             PlanStageReads(load, p.caches[g], st.agents, g));
    for (const StageRead& r : layers) {
      if (r.layer_shift != 0 || r.first != 0 || r.end != p.caches[g].num_layers()) {
        const CacheSpec& theirs = r.from->agent->metadata->caches[g];
        return Status::NotSupported(
            "request " + load.request_id + ": the prefill worker at " + r.from->endpoint +
            " holds the model's layers [" + std::to_string(theirs.first_layer()) + ", " +
            std::to_string(theirs.end_layer()) + ") and this decode stage [" +
            std::to_string(p.caches[g].first_layer()) + ", " +
            std::to_string(p.caches[g].end_layer()) + ")" +
            (grouped ? " of KV cache group " + std::to_string(g) : "") +
            "; layer-wise transfer needs stages of the same layers on both sides (whole-request "
            "legs read any split)");
      }
    }
  }
  {
    MutexLock lock(w.mu);
    for (const SourceAgent& a : st.agents) {
      w.peers[a.source.prefill_rank] = a.agent->metadata->agent.peer;
      // In engine block ids, as announcements name them.
      std::vector<std::int64_t>& blocks = w.remote_blocks[a.source.prefill_rank];
      for (const CacheSpec& c : a.agent->metadata->caches.specs()) {
        blocks.push_back(c.num_blocks() / c.blocks_per_id());
      }
    }
  }
  st.start_deadline = std::min(st.deadline, st.start + cfg_.layerwise_start_timeout);
  {
    MutexLock lock(mu_);
    st.listener = listener_endpoint_;
  }
  const std::string& listener = st.listener;
  if (Status own = wire::CheckPushEndpoint(listener); !own.ok()) {
    // A prefill worker would refuse the subscription; say why here, where it can be fixed.
    return Status::NotSupported("request " + load.request_id + ": this decode worker listens on " +
                                listener + ", where a prefill worker cannot push progress (" +
                                std::string(own.message()) +
                                "); give the worker this node's address as its host (WorkerConfig "
                                "host, KVFERRY_HOST, or the adapter's \"host\": \"auto\")");
  }
  KVFERRY_RETURN_IF_ERROR(SubscribeAll(w));
  st.heard = st.polled = Clock::now();
  return Status::Ok();
}

Status LoadRunner::SubscribeAll(ProgressWatch& w) {
  // Sent again as a poll whenever nothing was heard for half the progress timeout: it brings
  // what pushes that were lost would have (a link that flapped), and finds a prefill instance
  // that died or stopped before it announced anything (the call fails) without waiting for the
  // start deadline.
  LayerwiseState& st = w.state;
  const auto poll_every =
      std::max<Clock::duration>(cfg_.layerwise_progress_timeout / 2, std::chrono::milliseconds(1));
  for (const SourceAgent& a : st.agents) {
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::max<Clock::duration>(st.start_deadline - Clock::now(), Clock::duration::zero()));
    Result<wire::Message> reply = client_.Call(
        a.endpoint,
        wire::Subscribe{self_, st.load.transfer_id, static_cast<std::uint32_t>(cfg_.tp_size),
                        st.listener, static_cast<std::uint32_t>(wait.count()),
                        static_cast<std::uint32_t>(st.plan->caches.size())},
        std::min({st.deadline, DeadlineAfter(cfg_.handshake_timeout), Clock::now() + poll_every}));
    if (!reply.ok()) return reply.status().WithContext("subscribing at " + a.endpoint);
    const auto* progress = std::get_if<wire::Progress>(&*reply);
    if (progress == nullptr || progress->transfer_id != st.load.transfer_id ||
        progress->from.tp_rank != static_cast<std::uint32_t>(a.source.prefill_rank)) {
      return Status::InvalidArgument(
          "subscribing at " + a.endpoint + " for transfer " + st.load.transfer_id +
          ": expected its progress in reply, got '" + wire::MessageTypeName(*reply) + "'");
    }
    // The reply goes through the same checks as a pushed announcement.
    wire::Message taken = OnProgress(*progress);
    if (const auto* e = std::get_if<wire::ErrorReply>(&taken)) {
      return Status(e->code, e->message).WithContext("subscribing at " + a.endpoint);
    }
  }
  return Status::Ok();
}

Result<std::optional<Clock::time_point>> LoadRunner::AdvanceLayerwise(ProgressWatch& w) {
  LayerwiseState& st = w.state;
  if (!st.set_up) {
    {
      MutexLock lock(mu_);
      KVFERRY_RETURN_IF_ERROR(AbortedLocked(st.load.request_id));
      if (stopping_) return Status::Cancelled("the worker is shutting down");
    }
    KVFERRY_RETURN_IF_ERROR(SetUpLayerwise(w));
    st.set_up = true;
  }
  const LoadSpec& load = st.load;
  const auto poll_every =
      std::max<Clock::duration>(cfg_.layerwise_progress_timeout / 2, std::chrono::milliseconds(1));
  for (;;) {
    std::map<int, wire::Progress> fresh;
    bool waiting = false;
    std::vector<LayerwiseGroup> groups;
    std::map<int, std::vector<std::int64_t>> remote_blocks;  // by rank, as set up
    {
      MutexLock lock(w.mu);
      for (const auto& [rank, p] : w.latest) {
        if (p.state == wire::Progress::State::kWaiting) waiting = true;
        if (p.seq > st.taken[rank]) fresh.emplace(rank, p);
      }
      if (!fresh.empty()) {
        groups = w.groups;
        remote_blocks = w.remote_blocks;
      }
    }
    {
      MutexLock lock(mu_);
      KVFERRY_RETURN_IF_ERROR(AbortedLocked(load.request_id));
      if (stopping_) return Status::Cancelled("the worker is shutting down");
    }
    const Clock::time_point now = Clock::now();
    if (fresh.empty()) {
      const Deadline limit =
          std::min(waiting ? st.start_deadline : st.progress_deadline, st.deadline);
      if (now >= st.deadline) {
        return Status::Timeout("layer-wise load of transfer " + load.transfer_id +
                               " did not finish within the transfer timeout of " +
                               Ms(cfg_.transfer_timeout));
      }
      const SilenceStep step = OnSilence(now, limit, st.heard, st.polled, poll_every);
      if (step == SilenceStep::kFail && waiting) {
        return Status::Timeout("the prefill side (engine " + load.remote_engine_id +
                               ") did not start transfer " + load.transfer_id + " within " +
                               Ms(cfg_.layerwise_start_timeout) +
                               " (its request never arrived there, or waits behind its queue)");
      }
      if (step == SilenceStep::kFail) {
        return Status::Timeout("the prefill side (engine " + load.remote_engine_id +
                               ") announced no progress of transfer " + load.transfer_id + " for " +
                               Ms(cfg_.layerwise_progress_timeout) +
                               " (it died, stopped, or is overloaded)");
      }
      if (step == SilenceStep::kPoll) {
        KVFERRY_RETURN_IF_ERROR(SubscribeAll(w));
        st.heard = st.polled = Clock::now();
        continue;
      }
      return std::optional<Clock::time_point>(std::min(limit, st.heard + poll_every));
    }
    std::vector<PlannedBatch> batches;
    for (const auto& [rank, p] : fresh) {
      st.taken[rank] = p.seq;
      if (p.state == wire::Progress::State::kFailed) {
        return Status::Unavailable("the prefill side failed transfer " + load.transfer_id + ": " +
                                   p.reason);
      }
      if (p.state != wire::Progress::State::kRunning) continue;
      st.heard = Clock::now();
      st.progress_deadline = st.heard + cfg_.layerwise_progress_timeout;
      // A copy of the binding: clang before 16 cannot capture structured bindings.
      const SourceAgent& a = *std::find_if(
          st.agents.begin(), st.agents.end(),
          [&, wanted = rank](const SourceAgent& s) { return s.source.prefill_rank == wanted; });
      KVFERRY_ASSIGN_OR_RETURN(
          std::vector<LayerGroupRead> reads,
          PlanLayerwiseReads(p, groups, remote_blocks[rank], st.cursors[rank]));
      batches.push_back({&a, {}, 0, 0});
      for (const LayerGroupRead& r : reads) {
        const StageRead layers{&a, r.first_layer, r.end_layer, 0};
        if (r.whole) {
          // A window or a state, written to the prompt's end: read as a whole-request load reads
          // the group, from the blocks this announcement names.
          KVFERRY_RETURN_IF_ERROR(AddGroupReads(WithAnnouncedBlocks(load, p), *st.plan, layers,
                                                r.group, batches.back()));
          continue;
        }
        // Engine block ids, each per_id cache blocks on both sides (checked above).
        const std::int64_t per_id = st.plan->caches[r.group].blocks_per_id();
        KVFERRY_RETURN_IF_ERROR(AddReads(*st.plan, layers, r.group,
                                         CacheBlocksOfIds(r.remote_ids, per_id),
                                         CacheBlocksOfIds(r.local_ids, per_id), batches.back()));
      }
    }
    KVFERRY_RETURN_IF_ERROR(RunBatches(load, batches, st.deadline, &st.moved));
    const bool done = std::all_of(st.agents.begin(), st.agents.end(), [&](const SourceAgent& a) {
      return st.cursors[a.source.prefill_rank].Done();
    });
    if (done) return std::optional<Clock::time_point>();
  }
}

}  // namespace kvferry
