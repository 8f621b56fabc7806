// The scheduler side of the connector (DESIGN rules 1-4): pure logic on one thread. Its metadata's
// wire form is connector_metadata.cc.
#include <algorithm>

#include "kvferry/connector.h"
#include "wire/messages.h"

namespace kvferry {
namespace {

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLengthCapped:
      return "length capped";
    case FinishReason::kStopped:
      return "stopped";
    case FinishReason::kAborted:
      return "aborted";
    case FinishReason::kError:
      return "error";
    case FinishReason::kPreempted:
      return "preempted";
  }
  return "unknown";
}

// A host per rank, stage-major: exactly pp * tp of them, each a name the wire carries.
Status CheckRankHosts(const std::string& what, const std::vector<std::string>& hosts, int pp,
                      int tp) {
  const auto expected = static_cast<std::size_t>(pp) * static_cast<std::size_t>(tp);
  if (hosts.size() != expected) {
    return Status::InvalidArgument(what + " name " + std::to_string(hosts.size()) +
                                   " hosts; expected one per rank, PP " + std::to_string(pp) +
                                   " x TP " + std::to_string(tp) + " = " +
                                   std::to_string(expected) + ", stage-major");
  }
  for (std::size_t r = 0; r < hosts.size(); ++r) {
    if (hosts[r].empty() || hosts[r].size() > wire::kMaxIdBytes) {
      return Status::InvalidArgument(what + ": rank " + std::to_string(r) + "'s host has " +
                                     std::to_string(hosts[r].size()) + " bytes; expected 1 to " +
                                     std::to_string(wire::kMaxIdBytes));
    }
  }
  return Status::Ok();
}

}  // namespace

std::pair<std::int64_t, bool> Scheduler::GetNumNewMatchedTokens(
    const KvTransferParams& params, std::int64_t num_prompt_tokens,
    std::int64_t num_computed_tokens) const {
  if (!params.do_remote_prefill) return {0, false};
  const std::int64_t count =
      std::max<std::int64_t>(LoadedPrompt(num_prompt_tokens) - num_computed_tokens, 0);
  return {count, count > 0};
}

std::int64_t Scheduler::PrefillTokens(const KvTransferParams& params,
                                      std::int64_t num_prompt_tokens) const {
  return params.do_remote_decode ? LoadedPrompt(num_prompt_tokens) : num_prompt_tokens;
}

Status Scheduler::UpdateStateAfterAlloc(const std::string& request_id, KvTransferParams& params,
                                        std::span<const std::int64_t> new_block_ids) {
  return UpdateStateAfterAlloc(request_id, params, new_block_ids, -1, -1);
}

Status Scheduler::UpdateStateAfterAlloc(const std::string& request_id, KvTransferParams& params,
                                        std::span<const std::int64_t> new_block_ids,
                                        std::int64_t num_external_tokens,
                                        std::int64_t num_prompt_tokens) {
  if (!params.do_remote_prefill) return Status::Ok();
  const std::vector<std::vector<std::int64_t>> one = {{new_block_ids.begin(), new_block_ids.end()}};
  return UpdateStateAfterAllocAllGroups(request_id, params, one, num_external_tokens,
                                        num_prompt_tokens);
}

