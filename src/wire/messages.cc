#include "wire/messages.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>
#include <msgpack.hpp>
#include <string_view>
#include <utility>

#include "wire/cache_codec.h"
#include "wire/msgpack_reader.h"
#include "wire/msgpack_writer.h"

namespace kvferry::wire {
namespace {

// ---------------------------------------------------------------------------------------------
// Encoding

void PackKey(Packer& pk, const char* key) { PackStr(pk, key); }

void PackPeer(Packer& pk, const PeerRef& peer) {
  pk.pack_map(peer.pp_rank != 0 ? 4 : 3);
  PackKey(pk, "engine_id");
  PackStr(pk, peer.engine_id);
  PackKey(pk, "dp_rank");
  pk.pack_uint32(peer.dp_rank);
  PackKey(pk, "tp_rank");
  pk.pack_uint32(peer.tp_rank);
  if (peer.pp_rank != 0) {
    PackKey(pk, "pp_rank");
    pk.pack_uint32(peer.pp_rank);
  }
}

void PackStrList(Packer& pk, const std::vector<std::string>& items) {
  pk.pack_array(static_cast<std::uint32_t>(items.size()));
  for (const std::string& s : items) PackStr(pk, s);
}

void PackInts(Packer& pk, const std::vector<std::int64_t>& items) {
  pk.pack_array(static_cast<std::uint32_t>(items.size()));
  for (std::int64_t v : items) pk.pack_int64(v);
}

// Writes the envelope's "v" and "t" and the map header for `fields` more keys.
void PackHeader(Packer& pk, const char* type, std::uint32_t fields) {
  pk.pack_map(2 + fields);
  PackKey(pk, "v");
  pk.pack_uint32(kProtocolVersion);
  PackKey(pk, "t");
  PackStr(pk, type);
}

struct EncodeVisitor {
  Packer& pk;

