#include <algorithm>
#include <limits>

#include "kvferry/connector.h"
#include "wire/messages.h"
#include "wire/msgpack_reader.h"
#include "wire/msgpack_writer.h"

namespace kvferry {
namespace {

using wire::Packer;
using wire::PackIds;
using wire::PackStr;

Result<std::vector<std::int64_t>> DecodeIds(const wire::MapView& m, const char* key) {
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* v, m.Require(key));
  if (v->type != msgpack::type::ARRAY) {
    return Status::InvalidArgument(m.At(key) + ": expected an array of block ids");
  }
  std::vector<std::int64_t> out;
  out.reserve(v->via.array.size);
  for (std::uint32_t i = 0; i < v->via.array.size; ++i) {
    const msgpack::object& e = v->via.array.ptr[i];
    if (e.type != msgpack::type::POSITIVE_INTEGER ||
        e.via.u64 > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return Status::InvalidArgument(m.At(key) + "[" + std::to_string(i) +
                                     "]: expected a non-negative block id");
    }
    out.push_back(static_cast<std::int64_t>(e.via.u64));
  }
  return out;
}

constexpr std::uint64_t kMaxInt = std::numeric_limits<int>::max();

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
  }
  return "unknown";
}
constexpr std::uint64_t kMaxInt64 = std::numeric_limits<std::int64_t>::max();

Result<std::string> OptionalStr(const wire::MapView& m, const char* key) {
  if (auto v = m.OptionalStr(key, wire::kMaxIdBytes)) return *v;
  return std::string();
}

// The array under `key`, or nullptr when absent; InvalidArgument when it is not an array.
Result<const msgpack::object*> OptionalArray(const wire::MapView& m, const char* key) {
  const msgpack::object* v = m.Find(key);
  if (v != nullptr && v->type != msgpack::type::ARRAY) {
    return Status::InvalidArgument(m.At(key) + ": expected an array");
  }
  return v;
}

}  // namespace

std::vector<std::uint8_t> ConnectorMetadata::Encode() const {
  msgpack::sbuffer buffer;
  Packer pk(buffer);
  pk.pack_map(5);
  PackStr(pk, "v");
  pk.pack_uint32(1);
  PackStr(pk, "loads");
  pk.pack_array(static_cast<std::uint32_t>(loads.size()));
  for (const LoadSpec& l : loads) {
    pk.pack_map(9);
    PackStr(pk, "request_id");
    PackStr(pk, l.request_id);
    PackStr(pk, "local_block_ids");
    PackIds(pk, l.local_block_ids);
    PackStr(pk, "remote_block_ids");
    PackIds(pk, l.remote_block_ids);
    PackStr(pk, "remote_engine_id");
    PackStr(pk, l.remote_engine_id);
    PackStr(pk, "remote_host");
    PackStr(pk, l.remote_host);
    PackStr(pk, "remote_port");
    pk.pack_int32(l.remote_port);
    PackStr(pk, "remote_tp_size");
    pk.pack_int32(l.remote_tp_size);
    PackStr(pk, "remote_request_id");
    PackStr(pk, l.remote_request_id);
    PackStr(pk, "transfer_id");
    PackStr(pk, l.transfer_id);
  }
  PackStr(pk, "holds");
  pk.pack_array(static_cast<std::uint32_t>(holds.size()));
  for (const HoldSpec& h : holds) {
    pk.pack_map(3);
    PackStr(pk, "request_id");
    PackStr(pk, h.request_id);
    PackStr(pk, "lease_ms");
    pk.pack_int64(h.lease_ms);
    PackStr(pk, "transfer_id");
    PackStr(pk, h.transfer_id);
  }
  PackStr(pk, "saves");
  pk.pack_array(static_cast<std::uint32_t>(saves.size()));
  for (const LayerwiseSave& sv : saves) {
    pk.pack_map(6);
    PackStr(pk, "request_id");
    PackStr(pk, sv.request_id);
    PackStr(pk, "transfer_id");
    PackStr(pk, sv.transfer_id);
    PackStr(pk, "block_ids");
    PackIds(pk, sv.block_ids);
    PackStr(pk, "first_token");
    pk.pack_int64(sv.first_token);
    PackStr(pk, "end_token");
    pk.pack_int64(sv.end_token);
    PackStr(pk, "prompt_tokens");
    pk.pack_int64(sv.prompt_tokens);
  }
  PackStr(pk, "transfer_ends");
  pk.pack_array(static_cast<std::uint32_t>(transfer_ends.size()));
  for (const TransferEnd& e : transfer_ends) {
    pk.pack_map(2);
    PackStr(pk, "transfer_id");
    PackStr(pk, e.transfer_id);
    PackStr(pk, "reason");
    PackStr(pk, e.reason);
  }
  const auto* p = reinterpret_cast<const std::uint8_t*>(buffer.data());
  return {p, p + buffer.size()};
}

