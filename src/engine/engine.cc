#include "engine/engine.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "common/clock.h"
#include "common/log.h"
#include "engine/engine_internal.h"
#include "layout/block_runs.h"

namespace kvferry::engine {
namespace {

std::int64_t SteadyMicros(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Makes every page of [p, p + bytes) resident and writable now, as a GPU engine's KV cache is from
// the moment it is allocated (vLLM zeroes the whole cache at start-up). Without it the first write
// into each 4 KiB page faults, in the simulated compute and in the decode side's reads, and at
// concurrency those faults take the cores the transfers run on: an artefact of this host engine,
// not a cost a real engine's connector sees. MADV_POPULATE_WRITE (Linux 5.14) where there is one,
// else a write to every page (the memory is zero, and stays so).
void Populate(std::uint8_t* p, std::size_t bytes) {
  if (madvise(p, bytes, MADV_POPULATE_WRITE) == 0) return;
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  for (std::size_t at = 0; at < bytes; at += page) {
    reinterpret_cast<volatile std::uint8_t*>(p)[at] = 0;
  }
}

}  // namespace

Result<std::unique_ptr<Instance>> Instance::Create(InstanceConfig config) {
  std::unique_ptr<Instance> i(new Instance(std::move(config)));
  KVFERRY_RETURN_IF_ERROR(i->Init());
  return i;
}

Instance::Instance(InstanceConfig config) : config_(std::move(config)) {}
Instance::~Instance() = default;

std::pair<int, int> PipelineLayers(int num_layers, int pp_rank, int pp_size) {
  std::vector<int> counts(static_cast<std::size_t>(pp_size), num_layers / pp_size);
  for (int i = 2; i < num_layers % pp_size + 2; ++i) ++counts[counts.size() - i];
  int first = 0;
  for (int s = 0; s < pp_rank; ++s) first += counts[static_cast<std::size_t>(s)];
  return {first, first + counts[static_cast<std::size_t>(pp_rank)]};
}

// Model layers [first, end) of a pipeline stage as group `g` of `groups` holds them: the groups'
// layers interleave (model layer m is layer m / groups of group m % groups), so the stage holds
// the group's layers [ceil((first - g) / groups), ceil((end - g) / groups)).
std::pair<int, int> GroupLayers(std::pair<int, int> model, int g, int groups) {
  auto local = [&](int m) { return std::max(0, (m - g + groups - 1) / groups); };
  return {local(model.first), local(model.second)};
}

Status Instance::Init() {
  const InstanceConfig& c = config_;
  const int groups = num_groups();
  int model_layers = 0;
  for (int g = 0; g < groups; ++g) {
    const auto layers = static_cast<int>(group_options(g).layers.size());
    if (groups > 1 && c.pp_size > 1 && layers != static_cast<int>(c.model.layers.size())) {
      return Status::InvalidArgument(
          "KV cache group " + std::to_string(g) + " has " + std::to_string(layers) +
          " layers and group 0 has " + std::to_string(c.model.layers.size()) +
          "; pipeline stages of a hybrid model need groups of one size, whose layers interleave");
    }
    model_layers += layers;
  }
  bool attention = false;
  for (int g = 0; g < groups; ++g) {
    attention = attention || group_options(g).layers.front().kind != CacheKind::kState;
  }
  if (!attention) {
    return Status::InvalidArgument(
        "every KV cache group is a state group; a model has attention layers too (a state "
        "block holds no tokens, so nothing would say how long a prompt is)");
  }
  if (c.pp_size < 1 || c.pp_size > model_layers / groups) {
    return Status::InvalidArgument("pipeline-parallel size " + std::to_string(c.pp_size) + " for " +
                                   std::to_string(model_layers) +
                                   " layers; expected 1 to the number of layers of a group");
  }
  for (int worker_index = 0; worker_index < c.pp_size * c.tp_size; ++worker_index) {
    const int stage = worker_index / c.tp_size;
    const int r = worker_index % c.tp_size;
    const std::pair<int, int> stage_layers = PipelineLayers(model_layers, stage, c.pp_size);
    std::vector<CacheSpec> specs;
    std::vector<std::vector<std::vector<std::uint64_t>>> group_bases;
    std::vector<GroupMemory> group_memory;
    MemoryKind kind;
    if (c.memory != "host") {
      // "sim" is short for "sim:0".
      const std::string name = c.memory.find(':') == std::string::npos ? c.memory + ":0" : c.memory;
      KVFERRY_ASSIGN_OR_RETURN(kind, ParseMemoryKind(name));
      if (device_ == nullptr) {
        KVFERRY_ASSIGN_OR_RETURN(device_, device::ProcessDevice(name));
        KVFERRY_ASSIGN_OR_RETURN(stream_, device_->CreateStream());
      }
    }
    for (int g = 0; g < groups; ++g) {
      CacheSpecOptions o = group_options(g);
      const auto group_model_layers = static_cast<int>(o.layers.size());
      // One stage holds every layer of every group, whatever the groups' sizes; stages split
      // the interleaved model layers (Init checked the groups' sizes are equal then).
      const auto [first_layer, end_layer] = c.pp_size == 1
                                                ? std::pair<int, int>{0, group_model_layers}
                                                : GroupLayers(stage_layers, g, groups);
      o.layers.resize(static_cast<std::size_t>(end_layer - first_layer));
      o.first_layer = first_layer;
      o.model_layers = group_model_layers;
      o.tp_size = c.tp_size;
      o.tp_rank = r;
      KVFERRY_ASSIGN_OR_RETURN(CacheSpec spec, CacheSpec::Create(o));
      if (spec.is_state()) {
        // vLLM's Mamba page: every part of a block side by side, one page per block
        // (gpu_model_runner.py, _reshape_kv_cache_tensors: as_strided with a page's stride).
        // Parts follow each other (their offsets are the interleaved scheme's, RegionOfPart);
        // the page ends in padding to 8 bytes (page_size_padded).
        std::int64_t page = 0;
        for (int p = 0; p < spec.num_parts(); ++p) page += spec.BlockBytes(p);
        page = (page + 7) / 8 * 8;
        o.block_strides.assign(static_cast<std::size_t>(spec.num_parts()), page);
        KVFERRY_ASSIGN_OR_RETURN(spec, CacheSpec::Create(o));
      }
      for (int p = 0; p < spec.num_parts(); ++p) {
        // The verifier indexes blocks by HeadsHeldBy; the spec sized them by its own head count.
        const std::int64_t want =
            HeadsHeldBy(spec, p).count * (spec.is_state() ? 1 : spec.tokens_per_block()) *
            spec.parts()[static_cast<std::size_t>(p)].head_dim * DTypeSize(spec.PartDType(p));
        if (spec.BlockBytes(p) != want) {
          return Status::Internal(
              "TP rank " + std::to_string(r) + " group " + std::to_string(g) + " part " +
              std::to_string(p) + ": the cache spec sizes a block at " +
              std::to_string(spec.BlockBytes(p)) + " bytes, the head placement the engine " +
              "verifies against at " + std::to_string(want) + "; CacheSpec's head placement is " +
              "wrong");
        }
      }
      std::vector<std::vector<std::uint64_t>> bases(static_cast<std::size_t>(spec.num_layers()));
      GroupMemory mem;
      // One allocation of `bytes` on the host, and on the device where the caches are there.
      auto allocate = [&](std::int64_t bytes) -> Result<std::pair<std::uint8_t*, std::uint64_t>> {
        KVFERRY_ASSIGN_OR_RETURN(HostMemory m,
                                 HostMemory::Allocate(static_cast<std::size_t>(bytes)));
        storage_.push_back(std::move(m));
        auto* host = reinterpret_cast<std::uint8_t*>(storage_.back().data());
        Populate(host, static_cast<std::size_t>(bytes));
        std::uint64_t device = 0;
        if (device_ != nullptr) {
          KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<device::DeviceAllocation> d,
                                   device_->Allocate(static_cast<std::uint64_t>(bytes)));
          device = d->address();
          device_storage_.push_back(std::move(d));
        }
        return std::pair{host, device};
      };
      for (int l = 0; l < spec.num_layers(); ++l) {
        if (spec.is_state()) {
          KVFERRY_ASSIGN_OR_RETURN(auto page, allocate(spec.BlockStride(0) * spec.num_blocks()));
          for (int p = 0; p < spec.num_parts(); ++p) {
            const std::int64_t at = RegionOfPart(spec, l, p).offset;
            mem.host.push_back(page.first + at);
            mem.device.push_back(page.second + static_cast<std::uint64_t>(at));
          }
        } else {
          for (int p = 0; p < spec.num_parts(); ++p) {
            KVFERRY_ASSIGN_OR_RETURN(auto part, allocate(spec.PartBytes(p)));
            mem.host.push_back(part.first);
            mem.device.push_back(part.second);
          }
        }
        for (int p = 0; p < spec.num_parts(); ++p) {
          const std::size_t i = mem.host.size() - static_cast<std::size_t>(spec.num_parts() - p);
          bases[static_cast<std::size_t>(l)].push_back(
              device_ != nullptr ? mem.device[i] : reinterpret_cast<std::uint64_t>(mem.host[i]));
        }
      }
      group_memory.push_back(std::move(mem));
      specs.push_back(std::move(spec));
      group_bases.push_back(std::move(bases));
    }
    KVFERRY_ASSIGN_OR_RETURN(CacheGroups caches, CacheGroups::Create(std::move(specs)));
    WorkerConfig w;
    w.role = c.role;
    w.engine_id = c.engine_id;
    w.dp_rank = c.dp_rank;
    w.tp_size = c.tp_size;
    w.tp_rank = r;
    w.pp_size = c.pp_size;
    w.pp_rank = stage;
    w.host = c.host;
    w.base_port = c.base_port;
    w.secret = c.secret;
    w.rank_table = c.rank_table;
    w.server_id = c.host;
    w.visible_devices = c.visible_devices;
    w.transport.backend = c.transport;
    w.transport.backend_options = c.transport_options;
    w.hold_lease = c.hold_lease;
    w.layerwise_layers_per_notice = c.layers_per_notice;
    w.layerwise_start_timeout = c.layerwise_start_timeout;
    w.layerwise_progress_timeout = c.layerwise_progress_timeout;
    KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<Worker> worker, Worker::Create(w));
    KVFERRY_RETURN_IF_ERROR(worker->RegisterKvCaches(caches, group_bases, kind));
    caches_.push_back(std::move(caches));
    memory_.push_back(std::move(group_memory));
    workers_.push_back(std::move(worker));
  }
  SchedulerConfig s;
  s.role = c.role;
  s.engine_id = c.engine_id;
  s.host = c.host;
  s.base_port = c.base_port;
  s.dp_rank = c.dp_rank;
  s.tp_size = c.tp_size;
  s.pp_size = c.pp_size;
  s.hold_lease = c.hold_lease;
  for (int g = 0; g < groups; ++g) {
    s.state_groups = s.state_groups || group_options(g).layers.front().kind == CacheKind::kState;
  }
  scheduler_ = std::make_unique<Scheduler>(s);
  for (int g = 0; g < groups; ++g) {
    allocators_.push_back(std::make_unique<BlockAllocator>(group_options(g).num_blocks));
  }
  return Status::Ok();
}

