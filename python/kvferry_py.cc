// kvferry's Python module (_kvferry): the connector's scheduler and worker, the cache spec, the
// rank table. Every call that may block releases the GIL. Errors become Python exceptions through
// one mapping function, ThrowIfError, which must run with the GIL held: a call that releases it
// keeps its Status or Result and converts it after the release scope ends.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kvferry/cache_spec.h"
#include "kvferry/connector.h"
#include "kvferry/host_memory.h"
#include "kvferry/metrics.h"
#include "kvferry/rank_table.h"
#include "kvferry/status.h"
#include "kvferry/transport.h"

namespace py = pybind11;
using namespace kvferry;

namespace {

// One Python exception class per status code; all derive from kvferry.Error.
std::map<StatusCode, py::object>& Exceptions() {
  static std::map<StatusCode, py::object> map;
  return map;
}

// The one place a Status becomes a Python exception.
void ThrowIfError(const Status& s) {
  if (s.ok()) return;
  auto it = Exceptions().find(s.code());
  py::object type = it != Exceptions().end() ? it->second : Exceptions().at(StatusCode::kInternal);
  PyErr_SetString(type.ptr(), std::string(s.message()).c_str());
  throw py::error_already_set();
}

template <typename T>
T Unwrap(Result<T> r) {
  ThrowIfError(r.status());
  return std::move(r).value();
}

// vLLM's kv_transfer_params dict <-> KvTransferParams.
KvTransferParams ParamsFromDict(const py::dict& d) {
  KvTransferParams p;
  if (d.contains("do_remote_prefill")) p.do_remote_prefill = py::bool_(d["do_remote_prefill"]);
  if (d.contains("do_remote_decode")) p.do_remote_decode = py::bool_(d["do_remote_decode"]);
  auto opt = [&](const char* key) { return d.contains(key) && !d[key].is_none(); };
  if (opt("remote_block_ids"))
    p.remote_block_ids = d["remote_block_ids"].cast<std::vector<std::int64_t>>();
  if (opt("remote_engine_id")) p.remote_engine_id = d["remote_engine_id"].cast<std::string>();
  if (opt("remote_host")) p.remote_host = d["remote_host"].cast<std::string>();
  if (opt("remote_port")) p.remote_port = d["remote_port"].cast<int>();
  if (opt("remote_tp_size")) p.remote_tp_size = d["remote_tp_size"].cast<int>();
  if (opt("remote_pp_size")) p.remote_pp_size = d["remote_pp_size"].cast<int>();
  if (opt("remote_request_id")) p.remote_request_id = d["remote_request_id"].cast<std::string>();
  if (opt("transfer_id")) p.transfer_id = d["transfer_id"].cast<std::string>();
  if (opt("remote_rank_hosts"))
    p.remote_rank_hosts = d["remote_rank_hosts"].cast<std::vector<std::string>>();
  if (opt("remote_group_block_ids")) {
    p.remote_group_block_ids =
        d["remote_group_block_ids"].cast<std::vector<std::vector<std::int64_t>>>();
  }
  return p;
}

py::dict ParamsToDict(const KvTransferParams& p) {
  py::dict d;
  d["do_remote_prefill"] = p.do_remote_prefill;
  d["do_remote_decode"] = p.do_remote_decode;
  if (p.remote_block_ids) d["remote_block_ids"] = *p.remote_block_ids;
  if (p.remote_engine_id) d["remote_engine_id"] = *p.remote_engine_id;
  if (p.remote_host) d["remote_host"] = *p.remote_host;
  if (p.remote_port) d["remote_port"] = *p.remote_port;
  if (p.remote_tp_size) d["remote_tp_size"] = *p.remote_tp_size;
  if (p.remote_pp_size) d["remote_pp_size"] = *p.remote_pp_size;
  if (p.remote_request_id) d["remote_request_id"] = *p.remote_request_id;
  if (p.transfer_id) d["transfer_id"] = *p.transfer_id;
  if (p.remote_rank_hosts) d["remote_rank_hosts"] = *p.remote_rank_hosts;
  if (p.remote_group_block_ids) d["remote_group_block_ids"] = *p.remote_group_block_ids;
  return d;
}

// The Python object of a Worker. close() destroys the worker while Python still holds the
// object (vLLM's shutdown): its listener, loads and threads are stopped and joined before close()
// returns, unless a call is still running on another Python thread, whose end then finishes the
// destruction. Every later call raises UnavailableError; close() again does nothing.
class PyWorker {
 public:
  explicit PyWorker(std::unique_ptr<Worker> worker) : worker_(std::move(worker)) {}