  void operator()(const MetadataRequest& m) const {
    PackHeader(pk, "metadata_request", 1);
    PackKey(pk, "from");
    PackPeer(pk, m.from);
  }
  void operator()(const AgentMetadata& m) const {
    const AgentIdentity& a = m.agent;
    PackHeader(pk, "agent_metadata", 4 + CacheGroupsKeys(m.caches) + (m.features.empty() ? 0 : 1));
    PackKey(pk, "agent");
    pk.pack_map(6 + (a.super_pod_id ? 1 : 0) + (a.super_device_id ? 1 : 0));
    PackKey(pk, "peer");
    PackPeer(pk, a.peer);
    PackKey(pk, "tp_size");
    pk.pack_uint32(a.tp_size);
    PackKey(pk, "server_id");
    PackStr(pk, a.server_id);
    PackKey(pk, "device_id");
    PackStr(pk, a.device_id);
    PackKey(pk, "device_ip");
    PackStr(pk, a.device_ip);
    PackKey(pk, "cluster_id");
    pk.pack_uint64(a.cluster_id);
    if (a.super_pod_id) {
      PackKey(pk, "super_pod_id");
      PackStr(pk, *a.super_pod_id);
    }
    if (a.super_device_id) {
      PackKey(pk, "super_device_id");
      PackStr(pk, *a.super_device_id);
    }
    PackKey(pk, "endpoint");
    PackStr(pk, m.listener_endpoint);
    PackKey(pk, "transports");
    pk.pack_array(static_cast<std::uint32_t>(m.transports.size()));
    for (const TransportDescriptor& t : m.transports) {
      pk.pack_map(2);
      PackKey(pk, "kind");
      PackStr(pk, t.kind);
      PackKey(pk, "desc");
      pk.pack_bin(static_cast<std::uint32_t>(t.blob.size()));
      pk.pack_bin_body(reinterpret_cast<const char*>(t.blob.data()),
                       static_cast<std::uint32_t>(t.blob.size()));
    }
    PackCacheGroups(pk, m.caches);
    PackKey(pk, "cache_hash");
    pk.pack_bin(static_cast<std::uint32_t>(m.cache_hash.size()));
    pk.pack_bin_body(reinterpret_cast<const char*>(m.cache_hash.data()),
                     static_cast<std::uint32_t>(m.cache_hash.size()));
    if (!m.features.empty()) {
      PackKey(pk, "features");
      PackStrList(pk, m.features);
    }
  }
  void operator()(const FinishedNotice& m) const {
    PackHeader(pk, "finished", m.pp_readers != 1 ? 4 : 3);
    PackKey(pk, "from");
    PackPeer(pk, m.from);
    PackKey(pk, "request_ids");
    PackStrList(pk, m.request_ids);
    PackKey(pk, "tp_size");
    pk.pack_uint32(m.tp_size);
    if (m.pp_readers != 1) {
      PackKey(pk, "pp_readers");
      pk.pack_uint32(m.pp_readers);
    }
  }
  void operator()(const AbortNotice& m) const {
    PackHeader(pk, "abort", 3);
    PackKey(pk, "from");
    PackPeer(pk, m.from);
    PackKey(pk, "request_ids");
    PackStrList(pk, m.request_ids);
    PackKey(pk, "reason");
    PackStr(pk, m.reason);
  }
  void operator()(const LeaseRenewal& m) const {
    PackHeader(pk, "lease", 3);
    PackKey(pk, "from");
    PackPeer(pk, m.from);
    PackKey(pk, "request_ids");
    PackStrList(pk, m.request_ids);
    PackKey(pk, "lease_ms");
    pk.pack_uint32(m.lease_ms);
  }
  void operator()(const Subscribe& m) const {
    PackHeader(pk, "subscribe", m.groups != 1 ? 6 : 5);
    PackKey(pk, "from");
    PackPeer(pk, m.from);
    PackKey(pk, "transfer_id");
    PackStr(pk, m.transfer_id);
    PackKey(pk, "tp_size");
    pk.pack_uint32(m.tp_size);
    PackKey(pk, "endpoint");
    PackStr(pk, m.endpoint);
    PackKey(pk, "wait_ms");
    pk.pack_uint32(m.wait_ms);
    if (m.groups != 1) {
      PackKey(pk, "groups");
      pk.pack_uint32(m.groups);
    }
  }
  void operator()(const Progress& m) const {
    const bool grouped = !m.group_layers_cur.empty();
    PackHeader(pk, "progress", grouped ? 12 : 10);
    PackKey(pk, "from");
    PackPeer(pk, m.from);
    PackKey(pk, "transfer_id");
    PackStr(pk, m.transfer_id);
    PackKey(pk, "seq");
    pk.pack_uint64(m.seq);
    PackKey(pk, "state");
    pk.pack_uint8(static_cast<std::uint8_t>(m.state));
    PackKey(pk, "reason");
    PackStr(pk, m.reason);
    PackKey(pk, "prompt_tokens");
    pk.pack_uint64(m.prompt_tokens);
    PackKey(pk, "tokens_all");
    pk.pack_uint64(m.tokens_all);
    PackKey(pk, "tokens_cur");
    pk.pack_uint64(m.tokens_cur);
    PackKey(pk, "layers_cur");
    pk.pack_uint32(m.layers_cur);
    PackKey(pk, "block_ids");
    PackInts(pk, m.block_ids);
    if (grouped) {
      PackKey(pk, "group_layers_cur");
      pk.pack_array(static_cast<std::uint32_t>(m.group_layers_cur.size()));
      for (std::uint32_t n : m.group_layers_cur) pk.pack_uint32(n);
      PackKey(pk, "group_block_ids");
      pk.pack_array(static_cast<std::uint32_t>(m.group_block_ids.size()));
      for (const std::vector<std::int64_t>& ids : m.group_block_ids) PackInts(pk, ids);
    }
  }
  void operator()(const Ack& m) const {
    PackHeader(pk, "ack", 1);
    PackKey(pk, "count");
    pk.pack_uint32(m.count);
  }
  void operator()(const ErrorReply& m) const {
    PackHeader(pk, "error", 2);
    PackKey(pk, "code");
    pk.pack_uint8(static_cast<std::uint8_t>(m.code));
    PackKey(pk, "message");
    PackStr(pk, m.message);
  }
};

// ---------------------------------------------------------------------------------------------
// Decoding

constexpr std::uint64_t kMaxU32 = std::numeric_limits<std::uint32_t>::max();

Result<PeerRef> DecodePeer(const MapView& parent, const char* key) {
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* v, parent.Require(key));
  KVFERRY_ASSIGN_OR_RETURN(MapView m, MapView::Of(*v, parent.At(key)));
  PeerRef peer;
  KVFERRY_ASSIGN_OR_RETURN(peer.engine_id, m.Str("engine_id", kMaxIdBytes));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t dp, m.Uint("dp_rank", kMaxU32));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t tp, m.Uint("tp_rank", kMaxU32));
  peer.dp_rank = static_cast<std::uint32_t>(dp);
  peer.tp_rank = static_cast<std::uint32_t>(tp);
  if (m.Find("pp_rank") != nullptr) {
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t pp, m.Uint("pp_rank", kMaxTpSize - 1));
    peer.pp_rank = static_cast<std::uint32_t>(pp);
  }
  return peer;
}

