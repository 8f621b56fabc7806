#include "connector/layerwise_table.h"

#include <algorithm>

namespace kvferry {

std::string ReaderKey(const wire::PeerRef& p) {
  return p.engine_id + "/" + std::to_string(p.dp_rank) + "/" + std::to_string(p.tp_rank) +
         (p.pp_rank != 0 ? "/pp" + std::to_string(p.pp_rank) : std::string());
}

LayerwiseTable::LayerwiseTable(LayerwiseLimits limits, wire::PeerRef self)
    : limits_(limits), self_(std::move(self)) {}

int LayerwiseTable::total_layers() const {
  int total = 0;
  for (int n : limits_.group_layers) total += n;
  return total;
}

std::vector<ProgressPush> LayerwiseTable::PushAll(Transfer& t) {
  ++t.progress.seq;
  std::vector<ProgressPush> out;
  out.reserve(t.subscribers.size());
  for (const auto& [key, endpoint] : t.subscribers) out.push_back({endpoint, key, t.progress});
  return out;
}

void LayerwiseTable::RememberEnded(const std::string& transfer_id) {
  if (!ended_.insert(transfer_id).second) return;
  ended_order_.push_back(transfer_id);
  if (ended_order_.size() > 65536) {
    ended_.erase(ended_order_.front());
    ended_order_.pop_front();
  }
}

wire::Progress LayerwiseTable::EndedProgress(const std::string& transfer_id) const {
  wire::Progress p;
  p.from = self_;
  p.transfer_id = transfer_id;
  p.seq = 1;
  p.state = wire::Progress::State::kFailed;
  p.reason = "transfer " + transfer_id +
             " has ended on this prefill worker (its request was aborted or preempted, or its "
             "hold ended) before this subscription; recompute it";
  return p;
}

std::vector<ProgressPush> LayerwiseTable::Begin(const LayerwiseSave& save, Clock::time_point now) {
  (void)now;
  if (ended_.count(save.transfer_id) != 0) return {};  // a reader already gave up on it
  auto [it, fresh] = transfers_.try_emplace(save.transfer_id);
  Transfer& t = it->second;
  wire::Progress& p = t.progress;
  if (fresh || t.request_id.empty()) {
    if (!fresh) --waiting_;
    t.request_id = save.request_id;
    p.from = self_;
    p.transfer_id = save.transfer_id;
    p.state = wire::Progress::State::kRunning;
    p.prompt_tokens = static_cast<std::uint64_t>(save.prompt_tokens);
  } else if (t.request_id != save.request_id ||
             p.prompt_tokens != static_cast<std::uint64_t>(save.prompt_tokens)) {
    return Fail(save.transfer_id, "transfer " + save.transfer_id + " was started by request " +
                                      t.request_id + " with " + std::to_string(p.prompt_tokens) +
                                      " prompt tokens; request " + save.request_id + " with " +
                                      std::to_string(save.prompt_tokens) +
                                      " names it too (a transfer id must be unique per request)");
  } else if (static_cast<std::uint64_t>(save.first_token) < p.tokens_all) {
    return Fail(save.transfer_id, "request " + save.request_id +
                                      " is computing prompt tokens from " +
                                      std::to_string(save.first_token) + " again after " +
                                      std::to_string(p.tokens_all) +
                                      " were written (preempted): its blocks may have changed");
  }
  const std::size_t more = limits_.group_layers.size() - 1;
  if (save.group_block_ids.size() != more) {
    return Fail(save.transfer_id,
                "request " + save.request_id + " names blocks of " +
                    std::to_string(save.group_block_ids.size() + 1) +
                    " KV cache group(s) but this worker's cache has " + std::to_string(more + 1) +
                    " (an engine that schedules a hybrid model's layer-wise leg passes every "
                    "group's blocks: Scheduler::RequestScheduledAllGroups)");
  }
  p.tokens_all = std::max(p.tokens_all, static_cast<std::uint64_t>(save.first_token));
  p.tokens_cur = static_cast<std::uint64_t>(save.end_token);
  p.layers_cur = 0;
  p.group_layers_cur.assign(more, 0);
  p.block_ids = save.block_ids;
  p.group_block_ids = save.group_block_ids;
  return PushAll(t);
}

std::vector<ProgressPush> LayerwiseTable::LayerWritten(std::span<const LayerwiseSave> saves,
                                                       int layer) {
  std::vector<ProgressPush> out;
  const int total = total_layers();
  if (layer < 0 || layer >= total) return out;
  // The group and the group's own layer of the engine's layer index.
  int group = 0;
  int in_group = layer;
  while (in_group >= limits_.group_layers[static_cast<std::size_t>(group)]) {
    in_group -= limits_.group_layers[static_cast<std::size_t>(group)];
    ++group;
  }
  for (const LayerwiseSave& save : saves) {
    auto it = transfers_.find(save.transfer_id);
    if (it == transfers_.end() || it->second.request_id != save.request_id) continue;
    wire::Progress& p = it->second.progress;
    // A later step has begun since (the engine announces an earlier step's layers late), or the
    // request is held and so complete.
    if (p.tokens_cur != static_cast<std::uint64_t>(save.end_token) || p.complete()) continue;
    std::uint32_t& cur =
        group == 0 ? p.layers_cur : p.group_layers_cur[static_cast<std::size_t>(group - 1)];
    cur = std::max(cur, static_cast<std::uint32_t>(in_group + 1));
    int written = 0;
    for (int g = 0; g < p.groups(); ++g) written += static_cast<int>(p.LayersCur(g));
    const bool last = written == total;
    if (last) {
      p.tokens_all = p.tokens_cur;
      p.layers_cur = 0;
      std::fill(p.group_layers_cur.begin(), p.group_layers_cur.end(), 0);
    }
    if (last || written % std::max(1, limits_.layers_per_notice) == 0) {
      std::vector<ProgressPush> pushes = PushAll(it->second);
      out.insert(out.end(), std::make_move_iterator(pushes.begin()),
                 std::make_move_iterator(pushes.end()));
    }
  }
  return out;
}

std::vector<ProgressPush> LayerwiseTable::Complete(const std::string& transfer_id) {
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end()) return {};
  Transfer& t = it->second;
  if (t.request_id.empty()) {
    return Fail(transfer_id, "the prefill engine held transfer " + transfer_id +
                                 " without ever scheduling it layer by layer "
                                 "(Scheduler::RequestScheduled), so its blocks are unknown here");
  }
  wire::Progress& p = t.progress;
  if (p.complete()) return {};
  p.tokens_all = p.tokens_cur = p.prompt_tokens;
  p.layers_cur = 0;
  std::fill(p.group_layers_cur.begin(), p.group_layers_cur.end(), 0);
  return PushAll(t);
}

