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

}  // namespace

std::vector<std::uint8_t> ConnectorMetadata::Encode() const {
  msgpack::sbuffer buffer;
  Packer pk(buffer);
  pk.pack_map(3);
  PackStr(pk, "v");
  pk.pack_uint32(1);
  PackStr(pk, "loads");
  pk.pack_array(static_cast<std::uint32_t>(loads.size()));
  for (const LoadSpec& l : loads) {
    pk.pack_map(8);
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
  }
  PackStr(pk, "holds");
  pk.pack_array(static_cast<std::uint32_t>(holds.size()));
  for (const HoldSpec& h : holds) {
    pk.pack_map(2);
    PackStr(pk, "request_id");
    PackStr(pk, h.request_id);
    PackStr(pk, "lease_ms");
    pk.pack_int64(h.lease_ms);
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
    md.holds.push_back(std::move(h));
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
  need(params.remote_block_ids.has_value(), "remote_block_ids");
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
  load.remote_block_ids = *params.remote_block_ids;
  load.remote_engine_id = *params.remote_engine_id;
  load.remote_host = *params.remote_host;
  load.remote_port = *params.remote_port;
  load.remote_tp_size = *params.remote_tp_size;
  load.remote_request_id = params.remote_request_id.value_or(request_id);
  pending_.loads.push_back(std::move(load));
  return Status::Ok();
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
  if (!params.do_remote_decode || reason != FinishReason::kLengthCapped) {
    return {};
  }
  FinishedResult r;
  r.delay_free = !block_ids.empty();
  if (r.delay_free) {
    pending_.holds.push_back({request_id, static_cast<std::int64_t>(config_.hold_lease.count())});
  }
  KvTransferParams out;
  out.do_remote_prefill = true;
  out.remote_block_ids = std::vector<std::int64_t>(block_ids.begin(), block_ids.end());
  out.remote_engine_id = config_.engine_id;
  out.remote_host = config_.host;
  out.remote_port = config_.base_port + config_.dp_rank * config_.tp_size;
  out.remote_tp_size = config_.tp_size;
  out.remote_request_id = request_id;
  r.params = std::move(out);
  return r;
}

}  // namespace kvferry