Result<Message> DecodeAgentMetadata(const MapView& m) {
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* agent_obj, m.Require("agent"));
  KVFERRY_ASSIGN_OR_RETURN(MapView am, MapView::Of(*agent_obj, m.At("agent")));
  AgentIdentity agent;
  KVFERRY_ASSIGN_OR_RETURN(agent.peer, DecodePeer(am, "peer"));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t tp_size, am.Uint("tp_size", kMaxTpSize));
  if (tp_size == 0 || agent.peer.tp_rank >= tp_size) {
    return Status::InvalidArgument(am.At("tp_size") + ": expected tp_rank " +
                                   std::to_string(agent.peer.tp_rank) + " < tp_size, found " +
                                   std::to_string(tp_size));
  }
  agent.tp_size = static_cast<std::uint32_t>(tp_size);
  KVFERRY_ASSIGN_OR_RETURN(agent.server_id, am.Str("server_id", kMaxIdBytes));
  KVFERRY_ASSIGN_OR_RETURN(agent.device_id, am.Str("device_id", kMaxIdBytes));
  KVFERRY_ASSIGN_OR_RETURN(agent.device_ip, am.Str("device_ip", kMaxIdBytes));
  KVFERRY_ASSIGN_OR_RETURN(agent.cluster_id,
                           am.Uint("cluster_id", std::numeric_limits<std::uint64_t>::max()));
  if (auto pod = am.OptionalStr("super_pod_id", kMaxIdBytes)) {
    if (!pod->ok()) return pod->status();
    agent.super_pod_id = std::move(*pod).value();
  }
  if (auto sdid = am.OptionalStr("super_device_id", kMaxIdBytes)) {
    if (!sdid->ok()) return sdid->status();
    agent.super_device_id = std::move(*sdid).value();
  }
  KVFERRY_ASSIGN_OR_RETURN(std::string endpoint, m.Str("endpoint", kMaxTextBytes));
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* tr, m.Require("transports"));
  if (tr->type != msgpack::type::ARRAY) {
    return Status::InvalidArgument(m.At("transports") + ": expected an array, found " +
                                   ObjectTypeName(*tr));
  }
  if (tr->via.array.size > kMaxTransports) {
    return Status::InvalidArgument(m.At("transports") + ": " + std::to_string(tr->via.array.size) +
                                   " entries exceed the limit of " +
                                   std::to_string(kMaxTransports));
  }
  std::vector<TransportDescriptor> transports;
  for (std::uint32_t i = 0; i < tr->via.array.size; ++i) {
    KVFERRY_ASSIGN_OR_RETURN(
        MapView tm,
        MapView::Of(tr->via.array.ptr[i], m.At("transports") + "[" + std::to_string(i) + "]"));
    TransportDescriptor t;
    KVFERRY_ASSIGN_OR_RETURN(t.kind, tm.Str("kind", kMaxIdBytes));
    KVFERRY_ASSIGN_OR_RETURN(t.blob, tm.Bin("desc", kMaxDescriptorBytes));
    transports.push_back(std::move(t));
  }
  KVFERRY_ASSIGN_OR_RETURN(CacheGroups caches, DecodeCacheGroups(m));
  KVFERRY_ASSIGN_OR_RETURN(std::vector<std::uint8_t> hash, m.Bin("cache_hash", 32));
  CompatibilityHash cache_hash{};
  if (hash.size() != cache_hash.size()) {
    return Status::InvalidArgument(m.At("cache_hash") + ": expected 32 bytes, found " +
                                   std::to_string(hash.size()));
  }
  std::copy(hash.begin(), hash.end(), cache_hash.begin());
  if (cache_hash != caches.Hash()) {
    return Status::InvalidArgument(
        m.At("cache_hash") + ": does not match the cache spec it came with (" +
        caches.CanonicalText() +
        "): the peer runs another kvferry release, whose hash text differs (kvferry-cache-v3 and "
        "KV cache groups are of 2026-12), or the message is corrupt; upgrade both instances "
        "together");
  }
  std::vector<std::string> features;
  if (m.Find("features") != nullptr) {
    KVFERRY_ASSIGN_OR_RETURN(features, m.StrList("features", kMaxFeatures, kMaxIdBytes));
  }
  return Message{AgentMetadata{std::move(agent), std::move(endpoint), std::move(transports),
                               std::move(caches), cache_hash, std::move(features)}};
}

