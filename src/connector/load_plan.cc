// Where a load reads from, before anything is read (DESIGN rules 8, 14 and 17): the prefill
// stages it reaches (one where the PP sizes are equal, all where they differ), the layers each
// stage's ranks give it, the TP sources of every KV cache group, and the prefill ranks to tell
// when it ends. The reads themselves are load_reads.cc.
#include <algorithm>
#include <set>

#include "common/log.h"
#include "connector/load_runner.h"

namespace kvferry {
namespace {

// Remote input decides how many ranks a load talks to and their ports: bounded before any loop.
Status CheckRemoteRanks(int remote_tp_size, int remote_port) {
  if (remote_tp_size < 1 || remote_tp_size > kMaxTpSize) {
    return Status::InvalidArgument("remote_tp_size " + std::to_string(remote_tp_size) +
                                   " is outside 1.." + std::to_string(kMaxTpSize));
  }
  if (remote_port < 1 || remote_port + remote_tp_size - 1 > 65535) {
    return Status::InvalidArgument("remote_port " + std::to_string(remote_port) + " with " +
                                   std::to_string(remote_tp_size) +
                                   " ranks reaches past port 65535");
  }
  return Status::Ok();
}

}  // namespace

std::vector<LoadSpec> LoadRunner::Stages(const LoadSpec& load) const {
  // Equal PP sizes: the worker aimed the load at the prefill stage of this stage's index.
  if (load.remote_pp_size == cfg_.pp_size) return {load};
  std::vector<LoadSpec> out;
  for (int s = 0; s < load.remote_pp_size; ++s) {
    // Where stage s is and whom it holds for; not the block ids (read from `load` itself), so
    // that a large load is not copied once per stage.
    LoadSpec& stage = out.emplace_back();
    stage.request_id = load.request_id;
    stage.remote_request_id = load.remote_request_id;
    stage.remote_engine_id = load.remote_engine_id;
    stage.remote_host = load.remote_host;
    stage.remote_port = load.remote_port;
    stage.remote_tp_size = load.remote_tp_size;
    stage.remote_pp_size = load.remote_pp_size;
    stage.transfer_id = load.transfer_id;
    stage.remote_port += s * load.remote_tp_size;
    if (!load.remote_rank_hosts.empty()) {
      const auto first = load.remote_rank_hosts.begin() + s * load.remote_tp_size;
      stage.remote_rank_hosts.assign(first, first + load.remote_tp_size);
    }
  }
  return out;
}

std::uint32_t LoadRunner::PpReaders(const LoadSpec& load) const {
  return load.remote_pp_size == cfg_.pp_size ? 1 : static_cast<std::uint32_t>(cfg_.pp_size);
}

std::vector<std::string> LoadRunner::NoticeEndpoints(const LoadSpec& load, const CacheSpec& spec,
                                                     const std::vector<TpSource>& sources) const {
  std::set<int> ranks;
  for (const TpSource& s : sources) ranks.insert(s.prefill_rank);
  // Prefill ranks nobody reads (decode TP smaller) are told by one decode rank each.
  for (int q = 0; q < load.remote_tp_size; ++q) {
    Result<int> readers = ExpectedReaders(spec, load.remote_tp_size, cfg_.tp_size, q);
    if (readers.ok() && *readers == 0 && q % cfg_.tp_size == cfg_.tp_rank) ranks.insert(q);
  }
  // Unequal PP sizes: every stage tells every prefill stage (FinishedNotice::pp_readers), also
  // those holding none of its layers, so each prefill rank counts the same readers.
  std::vector<std::string> out;
  for (const LoadSpec& stage : Stages(load)) {
    for (int q : ranks) {
      out.push_back(SideChannelEndpoint(stage.RankHost(q), stage.remote_port + q));
    }
  }
  return out;
}

Result<std::vector<LoadRunner::StageRead>> LoadRunner::PlanStageReads(
    const LoadSpec& load, const CacheSpec& local, std::span<const SourceAgent> agents, int group) {
  std::vector<StageRead> out;
  std::string held;  // the prefill layer ranges, for the message
  std::vector<bool> covered(static_cast<std::size_t>(local.num_layers()), false);
  for (const SourceAgent& a : agents) {
    const CacheSpec& remote = a.agent->metadata->caches[group];
    const int first = std::max(local.first_layer(), remote.first_layer());
    const int end = std::min(local.end_layer(), remote.end_layer());
    const std::string range = "[" + std::to_string(remote.first_layer()) + ", " +
                              std::to_string(remote.end_layer()) + ")";
    if (held.find(range) == std::string::npos) held += (held.empty() ? "" : ", ") + range;
    StageRead r{&a, first - local.first_layer(), end - local.first_layer(),
                local.first_layer() - remote.first_layer()};
    for (int l = std::max(r.first, 0); l < r.end; ++l) covered[static_cast<std::size_t>(l)] = true;
    if (r.first < r.end) out.push_back(r);
  }
  // Rule 17: every layer of this stage from a prefill stage that holds it, or no byte moves.
  for (std::size_t l = 0; l < covered.size(); ++l) {
    if (covered[l]) continue;
    return Status::NotSupported(
        "request " + load.request_id + ": this decode stage holds the model's layers [" +
        std::to_string(local.first_layer()) + ", " + std::to_string(local.end_layer()) +
        "), but model layer " + std::to_string(local.first_layer() + static_cast<int>(l)) +
        " is in no prefill stage it reached (they hold " + held +
        "); a decode stage reads its layers from the prefill stages holding them, so check "
        "remote_port and remote_pp_size, and that both instances split the model's layers as "
        "vLLM's get_pp_indices does");
  }
  return out;
}

Result<LoadRunner::LoadPlan> LoadRunner::Plan(const LoadSpec& load) {
  std::optional<CacheGroups> caches;
  std::vector<CacheAddresses> addresses;
  {
    MutexLock lock(mu_);
    if (stopping_) return Status::Cancelled("the worker is shutting down");
    caches = caches_;
    addresses = addresses_;
  }
  if (!caches) {
    return Status::InvalidArgument("KV caches are not registered; call RegisterKvCaches first");
  }
  KVFERRY_RETURN_IF_ERROR(CheckRemoteRanks(load.remote_tp_size, load.remote_port));
  if (load.remote_pp_size != cfg_.pp_size && !load.transfer_id.empty()) {
    // Rule 17: whole-request loads read unequal pipelines by layer ranges; layer-wise ones
    // follow one prefill stage's announcements (refused before any byte moves).
    return Status::NotSupported(
        "request " + load.request_id + ": the prefill instance has pipeline-parallel size " +
        std::to_string(load.remote_pp_size) + " and this decode instance " +
        std::to_string(cfg_.pp_size) +
        "; layer-wise transfer reads a stage's layers from the prefill stage of its own index, "
        "so it needs the same PP size on both (whole-request legs read unequal pipelines)");
  }
  if (!load.transfer_id.empty() && load.num_groups() != caches->size()) {
    return Status::InvalidArgument(
        "request " + load.request_id + " names blocks of " + std::to_string(load.num_groups()) +
        " KV cache groups for its layer-wise load, but this decode worker's cache has " +
        std::to_string(caches->size()) + "; expected the engine's block ids of every group");
  }
  if (load.transfer_id.empty() && load.num_groups() != caches->size()) {
    return Status::InvalidArgument(
        "request " + load.request_id + " names blocks of " + std::to_string(load.num_groups()) +
        " KV cache groups, but this decode worker's cache has " + std::to_string(caches->size()) +
        "; expected the engine's block ids of every group");
  }
  // Rule 8: which prefill ranks, which bytes, group by group; every group reads the same ranks.
  std::vector<std::vector<TpSource>> group_sources;
  for (int g = 0; g < caches->size(); ++g) {
    KVFERRY_ASSIGN_OR_RETURN(
        std::vector<TpSource> sources,
        PlanTpSources((*caches)[g], load.remote_tp_size, cfg_.tp_size, cfg_.tp_rank));
    const bool same_ranks =
        g == 0 || std::equal(sources.begin(), sources.end(), group_sources[0].begin(),
                             group_sources[0].end(), [](const TpSource& a, const TpSource& b) {
                               return a.prefill_rank == b.prefill_rank;
                             });
    if (!same_ranks) {
      return Status::NotSupported(
          "request " + load.request_id + ": KV cache group " + std::to_string(g) + " (" +
          (*caches)[g].CanonicalText() + ") is read from other prefill TP ranks than group 0 " +
          "at these TP sizes (" + std::to_string(load.remote_tp_size) + " -> " +
          std::to_string(cfg_.tp_size) + "); kvferry reads every group from the same ranks");
    }
    group_sources.push_back(std::move(sources));
  }
  std::vector<std::string> endpoints = NoticeEndpoints(load, (*caches)[0], group_sources[0]);
  {
    MutexLock lock(mu_);
    KVFERRY_RETURN_IF_ERROR(AbortedLocked(load.request_id));  // aborted while queued
    auto it = loads_.find(load.request_id);
    if (it != loads_.end()) it->second.endpoints = endpoints;
  }
  std::vector<TpSource> sources = group_sources[0];
  return LoadPlan{*std::move(caches), std::move(addresses), std::move(sources),
                  std::move(group_sources), std::move(endpoints)};
}

}  // namespace kvferry