const CacheGroups& Instance::caches(int index) const {
  return caches_[static_cast<std::size_t>(index)];
}
void Instance::Submit(EngineRequest request) {
  auto r = std::make_unique<Running>();
  r->hashes = PrefixHashes(request.prompt);
  r->result.request_id = request.request_id;
  r->request = std::move(request);
  waiting_.push_back(std::move(r));
  PublishGauges();
}

void Instance::Abort(const std::string& request_id) {
  const Status cancelled = Status::Cancelled("request " + request_id + " was aborted");
  auto waiting = std::find_if(waiting_.begin(), waiting_.end(),
                              [&](const auto& r) { return r->request.request_id == request_id; });
  if (waiting != waiting_.end()) {
    // A decode request that never got its load tells the prefill side to free now.
    (void)scheduler_->RequestFinished(request_id, (*waiting)->request.params,
                                      FinishReason::kAborted, {});
    (*waiting)->result.status = cancelled;
    aborted_now_.push_back((*waiting)->result);
    waiting_.erase(waiting);
    ++aborted_;
    PublishGauges();
    return;
  }
  auto running = running_.find(request_id);
  if (running == running_.end() || running->second->aborted) return;
  running->second->aborted = true;
  running->second->result.status = cancelled;
  for (auto& w : workers_) {
    // NotFound: this rank's load already ended; it is (or was) reported in GetFinished.
    (void)w->AbortLoad(request_id, "the client went away");
  }
}

