// One whole-request load, step by step (DESIGN rules 8-10): the agents it reads from
// (handshakes, cached), the reads of each agent and KV cache group merged into block runs, the
// batches and their failures, and the confirmation that every rank read from still held the
// blocks. Its plan (stages, layers, TP sources, ranks to tell) is load_plan.cc; the runner
// around it (queueing, bookkeeping, aborts, leases) load_runner.cc; the layer-wise load,
// layerwise_load.cc.
#include <algorithm>
#include <set>

#include "common/checked_math.h"
#include "common/clock.h"
#include "common/log.h"
#include "connector/load_runner.h"

namespace kvferry {
namespace {

// Only liveness failures take a peer down (rule 14): its connection is lost, its process is gone,
// or it refused us. A slow batch (Timeout) or a refused read fails its own load alone.
bool PeerFault(const Status& s) {
  return s.code() == StatusCode::kPeerDisconnected || s.code() == StatusCode::kUnavailable;
}

}  // namespace

Result<TokenSpan> TokensOfLoad(const LoadSpec& load, std::int64_t remote_tokens_per_block,
                               std::int64_t local_tokens_per_block) {
  return TokensOfLoad(load, load.remote_block_ids, load.local_block_ids, remote_tokens_per_block,
                      local_tokens_per_block);
}

Result<TokenSpan> TokensOfLoad(const LoadSpec& load, std::span<const std::int64_t> remote_ids,
                               std::span<const std::int64_t> local_ids,
                               std::int64_t remote_tokens_per_block,
                               std::int64_t local_tokens_per_block) {
  const std::string sizes = "the prefill side's blocks hold " +
                            std::to_string(remote_tokens_per_block) + " tokens and this side's " +
                            std::to_string(local_tokens_per_block);
  if (load.num_tokens >= 0) {
    if (load.first_token < 0 || load.first_token % local_tokens_per_block != 0) {
      return Status::InvalidArgument("request " + load.request_id + " loads from token " +
                                     std::to_string(load.first_token) + "; " + sizes +
                                     ", and a load starts at a block of this side (a multiple of " +
                                     std::to_string(local_tokens_per_block) + ")");
    }
    return TokenSpan{load.first_token, load.num_tokens};
  }
  // Only block ids: where a local block holds m remote ones, the request's ceil(R / m) local
  // blocks end where the remote ones do, so the tail rule holds in tokens.
  if (local_tokens_per_block % remote_tokens_per_block != 0) {
    return Status::InvalidArgument(
        "request " + load.request_id + ": " + sizes +
        ", and its load gives block ids but not the tokens they hold, which blocks this small "
        "cannot be placed by; pass num_external_tokens and num_prompt_tokens to "
        "update_state_after_alloc (kvferry's vLLM adapter does), or give both instances one "
        "block size");
  }
  const std::int64_t m = local_tokens_per_block / remote_tokens_per_block;
  const auto remote = static_cast<std::int64_t>(remote_ids.size());
  const auto local = static_cast<std::int64_t>(local_ids.size());
  const std::int64_t total = (remote + m - 1) / m;
  if (local > total) {
    return Status::InvalidArgument("the decode side allocated " + std::to_string(local) +
                                   " blocks but the prefill side's " + std::to_string(remote) +
                                   " fill only " + std::to_string(total) + " (" + sizes +
                                   "); expected at most as many");
  }
  const std::optional<std::int64_t> first = CheckedMul(total - local, local_tokens_per_block);
  const std::optional<std::int64_t> end = CheckedMul(remote, remote_tokens_per_block);
  if (!first || !end) {
    return Status::InvalidArgument("request " + load.request_id + ": " + sizes + ", and its " +
                                   std::to_string(remote) +
                                   " prefill blocks hold more tokens than a load can count");
  }
  return TokenSpan{*first, *end - *first};
}

Result<std::vector<LoadRunner::SourceAgent>> LoadRunner::ResolveSources(const LoadSpec& load,
                                                                        const LoadPlan& plan,
                                                                        Deadline deadline,
                                                                        const char* feature) {
  std::vector<SourceAgent> out;
  for (const TpSource& source : plan.sources) {
    const std::string endpoint = SideChannelEndpoint(load.RankHost(source.prefill_rank),
                                                     load.remote_port + source.prefill_rank);
    const Deadline hs_deadline = std::min(deadline, DeadlineAfter(cfg_.handshake_timeout));
    KVFERRY_ASSIGN_OR_RETURN(
        std::shared_ptr<RemoteAgent> agent,
        agents_.Get({endpoint, load.remote_engine_id, source.prefill_rank, load.remote_tp_size},
                    hs_deadline));
    // A restarted prefill instance answers on the same endpoint under a new engine id; its
    // blocks are not this request's.
    if (agent->metadata->agent.peer.engine_id != load.remote_engine_id) {
      return Status::Unavailable("the prefill instance at " + endpoint + " is now engine " +
                                 agent->metadata->agent.peer.engine_id + ", but request " +
                                 load.request_id + " was held by engine " + load.remote_engine_id +
                                 ", which is gone");
    }
    // Equal hashes mean the same groups; a peer of another release may still send fewer.
    if (agent->metadata->caches.size() != plan.caches.size()) {
      return Status::NotSupported("the prefill worker at " + endpoint + " has " +
                                  std::to_string(agent->metadata->caches.size()) +
                                  " KV cache groups and this decode worker " +
                                  std::to_string(plan.caches.size()));
    }
    for (const CacheSpec& group : agent->metadata->caches.specs()) {
      KVFERRY_RETURN_IF_ERROR(CheckRegionLayout(group));
    }
    if (feature != nullptr && !agent->metadata->Offers(feature)) {
      return Status::NotSupported("the prefill worker at " + endpoint + " (engine " +
                                  load.remote_engine_id + ") does not speak " + feature +
                                  " transfer (an older kvferry); request " + load.request_id +
                                  " is recomputed here: send it whole-request legs instead");
    }
    out.push_back({source, endpoint, std::move(agent)});
  }
  return out;
}

const TpSource& LoadRunner::GroupSource(const LoadPlan& plan, const SourceAgent& s, int group) {
  // Plan checked that every group's sources name group 0's ranks, in order.
  const auto at = std::find_if(plan.sources.begin(), plan.sources.end(), [&](const TpSource& t) {
    return t.prefill_rank == s.source.prefill_rank;
  });
  return plan.group_sources[static_cast<std::size_t>(group)]
                           [static_cast<std::size_t>(at - plan.sources.begin())];
}

Status LoadRunner::AddGroupReads(const LoadSpec& load, const LoadPlan& plan, const StageRead& r,
                                 int group, PlannedBatch& batch) const {
  const CacheSpec& local = plan.caches[group];
  const CacheSpec& remote = r.from->agent->metadata->caches[group];
  const std::vector<std::int64_t>& local_ids = load.LocalIds(group);
  const std::vector<std::int64_t>& remote_ids = load.RemoteIds(group);
  if (local.is_state()) return AddStateReads(load, plan, r, group, batch);
  if (local.sliding_window() == 0 && remote.tokens_per_block() == local.tokens_per_block() &&
      remote.blocks_per_id() == 1 && local.blocks_per_id() == 1) {
    // The tail rule for decode-side prefix hits.
    KVFERRY_ASSIGN_OR_RETURN(std::span<const std::int64_t> tail,
                             TailOfRemote(remote_ids, local_ids));
    return AddReads(plan, r, group, tail, local_ids, batch);
  }
  // Engine block ids hold tokens_per_id tokens; the caches' own blocks, tokens_per_block.
  KVFERRY_ASSIGN_OR_RETURN(
      TokenSpan tokens,
      TokensOfLoad(load, remote_ids, local_ids, remote.tokens_per_id(), local.tokens_per_id()));
  if (local.sliding_window() > 0) {
    // Rule 17: a sliding window reads the prompt's last `sliding_window` tokens, from where the
    // decode side computes on (vLLM's SlidingWindowManager skips the tokens before), from the
    // start of the decode block they begin in, so that no block the decode side keeps is
    // partly written (NixlConnector reads cdiv(window, block) + 1 whole blocks), unless the
    // prefill side freed that block's first tokens (its blocks are smaller).
    const std::int64_t end = tokens.first + tokens.count;
    // Measured from the whole prompt: with state groups the load ends one token before it
    // (vLLM's rule), and the prefill side keeps the window of the whole prompt.
    bool state = false;
    for (int g = 0; g < plan.caches.size(); ++g) state = state || plan.caches[g].is_state();
    const std::int64_t window_first =
        std::max<std::int64_t>(end + (state ? 1 : 0) - local.sliding_window(), 0);
    const std::int64_t block_first = window_first / local.tokens_per_id() * local.tokens_per_id();
    const auto remote_at = static_cast<std::size_t>(block_first / remote.tokens_per_id());
    const bool held = remote_at < remote_ids.size() && remote_ids[remote_at] != kNoBlock;
    std::int64_t first = held ? block_first : window_first;
    // vLLM's decode side may have freed the block whose last token is the window's first (it
    // counts the loaded prompt as computed, skipping one token more): start after it.
    const std::int64_t local_first = load.first_token >= 0 ? load.first_token : tokens.first;
    const std::int64_t local_at = (block_first - local_first) / local.tokens_per_id();
    if (block_first >= local_first && local_at < static_cast<std::int64_t>(local_ids.size()) &&
        local_ids[static_cast<std::size_t>(local_at)] == kNoBlock &&
        block_first + local.tokens_per_id() <= window_first + 1) {
      first = block_first + local.tokens_per_id();
    }
    first = std::max(tokens.first, first);
    tokens = {first, end - first};
  }
  return AddTokenReads(load, plan, r, group, tokens, batch);
}

namespace {

// A state group's block of a request on one side: its last id that names a block (vLLM's
// running-state block; the ids before it are null or older states, as its "align" mode leaves
// them), or InvalidArgument saying which side named none and which block it should have named.
Result<std::int64_t> StateBlock(const LoadSpec& load, int group,
                                const std::vector<std::int64_t>& ids, const char* side,
                                const char* expected) {
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    if (*it != kNoBlock) return *it;
  }
  return Status::InvalidArgument("request " + load.request_id + ": KV cache group " +
                                 std::to_string(group) + " is a state group and " + side +
                                 " named no state block of it; expected the block " + expected);
}

}  // namespace