// A transfer id: 1 to kMaxIdBytes bytes (docs/protocol.md).
Result<std::string> TransferId(const MapView& m) {
  KVFERRY_ASSIGN_OR_RETURN(std::string id, m.Str("transfer_id", kMaxIdBytes));
  if (id.empty()) {
    return Status::InvalidArgument(m.At("transfer_id") + ": expected 1 to " +
                                   std::to_string(kMaxIdBytes) + " bytes, found an empty id");
  }
  return id;
}

Result<Message> DecodeSubscribe(const MapView& m) {
  Subscribe s;
  KVFERRY_ASSIGN_OR_RETURN(s.from, DecodePeer(m, "from"));
  KVFERRY_ASSIGN_OR_RETURN(s.transfer_id, TransferId(m));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t tp_size, m.Uint("tp_size", kMaxTpSize));
  if (tp_size == 0 || s.from.tp_rank >= tp_size) {
    return Status::InvalidArgument(m.At("tp_size") + ": expected from.tp_rank " +
                                   std::to_string(s.from.tp_rank) + " < tp_size, found " +
                                   std::to_string(tp_size));
  }
  s.tp_size = static_cast<std::uint32_t>(tp_size);
  KVFERRY_ASSIGN_OR_RETURN(s.endpoint, m.Str("endpoint", kMaxTextBytes));
  if (Status e = CheckPushEndpoint(s.endpoint); !e.ok()) {
    return Status::InvalidArgument(m.At("endpoint") + ": " + std::string(e.message()));
  }
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t wait_ms, m.Uint("wait_ms", kMaxU32));
  s.wait_ms = static_cast<std::uint32_t>(wait_ms);
  if (m.Find("groups") != nullptr) {
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t groups, m.Uint("groups", kMaxCacheGroups));
    if (groups == 0) {
      return Status::InvalidArgument(m.At("groups") + ": expected 1 to " +
                                     std::to_string(kMaxCacheGroups) + " KV cache groups, found 0");
    }
    s.groups = static_cast<std::uint32_t>(groups);
  }
  return Message{std::move(s)};
}

// Progress::group_layers_cur and group_block_ids: both or neither, one entry each per group
// after the first, block ids non-negative or kNoBlock.
Status DecodeProgressGroups(const MapView& m, Progress& p) {
  const msgpack::object* layers = m.Find("group_layers_cur");
  const msgpack::object* ids = m.Find("group_block_ids");
  if (layers == nullptr && ids == nullptr) return Status::Ok();
  constexpr auto kMaxMore = static_cast<std::uint32_t>(kMaxCacheGroups - 1);
  if (layers == nullptr || ids == nullptr || layers->type != msgpack::type::ARRAY ||
      ids->type != msgpack::type::ARRAY || layers->via.array.size == 0 ||
      layers->via.array.size > kMaxMore || ids->via.array.size != layers->via.array.size) {
    return Status::InvalidArgument(
        m.path() + ": expected group_layers_cur and group_block_ids together, arrays of 1 to " +
        std::to_string(kMaxMore) + " entries each (one per KV cache group after the first)");
  }
  for (std::uint32_t g = 0; g < layers->via.array.size; ++g) {
    const msgpack::object& n = layers->via.array.ptr[g];
    const std::string at = m.At("group_layers_cur") + "[" + std::to_string(g) + "]";
    if (n.type != msgpack::type::POSITIVE_INTEGER || n.via.u64 > kMaxLayers) {
      return Status::InvalidArgument(at + ": expected a layer count of at most " +
                                     std::to_string(kMaxLayers) + ", found " + ObjectTypeName(n));
    }
    p.group_layers_cur.push_back(static_cast<std::uint32_t>(n.via.u64));
    KVFERRY_ASSIGN_OR_RETURN(
        std::vector<std::int64_t> group,
        BlockIdsOf(ids->via.array.ptr[g], m.At("group_block_ids") + "[" + std::to_string(g) + "]",
                   kMaxProgressBlocks));
    p.group_block_ids.push_back(std::move(group));
  }
  return Status::Ok();
}