bool Instance::Idle() const {
  return waiting_.empty() && running_.empty() && held_.empty() && aborted_now_.empty();
}

bool Instance::HasWorkNow() const { return !waiting_.empty() || !aborted_now_.empty(); }

std::vector<EngineResult> Instance::Step() {
  std::vector<EngineResult> out;
  out.swap(aborted_now_);
  if (config_.role == Role::kPrefill) {
    StepPrefill(out);
  } else {
    StepDecode(out);
  }
  PublishGauges();
  return out;
}

void Instance::PublishGauges() {
  in_flight_.store(waiting_.size() + running_.size(), std::memory_order_relaxed);
  std::int64_t used = 0;
  for (const auto& a : allocators_) used += a->used_blocks();
  blocks_allocated_.store(used, std::memory_order_relaxed);
}

std::vector<WorkerMetrics> Instance::ConnectorMetrics() const {
  // workers_ is fixed once Create returns, and Worker is thread-safe.
  std::vector<WorkerMetrics> out;
  out.reserve(workers_.size());
  for (const auto& w : workers_) out.push_back(w->Metrics());
  return out;
}

std::vector<ExtraMetric> Instance::EngineMetrics() const {
  const std::vector<std::pair<std::string, std::string>> id = {
      {"engine_id", config_.engine_id},
      {"role", RoleName(config_.role)},
      {"dp_rank", std::to_string(config_.dp_rank)}};
  auto with = [&](const char* outcome) {
    auto labels = id;
    labels.emplace_back("outcome", outcome);
    return labels;
  };
  const char* requests_help = "Requests this engine instance ended, by outcome";
  return {{"kvferry_requests_in_flight", "Requests submitted to this engine instance and not ended",
           MetricType::kGauge, id, static_cast<double>(in_flight_.load(std::memory_order_relaxed))},
          {"kvferry_requests_total", requests_help, MetricType::kCounter, with("done"),
           static_cast<double>(done_.load(std::memory_order_relaxed))},
          {"kvferry_requests_total", requests_help, MetricType::kCounter, with("failed"),
           static_cast<double>(failed_.load(std::memory_order_relaxed))},
          {"kvferry_requests_total", requests_help, MetricType::kCounter, with("aborted"),
           static_cast<double>(aborted_.load(std::memory_order_relaxed))},
          {"kvferry_blocks_allocated", "KV blocks allocated (running, held or in the prefix cache)",
           MetricType::kGauge, id,
           static_cast<double>(blocks_allocated_.load(std::memory_order_relaxed))}};
}