Status LoadRunner::AddStateReads(const LoadSpec& load, const LoadPlan& plan, const StageRead& r,
                                 int group, PlannedBatch& batch) const {
  // Rule 18: a state group moves one block, the prefill's state as of the last token it
  // computed, into the decode side's state block.
  // Without a local one the attention groups' tokens would land without the state they go with:
  // the decode side would compute on from a stale state.
  KVFERRY_ASSIGN_OR_RETURN(const std::int64_t local_id,
                           StateBlock(load, group, load.LocalIds(group), "this side",
                                      "the request's loaded state goes into"));
  KVFERRY_ASSIGN_OR_RETURN(const std::int64_t remote_id,
                           StateBlock(load, group, load.RemoteIds(group), "the prefill side",
                                      "holding the request's state as of its last computed token"));
  return AddReads(plan, r, group, std::span(&remote_id, 1), std::span(&local_id, 1), batch);
}

Status LoadRunner::AddReads(const LoadPlan& plan, const StageRead& r, int group,
                            std::span<const std::int64_t> remote_ids,
                            std::span<const std::int64_t> local_ids, PlannedBatch& batch) const {
  const SourceAgent& s = *r.from;
  const CacheSpec& local = plan.caches[group];
  const CacheSpec& remote = s.agent->metadata->caches[group];
  KVFERRY_ASSIGN_OR_RETURN(
      std::vector<BlockRun> runs,
      MergeBlockRuns(remote_ids, local_ids, remote.num_blocks(), local.num_blocks()));
  AppendReadOps(plan, s, group,
                RunByteRanges(runs, r.first, r.end, PartBlockGeometryOf(remote, local),
                              GroupSource(plan, s, group)),
                r.layer_shift, batch);
  batch.runs += runs.size();
  return Status::Ok();
}

