// The side-channel messages between prefill and decode workers, and their msgpack form.
//
// Format (protocol version 1, specified in docs/protocol.md): every message is one msgpack map
// with string keys. "v" holds the protocol version, "t" the message type; the other keys are the
// type's fields. Unknown keys are ignored so that later minor additions stay readable; a missing
// or mistyped known key, an unknown type or version, or bytes after the map are errors.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kvferry/cache_spec.h"
#include "kvferry/status.h"

namespace kvferry::wire {

/// The protocol version this build speaks. Peers with another version are refused.
inline constexpr std::uint32_t kProtocolVersion = 1;

/// Bounds every decoder enforces; inputs beyond them are InvalidArgument or ResourceExhausted.
inline constexpr std::size_t kMaxMessageBytes = 8u << 20;
inline constexpr std::size_t kMaxRequestIds = 65536;
inline constexpr std::size_t kMaxIdBytes = 1024;    ///< request ids, engine ids, names
inline constexpr std::size_t kMaxTextBytes = 4096;  ///< error and abort reasons, endpoints
inline constexpr std::size_t kMaxTransports = 16;
inline constexpr std::size_t kMaxDescriptorBytes = 64u << 10;
inline constexpr std::size_t kMaxLayers = 4096;
inline constexpr std::size_t kMaxDepth = 6;
inline constexpr std::size_t kMaxFeatures = 16;
/// Block ids one progress message may carry: a prompt of up to 1,048,576 tokens at 16 per block.
inline constexpr std::size_t kMaxProgressBlocks = 65536;

/// Features a worker offers in its AgentMetadata (docs/protocol.md, "Features"). A peer uses a
/// feature's messages only with workers that offer it.
inline constexpr const char* kFeatureLayerwise = "layerwise";
/// The receiver counts finished notices from every stage of a decode instance whose pipeline has
/// another size (FinishedNotice::pp_readers, PeerRef::pp_rank): it can be read by layer ranges.
inline constexpr const char* kFeaturePpReaders = "pp_readers";
/// Layer-wise transfer of a cache of several KV cache groups (hybrid models): Subscribe::groups,
/// Progress::group_layers_cur and group_block_ids. A reader of such a cache subscribes only at
/// workers that offer it; a worker with such a cache refuses a subscription that reads fewer
/// groups (an older reader, which would read group 0 alone).
inline constexpr const char* kFeatureLayerwiseGroups = "layerwise_groups";

/// Who sent a message: an engine instance and the worker's place in it.
struct PeerRef {
  std::string engine_id;
  std::uint32_t dp_rank = 0;
  std::uint32_t tp_rank = 0;
  /// The sender's pipeline stage; sent only when not 0 (a reader of each stage is its own reader).
  std::uint32_t pp_rank = 0;

  friend bool operator==(const PeerRef&, const PeerRef&) = default;
};

/// A worker's identity from the rank table plus its parallel placement.
struct AgentIdentity {
  PeerRef peer;
  std::uint32_t tp_size = 1;
  std::string server_id;
  std::string device_id;
  std::string device_ip;
  std::uint64_t cluster_id = 0;
  std::optional<std::string> super_pod_id;
  std::optional<std::string> super_device_id;

  friend bool operator==(const AgentIdentity&, const AgentIdentity&) = default;
};

/// How to reach one data-plane backend of a worker. The bytes are the backend's own descriptor;
/// the wire layer carries them without looking inside.
struct TransportDescriptor {
  std::string kind;  ///< "shm", "tcp", ...
  std::vector<std::uint8_t> blob;

  friend bool operator==(const TransportDescriptor&, const TransportDescriptor&) = default;
};

/// Type "metadata_request": a decode worker asks for a prefill worker's AgentMetadata.
struct MetadataRequest {
  PeerRef from;

  friend bool operator==(const MetadataRequest&, const MetadataRequest&) = default;
};

/// Type "agent_metadata": everything a peer needs before bytes move. The decoder re-validates the
/// cache spec and checks that cache_hash matches it.
struct AgentMetadata {
  AgentIdentity agent;
  std::string listener_endpoint;  ///< e.g. "tcp://10.0.0.1:30000"
  std::vector<TransportDescriptor> transports;
  /// The sender's KV cache groups (one for a uniform model); cache_hash is their Hash().
  CacheGroups caches;
  CompatibilityHash cache_hash{};
  /// What the sender speaks beyond the messages every version-1 peer does (kFeatureLayerwise).
  /// Optional on the wire: absent, as from an older peer, is none.
  std::vector<std::string> features;

  bool Offers(std::string_view feature) const;
  friend bool operator==(const AgentMetadata&, const AgentMetadata&) = default;
};

/// Type "finished": the sender has completed its reads of these requests (batched).
struct FinishedNotice {
  PeerRef from;
  std::vector<std::string> request_ids;
  /// The sender's TP size: with the receiver's own, it decides how many readers to wait for.
  std::uint32_t tp_size = 1;
  /// How many pipeline stages of the sender's instance notify each prefill rank: 1 where each
  /// decode stage reads the prefill stage of its own index (equal PP sizes), the decode's PP size
  /// where every decode stage tells every prefill stage (unequal sizes, read by layer ranges).
  /// The receiver waits for this many times the readers the TP sizes give. Sent only when not 1.
  std::uint32_t pp_readers = 1;

  friend bool operator==(const FinishedNotice&, const FinishedNotice&) = default;
};

/// Type "abort": the sender will not read these requests; free their blocks now.
struct AbortNotice {
  PeerRef from;
  std::vector<std::string> request_ids;
  std::string reason;