Status Scheduler::UpdateStateAfterAllocAllGroups(
    const std::string& request_id, KvTransferParams& params,
    std::span<const std::vector<std::int64_t>> group_block_ids, std::int64_t num_external_tokens,
    std::int64_t num_prompt_tokens) {
  if (!params.do_remote_prefill) return Status::Ok();
  // Cleared first, whatever happens next, so the request is never loaded twice.
  params.do_remote_prefill = false;
  const bool tokens_known = num_external_tokens >= 0 || num_prompt_tokens >= 0;
  // With state groups the prefill side computed the prompt less its last token: the load's
  // tokens end there.
  if (num_prompt_tokens > 0) num_prompt_tokens = LoadedPrompt(num_prompt_tokens);
  constexpr std::int64_t kMaxTokens = std::int64_t{1} << 40;  // what the metadata carries
  if (tokens_known && (num_external_tokens < 0 || num_prompt_tokens > kMaxTokens ||
                       num_external_tokens > num_prompt_tokens)) {
    return Status::InvalidArgument("request " + request_id + " brings " +
                                   std::to_string(num_external_tokens) + " external tokens of a " +
                                   std::to_string(num_prompt_tokens) +
                                   "-token prompt; expected 0 to the prompt's length");
  }
  std::string missing;
  auto need = [&](bool present, const char* name) {
    if (!present) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  const bool layerwise = params.transfer_id.has_value();
  need(layerwise || params.remote_block_ids.has_value(), "remote_block_ids");
  need(params.remote_engine_id.has_value(), "remote_engine_id");
  need(params.remote_host.has_value(), "remote_host");
  need(params.remote_port.has_value(), "remote_port");
  need(params.remote_tp_size.has_value(), "remote_tp_size");
  if (!missing.empty()) {
    return Status::InvalidArgument("request " + request_id +
                                   " asks for remote prefill but its kv_transfer_params lack " +
                                   missing + "; check the proxy that forwards them");
  }
  // Rule 14: the prefill ranks a load talks to are remote_port + 0 .. remote_pp_size *
  // remote_tp_size - 1.
  const int pp = params.remote_pp_size.value_or(1);
  if (*params.remote_tp_size < 1 || *params.remote_tp_size > kMaxTpSize || pp < 1 ||
      pp > kMaxTpSize || *params.remote_port < 1 ||
      static_cast<std::int64_t>(*params.remote_port) +
              static_cast<std::int64_t>(pp) * *params.remote_tp_size - 1 >
          65535) {
    return Status::InvalidArgument(
        "request " + request_id + " has remote_tp_size " + std::to_string(*params.remote_tp_size) +
        ", remote_pp_size " + std::to_string(pp) + " and remote_port " +
        std::to_string(*params.remote_port) + "; expected TP and PP sizes in 1.." +
        std::to_string(kMaxTpSize) +
        " and ports remote_port..remote_port + remote_pp_size * remote_tp_size - 1 inside "
        "1..65535");
  }
  LoadSpec load;
  load.request_id = request_id;
  const std::size_t groups =
      params.remote_group_block_ids ? params.remote_group_block_ids->size() + 1 : 1;
  if (group_block_ids.empty() ||
      group_block_ids.size() > static_cast<std::size_t>(kMaxCacheGroups) ||
      (!layerwise && group_block_ids.size() != groups)) {
    return Status::InvalidArgument(
        "request " + request_id + " has blocks of " + std::to_string(group_block_ids.size()) +
        " KV cache groups here, but its kv_transfer_params name " + std::to_string(groups) +
        " (remote_block_ids and remote_group_block_ids); expected one list per group, 1 to " +
        std::to_string(kMaxCacheGroups) + ", on both instances");
  }
  load.local_block_ids = group_block_ids[0];
  for (std::size_t g = 1; g < group_block_ids.size(); ++g) {
    load.more_groups.push_back({group_block_ids[g], layerwise
                                                        ? std::vector<std::int64_t>{}
                                                        : (*params.remote_group_block_ids)[g - 1]});
  }
  if (layerwise) {
    if (params.transfer_id->empty() || params.transfer_id->size() > wire::kMaxIdBytes) {
      return Status::InvalidArgument("request " + request_id + " has a transfer_id of " +
                                     std::to_string(params.transfer_id->size()) +
                                     " bytes; expected 1 to " + std::to_string(wire::kMaxIdBytes));
    }
    load.transfer_id = *params.transfer_id;
  } else {
    load.remote_block_ids = *params.remote_block_ids;
  }
  load.remote_engine_id = *params.remote_engine_id;
  load.remote_host = *params.remote_host;
  load.remote_port = *params.remote_port;
  load.remote_tp_size = *params.remote_tp_size;
  load.remote_pp_size = pp;
  if (params.remote_rank_hosts) {
    KVFERRY_RETURN_IF_ERROR(CheckRankHosts("request " + request_id + "'s remote_rank_hosts",
                                           *params.remote_rank_hosts, pp, *params.remote_tp_size));
    load.remote_rank_hosts = *params.remote_rank_hosts;
  }
  if (tokens_known) {
    load.first_token = num_prompt_tokens - num_external_tokens;
    load.num_tokens = num_external_tokens;
  }
  load.remote_request_id =
      layerwise ? load.transfer_id : params.remote_request_id.value_or(request_id);
  pending_.loads.push_back(std::move(load));
  return Status::Ok();
}

void Scheduler::RequestScheduled(const std::string& request_id, const KvTransferParams& params,
                                 std::span<const std::int64_t> block_ids,
                                 std::int64_t num_computed_tokens,
                                 std::int64_t num_scheduled_tokens,
                                 std::int64_t num_prompt_tokens) {
  const std::vector<std::vector<std::int64_t>> one = {{block_ids.begin(), block_ids.end()}};
  RequestScheduledAllGroups(request_id, params, one, num_computed_tokens, num_scheduled_tokens,
                            num_prompt_tokens);
}

void Scheduler::RequestScheduledAllGroups(
    const std::string& request_id, const KvTransferParams& params,
    std::span<const std::vector<std::int64_t>> group_block_ids, std::int64_t num_computed_tokens,
    std::int64_t num_scheduled_tokens, std::int64_t num_prompt_tokens) {
  if (!ServesKv(config_.role) || !params.do_remote_decode || !params.transfer_id ||
      params.transfer_id->empty() || num_prompt_tokens <= 0) {
    return;
  }
  const std::int64_t first = std::clamp<std::int64_t>(num_computed_tokens, 0, num_prompt_tokens);
  const std::int64_t end = std::clamp<std::int64_t>(num_computed_tokens + num_scheduled_tokens,
                                                    first, num_prompt_tokens);
  auto [it, fresh] = layerwise_computed_.try_emplace(request_id, first);
  if (!fresh && first < it->second) {
    // Preempted and recomputed: its old blocks were freed, and readers may have read them.
    pending_.transfer_ends.push_back(
        {*params.transfer_id, "request " + request_id +
                                  " was preempted on the prefill side and "
                                  "is being recomputed from token " +
                                  std::to_string(first)});
    layerwise_computed_.erase(it);
    return;
  }
  it->second = end;
  if (first == end || group_block_ids.empty()) return;  // decoding, or no prompt this step
  pending_.saves.push_back(
      {request_id, *params.transfer_id, group_block_ids.front(), first, end, num_prompt_tokens,
       std::vector<std::vector<std::int64_t>>(group_block_ids.begin() + 1, group_block_ids.end())});
}

ConnectorMetadata Scheduler::BuildConnectorMeta() {
  ConnectorMetadata out;
  std::swap(out, pending_);
  return out;
}

Scheduler::FinishedResult Scheduler::RequestFinished(const std::string& request_id,
                                                     const KvTransferParams& params,
                                                     FinishReason reason,
                                                     std::span<const std::int64_t> block_ids) {
  const std::vector<std::vector<std::int64_t>> one = {{block_ids.begin(), block_ids.end()}};
  return RequestFinishedAllGroups(request_id, params, reason, one);
}

Scheduler::FinishedResult Scheduler::RequestFinishedAllGroups(
    const std::string& request_id, const KvTransferParams& params, FinishReason reason,
    std::span<const std::vector<std::int64_t>> group_block_ids) {
  const bool any_block = std::any_of(group_block_ids.begin(), group_block_ids.end(),
                                     [](const std::vector<std::int64_t>& g) { return !g.empty(); });
  if (ReadsKv(config_.role) && params.do_remote_prefill) {
    // Ended before UpdateStateAfterAlloc (aborted while it waited): a load of no blocks still
    // sends its finished notices, so the prefill side frees now instead of at its lease.
    // Incomplete params have no one to tell.
    KvTransferParams unscheduled = params;
    const std::vector<std::vector<std::int64_t>> none(
        params.remote_group_block_ids ? params.remote_group_block_ids->size() + 1 : 1);
    (void)UpdateStateAfterAllocAllGroups(request_id, unscheduled, none, -1, -1);
    return {};
  }
  if (!ServesKv(config_.role)) return {};
  const bool layerwise =
      params.do_remote_decode && params.transfer_id.has_value() && !params.transfer_id->empty();
  if (layerwise) layerwise_computed_.erase(request_id);
  if (!params.do_remote_decode || reason != FinishReason::kLengthCapped || !any_block) {
    if (layerwise) {
      pending_.transfer_ends.push_back(
          {*params.transfer_id, "request " + request_id + " ended on the prefill side (" +
                                    FinishReasonName(reason) + ") without holding its KV"});
    }
    if (!params.do_remote_decode || reason != FinishReason::kLengthCapped) return {};
  }
  FinishedResult r;
  r.delay_free = any_block;
  if (r.delay_free) {
    pending_.holds.push_back({request_id, static_cast<std::int64_t>(config_.hold_lease.count()),
                              layerwise ? *params.transfer_id : std::string()});
  }
  KvTransferParams out;
  out.do_remote_prefill = true;
  out.remote_block_ids =
      group_block_ids.empty() ? std::vector<std::int64_t>{} : group_block_ids.front();
  if (group_block_ids.size() > 1) {
    out.remote_group_block_ids.emplace(group_block_ids.begin() + 1, group_block_ids.end());
  }
  out.remote_engine_id = config_.engine_id;
  out.remote_host = config_.host;
  out.remote_port = config_.base_port + config_.dp_rank * config_.pp_size * config_.tp_size;
  out.remote_tp_size = config_.tp_size;
  if (config_.pp_size > 1) out.remote_pp_size = config_.pp_size;
  if (!rank_hosts_.empty()) out.remote_rank_hosts = rank_hosts_;
  // A layer-wise hold is keyed by the transfer id: a proxy that falls back to forwarding these
  // params (whole-request) reaches the same hold.
  out.remote_request_id = layerwise ? *params.transfer_id : request_id;
  r.params = std::move(out);
  return r;
}

Status Scheduler::SetRankHosts(std::vector<std::string> hosts) {
  if (!hosts.empty()) {
    KVFERRY_RETURN_IF_ERROR(
        CheckRankHosts("the rank hosts", hosts, config_.pp_size, config_.tp_size));
  }
  rank_hosts_ = std::move(hosts);
  return Status::Ok();
}

}  // namespace kvferry