Status LoadRunner::AddTokenReads(const LoadSpec& load, const LoadPlan& plan, const StageRead& r,
                                 int group, TokenSpan tokens, PlannedBatch& batch) const {
  const SourceAgent& s = *r.from;
  const CacheSpec& local = plan.caches[group];
  const CacheSpec& remote = s.agent->metadata->caches[group];
  const std::vector<std::int64_t> remote_ids =
      CacheBlocksOfIds(load.RemoteIds(group), remote.blocks_per_id());
  const std::vector<std::int64_t> local_ids =
      CacheBlocksOfIds(load.LocalIds(group), local.blocks_per_id());
  // Local ids hold the load's tokens from its first one on, remote ones the prompt's from 0.
  const std::int64_t local_first = load.first_token >= 0 ? load.first_token : tokens.first;
  KVFERRY_ASSIGN_OR_RETURN(
      std::vector<TokenRun> runs,
      PairTokenRuns({remote_ids, remote.tokens_per_block(), remote.num_blocks(), 0},
                    {local_ids, local.tokens_per_block(), local.num_blocks(), local_first},
                    tokens.first, tokens.count));
  AppendReadOps(
      plan, s, group,
      TokenRunByteRanges(runs, r.first, r.end, remote, local, GroupSource(plan, s, group)),
      r.layer_shift, batch);
  batch.runs += runs.size();
  return Status::Ok();
}