std::vector<ProgressPush> LayerwiseTable::Fail(const std::string& transfer_id,
                                               const std::string& reason) {
  RememberEnded(transfer_id);
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end()) return {};
  Transfer& t = it->second;
  t.progress.from = self_;
  t.progress.transfer_id = transfer_id;
  t.progress.state = wire::Progress::State::kFailed;
  t.progress.reason = reason;
  std::vector<ProgressPush> out = PushAll(t);
  if (t.request_id.empty()) --waiting_;
  transfers_.erase(it);
  return out;
}

void LayerwiseTable::Remove(const std::string& transfer_id) {
  RememberEnded(transfer_id);
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end()) return;
  if (it->second.request_id.empty()) --waiting_;
  transfers_.erase(it);
}

Result<wire::Progress> LayerwiseTable::Subscribe(const wire::Subscribe& s, Clock::time_point now) {
  if (s.groups != limits_.group_layers.size()) {
    return Status::NotSupported(
        "transfer " + s.transfer_id + ": this prefill worker's cache has " +
        std::to_string(limits_.group_layers.size()) + " KV cache group(s) and reader " +
        ReaderKey(s.from) + " subscribes for " + std::to_string(s.groups) +
        " (a kvferry without layer-wise transfer of hybrid models reads group 0 alone); "
        "refused: upgrade the decode instance, or send this model whole-request legs");
  }
  if (ended_.count(s.transfer_id) != 0) return EndedProgress(s.transfer_id);
  const std::string key = ReaderKey(s.from);
  auto it = transfers_.find(s.transfer_id);
  if (it == transfers_.end()) {
    if (waiting_ >= limits_.max_waiting) {
      ++refused_;
      return Status::ResourceExhausted(
          "this prefill worker already keeps " + std::to_string(limits_.max_waiting) +
          " subscriptions to transfers it has not started; transfer " + s.transfer_id +
          " is refused (its load fails, to be recomputed)");
    }
    it = transfers_.try_emplace(s.transfer_id).first;
    ++waiting_;
    Transfer& t = it->second;
    t.progress.from = self_;
    t.progress.transfer_id = s.transfer_id;
    t.progress.state = wire::Progress::State::kWaiting;
    t.wait_until = now + std::min(std::chrono::milliseconds(s.wait_ms), limits_.max_wait);
  }
  Transfer& t = it->second;
  if (t.subscribers.count(key) == 0 && t.subscribers.size() >= limits_.max_subscribers) {
    ++refused_;
    return Status::ResourceExhausted("transfer " + s.transfer_id + " already has " +
                                     std::to_string(limits_.max_subscribers) +
                                     " subscribers; reader " + key + " is refused");
  }
  t.subscribers[key] = s.endpoint;
  return t.progress;
}

void LayerwiseTable::Unsubscribe(const std::string& transfer_id, const std::string& subscriber) {
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end()) return;
  it->second.subscribers.erase(subscriber);
  if (it->second.request_id.empty() && it->second.subscribers.empty()) {
    --waiting_;
    transfers_.erase(it);
  }
}

std::vector<ProgressPush> LayerwiseTable::Expire(Clock::time_point now) {
  std::vector<ProgressPush> out;
  std::vector<std::string> expired;
  for (const auto& [id, t] : transfers_) {
    if (t.request_id.empty() && t.wait_until <= now) expired.push_back(id);
  }
  for (const std::string& id : expired) {
    std::vector<ProgressPush> pushes =
        Fail(id, "the request of transfer " + id +
                     " never arrived at this prefill worker while its subscription waited (the "
                     "prefill leg was lost, or waits behind a long queue)");
    out.insert(out.end(), std::make_move_iterator(pushes.begin()),
               std::make_move_iterator(pushes.end()));
  }
  return out;
}

}  // namespace kvferry