Result<Message> DecodeProgress(const MapView& m) {
  Progress p;
  KVFERRY_ASSIGN_OR_RETURN(p.from, DecodePeer(m, "from"));
  KVFERRY_ASSIGN_OR_RETURN(p.transfer_id, TransferId(m));
  // Every uint64 (docs/protocol.md): a sender's sequence never wraps in practice.
  KVFERRY_ASSIGN_OR_RETURN(p.seq, m.Uint("seq", std::numeric_limits<std::uint64_t>::max()));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t state, m.Uint("state", 2));
  p.state = static_cast<Progress::State>(state);
  KVFERRY_ASSIGN_OR_RETURN(p.reason, m.Str("reason", kMaxTextBytes));
  // Token counts are bounded by what a prompt of kMaxProgressBlocks blocks of any size could be;
  // the reader checks them against its own cache.
  KVFERRY_ASSIGN_OR_RETURN(p.prompt_tokens, m.Uint("prompt_tokens", kMaxI64));
  KVFERRY_ASSIGN_OR_RETURN(p.tokens_all, m.Uint("tokens_all", kMaxI64));
  KVFERRY_ASSIGN_OR_RETURN(p.tokens_cur, m.Uint("tokens_cur", kMaxI64));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t layers_cur, m.Uint("layers_cur", kMaxLayers));
  p.layers_cur = static_cast<std::uint32_t>(layers_cur);
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* block_ids, m.Require("block_ids"));
  KVFERRY_ASSIGN_OR_RETURN(p.block_ids,
                           BlockIdsOf(*block_ids, m.At("block_ids"), kMaxProgressBlocks));
  KVFERRY_RETURN_IF_ERROR(DecodeProgressGroups(m, p));
  if (p.tokens_all > p.tokens_cur || (p.prompt_tokens > 0 && p.tokens_cur > p.prompt_tokens)) {
    return Status::InvalidArgument(
        m.path() + ": expected tokens_all <= tokens_cur <= prompt_tokens, found " +
        std::to_string(p.tokens_all) + ", " + std::to_string(p.tokens_cur) + ", " +
        std::to_string(p.prompt_tokens));
  }
  return Message{std::move(p)};
}

Result<Message> DecodeBody(const MapView& m, std::string_view type) {
  if (type == "metadata_request") {
    KVFERRY_ASSIGN_OR_RETURN(PeerRef from, DecodePeer(m, "from"));
    return Message{MetadataRequest{std::move(from)}};
  }
  if (type == "agent_metadata") return DecodeAgentMetadata(m);
  if (type == "finished" || type == "abort" || type == "lease") {
    KVFERRY_ASSIGN_OR_RETURN(PeerRef from, DecodePeer(m, "from"));
    KVFERRY_ASSIGN_OR_RETURN(std::vector<std::string> ids,
                             m.StrList("request_ids", kMaxRequestIds, kMaxIdBytes));
    if (type == "finished") {
      KVFERRY_ASSIGN_OR_RETURN(std::uint64_t tp_size, m.Uint("tp_size", kMaxTpSize));
      if (tp_size == 0 || from.tp_rank >= tp_size) {
        return Status::InvalidArgument(m.At("tp_size") + ": expected from.tp_rank " +
                                       std::to_string(from.tp_rank) + " < tp_size, found " +
                                       std::to_string(tp_size));
      }
      std::uint64_t pp_readers = 1;
      if (m.Find("pp_readers") != nullptr) {
        KVFERRY_ASSIGN_OR_RETURN(pp_readers, m.Uint("pp_readers", kMaxTpSize));
        if (pp_readers == 0) {
          return Status::InvalidArgument(m.At("pp_readers") +
                                         ": expected the stages that notify each rank, at least 1");
        }
      }
      return Message{FinishedNotice{std::move(from), std::move(ids),
                                    static_cast<std::uint32_t>(tp_size),
                                    static_cast<std::uint32_t>(pp_readers)}};
    }
    if (type == "abort") {
      KVFERRY_ASSIGN_OR_RETURN(std::string reason, m.Str("reason", kMaxTextBytes));
      return Message{AbortNotice{std::move(from), std::move(ids), std::move(reason)}};
    }
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t lease_ms, m.Uint("lease_ms", kMaxU32));
    return Message{
        LeaseRenewal{std::move(from), std::move(ids), static_cast<std::uint32_t>(lease_ms)}};
  }
  if (type == "subscribe") return DecodeSubscribe(m);
  if (type == "progress") return DecodeProgress(m);
  if (type == "ack") {
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t count, m.Uint("count", kMaxU32));
    return Message{Ack{static_cast<std::uint32_t>(count)}};
  }
  if (type == "error") {
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t code, m.Uint("code", 255));
    if (code == 0) {
      return Status::InvalidArgument(m.At("code") + ": an error reply cannot carry code 0 (OK)");
    }
    KVFERRY_ASSIGN_OR_RETURN(std::string text, m.Str("message", kMaxTextBytes));
    return Message{ErrorReply{StatusCodeFromWire(code), std::move(text)}};
  }
  return Status::InvalidArgument("message type '" + std::string(type.substr(0, 64)) +
                                 "' is unknown: expected metadata_request, agent_metadata, "
                                 "finished, abort, lease, subscribe, progress, ack or error");
}

}  // namespace