Scheduler::FinishedResult Instance::Finish(const Running& r, FinishReason reason) {
  if (!grouped()) {
    return scheduler_->RequestFinished(r.request.request_id, r.request.params, reason, r.blocks[0]);
  }
  return scheduler_->RequestFinishedAllGroups(r.request.request_id, r.request.params, reason,
                                              r.blocks);
}

void Instance::FailPrefill(Running& r, Status status, std::vector<EngineResult>& out) {
  r.result.status = std::move(status);
  // Ends its transfer too: the blocks go back now.
  (void)Finish(r, FinishReason::kError);
  FreeBlocks(r.blocks);
  ++failed_;
  out.push_back(r.result);
  waiting_.pop_front();
}

void Instance::StepPrefill(std::vector<EngineResult>& out) {
  // Schedule what fits; "compute" it; finish it on its length cap (max_tokens 1).
  while (!waiting_.empty()) {
    Running& r = *waiting_.front();
    const auto prompt = static_cast<std::int64_t>(r.request.prompt.size());
    if (!AllocateGroups(r, prompt, /*window_only=*/false)) break;  // wait for holds to end
    r.scheduled = Clock::now();
    const bool layerwise = r.request.params.do_remote_decode && r.request.params.transfer_id;
    // With state groups, the prompt less its last token (the decode side computes that one).
    Status s = layerwise ? ComputeLayerwise(r)
                         : Compute(r, {0, scheduler_->PrefillTokens(r.request.params, prompt)});
    if (!s.ok()) {
      FailPrefill(r, s, out);
      continue;
    }
    if (!layerwise) {
      // The modelled compute writes the KV as it goes: the bytes above were made inside it.
      std::this_thread::sleep_until(r.scheduled +
                                    config_.compute_per_token * r.request.prompt.size());
    }
    const Clock::time_point computed = Clock::now();
    FreeOutsideWindow(r);
    Scheduler::FinishedResult f = Finish(r, FinishReason::kLengthCapped);
    r.result.queue_ms = Ms(r.submitted, r.scheduled);
    r.result.compute_ms = Ms(r.scheduled, computed);
    r.result.computed_at_us = SteadyMicros(computed);
    if (f.params) r.result.params = *f.params;
    if (f.delay_free) {
      held_[r.request.request_id] = r.blocks;
    } else {
      FreeBlocks(r.blocks);
    }
    ++done_;
    out.push_back(r.result);
    waiting_.pop_front();
  }
  const ConnectorMetadata meta = scheduler_->BuildConnectorMeta();
  for (auto& w : workers_) w->StartLoadKv(meta);
  // Free held blocks once every TP rank's hold has ended.
  for (std::size_t rank = 0; rank < workers_.size(); ++rank) {
    for (const std::string& id : workers_[rank]->GetFinished().sending) {
      std::set<int>& ranks = rank_reports_[id];
      ranks.insert(static_cast<int>(rank));
      if (ranks.size() == workers_.size()) {
        auto it = held_.find(id);
        if (it != held_.end()) {
          FreeBlocks(it->second);
          held_.erase(it);
        }
        rank_reports_.erase(id);
      }
    }
  }
}

