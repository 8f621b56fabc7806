// The control protocol between the proxy (kvferry demo, bench e2e) and kvferry serve instances
// (docs/control.md): over a ZeroMQ ROUTER socket, each message is [authentication header][JSON
// object], signed with the instance's secret in the side channel's scheme (sidechannel/auth.h);
// replies are signed and bound to the nonce of the request they answer. This is the tool's own
// protocol, not part of the library.
//
// Parsing never throws and never trusts its input: every field is checked for its type and
// bounds, and a refusal names the field, what was expected and what was found.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/engine.h"
#include "sidechannel/auth.h"

namespace kvferry::cli {

/// Largest control frame (header or body) an instance accepts; ZeroMQ drops the connection of a
/// peer that sends a larger one.
inline constexpr std::size_t kMaxControlFrameBytes = 16u << 20;
/// Longest request id, engine id, host or remote request id, in bytes.
inline constexpr std::size_t kMaxControlTextBytes = 1024;
inline constexpr std::size_t kMaxRemoteBlockIds = 1u << 20;
inline constexpr std::int64_t kMaxRemoteTpSize = 1024;
/// Allowed distance between a message's timestamp and the receiver's clock; an accepted
/// request's nonce is remembered against replays for twice this (sidechannel::ReplayGuard).
inline constexpr std::chrono::milliseconds kControlMaxClockSkew{30000};

enum class ControlOp : std::uint8_t { kUnknown, kGenerate, kAbort, kStats, kShutdown, kDrain };

/// One control request as parsed. Fields that parsed before a refusal are kept, so the error
/// reply can name the request it refuses.
struct ControlRequest {
  ControlOp op = ControlOp::kUnknown;
  std::optional<std::string> request_id;  ///< generate and abort
  std::vector<std::int32_t> prompt;       ///< generate
  KvTransferParams params;                ///< generate
};

struct ParsedControlRequest {
  ControlRequest request;
  Status status;  ///< OK, or InvalidArgument naming the field
};

/// Parses one request body. `max_prompt_tokens` is what the instance's cache can ever hold: a
/// longer prompt could never be scheduled and would block every request behind it.
ParsedControlRequest ParseControlRequest(std::span<const std::uint8_t> body,
                                         std::size_t max_prompt_tokens);

/// kv_transfer_params as JSON (absent optionals are left out).
nlohmann::json ParamsToJson(const KvTransferParams& p);
/// Strict: every known field must have its documented type and range (null counts as absent);
/// unknown fields are ignored. `where` prefixes the field names in errors.
Result<KvTransferParams> ParamsFromJson(const nlohmann::json& j, std::string_view where);

/// JSON text that never throws: invalid UTF-8 is replaced (U+FFFD).
std::string DumpJson(const nlohmann::json& j);

std::string NonceHex(const sidechannel::AuthNonce& nonce);
std::optional<sidechannel::AuthNonce> NonceFromHex(std::string_view hex);

/// A signed reply: [header][body], where the body is `reply` with "request_nonce" (the hex nonce
/// of the request it answers) added, and the header's MAC binds `request_nonce`.
struct SignedMessage {
  std::vector<std::uint8_t> header;
  std::vector<std::uint8_t> body;
};
SignedMessage SignControlReply(std::string_view secret, const sidechannel::AuthNonce& request_nonce,
                               nlohmann::json reply);
/// A signed request: [header][body]; `*nonce` receives the request's nonce.
SignedMessage SignControlRequest(std::string_view secret, const nlohmann::json& request,
                                 sidechannel::AuthNonce* nonce);

}  // namespace kvferry::cli