void LoadRunner::AppendReadOps(const LoadPlan& plan, const SourceAgent& s, int group,
                               std::span<const ByteRange> ranges, int layer_shift,
                               PlannedBatch& batch) const {
  const CacheGroups& remote = s.agent->metadata->caches;
  const CacheAddresses& local = plan.addresses[static_cast<std::size_t>(group)];
  for (const ByteRange& r : ranges) {
    const PartRegion region = RegionOfPart(remote, group, r.layer + layer_shift, r.part);
    batch.ops.push_back(
        {reinterpret_cast<std::byte*>(  // NOLINT(performance-no-int-to-ptr)
             local.Base(r.layer, r.part) + static_cast<std::uint64_t>(r.local_offset)),
         static_cast<RegionId>(region.id),
         static_cast<std::uint64_t>(region.offset + r.remote_offset),
         static_cast<std::uint64_t>(r.length), static_cast<std::uint64_t>(r.count),
         static_cast<std::uint64_t>(r.remote_step), static_cast<std::uint64_t>(r.local_step)});
    batch.bytes += static_cast<std::uint64_t>(r.length * r.count);
  }
}

Status LoadRunner::RunBatches(const LoadSpec& load, std::vector<PlannedBatch>& planned,
                              Deadline deadline, std::uint64_t* moved) {
  struct Submitted {
    BatchId batch;
    const SourceAgent* from;
  };
  std::vector<Submitted> batches;
  Status failure;
  std::uint64_t bytes = 0;
  std::uint64_t reads = 0;
  std::uint64_t runs = 0;
  for (PlannedBatch& p : planned) {
    if (p.ops.empty()) continue;
    bytes += p.bytes;
    reads += p.ops.size();
    runs += p.runs;
    UniqueLock lock(mu_);
    if (Status aborted = AbortedLocked(load.request_id); !aborted.ok()) {
      failure = aborted;
      break;
    }
    // Submitted under mu_ so an AbortLoad either sees this batch or ran before the check above.
    Result<BatchId> b = transport_.SubmitReads(p.from->agent->peer, std::move(p.ops), deadline);
    if (b.ok()) loads_.at(load.request_id).batches.push_back(*b);
    lock.Unlock();
    if (!b.ok()) {
      failure = b.status();
      if (PeerFault(failure)) agents_.Invalidate(p.from->endpoint, p.from->agent);
      break;
    }
    batches.push_back({*b, p.from});
  }
  for (const Submitted& s : batches) {
    if (!failure.ok()) {
      transport_.Cancel(s.batch);
    } else {
      BatchResult r = transport_.Wait(s.batch, deadline + std::chrono::seconds(1));
      if (r.state == BatchState::kInProgress) {
        transport_.Cancel(s.batch);
        r = {BatchState::kFailed, Status::Timeout("the read did not finish in time")};
      }
      if (r.state == BatchState::kCancelled) {
        MutexLock lock(mu_);
        if (Status aborted = AbortedLocked(load.request_id); !aborted.ok()) {
          // The engine's abort cancelled it: the peer is fine, and other loads read from it.
          r.status = aborted;
        } else {
          // Not cancelled by this load: another load found the peer dead and dropped it.
          r.status = Status::PeerDisconnected("the read was stopped because its peer was dropped");
        }
      }
      if (r.state != BatchState::kDone) {
        failure = r.status.WithContext("reading from " + s.from->endpoint);
        // Rule 12: a dead or restarted peer is dropped and re-handshaken on next use.
        if (PeerFault(r.status)) agents_.Invalidate(s.from->endpoint, s.from->agent);
      }
    }
    {
      MutexLock lock(mu_);
      std::vector<BatchId>& mine = loads_.at(load.request_id).batches;
      mine.erase(std::remove(mine.begin(), mine.end(), s.batch), mine.end());
      if (Status aborted = AbortedLocked(load.request_id); !aborted.ok()) failure = aborted;
    }
    transport_.Release(s.batch);
  }
  if (!failure.ok()) return failure;
  *moved += bytes;
  MutexLock lock(mu_);
  stats_.bytes_read += bytes;
  stats_.reads += reads;
  stats_.merged_runs += runs;
  return Status::Ok();
}