void Instance::StepDecode(std::vector<EngineResult>& out) {
  const std::int64_t tpb = config_.model.tokens_per_block;
  while (!waiting_.empty()) {
    Running& r = *waiting_.front();
    const auto prompt = static_cast<std::int64_t>(r.request.prompt.size());
    const std::int64_t total = (prompt + tpb - 1) / tpb;
    std::vector<std::int64_t> fresh;
    if (grouped()) {
      // Every group's blocks, a sliding window's only (no prefix cache: a hybrid's hit would
      // need every group's blocks of it).
      if (!AllocateGroups(r, prompt, /*window_only=*/true)) break;
      fresh = r.blocks[0];
    } else {
      // Prefix cache: full blocks whose chain hash is cached.
      std::vector<std::int64_t> hit;
      for (std::int64_t bi = 0; bi < prompt / tpb; ++bi) {
        auto it = prefix_.find(r.hashes[static_cast<std::size_t>((bi + 1) * tpb - 1)]);
        if (it == prefix_.end()) break;
        hit.push_back(it->second);
      }
      // Like vLLM, the last prompt token is always computed: never hit the whole prompt.
      if (static_cast<std::int64_t>(hit.size()) * tpb >= prompt && !hit.empty()) hit.pop_back();
      // Pin the hits first: making room evicts cached blocks only the cache references, and
      // these must not be among them.
      for (std::int64_t block : hit) allocators_[0]->Ref(block);
      Result<std::vector<std::int64_t>> got =
          AllocateEvicting(static_cast<std::size_t>(total) - hit.size());
      if (!got.ok()) {
        FreeBlocks({hit});  // back to the cache's own reference
        break;
      }
      for (std::size_t bi = 0; bi < hit.size(); ++bi) {
        const std::uint64_t key = r.hashes[(bi + 1) * static_cast<std::size_t>(tpb) - 1];
        lru_.splice(lru_.end(), lru_, lru_pos_.at(key));  // touched
      }
      fresh = *got;
      r.prefix_hit = static_cast<std::int64_t>(hit.size());
      r.blocks = {hit};
      r.blocks[0].insert(r.blocks[0].end(), fresh.begin(), fresh.end());
    }
    r.scheduled = Clock::now();
    const auto [tokens, async] =
        scheduler_->GetNumNewMatchedTokens(r.request.params, prompt, r.prefix_hit * tpb);
    (void)async;
    // With the tokens it brings (vLLM's num_external_tokens), so the prefill instance's blocks
    // may hold another number of tokens than ours.
    Status s = grouped() ? scheduler_->UpdateStateAfterAllocAllGroups(
                               r.request.request_id, r.request.params, r.blocks, tokens, prompt)
                         : scheduler_->UpdateStateAfterAlloc(r.request.request_id, r.request.params,
                                                             fresh, tokens, prompt);
    r.loaded_end = r.prefix_hit * tpb + tokens;
    r.result.queue_ms = Ms(r.submitted, r.scheduled);
    r.result.prefix_hit_blocks = r.prefix_hit;
    r.result.loaded_blocks =
        std::count_if(fresh.begin(), fresh.end(), [](std::int64_t b) { return b != kNoBlock; });
    std::unique_ptr<Running> owned = std::move(waiting_.front());
    waiting_.pop_front();
    if (!s.ok()) {
      // The error reaches the request (rule 2): it fails, nothing is loaded.
      owned->result.status = s;
      FreeBlocks(owned->blocks);
      ++failed_;
      out.push_back(owned->result);
      continue;
    }
    running_[owned->request.request_id] = std::move(owned);
  }
  const ConnectorMetadata meta = scheduler_->BuildConnectorMeta();
  for (auto& w : workers_) w->StartLoadKv(meta);
  // Each rank's finished loads first, then its errors (vLLM's order): a worker records a load's
  // error before it reports the load finished, so every load reported here has its error in
  // load_errors_ by now. Errors are kept until the request ends: another rank may report the
  // same request steps later, and one failed rank is enough to recompute.
  std::vector<std::vector<std::string>> finished(workers_.size());
  for (std::size_t rank = 0; rank < workers_.size(); ++rank) {
    finished[rank] = workers_[rank]->GetFinished().receiving;
    for (LoadError& e : workers_[rank]->TakeLoadErrors()) {
      if (running_.count(e.request_id) != 0) load_errors_.emplace(e.request_id, e.status);
    }
    for (const LoadTransfer& t : workers_[rank]->TakeLoadTransfers()) {
      if (running_.count(t.request_id) == 0) continue;
      LoadTransfer& sum = transfers_[t.request_id];
      sum.bytes += t.bytes;
      sum.duration = std::max(sum.duration, t.duration);
    }
  }
  // When this step saw them finished: one moment for all, so the first steps of the requests
  // ahead in this step count in each later one's pick-up (first_step_at_us - loaded_at_us), not
  // in its load.
  const Clock::time_point seen = Clock::now();
  for (std::size_t rank = 0; rank < workers_.size(); ++rank) {
    for (const std::string& id : finished[rank]) {
      std::set<int>& ranks = rank_reports_[id];
      ranks.insert(static_cast<int>(rank));
      if (ranks.size() != workers_.size()) continue;
      rank_reports_.erase(id);
      auto it = running_.find(id);
      if (it == running_.end()) continue;
      Running& r = *it->second;
      r.result.load_ms = Ms(r.scheduled, seen);
      r.result.loaded_at_us = SteadyMicros(seen);
      if (auto t = transfers_.find(id); t != transfers_.end()) {
        r.result.transfer_bytes = t->second.bytes;
        r.result.transfer_ms = static_cast<double>(t->second.duration.count()) / 1000.0;
        transfers_.erase(t);
      }
      if (r.aborted) {
        // Every rank's load has stopped: the blocks are free to reuse, and nothing is cached.
        ++aborted_;
        FreeBlocks(r.blocks);
        out.push_back(r.result);
        running_.erase(it);
        load_errors_.erase(id);
        continue;
      }
      auto err = load_errors_.find(id);
      if (err != load_errors_.end()) {
        // Recompute policy: the engine computes the blocks the load could not deliver.
        Log().warn("request {}: load failed ({}); recomputing {} blocks", id,
                   err->second.ToString(), r.result.loaded_blocks);
        // What the load should have brought (with state groups, the state after the prompt less
        // its last token, which Verify checks).
        if (Status s = Compute(r, {r.prefix_hit * tpb, r.loaded_end}); !s.ok()) {
          Log().error("request {}: recomputing failed: {}", id, s.ToString());
        }
        r.result.recomputed_blocks = r.result.loaded_blocks;
        load_errors_.erase(err);
      }
      Status verify;
      const Clock::time_point step = Clock::now();
      r.result.first_step_at_us = SteadyMicros(step);
      // What the load brought (with state groups, the prompt less the last token, which a real
      // engine computes in this step from the loaded state).
      r.result.verified_bytes = Verify(r, {0, r.loaded_end}, &verify);
      r.result.first_step_ms = Ms(step, Clock::now());
      r.result.status = verify;
      if (verify.ok()) {
        ++done_;
        if (!grouped()) AddToPrefixCache(r);
      } else {
        ++failed_;
      }
      FreeBlocks(r.blocks);
      out.push_back(r.result);
      running_.erase(it);
    }
  }
}

InstanceStats Instance::Stats() const {
  InstanceStats s;
  // Cached blocks that only the cache references are free for the taking, not in use.
  std::int64_t evictable = 0;
  for (const auto& [key, block] : prefix_) evictable += allocators_[0]->refs(block) == 1 ? 1 : 0;
  s.cached_blocks = static_cast<std::int64_t>(prefix_.size());
  s.used_blocks = -evictable;
  for (const auto& a : allocators_) s.used_blocks += a->used_blocks();
  LatencyHistogram transfers;
  for (const auto& w : workers_) {
    const WorkerStats ws = w->Stats();
    transfers.Merge(ws.transfer_latency);
    s.holds += ws.holds_outstanding;
    s.loads_outstanding += ws.loads_outstanding;
    s.bytes_read += ws.bytes_read;
  }
  s.transfer_p50_us = transfers.Quantile(0.5);
  s.transfer_p90_us = transfers.Quantile(0.9);
  s.transfer_p99_us = transfers.Quantile(0.99);
  s.transfer_max_us = transfers.max_us();
  s.requests_done = done_;
  s.requests_failed = failed_;
  s.requests_aborted = aborted_;
  return s;
}

}  // namespace kvferry::engine