Result<ConnectorMetadata> ConnectorMetadata::Decode(std::span<const std::uint8_t> bytes) {
  KVFERRY_ASSIGN_OR_RETURN(msgpack::object_handle handle,
                           wire::SafeUnpack(bytes, {1u << 22, 16, 5}));
  KVFERRY_ASSIGN_OR_RETURN(wire::MapView m, wire::MapView::Of(handle.get(), "metadata"));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t version, m.Uint("v", 255));
  if (version != 1) {
    return Status::NotSupported("connector metadata version " + std::to_string(version) +
                                " is not supported; this build reads version 1");
  }
  ConnectorMetadata md;
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* loads, m.Require("loads"));
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* holds, m.Require("holds"));
  if (loads->type != msgpack::type::ARRAY || holds->type != msgpack::type::ARRAY) {
    return Status::InvalidArgument("metadata: expected arrays of loads and holds");
  }
  for (std::uint32_t i = 0; i < loads->via.array.size; ++i) {
    KVFERRY_ASSIGN_OR_RETURN(
        wire::MapView lm,
        wire::MapView::Of(loads->via.array.ptr[i], "metadata.loads[" + std::to_string(i) + "]"));
    LoadSpec l;
    KVFERRY_ASSIGN_OR_RETURN(l.request_id, lm.Str("request_id", wire::kMaxIdBytes));
    KVFERRY_ASSIGN_OR_RETURN(l.local_block_ids, DecodeIds(lm, "local_block_ids"));
    KVFERRY_ASSIGN_OR_RETURN(l.remote_block_ids, DecodeIds(lm, "remote_block_ids"));
    KVFERRY_ASSIGN_OR_RETURN(l.remote_engine_id, lm.Str("remote_engine_id", wire::kMaxIdBytes));
    KVFERRY_ASSIGN_OR_RETURN(l.remote_host, lm.Str("remote_host", wire::kMaxIdBytes));
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t port, lm.Uint("remote_port", 65535));
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t tp, lm.Uint("remote_tp_size", kMaxTpSize));
    l.remote_port = static_cast<int>(port);
    l.remote_tp_size = static_cast<int>(tp);
    KVFERRY_ASSIGN_OR_RETURN(l.remote_request_id, lm.Str("remote_request_id", wire::kMaxIdBytes));
    KVFERRY_ASSIGN_OR_RETURN(l.transfer_id, OptionalStr(lm, "transfer_id"));
    md.loads.push_back(std::move(l));
  }
  for (std::uint32_t i = 0; i < holds->via.array.size; ++i) {
    KVFERRY_ASSIGN_OR_RETURN(
        wire::MapView hm,
        wire::MapView::Of(holds->via.array.ptr[i], "metadata.holds[" + std::to_string(i) + "]"));
    HoldSpec h;
    KVFERRY_ASSIGN_OR_RETURN(h.request_id, hm.Str("request_id", wire::kMaxIdBytes));
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t lease, hm.Uint("lease_ms", kMaxInt));
    h.lease_ms = static_cast<std::int64_t>(lease);
    KVFERRY_ASSIGN_OR_RETURN(h.transfer_id, OptionalStr(hm, "transfer_id"));
    md.holds.push_back(std::move(h));
  }
  // Layer-wise saves and transfer ends: optional, so metadata without them still decodes.
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* saves, OptionalArray(m, "saves"));
  for (std::uint32_t i = 0; saves != nullptr && i < saves->via.array.size; ++i) {
    KVFERRY_ASSIGN_OR_RETURN(
        wire::MapView sm,
        wire::MapView::Of(saves->via.array.ptr[i], "metadata.saves[" + std::to_string(i) + "]"));
    LayerwiseSave sv;
    KVFERRY_ASSIGN_OR_RETURN(sv.request_id, sm.Str("request_id", wire::kMaxIdBytes));
    KVFERRY_ASSIGN_OR_RETURN(sv.transfer_id, sm.Str("transfer_id", wire::kMaxIdBytes));
    KVFERRY_ASSIGN_OR_RETURN(sv.block_ids, DecodeIds(sm, "block_ids"));
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t first, sm.Uint("first_token", kMaxInt64));
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t end, sm.Uint("end_token", kMaxInt64));
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t prompt, sm.Uint("prompt_tokens", kMaxInt64));
    if (first > end || end > prompt) {
      return Status::InvalidArgument(sm.path() +
                                     ": expected first_token <= end_token <= prompt_tokens");
    }
    sv.first_token = static_cast<std::int64_t>(first);
    sv.end_token = static_cast<std::int64_t>(end);
    sv.prompt_tokens = static_cast<std::int64_t>(prompt);
    md.saves.push_back(std::move(sv));
  }
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* ends, OptionalArray(m, "transfer_ends"));
  for (std::uint32_t i = 0; ends != nullptr && i < ends->via.array.size; ++i) {
    KVFERRY_ASSIGN_OR_RETURN(
        wire::MapView em, wire::MapView::Of(ends->via.array.ptr[i],
                                            "metadata.transfer_ends[" + std::to_string(i) + "]"));
    TransferEnd e;
    KVFERRY_ASSIGN_OR_RETURN(e.transfer_id, em.Str("transfer_id", wire::kMaxIdBytes));
    KVFERRY_ASSIGN_OR_RETURN(e.reason, em.Str("reason", wire::kMaxTextBytes));
    md.transfer_ends.push_back(std::move(e));
  }
  return md;
}