  std::shared_ptr<Worker> Get() const {
    std::shared_ptr<Worker> w;
    {
      std::lock_guard<std::mutex> lock(mu_);
      w = worker_;
    }
    if (!w) {
      ThrowIfError(Status::Unavailable(
          "this kvferry Worker was closed (close() or the connector's shutdown); make a new one"));
    }
    return w;
  }

  void Close() {
    std::shared_ptr<Worker> w;
    {
      std::lock_guard<std::mutex> lock(mu_);
      w.swap(worker_);
    }
    py::gil_scoped_release release;  // the destructor joins threads that never take the GIL
    w.reset();
  }

  bool closed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return worker_ == nullptr;
  }

 private:
  mutable std::mutex mu_;  // guards worker_ (the pointer; the Worker is thread-safe itself)
  std::shared_ptr<Worker> worker_;
};

FinishReason ParseReason(const std::string& r) {
  if (r == "length" || r == "FINISHED_LENGTH_CAPPED" || r == "length_capped") {
    return FinishReason::kLengthCapped;
  }
  if (r == "stop" || r == "FINISHED_STOPPED") return FinishReason::kStopped;
  if (r == "abort" || r == "FINISHED_ABORTED") return FinishReason::kAborted;
  if (r == "preempted" || r == "PREEMPTED") return FinishReason::kPreempted;
  return FinishReason::kError;
}

CacheSpec MakeSpec(CacheSpecOptions o) { return Unwrap(CacheSpec::Create(std::move(o))); }

py::dict HistogramDict(const LatencyHistogram& h) {
  py::dict d;
  d["count"] = h.count();
  d["sum_us"] = h.sum_us();
  d["min_us"] = h.min_us();
  d["p50_us"] = h.Quantile(0.5);
  d["p90_us"] = h.Quantile(0.9);
  d["p99_us"] = h.Quantile(0.99);
  d["max_us"] = h.max_us();
  py::list buckets;  // cumulative (upper bound in µs or None for +Inf, count), as Prometheus's
  for (std::size_t i = 0; i < LatencyHistogram::kExportBoundsUs.size(); ++i) {
    buckets.append(py::make_tuple(LatencyHistogram::kExportBoundsUs[i], h.CountAtOrBelowBound(i)));
  }
  buckets.append(py::make_tuple(py::none(), h.count()));
  d["buckets"] = buckets;
  return d;
}

// Worker.metrics(): the same figures as PrometheusText, as plain Python values.
py::dict MetricsDict(const WorkerMetrics& m) {
  const WorkerStats& s = m.stats;
  py::dict d;
  d["engine_id"] = m.engine_id;
  d["role"] = RoleName(m.role);
  d["dp_rank"] = m.dp_rank;
  d["tp_rank"] = m.tp_rank;
  d["loads_done"] = s.loads_done;
  d["loads_failed"] = s.loads_failed;
  d["loads_reread"] = s.loads_reread;
  d["failures"] = s.failures;
  d["loads_outstanding"] = s.loads_outstanding;
  d["bytes_read"] = s.bytes_read;
  d["reads"] = s.reads;
  d["merged_runs"] = s.merged_runs;
  d["handshakes"] = s.handshakes;
  d["agents_evicted"] = s.agents_evicted;
  d["holds_outstanding"] = s.holds_outstanding;
  d["holds_released_by_readers"] = s.holds_released_by_readers;
  d["holds_released_by_abort"] = s.holds_released_by_abort;
  d["holds_expired"] = s.holds_expired;
  d["notices_received"] = s.notices_received;
  d["early_notices"] = s.early_notices;
  d["early_notices_refused"] = s.early_notices_refused;
  d["notices_dropped"] = s.notices_dropped;
  d["transfer_latency"] = HistogramDict(s.transfer_latency);
  d["handshake_latency"] = HistogramDict(s.handshake_latency);
  py::dict t;
  t["batches_submitted"] = s.transport.batches_submitted;
  t["batches_done"] = s.transport.batches_done;
  t["batches_failed"] = s.transport.batches_failed;
  t["batches_cancelled"] = s.transport.batches_cancelled;
  t["bytes_read"] = s.transport.bytes_read;
  t["bytes_served"] = s.transport.bytes_served;
  t["requests_refused"] = s.transport.requests_refused;
  t["staging_bytes"] = s.transport.staging_bytes;
  t["registered_bytes"] = s.transport.registered_bytes;
  d["transport"] = t;
  return d;
}

}  // namespace

