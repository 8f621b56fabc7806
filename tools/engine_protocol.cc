#include "tools/engine_protocol.h"

#include <limits>

namespace kvferry::cli {
namespace {

using Json = nlohmann::json;

// What was found, for error messages: the JSON type, and short scalars themselves.
std::string Found(const Json& v) {
  if (v.is_string() || v.is_number() || v.is_boolean()) {
    std::string text = DumpJson(v);
    if (text.size() > 64) text = text.substr(0, 64) + "...";
    return std::string(v.type_name()) + " " + text;
  }
  return v.type_name();
}

Status Wrong(std::string_view field, std::string_view expected, const Json& found) {
  return Status::InvalidArgument(std::string(field) + ": expected " + std::string(expected) +
                                 ", found " + Found(found));
}

// The member `key` of object `j`, or nullptr if it is absent (or null, when `null_is_absent`).
const Json* Member(const Json& j, const char* key, bool null_is_absent) {
  auto it = j.find(key);
  if (it == j.end() || (null_is_absent && it->is_null())) return nullptr;
  return &*it;
}

// An integer in [lo, hi], without throwing for any JSON value.
Result<std::int64_t> Integer(const Json& v, std::string_view field, std::int64_t lo,
                             std::int64_t hi) {
  const std::string expected = "an integer in " + std::to_string(lo) + ".." + std::to_string(hi);
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    // nlohmann stores every non-negative integer literal as unsigned: check both bounds here.
    if (u > static_cast<std::uint64_t>(hi) || static_cast<std::int64_t>(u) < lo) {
      return Wrong(field, expected, v);
    }
    return static_cast<std::int64_t>(u);
  }
  if (!v.is_number_integer()) return Wrong(field, expected, v);
  const auto i = v.get<std::int64_t>();
  if (i < lo || i > hi) return Wrong(field, expected, v);
  return i;
}

Result<std::string> Text(const Json& v, std::string_view field) {
  const std::string expected =
      "a non-empty string of at most " + std::to_string(kMaxControlTextBytes) + " bytes";
  if (!v.is_string()) return Wrong(field, expected, v);
  const std::string& s = v.get_ref<const std::string&>();
  if (s.empty()) return Wrong(field, expected, v);
  if (s.size() > kMaxControlTextBytes) {
    return Status::InvalidArgument(std::string(field) + ": expected " + expected + ", found " +
                                   std::to_string(s.size()) + " bytes");
  }
  return s;
}

Result<bool> Boolean(const Json& v, std::string_view field) {
  if (!v.is_boolean()) return Wrong(field, "a boolean (true or false)", v);
  return v.get<bool>();
}

std::string Field(std::string_view where, std::string_view name) {
  return std::string(where) + "." + std::string(name);
}

Result<std::vector<std::int32_t>> Prompt(const Json& v, std::size_t max_tokens) {
  const std::string expected = "a non-empty array of at most " + std::to_string(max_tokens) +
                               " token ids (integers in 0.." +
                               std::to_string(std::numeric_limits<std::int32_t>::max()) + ")";
  if (!v.is_array() || v.empty()) return Wrong("prompt", expected, v);
  if (v.size() > max_tokens) {
    return Status::InvalidArgument("prompt: expected " + expected + ", found " +
                                   std::to_string(v.size()) +
                                   " tokens, more than this instance's cache can ever hold");
  }
  std::vector<std::int32_t> out;
  out.reserve(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    KVFERRY_ASSIGN_OR_RETURN(std::int64_t t, Integer(v[i], "prompt[" + std::to_string(i) + "]", 0,
                                                     std::numeric_limits<std::int32_t>::max()));
    out.push_back(static_cast<std::int32_t>(t));
  }
  return out;
}

ControlOp OpFromName(const std::string& name) {
  if (name == "generate") return ControlOp::kGenerate;
  if (name == "abort") return ControlOp::kAbort;
  if (name == "stats") return ControlOp::kStats;
  if (name == "shutdown") return ControlOp::kShutdown;
  if (name == "drain") return ControlOp::kDrain;
  return ControlOp::kUnknown;
}

Status ParseInto(const Json& j, std::size_t max_prompt_tokens, ControlRequest& r) {
  if (!j.is_object()) return Wrong("message", "a JSON object", j);
  const Json* op = Member(j, "op", false);
  constexpr std::string_view kOps =
      "one of \"generate\", \"abort\", \"stats\", \"shutdown\", \"drain\"";
  if (op == nullptr) return Status::InvalidArgument("op: missing; expected " + std::string(kOps));
  if (!op->is_string()) return Wrong("op", kOps, *op);
  r.op = OpFromName(op->get_ref<const std::string&>());
  if (r.op == ControlOp::kUnknown) return Wrong("op", kOps, *op);
  if (r.op == ControlOp::kStats || r.op == ControlOp::kShutdown || r.op == ControlOp::kDrain) {
    return Status::Ok();
  }

  const Json* id = Member(j, "request_id", false);
  if (id == nullptr) {
    return Status::InvalidArgument("request_id: missing; expected a non-empty string of at most " +
                                   std::to_string(kMaxControlTextBytes) + " bytes");
  }
  KVFERRY_ASSIGN_OR_RETURN(r.request_id, Text(*id, "request_id"));
  if (r.op == ControlOp::kAbort) return Status::Ok();

  const Json* prompt = Member(j, "prompt", false);
  if (prompt == nullptr) return Status::InvalidArgument("prompt: missing; expected an array");
  KVFERRY_ASSIGN_OR_RETURN(r.prompt, Prompt(*prompt, max_prompt_tokens));
  if (const Json* params = Member(j, "kv_transfer_params", true)) {
    KVFERRY_ASSIGN_OR_RETURN(r.params, ParamsFromJson(*params, "kv_transfer_params"));
  }
  return Status::Ok();
}

// A list of block ids: each one a block, or kNoBlock (-1) where the instance holds none.
Result<std::vector<std::int64_t>> BlockIds(const Json& v, const std::string& field) {
  if (!v.is_array() || v.size() > kMaxRemoteBlockIds) {
    return Wrong(
        field,
        "an array of at most " + std::to_string(kMaxRemoteBlockIds) + " block ids (-1 for none)",
        v);
  }
  std::vector<std::int64_t> ids;
  ids.reserve(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    KVFERRY_ASSIGN_OR_RETURN(std::int64_t id,
                             Integer(v[i], field + "[" + std::to_string(i) + "]", kNoBlock,
                                     std::numeric_limits<std::int64_t>::max()));
    ids.push_back(id);
  }
  return ids;
}

}  // namespace

