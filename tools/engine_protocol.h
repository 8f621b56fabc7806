// The control protocol between the proxy (kvferry demo, bench e2e) and kvferry serve instances:
// JSON objects over a ZeroMQ ROUTER socket, one request and one reply per generate call. This is
// the tool's own protocol, not part of the library.
#pragma once

#include <nlohmann/json.hpp>

#include "engine/engine.h"

namespace kvferry::cli {

inline nlohmann::json ParamsToJson(const KvTransferParams& p) {
  nlohmann::json j;
  j["do_remote_prefill"] = p.do_remote_prefill;
  j["do_remote_decode"] = p.do_remote_decode;
  if (p.remote_block_ids) j["remote_block_ids"] = *p.remote_block_ids;
  if (p.remote_engine_id) j["remote_engine_id"] = *p.remote_engine_id;
  if (p.remote_host) j["remote_host"] = *p.remote_host;
  if (p.remote_port) j["remote_port"] = *p.remote_port;
  if (p.remote_tp_size) j["remote_tp_size"] = *p.remote_tp_size;
  if (p.remote_request_id) j["remote_request_id"] = *p.remote_request_id;
  return j;
}

inline KvTransferParams ParamsFromJson(const nlohmann::json& j) {
  KvTransferParams p;
  if (!j.is_object()) return p;
  p.do_remote_prefill = j.value("do_remote_prefill", false);
  p.do_remote_decode = j.value("do_remote_decode", false);
  if (j.contains("remote_block_ids") && j["remote_block_ids"].is_array()) {
    std::vector<std::int64_t> ids;
    for (const auto& v : j["remote_block_ids"]) {
      if (v.is_number_integer()) ids.push_back(v.get<std::int64_t>());
    }
    p.remote_block_ids = ids;
  }
  if (j.contains("remote_engine_id") && j["remote_engine_id"].is_string()) {
    p.remote_engine_id = j["remote_engine_id"].get<std::string>();
  }
  if (j.contains("remote_host") && j["remote_host"].is_string()) {
    p.remote_host = j["remote_host"].get<std::string>();
  }
  if (j.contains("remote_port") && j["remote_port"].is_number_integer()) {
    p.remote_port = j["remote_port"].get<int>();
  }
  if (j.contains("remote_tp_size") && j["remote_tp_size"].is_number_integer()) {
    p.remote_tp_size = j["remote_tp_size"].get<int>();
  }
  if (j.contains("remote_request_id") && j["remote_request_id"].is_string()) {
    p.remote_request_id = j["remote_request_id"].get<std::string>();
  }
  return p;
}

}  // namespace kvferry::cli