Status LoadRunner::DoLoad(const LoadSpec& load, std::uint64_t* moved) {
  const Deadline deadline = DeadlineAfter(cfg_.transfer_timeout);
  KVFERRY_ASSIGN_OR_RETURN(LoadPlan plan, Plan(load));
  std::set<std::string> read_from;
  if (!load.local_block_ids.empty()) {
    bool peer_fault = false;
    Status s = ReadLoad(load, plan, deadline, moved, read_from, &peer_fault,
                        /*probe_holds=*/false);
    // A cached agent whose reads fail on a peer fault was handshaken with a process that may
    // since have restarted on its endpoint (rule 12): it is dropped, and the load is read once
    // more through a fresh handshake, so that a restart costs no recompute, but only from ranks
    // that hold the request now (ReadLoad's probe): a restarted instance of the same engine id
    // that holds nothing of it would otherwise serve other blocks at these ids, and confirm them
    // as an early notice.
    if (peer_fault && Clock::now() < deadline) {
      Log().info(
          "request {}: reads failed on a peer fault ({}); reading once more after a new "
          "handshake",
          load.request_id, s.ToString());
      {
        MutexLock lock(mu_);
        ++stats_.loads_reread;
      }
      read_from.clear();
      s = ReadLoad(load, plan, deadline, moved, read_from, &peer_fault, /*probe_holds=*/true);
    }
    KVFERRY_RETURN_IF_ERROR(s);
  }
  return Confirm(load, plan.endpoints, read_from);
}