std::string DumpJson(const Json& j) {
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

Json ParamsToJson(const KvTransferParams& p) {
  Json j = Json::object();
  j["do_remote_prefill"] = p.do_remote_prefill;
  j["do_remote_decode"] = p.do_remote_decode;
  if (p.remote_block_ids) j["remote_block_ids"] = *p.remote_block_ids;
  if (p.remote_group_block_ids) j["remote_group_block_ids"] = *p.remote_group_block_ids;
  if (p.remote_engine_id) j["remote_engine_id"] = *p.remote_engine_id;
  if (p.remote_host) j["remote_host"] = *p.remote_host;
  if (p.remote_port) j["remote_port"] = *p.remote_port;
  if (p.remote_tp_size) j["remote_tp_size"] = *p.remote_tp_size;
  if (p.remote_pp_size) j["remote_pp_size"] = *p.remote_pp_size;
  if (p.remote_request_id) j["remote_request_id"] = *p.remote_request_id;
  if (p.transfer_id) j["transfer_id"] = *p.transfer_id;
  if (p.remote_rank_hosts) j["remote_rank_hosts"] = *p.remote_rank_hosts;
  return j;
}

Result<KvTransferParams> ParamsFromJson(const Json& j, std::string_view where) {
  KvTransferParams p;
  if (j.is_null()) return p;
  if (!j.is_object()) return Wrong(where, "a JSON object", j);
  if (const Json* v = Member(j, "do_remote_prefill", true)) {
    KVFERRY_ASSIGN_OR_RETURN(p.do_remote_prefill, Boolean(*v, Field(where, "do_remote_prefill")));
  }
  if (const Json* v = Member(j, "do_remote_decode", true)) {
    KVFERRY_ASSIGN_OR_RETURN(p.do_remote_decode, Boolean(*v, Field(where, "do_remote_decode")));
  }
  if (const Json* v = Member(j, "remote_block_ids", true)) {
    KVFERRY_ASSIGN_OR_RETURN(p.remote_block_ids, BlockIds(*v, Field(where, "remote_block_ids")));
  }
  if (const Json* v = Member(j, "remote_group_block_ids", true)) {
    const std::string field = Field(where, "remote_group_block_ids");
    if (!v->is_array() || v->size() >= static_cast<std::size_t>(kMaxCacheGroups)) {
      return Wrong(field,
                   "an array of at most " + std::to_string(kMaxCacheGroups - 1) +
                       " block id lists (KV cache groups 1, 2, ...)",
                   *v);
    }
    std::vector<std::vector<std::int64_t>> groups;
    for (std::size_t g = 0; g < v->size(); ++g) {
      KVFERRY_ASSIGN_OR_RETURN(std::vector<std::int64_t> ids,
                               BlockIds((*v)[g], field + "[" + std::to_string(g) + "]"));
      groups.push_back(std::move(ids));
    }
    p.remote_group_block_ids = std::move(groups);
  }
  if (const Json* v = Member(j, "remote_engine_id", true)) {
    KVFERRY_ASSIGN_OR_RETURN(p.remote_engine_id, Text(*v, Field(where, "remote_engine_id")));
  }
  if (const Json* v = Member(j, "remote_host", true)) {
    KVFERRY_ASSIGN_OR_RETURN(p.remote_host, Text(*v, Field(where, "remote_host")));
  }
  if (const Json* v = Member(j, "remote_request_id", true)) {
    KVFERRY_ASSIGN_OR_RETURN(p.remote_request_id, Text(*v, Field(where, "remote_request_id")));
  }
  if (const Json* v = Member(j, "transfer_id", true)) {
    KVFERRY_ASSIGN_OR_RETURN(p.transfer_id, Text(*v, Field(where, "transfer_id")));
  }
  if (const Json* v = Member(j, "remote_port", true)) {
    KVFERRY_ASSIGN_OR_RETURN(std::int64_t port, Integer(*v, Field(where, "remote_port"), 1, 65535));
    p.remote_port = static_cast<int>(port);
  }
  if (const Json* v = Member(j, "remote_tp_size", true)) {
    KVFERRY_ASSIGN_OR_RETURN(std::int64_t tp,
                             Integer(*v, Field(where, "remote_tp_size"), 1, kMaxRemoteTpSize));
    p.remote_tp_size = static_cast<int>(tp);
  }
  if (const Json* v = Member(j, "remote_pp_size", true)) {
    KVFERRY_ASSIGN_OR_RETURN(std::int64_t pp,
                             Integer(*v, Field(where, "remote_pp_size"), 1, kMaxRemoteTpSize));
    p.remote_pp_size = static_cast<int>(pp);
  }
  if (const Json* v = Member(j, "remote_rank_hosts", true)) {
    const std::string field = Field(where, "remote_rank_hosts");
    const auto most = static_cast<std::size_t>(kMaxRemoteTpSize) * kMaxRemoteTpSize;
    if (!v->is_array() || v->size() > most) {
      return Wrong(field, "an array of at most " + std::to_string(most) + " hosts", *v);
    }
    std::vector<std::string> hosts;
    for (std::size_t i = 0; i < v->size(); ++i) {
      KVFERRY_ASSIGN_OR_RETURN(std::string h, Text((*v)[i], field + "[" + std::to_string(i) + "]"));
      hosts.push_back(std::move(h));
    }
    p.remote_rank_hosts = std::move(hosts);
  }
  // TP rank q of stage s of the remote instance listens on remote_port + s * remote_tp_size + q.
  const int stages = p.remote_pp_size.value_or(1);
  if (p.remote_port && p.remote_tp_size &&
      *p.remote_port + stages * *p.remote_tp_size - 1 > 65535) {
    return Status::InvalidArgument(
        Field(where, "remote_port") + " + " + Field(where, "remote_pp_size") + " * " +
        Field(where, "remote_tp_size") +
        " - 1: expected at most 65535 (TP rank q of stage s listens on remote_port + s * "
        "remote_tp_size + q), found " +
        std::to_string(*p.remote_port + stages * *p.remote_tp_size - 1));
  }
  return p;
}

ParsedControlRequest ParseControlRequest(std::span<const std::uint8_t> body,
                                         std::size_t max_prompt_tokens) {
  ParsedControlRequest out;
  const Json j = Json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    out.status = Status::InvalidArgument(
        "message: expected a JSON object, found text that is "
        "not JSON (or not UTF-8)");
    return out;
  }
  out.status = ParseInto(j, max_prompt_tokens, out.request);
  return out;
}