std::pair<std::int64_t, bool> Scheduler::GetNumNewMatchedTokens(
    const KvTransferParams& params, std::int64_t num_prompt_tokens,
    std::int64_t num_computed_tokens) const {
  if (!params.do_remote_prefill) return {0, false};
  const std::int64_t count = std::max<std::int64_t>(num_prompt_tokens - num_computed_tokens, 0);
  return {count, count > 0};
}

Status Scheduler::UpdateStateAfterAlloc(const std::string& request_id, KvTransferParams& params,
                                        std::span<const std::int64_t> new_block_ids) {
  if (!params.do_remote_prefill) return Status::Ok();
  // Cleared first, whatever happens next, so the request is never loaded twice.
  params.do_remote_prefill = false;
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
  // Rule 14: the prefill ranks a load talks to are remote_port + 0 .. remote_tp_size - 1.
  if (*params.remote_tp_size < 1 || *params.remote_tp_size > kMaxTpSize ||
      *params.remote_port < 1 ||
      static_cast<std::int64_t>(*params.remote_port) + *params.remote_tp_size - 1 > 65535) {
    return Status::InvalidArgument(
        "request " + request_id + " has remote_tp_size " + std::to_string(*params.remote_tp_size) +
        " and remote_port " + std::to_string(*params.remote_port) + "; expected a TP size in 1.." +
        std::to_string(kMaxTpSize) + " and ports remote_port..remote_port + remote_tp_size - 1 " +
        "inside 1..65535");
  }
  LoadSpec load;
  load.request_id = request_id;
  load.local_block_ids.assign(new_block_ids.begin(), new_block_ids.end());
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
  if (config_.role != Role::kPrefill || !params.do_remote_decode || !params.transfer_id ||
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
  if (first == end) return;  // decoding, or nothing of the prompt in this step
  pending_.saves.push_back({request_id, *params.transfer_id,
                            std::vector<std::int64_t>(block_ids.begin(), block_ids.end()), first,
                            end, num_prompt_tokens});
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
  if (config_.role == Role::kDecode) {
    if (params.do_remote_prefill) {
      // Ended before UpdateStateAfterAlloc (aborted while it waited): a load of no blocks still
      // sends its finished notices, so the prefill side frees now instead of at its lease.
      // Incomplete params have no one to tell.
      KvTransferParams unscheduled = params;
      (void)UpdateStateAfterAlloc(request_id, unscheduled, {});
    }
    return {};
  }
  const bool layerwise =
      params.do_remote_decode && params.transfer_id.has_value() && !params.transfer_id->empty();
  if (layerwise) layerwise_computed_.erase(request_id);
  if (!params.do_remote_decode || reason != FinishReason::kLengthCapped || block_ids.empty()) {
    if (layerwise) {
      pending_.transfer_ends.push_back(
          {*params.transfer_id, "request " + request_id + " ended on the prefill side (" +
                                    FinishReasonName(reason) + ") without holding its KV"});
    }
    if (!params.do_remote_decode || reason != FinishReason::kLengthCapped) return {};
  }
  FinishedResult r;
  r.delay_free = !block_ids.empty();
  if (r.delay_free) {
    pending_.holds.push_back({request_id, static_cast<std::int64_t>(config_.hold_lease.count()),
                              layerwise ? *params.transfer_id : std::string()});
  }
  KvTransferParams out;
  out.do_remote_prefill = true;
  out.remote_block_ids = std::vector<std::int64_t>(block_ids.begin(), block_ids.end());
  out.remote_engine_id = config_.engine_id;
  out.remote_host = config_.host;
  out.remote_port = config_.base_port + config_.dp_rank * config_.tp_size;
  out.remote_tp_size = config_.tp_size;
  // A layer-wise hold is keyed by the transfer id: a proxy that falls back to forwarding these
  // params (whole-request) reaches the same hold.
  out.remote_request_id = layerwise ? *params.transfer_id : request_id;
  r.params = std::move(out);
  return r;
}

}  // namespace kvferry