PYBIND11_MODULE(_kvferry, m) {
  m.def("transport_backends", &TransportBackendNames,
        "The transport backends of this build ('auto' tries the ones it includes in this order; "
        "others run when named, as in 'shm,ucx,tcp'); each accepts the transport_options "
        "'<backend>.<option>' listed in docs/transport.md");
  m.doc() = "kvferry: KV-cache transfer for disaggregated prefill/decode serving";

  py::object base = py::reinterpret_borrow<py::object>(PyExc_RuntimeError);
  static py::exception<std::runtime_error> error(m, "Error", base.ptr());
  const std::pair<StatusCode, const char*> names[] = {
      {StatusCode::kInvalidArgument, "InvalidArgumentError"},
      {StatusCode::kNotFound, "NotFoundError"},
      {StatusCode::kUnavailable, "UnavailableError"},
      {StatusCode::kPeerDisconnected, "PeerDisconnectedError"},
      {StatusCode::kTimeout, "TimeoutError"},
      {StatusCode::kCancelled, "CancelledError"},
      {StatusCode::kResourceExhausted, "ResourceExhaustedError"},
      {StatusCode::kNotSupported, "NotSupportedError"},
      {StatusCode::kInternal, "InternalError"},
      {StatusCode::kUnauthenticated, "UnauthenticatedError"},
  };
  for (const auto& [code, name] : names) {
    py::object type = py::reinterpret_steal<py::object>(
        PyErr_NewException((std::string("kvferry.") + name).c_str(), error.ptr(), nullptr));
    m.attr(name) = type;
    Exceptions()[code] = type;
  }

  py::class_<HostMemory>(m, "HostMemory", py::buffer_protocol(),
                         "Host memory kvferry allocates (a sealed memfd): a same-host shm reader "
                         "maps it read-only and copies it with memcpy instead of walking this "
                         "process's page table (docs/transport.md). A writable buffer of bytes; "
                         "torch.frombuffer(memory, dtype=torch.uint8) views it as a tensor.")
      .def(py::init([](std::size_t bytes, bool huge_pages) {
             return Unwrap(HostMemory::Allocate(bytes, huge_pages));
           }),
           py::arg("bytes"), py::arg("huge_pages") = false,
           "`bytes` (> 0) of zeroed memory; huge_pages advises transparent huge pages.")
      .def_property_readonly(
          "address", [](const HostMemory& h) { return reinterpret_cast<std::uintptr_t>(h.data()); },
          "The first byte's address.")
      .def("__len__", &HostMemory::size)
      .def_buffer([](HostMemory& h) {
        return py::buffer_info(h.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(h.size())}, {1});
      });

  py::class_<CacheSpec>(m, "CacheSpec", "The validated geometry of one TP rank's KV cache.")
      .def_static(
          "mha",
          [](int layers, std::int64_t kv_heads, std::int64_t head_dim, std::int64_t num_blocks,
             std::int64_t tokens_per_block, const std::string& dtype, int tp_size, int tp_rank,
             const std::string& layout) {
            return Unwrap(CacheSpec::Mha(layers, kv_heads, head_dim, num_blocks, tokens_per_block,
                                         Unwrap(ParseDType(dtype)), tp_size, tp_rank,
                                         Unwrap(ParseBlockLayout(layout))));
          },
          py::arg("layers"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("num_blocks"),
          py::arg("tokens_per_block"), py::arg("dtype") = "bf16", py::arg("tp_size") = 1,
          py::arg("tp_rank") = 0, py::arg("layout") = "token_major")
      .def_static(
          "mla",
          [](int layers, std::int64_t latent_dim, std::int64_t rope_dim, std::int64_t num_blocks,
             std::int64_t tokens_per_block, const std::string& dtype, int tp_size, int tp_rank) {
            return Unwrap(CacheSpec::Mla(layers, latent_dim, rope_dim, num_blocks, tokens_per_block,
                                         Unwrap(ParseDType(dtype)), tp_size, tp_rank));
          },
          py::arg("layers"), py::arg("latent_dim"), py::arg("rope_dim"), py::arg("num_blocks"),
          py::arg("tokens_per_block"), py::arg("dtype") = "bf16", py::arg("tp_size") = 1,
          py::arg("tp_rank") = 0)
      .def_static(
          "sparse_mla",
          [](int layers, std::int64_t latent_dim, std::int64_t rope_dim, std::int64_t indexer_dim,
             std::int64_t num_blocks, std::int64_t tokens_per_block, const std::string& dtype,
             int tp_size, int tp_rank) {
            return Unwrap(CacheSpec::SparseMla(layers, latent_dim, rope_dim, indexer_dim,
                                               num_blocks, tokens_per_block,
                                               Unwrap(ParseDType(dtype)), tp_size, tp_rank));
          },
          py::arg("layers"), py::arg("latent_dim"), py::arg("rope_dim"), py::arg("indexer_dim"),
          py::arg("num_blocks"), py::arg("tokens_per_block"), py::arg("dtype") = "bf16",
          py::arg("tp_size") = 1, py::arg("tp_rank") = 0)
      .def_static(
          "create",
          [](const std::string& kind, int layers, const std::vector<py::tuple>& parts,
             std::int64_t num_blocks, std::int64_t tokens_per_block, const std::string& dtype,
             const std::string& layout, int tp_size, int tp_rank,
             const std::vector<std::int64_t>& fields,
             const std::vector<std::int64_t>& block_strides, int first_layer,
             std::int64_t blocks_per_id, int model_layers, std::int64_t sliding_window) {
            CacheSpecOptions o;
            LayerSpec layer;
            layer.kind = Unwrap(ParseCacheKind(kind));
            for (const py::tuple& t : parts) {
              if (t.size() != 3 && t.size() != 4) {
                throw py::value_error(
                    "a part is (name, model-wide heads, head_dim) or, for a state part, (name, "
                    "heads, dim, dtype); found a tuple of " +
                    std::to_string(t.size()));
              }
              PartSpec part{t[0].cast<std::string>(), t[1].cast<std::int64_t>(),
                            t[2].cast<std::int64_t>()};
              if (t.size() == 4) part.dtype = Unwrap(ParseDType(t[3].cast<std::string>()));
              layer.parts.push_back(std::move(part));
            }
            layer.fields = fields;
            o.layers.assign(static_cast<std::size_t>(std::max(layers, 0)), layer);
            o.num_blocks = num_blocks;
            o.tokens_per_block = tokens_per_block;
            o.dtype = Unwrap(ParseDType(dtype));
            o.layout = Unwrap(ParseBlockLayout(layout));
            o.tp_size = tp_size;
            o.tp_rank = tp_rank;
            o.block_strides = block_strides;
            o.first_layer = first_layer;
            o.blocks_per_id = blocks_per_id;
            o.model_layers = model_layers;
            o.sliding_window = sliding_window;
            return MakeSpec(std::move(o));
          },
          "Any uniform cache: parts are (name, model-wide heads, head_dim), or for kind 'state' "
          "(Mamba / linear attention: one state per block) (name, model-wide extent of its "
          "TP-split axis, elements per unit of it, dtype); names and dtypes enter the hash. "
          "fields: for kind 'mla_fused', the widths packed in each row (kv_lora_rank, "
          "qk_rope_head_dim); they enter the hash. block_strides: bytes from one block of a part "
          "to the next, one per part (empty: packed); parts interleaved block by block, as in "
          "vLLM's (num_blocks, 2, ...) tensors, have stride = the sum of all parts' block bytes. "
          "Not in the hash. first_layer: the model-wide index of layer 0 (a pipeline stage's first "
          "layer); not in the hash (loads read each layer from a stage holding it). "
          "model_layers: the model's layer count, all stages (0: first_layer + layers); in the "
          "hash. blocks_per_id: blocks (the tensor's kernel blocks) one engine block id names, "
          "where vLLM's block size is a multiple of the kernel's; not in the hash. sliding_window: "
          "a sliding-window group's window in tokens (0: full attention); in the hash.",
          py::arg("kind"), py::arg("layers"), py::arg("parts"), py::arg("num_blocks"),
          py::arg("tokens_per_block"), py::arg("dtype") = "bf16", py::arg("layout") = "token_major",
          py::arg("tp_size") = 1, py::arg("tp_rank") = 0,
          py::arg("fields") = std::vector<std::int64_t>{},
          py::arg("block_strides") = std::vector<std::int64_t>{}, py::arg("first_layer") = 0,
          py::arg("blocks_per_id") = 1, py::arg("model_layers") = 0, py::arg("sliding_window") = 0)
      .def_property_readonly("fields", &CacheSpec::fields)
      .def_property_readonly("kind", [](const CacheSpec& s) { return CacheKindName(s.kind()); })
      .def_property_readonly("num_layers", &CacheSpec::num_layers)
      .def_property_readonly("num_parts", &CacheSpec::num_parts)
      .def_property_readonly("num_blocks", &CacheSpec::num_blocks)
      .def_property_readonly("tokens_per_block", &CacheSpec::tokens_per_block)
      .def_property_readonly("dtype", [](const CacheSpec& s) { return DTypeName(s.dtype()); })
      .def_property_readonly("tp_size", &CacheSpec::tp_size)
      .def_property_readonly("tp_rank", &CacheSpec::tp_rank)
      .def_property_readonly("first_layer", &CacheSpec::first_layer)
      .def_property_readonly("model_layers", &CacheSpec::model_layers)
      .def_property_readonly("sliding_window", &CacheSpec::sliding_window)
      .def_property_readonly("blocks_per_id", &CacheSpec::blocks_per_id)
      .def_property_readonly("total_bytes", &CacheSpec::TotalBytes)
      .def("block_bytes", &CacheSpec::BlockBytes, py::arg("part"))
      .def("part_bytes", &CacheSpec::PartBytes, py::arg("part"))
      .def(
          "block_stride",
          [](const CacheSpec& s, int part) {
            if (part < 0 || part >= s.num_parts()) throw py::index_error("no such part");
            return s.BlockStride(part);
          },
          py::arg("part"))
      .def("local_heads", &CacheSpec::LocalHeads, py::arg("part"))
      .def_property_readonly("hash",
                             [](const CacheSpec& s) {
                               const CompatibilityHash h = s.Hash();
                               return py::bytes(reinterpret_cast<const char*>(h.data()), h.size());
                             })
      .def_property_readonly("canonical_text", &CacheSpec::CanonicalText)
      .def("__repr__", [](const CacheSpec& s) { return "CacheSpec(" + s.CanonicalText() + ")"; });

  py::class_<RankTable>(m, "RankTable", "The global rank table (reference format).")
      .def_static("load", [](const std::string& path) { return Unwrap(RankTable::Load(path)); })
      .def_static(
          "parse",
          [](const std::string& text, const std::string& source) {
            return Unwrap(RankTable::Parse(text, source));
          },
          py::arg("text"), py::arg("source") = "<string>")
      .def("to_json", &RankTable::ToJson)
      .def(
          "select_local",
          [](const RankTable& t, const std::string& role, const std::string& server_id,
             const std::string& visible_devices, int tp_rank) {
            DeviceEntry e = Unwrap(t.SelectLocal(Unwrap(ParseRole(role)), server_id,
                                                 ParseVisibleDevices(visible_devices), tp_rank));
            py::dict d;
            d["server_id"] = e.server_id;
            d["device_id"] = e.device_id;
            d["device_ip"] = e.device_ip;
            d["cluster_id"] = e.cluster_id;
            if (e.super_pod_id) d["super_pod_id"] = *e.super_pod_id;
            if (e.super_device_id) d["super_device_id"] = *e.super_device_id;
            return d;
          },
          py::arg("role"), py::arg("server_id"), py::arg("visible_devices") = "",
          py::arg("tp_rank") = 0);

  py::class_<Scheduler>(m, "Scheduler",
                        "The scheduler side: pure bookkeeping; call it from one thread.")
      .def(py::init([](const std::string& role, const std::string& engine_id,
                       const std::string& host, int base_port, int dp_rank, int tp_size,
                       int hold_lease_ms, int pp_size, bool state_groups) {
             SchedulerConfig c;
             c.state_groups = state_groups;
             c.role = Unwrap(ParseRole(role));
             c.engine_id = engine_id;
             c.host = host;
             c.base_port = base_port;
             c.dp_rank = dp_rank;
             c.tp_size = tp_size;
             c.pp_size = pp_size;
             c.hold_lease = std::chrono::milliseconds(hold_lease_ms);
             return std::make_unique<Scheduler>(c);
           }),
           py::arg("role"), py::arg("engine_id"), py::arg("host") = "127.0.0.1",
           py::arg("base_port") = 5557, py::arg("dp_rank") = 0, py::arg("tp_size") = 1,
           py::arg("hold_lease_ms") = 120000, py::arg("pp_size") = 1,
           py::arg("state_groups") = false,
           "state_groups: the cache has a state group (Mamba, linear attention): vLLM's token "
           "rule for them (the prefill side computes the prompt less its last token, a load "
           "brings that many; prefill_tokens, get_num_new_matched_tokens)")
      .def(
          "prefill_tokens",
          [](const Scheduler& s, const py::dict& params, std::int64_t prompt) {
            return s.PrefillTokens(ParamsFromDict(params), prompt);
          },
          "Prefill side: the prompt tokens to compute (state groups and remote decode: one "
          "fewer).")
      .def("get_num_new_matched_tokens",
           [](const Scheduler& s, const py::dict& params, std::int64_t prompt,
              std::int64_t computed) {
             return s.GetNumNewMatchedTokens(ParamsFromDict(params), prompt, computed);
           })
      .def(
          "update_state_after_alloc",
          [](Scheduler& s, const std::string& request_id, py::dict params,
             const std::vector<std::int64_t>& block_ids, std::int64_t num_external_tokens,
             std::int64_t num_prompt_tokens) {
            KvTransferParams p = ParamsFromDict(params);
            Status st = s.UpdateStateAfterAlloc(request_id, p, block_ids, num_external_tokens,
                                                num_prompt_tokens);
            params["do_remote_prefill"] = p.do_remote_prefill;  // cleared: not loaded twice
            ThrowIfError(st);
          },
          py::arg("request_id"), py::arg("params"), py::arg("block_ids"),
          py::arg("num_external_tokens") = -1, py::arg("num_prompt_tokens") = -1)
      .def(
          "update_state_after_alloc_all_groups",
          [](Scheduler& s, const std::string& request_id, py::dict params,
             const std::vector<std::vector<std::int64_t>>& group_block_ids,
             std::int64_t num_external_tokens, std::int64_t num_prompt_tokens) {
            KvTransferParams p = ParamsFromDict(params);
            Status st = s.UpdateStateAfterAllocAllGroups(request_id, p, group_block_ids,
                                                         num_external_tokens, num_prompt_tokens);
            params["do_remote_prefill"] = p.do_remote_prefill;  // cleared: not loaded twice
            ThrowIfError(st);
          },
          "A cache of several KV cache groups: each group's block ids from the load's first "
          "token on (-1 where the engine allocated none).",
          py::arg("request_id"), py::arg("params"), py::arg("group_block_ids"),
          py::arg("num_external_tokens"), py::arg("num_prompt_tokens"))
      .def(
          "request_scheduled",
          [](Scheduler& s, const std::string& request_id, const py::dict& params,
             const std::vector<std::int64_t>& block_ids, std::int64_t num_computed_tokens,
             std::int64_t num_scheduled_tokens, std::int64_t num_prompt_tokens) {
            s.RequestScheduled(request_id, ParamsFromDict(params), block_ids, num_computed_tokens,
                               num_scheduled_tokens, num_prompt_tokens);
          },
          py::arg("request_id"), py::arg("params"), py::arg("block_ids"),
          py::arg("num_computed_tokens"), py::arg("num_scheduled_tokens"),
          py::arg("num_prompt_tokens"))
      .def(
          "request_scheduled_all_groups",
          [](Scheduler& s, const std::string& request_id, const py::dict& params,
             const std::vector<std::vector<std::int64_t>>& group_block_ids,
             std::int64_t num_computed_tokens, std::int64_t num_scheduled_tokens,
             std::int64_t num_prompt_tokens) {
            s.RequestScheduledAllGroups(request_id, ParamsFromDict(params), group_block_ids,
                                        num_computed_tokens, num_scheduled_tokens,
                                        num_prompt_tokens);
          },
          "A cache of several KV cache groups: each group's block ids so far in prompt order "
          "(-1 where the engine freed one); the prompt is what the prefill side computes.",
          py::arg("request_id"), py::arg("params"), py::arg("group_block_ids"),
          py::arg("num_computed_tokens"), py::arg("num_scheduled_tokens"),
          py::arg("num_prompt_tokens"))
      .def(
          "set_rank_hosts",
          [](Scheduler& s, std::vector<std::string> hosts) {
            ThrowIfError(s.SetRankHosts(std::move(hosts)));
          },
          py::arg("hosts"),
          "Where each of this instance's PP x TP workers listens, stage-major; request_finished's "
          "params then carry them as remote_rank_hosts. [] for every rank on `host`.")
      .def("build_connector_meta",
           [](Scheduler& s) {
             const std::vector<std::uint8_t> b = s.BuildConnectorMeta().Encode();
             return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
           })
      .def(
          "request_finished",
          [](Scheduler& s, const std::string& request_id, const py::dict& params,
             const std::string& reason, const std::vector<std::int64_t>& block_ids) {
            Scheduler::FinishedResult r = s.RequestFinished(request_id, ParamsFromDict(params),
                                                            ParseReason(reason), block_ids);
            py::object out = r.params ? py::object(ParamsToDict(*r.params)) : py::none();
            return py::make_tuple(r.delay_free, out);
          },
          py::arg("request_id"), py::arg("params"), py::arg("reason"), py::arg("block_ids"))
      .def(
          "request_finished_all_groups",
          [](Scheduler& s, const std::string& request_id, const py::dict& params,
             const std::string& reason,
             const std::vector<std::vector<std::int64_t>>& group_block_ids) {
            Scheduler::FinishedResult r = s.RequestFinishedAllGroups(
                request_id, ParamsFromDict(params), ParseReason(reason), group_block_ids);
            py::object out = r.params ? py::object(ParamsToDict(*r.params)) : py::none();
            return py::make_tuple(r.delay_free, out);
          },
          "vLLM's request_finished_all_groups: each group's block ids (-1 where freed).",
          py::arg("request_id"), py::arg("params"), py::arg("reason"), py::arg("group_block_ids"));

  py::class_<PyWorker>(m, "Worker", "The worker side, one per TP worker. Thread-safe.")
      .def(py::init([](const std::string& role, const std::string& engine_id, int tp_size,
                       int tp_rank, int dp_rank, const std::string& host, int base_port,
                       const std::string& secret, const std::string& transport,
                       const std::string& rank_table_path, const std::string& server_id,
                       const std::string& visible_devices, int transfer_timeout_ms,
                       int hold_lease_ms, const std::string& failure_policy,
                       const std::map<std::string, std::string>& transport_options, int pp_size,
                       int pp_rank, int layerwise_start_timeout_ms,
                       int layerwise_progress_timeout_ms) {
             WorkerConfig c;
             c.role = Unwrap(ParseRole(role));
             c.engine_id = engine_id;
             c.tp_size = tp_size;
             c.tp_rank = tp_rank;
             c.dp_rank = dp_rank;
             c.pp_size = pp_size;
             c.pp_rank = pp_rank;
             c.host = host;
             c.base_port = base_port;
             c.secret = secret;
             c.transport.backend = transport;
             c.transport.backend_options = transport_options;
             ThrowIfError(CheckTransportOptions(c.transport));
             if (!rank_table_path.empty()) c.rank_table = Unwrap(RankTable::Load(rank_table_path));
             c.server_id = server_id;
             c.visible_devices = ParseVisibleDevices(visible_devices);
             c.transfer_timeout = std::chrono::milliseconds(transfer_timeout_ms);
             c.hold_lease = std::chrono::milliseconds(hold_lease_ms);
             c.layerwise_start_timeout = std::chrono::milliseconds(layerwise_start_timeout_ms);
             c.layerwise_progress_timeout =
                 std::chrono::milliseconds(layerwise_progress_timeout_ms);
             if (failure_policy == "fail") {
               c.failure_policy = LoadFailurePolicy::kFail;
             } else if (failure_policy != "recompute") {
               ThrowIfError(Status::InvalidArgument(
                   "failure_policy must be 'recompute' or 'fail', found '" + failure_policy + "'"));
             }
             // Errors become exceptions only with the GIL held: PyErr_SetString without it
             // crashes the interpreter.
             Result<std::unique_ptr<Worker>> worker = [&] {
               py::gil_scoped_release release;
               return Worker::Create(std::move(c));
             }();
             return std::make_unique<PyWorker>(Unwrap(std::move(worker)));
           }),
           py::arg("role"), py::arg("engine_id"), py::arg("tp_size") = 1, py::arg("tp_rank") = 0,
           py::arg("dp_rank") = 0, py::arg("host") = "127.0.0.1", py::arg("base_port") = 5557,
           py::arg("secret") = "", py::arg("transport") = "auto", py::arg("rank_table_path") = "",
           py::arg("server_id") = "", py::arg("visible_devices") = "",
           py::arg("transfer_timeout_ms") = 30000, py::arg("hold_lease_ms") = 120000,
           py::arg("failure_policy") = "recompute",
           py::arg("transport_options") = std::map<std::string, std::string>{},
           py::arg("pp_size") = 1, py::arg("pp_rank") = 0,
           py::arg("layerwise_start_timeout_ms") = 30000,
           py::arg("layerwise_progress_timeout_ms") = 5000)
      .def(
          "register_kv_caches",
          [](PyWorker& pw, const CacheSpec& spec, std::vector<std::vector<std::uint64_t>> bases,
             const std::string& memory) {
            const std::shared_ptr<Worker> keep = pw.Get();
            Worker& w = *keep;
            const MemoryKind kind = Unwrap(ParseMemoryKind(memory));
            Status s;
            {
              py::gil_scoped_release release;
              s = w.RegisterKvCaches(spec, std::move(bases), kind);
            }
            ThrowIfError(s);
          },
          py::arg("spec"), py::arg("bases"), py::arg("memory") = "host")
      .def(
          "register_kv_cache_groups",
          [](PyWorker& pw, const std::vector<CacheSpec>& specs,
             std::vector<std::vector<std::vector<std::uint64_t>>> bases,
             const std::string& memory) {
            const std::shared_ptr<Worker> keep = pw.Get();
            Worker& w = *keep;
            const MemoryKind kind = Unwrap(ParseMemoryKind(memory));
            const CacheGroups groups = Unwrap(CacheGroups::Create(specs));
            Status s;
            {
              py::gil_scoped_release release;
              s = w.RegisterKvCaches(groups, std::move(bases), kind);
            }
            ThrowIfError(s);
          },
          "A cache of several KV cache groups (a hybrid model): one spec per group, "
          "bases[group][layer][part]; groups may share tensors (vLLM's hybrid allocator).",
          py::arg("specs"), py::arg("bases"), py::arg("memory") = "host")
      .def("start_load_kv",
           [](PyWorker& pw, const py::bytes& metadata) {
             const std::shared_ptr<Worker> keep = pw.Get();
             Worker& w = *keep;
             const std::string b = metadata;
             ConnectorMetadata md = Unwrap(ConnectorMetadata::Decode(
                 std::span(reinterpret_cast<const std::uint8_t*>(b.data()), b.size())));
             py::gil_scoped_release release;
             w.StartLoadKv(md);
           })
      .def(
          "save_kv_layer",
          [](PyWorker& pw, int layer, std::uint64_t stream) {
            const std::shared_ptr<Worker> keep = pw.Get();
            Worker& w = *keep;
            Status s;
            {
              py::gil_scoped_release release;
              s = w.SaveKvLayer(layer, stream);
            }
            ThrowIfError(s);
          },
          py::arg("layer"), py::arg("stream") = 0)
      .def("get_finished",
           [](PyWorker& pw) {
             const std::shared_ptr<Worker> keep = pw.Get();
             Worker& w = *keep;
             FinishedRequests f;
             {
               py::gil_scoped_release release;
               f = w.GetFinished();
             }
             return py::make_tuple(std::set<std::string>(f.sending.begin(), f.sending.end()),
                                   std::set<std::string>(f.receiving.begin(), f.receiving.end()));
           })
      .def("take_load_errors",
           [](PyWorker& pw) {
             const std::shared_ptr<Worker> keep = pw.Get();
             Worker& w = *keep;
             std::vector<LoadError> errors;
             {
               py::gil_scoped_release release;
               errors = w.TakeLoadErrors();
             }
             py::list out;
             for (const LoadError& e : errors) {
               py::dict d;
               d["request_id"] = e.request_id;
               d["block_ids"] = e.local_block_ids;
               d["code"] = StatusCodeName(e.status.code());
               d["message"] = std::string(e.status.message());
               d["recompute"] = e.recompute;
               out.append(d);
             }
             return out;
           })
      .def("take_load_transfers",
           [](PyWorker& pw) {
             const std::shared_ptr<Worker> keep = pw.Get();
             Worker& w = *keep;
             std::vector<LoadTransfer> transfers;
             {
               py::gil_scoped_release release;
               transfers = w.TakeLoadTransfers();
             }
             py::list out;
             for (const LoadTransfer& t : transfers) {
               py::dict d;
               d["request_id"] = t.request_id;
               d["bytes"] = t.bytes;
               d["duration_us"] = t.duration.count();
               out.append(d);
             }
             return out;
           })
      .def(
          "abort_load",
          [](PyWorker& pw, const std::string& request_id, const std::string& reason) {
            const std::shared_ptr<Worker> keep = pw.Get();
            Worker& w = *keep;
            Status s;
            {
              py::gil_scoped_release release;
              s = w.AbortLoad(request_id, reason);
            }
            if (s.code() == StatusCode::kNotFound) return false;  // no such load: nothing to stop
            ThrowIfError(s);
            return true;
          },
          py::arg("request_id"), py::arg("reason") = "aborted by the engine")
      .def("stats",
           [](PyWorker& pw) {
             const std::shared_ptr<Worker> keep = pw.Get();
             Worker& w = *keep;
             WorkerStats s;
             {
               py::gil_scoped_release release;
               s = w.Stats();
             }
             py::dict d;
             d["bytes_read"] = s.bytes_read;
             d["reads"] = s.reads;
             d["merged_runs"] = s.merged_runs;
             d["loads_done"] = s.loads_done;
             d["loads_failed"] = s.loads_failed;
             d["loads_reread"] = s.loads_reread;
             d["handshakes"] = s.handshakes;
             d["failures"] = s.failures;
             d["holds_outstanding"] = s.holds_outstanding;
             d["loads_outstanding"] = s.loads_outstanding;
             d["transfer_p50_us"] = s.transfer_latency.Quantile(0.5);
             d["transfer_p90_us"] = s.transfer_latency.Quantile(0.9);
             d["transfer_p99_us"] = s.transfer_latency.Quantile(0.99);
             d["transfer_max_us"] = s.transfer_latency.max_us();
             return d;
           })
      .def(
          "metrics",
          [](PyWorker& pw) {
            const std::shared_ptr<Worker> keep = pw.Get();
            Worker& w = *keep;
            WorkerMetrics m;
            {
              py::gil_scoped_release release;
              m = w.Metrics();
            }
            return MetricsDict(m);
          },
          "A snapshot of every counter, gauge and latency histogram (docs/observability.md)")
      .def(
          "metrics_text",
          [](PyWorker& pw) {
            const std::shared_ptr<Worker> keep = pw.Get();
            Worker& w = *keep;
            std::string text;
            {
              py::gil_scoped_release release;
              const WorkerMetrics m = w.Metrics();
              text = PrometheusText(std::span<const WorkerMetrics>(&m, 1));
            }
            return text;
          },
          "The metrics snapshot in the Prometheus text format (0.0.4)")
      .def_property_readonly("listener_endpoint",
                             [](const PyWorker& pw) { return pw.Get()->listener_endpoint(); })
      .def("close", &PyWorker::Close,
           "Stops the worker and joins its threads (vLLM's shutdown); a second call does nothing")
      .def_property_readonly("closed", &PyWorker::closed);
}