std::string NonceHex(const sidechannel::AuthNonce& nonce) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (std::uint8_t b : nonce) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

std::optional<sidechannel::AuthNonce> NonceFromHex(std::string_view hex) {
  sidechannel::AuthNonce nonce{};
  if (hex.size() != 2 * nonce.size()) return std::nullopt;
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (std::size_t i = 0; i < nonce.size(); ++i) {
    const int hi = digit(hex[2 * i]);
    const int lo = digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    nonce[i] = static_cast<std::uint8_t>(hi * 16 + lo);
  }
  return nonce;
}

SignedMessage SignControlReply(std::string_view secret, const sidechannel::AuthNonce& request_nonce,
                               Json reply) {
  reply["request_nonce"] = NonceHex(request_nonce);
  const std::string text = DumpJson(reply);
  SignedMessage m;
  m.body.assign(text.begin(), text.end());
  m.header = sidechannel::SignMessage(secret, sidechannel::AuthKind::kReply, m.body, request_nonce,
                                      nullptr);
  return m;
}

SignedMessage SignControlRequest(std::string_view secret, const Json& request,
                                 sidechannel::AuthNonce* nonce) {
  const std::string text = DumpJson(request);
  SignedMessage m;
  m.body.assign(text.begin(), text.end());
  m.header = sidechannel::SignMessage(secret, sidechannel::AuthKind::kRequest, m.body,
                                      sidechannel::AuthNonce{}, nonce);
  return m;
}

}  // namespace kvferry::cli