bool AgentMetadata::Offers(std::string_view feature) const {
  return std::find(features.begin(), features.end(), feature) != features.end();
}

const char* MessageTypeName(const Message& message) {
  static constexpr const char* kNames[] = {
      "metadata_request", "agent_metadata", "finished", "abort", "lease", "ack", "error",
      "subscribe",        "progress"};
  return kNames[message.index()];
}

std::vector<std::uint8_t> Encode(const Message& message) {
  msgpack::sbuffer buffer;
  Packer pk(buffer);
  std::visit(EncodeVisitor{pk}, message);
  const auto* p = reinterpret_cast<const std::uint8_t*>(buffer.data());
  return {p, p + buffer.size()};
}

Result<Message> Decode(std::span<const std::uint8_t> bytes) {
  if (bytes.empty()) return Status::InvalidArgument("empty message: expected a msgpack map");
  if (bytes.size() > kMaxMessageBytes) {
    return Status::InvalidArgument("message of " + std::to_string(bytes.size()) +
                                   " bytes exceeds the limit of " +
                                   std::to_string(kMaxMessageBytes));
  }
  KVFERRY_ASSIGN_OR_RETURN(msgpack::object_handle handle,
                           SafeUnpack(bytes, {kMaxRequestIds, 64, kMaxDepth}));
  KVFERRY_ASSIGN_OR_RETURN(MapView m, MapView::Of(handle.get(), "message"));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t version,
                           m.Uint("v", std::numeric_limits<std::uint64_t>::max()));
  if (version != kProtocolVersion) {
    return Status::NotSupported("protocol version " + std::to_string(version) +
                                " is not supported: this build speaks version " +
                                std::to_string(kProtocolVersion) +
                                "; run the same kvferry release on both sides");
  }
  KVFERRY_ASSIGN_OR_RETURN(std::string type, m.Str("t", kMaxIdBytes));
  return DecodeBody(m, type);
}

Status CheckPushEndpoint(const std::string& endpoint) {
  const std::string_view e(endpoint);
  auto refuse = [&](const char* why) {
    return Status::InvalidArgument(
        "expected tcp://HOST:PORT (a host name or address, not a "
        "wildcard, and a port in 1..65535), found '" +
        endpoint.substr(0, 128) + "': " + why);
  };
  constexpr std::string_view kTcp = "tcp://";
  if (e.substr(0, kTcp.size()) != kTcp) return refuse("not tcp://");
  const std::string_view rest = e.substr(kTcp.size());
  const std::size_t colon = rest.rfind(':');
  if (colon == std::string_view::npos || colon == 0) return refuse("no host and port");
  const std::string_view host = rest.substr(0, colon);
  const std::string_view port = rest.substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return refuse("the port is not a number");
  }
  const int number = std::stoi(std::string(port));
  if (number < 1 || number > 65535) return refuse("the port is outside 1..65535");
  const bool bracketed = host.front() == '[' && host.back() == ']' && host.size() > 2;
  const std::string_view name = bracketed ? host.substr(1, host.size() - 2) : host;
  // Names (underscores too, as container names have them), IPv4, and bracketed IPv6 with a zone.
  const bool ok = std::all_of(name.begin(), name.end(), [&](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '.' ||
           c == '-' || c == '_' || (bracketed && (c == ':' || c == '%'));
  });
  if (!ok || name.empty()) return refuse("the host is not a name or an address");
  if (name == "0.0.0.0" || name.find_first_not_of("0:") == std::string_view::npos) {
    return refuse("the host is a wildcard address");
  }
  return Status::Ok();
}

}  // namespace kvferry::wire