  friend bool operator==(const AbortNotice&, const AbortNotice&) = default;
};

/// Type "lease": the sender still means to read these requests; extend their holds.
struct LeaseRenewal {
  PeerRef from;
  std::vector<std::string> request_ids;
  std::uint32_t lease_ms = 0;

  friend bool operator==(const LeaseRenewal&, const LeaseRenewal&) = default;
};

/// Type "ack": a request was accepted; `count` is how many of its items took effect.
struct Ack {
  std::uint32_t count = 0;

  friend bool operator==(const Ack&, const Ack&) = default;
};

/// Type "error": a request was refused. `code` is a StatusCode wire value.
struct ErrorReply {
  StatusCode code = StatusCode::kInternal;
  std::string message;

  friend bool operator==(const ErrorReply&, const ErrorReply&) = default;
};

/// Type "subscribe" (feature "layerwise"): a decode worker will read transfer `transfer_id` from
/// the receiver as its KV is written, and asks to be told of its progress at `endpoint`. The
/// reply is a Progress with what has been written so far (state kWaiting when the receiver has
/// not started the request yet: it then keeps the subscription for up to `wait_ms`).
struct Subscribe {
  PeerRef from;
  std::string transfer_id;
  /// The reader's TP size; from.tp_rank < tp_size.
  std::uint32_t tp_size = 1;
  /// The reader's listener, where progress is pushed ("tcp://host:port").
  std::string endpoint;
  std::uint32_t wait_ms = 0;
  /// The KV cache groups the reader reads (feature "layerwise_groups"); sent only when not 1.
  std::uint32_t groups = 1;

  friend bool operator==(const Subscribe&, const Subscribe&) = default;
};

/// Type "progress" (feature "layerwise"): how far prefill rank `from` has written the KV of
/// transfer `transfer_id`, pushed to each subscriber as layers are written and sent as the reply
/// to a subscribe. Cumulative: each one supersedes every earlier one (a receiver ignores one
/// whose `seq` is not above the last it took), so a lost one is healed by the next.
struct Progress {
  enum class State : std::uint8_t {
    kWaiting = 0,  ///< the receiver has not started the request yet
    kRunning = 1,  ///< written as the token and layer fields say
    kFailed = 2,   ///< ended without its KV (aborted, preempted): `reason` says why
  };
  PeerRef from;
  std::string transfer_id;
  std::uint64_t seq = 0;
  State state = State::kWaiting;
  std::string reason;
  /// The request's prompt length; 0 while waiting.
  std::uint64_t prompt_tokens = 0;
  /// Every layer holds the KV of prompt tokens [0, tokens_all); layers [0, layers_cur) also
  /// hold [tokens_all, tokens_cur). tokens_all <= tokens_cur <= prompt_tokens. The transfer is
  /// complete when tokens_all == prompt_tokens > 0. With several KV cache groups, layers_cur is
  /// group 0's and group_layers_cur[g - 1] group g's (layers [0, n) of group g hold
  /// [tokens_all, tokens_cur)), and a state group's layer holds the state as of its token count.
  std::uint64_t tokens_all = 0;
  std::uint64_t tokens_cur = 0;
  std::uint32_t layers_cur = 0;
  /// The request's blocks on the sender in prompt order: at least the ones holding tokens
  /// [0, tokens_cur). Group 0's; group_block_ids[g - 1] are group g's, kNoBlock (-1) where the
  /// sender holds none (a sliding window's freed blocks).
  std::vector<std::int64_t> block_ids;
  /// Feature "layerwise_groups": groups 1, 2, ... of a cache of several KV cache groups; both
  /// empty for one group, else one entry per group after the first.
  std::vector<std::uint32_t> group_layers_cur;
  std::vector<std::vector<std::int64_t>> group_block_ids;

  /// The KV cache groups this progress describes.
  int groups() const { return 1 + static_cast<int>(group_layers_cur.size()); }
  /// Group g's layers_cur and block ids.
  std::uint32_t LayersCur(int g) const {
    return g == 0 ? layers_cur : group_layers_cur[static_cast<std::size_t>(g - 1)];
  }
  const std::vector<std::int64_t>& BlockIds(int g) const {
    return g == 0 ? block_ids : group_block_ids[static_cast<std::size_t>(g - 1)];
  }

  bool complete() const { return prompt_tokens > 0 && tokens_all == prompt_tokens; }
  friend bool operator==(const Progress&, const Progress&) = default;
};

/// Where a subscriber may have its progress pushed (Subscribe::endpoint): "tcp://HOST:PORT",
/// HOST a name, an IPv4 address or a bracketed IPv6 one (a zone allowed), never a wildcard,
/// PORT 1..65535. InvalidArgument saying what is wrong otherwise.
Status CheckPushEndpoint(const std::string& endpoint);

using Message = std::variant<MetadataRequest, AgentMetadata, FinishedNotice, AbortNotice,
                             LeaseRenewal, Ack, ErrorReply, Subscribe, Progress>;

/// The type name written in "t" for a message.
const char* MessageTypeName(const Message& message);

/// Encodes a message. Never fails for values within the bounds above; values beyond them are
/// encoded anyway and refused by the receiver's decoder.
std::vector<std::uint8_t> Encode(const Message& message);

/// Decodes exactly one message that fills `bytes`. Never trusts the input: wrong types, missing
/// fields, oversized lists or strings, unknown types or versions and trailing bytes are
/// InvalidArgument; memory use is bounded by a small multiple of the input size. Thread-safe.
Result<Message> Decode(std::span<const std::uint8_t> bytes);

}  // namespace kvferry::wire