Status LoadRunner::ReadLoad(const LoadSpec& load, const LoadPlan& plan, Deadline deadline,
                            std::uint64_t* moved, std::set<std::string>& read_from,
                            bool* peer_fault, bool probe_holds) {
  *peer_fault = false;
  // Every prefill stage the load reaches (one where the PP sizes are equal), handshaken.
  const bool unequal = PpReaders(load) != 1;
  std::vector<SourceAgent> agents;
  for (const LoadSpec& stage : Stages(load)) {
    KVFERRY_ASSIGN_OR_RETURN(
        std::vector<SourceAgent> more,
        ResolveSources(stage, plan, deadline, unequal ? wire::kFeaturePpReaders : nullptr));
    for (SourceAgent& a : more) agents.push_back(std::move(a));
  }
  // One batch per prefill rank, with every group's reads from it.
  std::vector<PlannedBatch> batches;
  for (const SourceAgent& a : agents) batches.push_back({&a, {}, 0, 0});
  for (int g = 0; g < plan.caches.size(); ++g) {
    KVFERRY_ASSIGN_OR_RETURN(std::vector<StageRead> reads,
                             PlanStageReads(load, plan.caches[g], agents, g));
    for (const StageRead& r : reads) {
      PlannedBatch& batch = batches[static_cast<std::size_t>(r.from - agents.data())];
      KVFERRY_RETURN_IF_ERROR(AddGroupReads(load, plan, r, g, batch));
      read_from.insert(r.from->endpoint);
    }
  }
  if (probe_holds) {
    for (const std::string& endpoint : read_from) {
      KVFERRY_RETURN_IF_ERROR(ProbeHold(load, endpoint));
    }
  }
  Status s = RunBatches(load, batches, deadline, moved);
  *peer_fault = PeerFault(s);
  return s;
}

Status LoadRunner::ProbeHold(const LoadSpec& load, const std::string& endpoint) {
  // A lease renewal's ack counts the holds it renewed: unknown ids (and early notices) are not.
  Result<wire::Message> reply = client_.Call(
      endpoint,
      wire::LeaseRenewal{
          self_, {load.remote_request_id}, static_cast<std::uint32_t>(cfg_.hold_lease.count())},
      DeadlineAfter(cfg_.notice_timeout));
  if (!reply.ok()) return reply.status().WithContext("asking " + endpoint + " for its hold");
  const auto* ack = std::get_if<wire::Ack>(&*reply);
  if (ack == nullptr || ack->count != 1) {
    return Status::NotFound("the prefill rank at " + endpoint +
                            " answered again after a peer fault (a restart) but does not hold "
                            "request " +
                            load.remote_request_id + "; its blocks are not read (recompute)");
  }
  return Status::Ok();
}

Status LoadRunner::Confirm(const LoadSpec& load, const std::vector<std::string>& endpoints,
                           const std::set<std::string>& read_from) {
  // Rule 10: every prefill rank read from (and the unread ones this rank covers) is told, also
  // when there was nothing to read. A rank read from is told at once and must confirm that it
  // still held the blocks: a hold that ended by lease or abort during the reads may have had its
  // blocks reused, and bytes read then must not be used (the load fails, to be recomputed). The
  // other ranks' notices are batched.
  for (const std::string& endpoint : endpoints) {
    if (read_from.count(endpoint) == 0) {
      notifier_->Finished(endpoint, load.remote_request_id, DeadlineAfter(cfg_.notice_timeout),
                          PpReaders(load));
      continue;
    }
    Result<wire::Message> reply =
        client_.Call(endpoint,
                     wire::FinishedNotice{self_,
                                          {load.remote_request_id},
                                          static_cast<std::uint32_t>(cfg_.tp_size),
                                          PpReaders(load)},
                     DeadlineAfter(cfg_.notice_timeout));
    // An error reply arrives as an error status (NotFound: the hold had ended), as does no
    // reply: either way the bytes are not confirmed, and the load fails.
    if (!reply.ok()) {
      return reply.status().WithContext("confirming with " + endpoint +
                                        " that it held the blocks while they were read");
    }
  }
  return Status::Ok();
}

}  // namespace kvferry
