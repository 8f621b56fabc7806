// ConnectorMetadata's wire form (Encode and Decode): the plain value the scheduler builds each
// step and the engine ships to its worker processes (DESIGN rule 3), decoded without trusting it.
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

// Block ids, kNoBlock (-1) allowed: a group's position without a block (a sliding window's).
Result<std::vector<std::int64_t>> DecodeIds(const wire::MapView& m, const char* key) {
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* v, m.Require(key));
  return wire::BlockIdsOf(*v, m.At(key), 1u << 22);
}

constexpr std::uint64_t kMaxInt = std::numeric_limits<int>::max();

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
    // Sent only where they say something.
    const bool staged = l.remote_pp_size != 1;
    const bool tokens = l.num_tokens >= 0;
    const bool hosts = !l.remote_rank_hosts.empty();
    const bool grouped = !l.more_groups.empty();
    pk.pack_map(9 + (staged ? 1 : 0) + (tokens ? 2 : 0) + (hosts ? 1 : 0) + (grouped ? 1 : 0));
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
    if (staged) {
      PackStr(pk, "remote_pp_size");
      pk.pack_int32(l.remote_pp_size);
    }
    if (tokens) {
      PackStr(pk, "first_token");
      pk.pack_int64(l.first_token);
      PackStr(pk, "num_tokens");
      pk.pack_int64(l.num_tokens);
    }
    if (hosts) {
      PackStr(pk, "remote_rank_hosts");
      pk.pack_array(static_cast<std::uint32_t>(l.remote_rank_hosts.size()));
      for (const std::string& h : l.remote_rank_hosts) PackStr(pk, h);
    }
    if (grouped) {
      PackStr(pk, "more_groups");
      pk.pack_array(static_cast<std::uint32_t>(l.more_groups.size()));
      for (const GroupBlockIds& g : l.more_groups) {
        pk.pack_map(2);
        PackStr(pk, "local_block_ids");
        PackIds(pk, g.local);
        PackStr(pk, "remote_block_ids");
        PackIds(pk, g.remote);
      }
    }
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
    pk.pack_map(sv.group_block_ids.empty() ? 6 : 7);
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
    if (!sv.group_block_ids.empty()) {
      PackStr(pk, "group_block_ids");
      pk.pack_array(static_cast<std::uint32_t>(sv.group_block_ids.size()));
      for (const std::vector<std::int64_t>& ids : sv.group_block_ids) PackIds(pk, ids);
    }
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
  KVFERRY_ASSIGN_OR_RETURN(
      msgpack::object_handle handle,
      wire::SafeUnpack(bytes, {1u << 22, 16, 6}));  // loads[i].more_groups[g].ids: 6
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
    if (lm.Find("remote_pp_size") != nullptr) {
      KVFERRY_ASSIGN_OR_RETURN(std::uint64_t pp, lm.Uint("remote_pp_size", kMaxTpSize));
      if (pp == 0) {
        return Status::InvalidArgument("metadata.loads[" + std::to_string(i) +
                                       "].remote_pp_size is 0; expected a PP size of at least 1");
      }
      l.remote_pp_size = static_cast<int>(pp);
    }
    if (lm.Find("num_tokens") != nullptr) {
      // Bounded so first_token + num_tokens cannot overflow.
      constexpr std::uint64_t kMaxTokens = std::uint64_t{1} << 40;
      KVFERRY_ASSIGN_OR_RETURN(std::uint64_t first, lm.Uint("first_token", kMaxTokens));
      KVFERRY_ASSIGN_OR_RETURN(std::uint64_t count, lm.Uint("num_tokens", kMaxTokens));
      l.first_token = static_cast<std::int64_t>(first);
      l.num_tokens = static_cast<std::int64_t>(count);
    }
    if (const msgpack::object* more = lm.Find("more_groups")) {
      if (more->type != msgpack::type::ARRAY ||
          more->via.array.size > static_cast<std::uint32_t>(kMaxCacheGroups - 1)) {
        return Status::InvalidArgument(lm.At("more_groups") + ": expected an array of at most " +
                                       std::to_string(kMaxCacheGroups - 1) + " groups");
      }
      for (std::uint32_t g = 0; g < more->via.array.size; ++g) {
        KVFERRY_ASSIGN_OR_RETURN(wire::MapView gm, wire::MapView::Of(more->via.array.ptr[g],
                                                                     lm.At("more_groups") + "[" +
                                                                         std::to_string(g) + "]"));
        GroupBlockIds ids;
        KVFERRY_ASSIGN_OR_RETURN(ids.local, DecodeIds(gm, "local_block_ids"));
        KVFERRY_ASSIGN_OR_RETURN(ids.remote, DecodeIds(gm, "remote_block_ids"));
        l.more_groups.push_back(std::move(ids));
      }
    }
    if (lm.Find("remote_rank_hosts") != nullptr) {
      KVFERRY_ASSIGN_OR_RETURN(
          l.remote_rank_hosts,
          lm.StrList("remote_rank_hosts", static_cast<std::size_t>(kMaxTpSize) * kMaxTpSize,
                     wire::kMaxIdBytes));
      const auto ranks =
          static_cast<std::size_t>(l.remote_pp_size) * static_cast<std::size_t>(l.remote_tp_size);
      if (l.remote_rank_hosts.size() != ranks) {
        return Status::InvalidArgument(
            "metadata.loads[" + std::to_string(i) + "].remote_rank_hosts names " +
            std::to_string(l.remote_rank_hosts.size()) + " hosts; expected remote_pp_size x " +
            "remote_tp_size = " + std::to_string(ranks));
      }
    }
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
    if (const msgpack::object* more = sm.Find("group_block_ids")) {
      if (more->type != msgpack::type::ARRAY ||
          more->via.array.size > static_cast<std::uint32_t>(kMaxCacheGroups - 1)) {
        return Status::InvalidArgument(sm.At("group_block_ids") +
                                       ": expected an array of at most " +
                                       std::to_string(kMaxCacheGroups - 1) + " groups' block ids");
      }
      for (std::uint32_t g = 0; g < more->via.array.size; ++g) {
        KVFERRY_ASSIGN_OR_RETURN(
            std::vector<std::int64_t> ids,
            wire::BlockIdsOf(more->via.array.ptr[g],
                             sm.At("group_block_ids") + "[" + std::to_string(g) + "]", 1u << 22));
        sv.group_block_ids.push_back(std::move(ids));
      }
    }
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

}  // namespace kvferry
