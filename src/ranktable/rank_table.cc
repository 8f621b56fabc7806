#include "kvferry/rank_table.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <utility>

namespace kvferry {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

constexpr std::size_t kMaxFileBytes = 16u << 20;
constexpr std::size_t kMaxEntries = 65536;
constexpr const char* kPrefillList = "prefill_device_list";
constexpr const char* kDecodeList = "decode_device_list";

// Records the first syntax error of a JSON text, with its byte position.
class SyntaxErrorCatcher : public nlohmann::json_sax<Json> {
 public:
  bool null() override { return true; }
  bool boolean(bool /*val*/) override { return true; }
  bool number_integer(number_integer_t /*val*/) override { return true; }
  bool number_unsigned(number_unsigned_t /*val*/) override { return true; }
  bool number_float(number_float_t /*val*/, const string_t& /*s*/) override { return true; }
  bool string(string_t& /*val*/) override { return true; }
  bool binary(binary_t& /*val*/) override { return true; }
  bool start_object(std::size_t /*elements*/) override { return true; }
  bool key(string_t& /*val*/) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t /*elements*/) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t position, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& ex) override {
    message_ = "byte " + std::to_string(position) + ": " + ex.what();
    return false;
  }
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

std::string TypeName(const Json& v) {
  if (v.is_number_unsigned() || v.is_number_integer()) return "an integer";
  if (v.is_number_float()) return "a float";
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "a boolean";
  if (v.is_null()) return "null";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "an unsupported value";
}

std::string Quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s.substr(0, 64)) {
    out += std::isprint(static_cast<unsigned char>(c)) ? c : '?';
  }
  if (s.size() > 64) out += "...";
  return out + "\"";
}

// Error context: "<source>: <list>[<index>].<field>".
class Where {
 public:
  Where(std::string_view source, std::string path) : source_(source), path_(std::move(path)) {}
  Status Error(const std::string& what) const {
    return Status::InvalidArgument(std::string(source_) + ": " + path_ + ": " + what);
  }
  Where Field(std::string_view field) const { return {source_, path_ + "." + std::string(field)}; }

 private:
  std::string_view source_;
  std::string path_;
};

bool ParseU64(std::string_view s, std::uint64_t& out) {
  if (s.empty()) return false;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && ptr == s.data() + s.size();
}

// A field that the generator writes as a string but people write as an integer too.
Result<std::string> StringOrInteger(const Json& obj, const char* name, const Where& where,
                                    bool required) {
  const Where at = where.Field(name);
  auto it = obj.find(name);
  if (it == obj.end()) {
    if (required) return at.Error("missing; expected a string or a non-negative integer");
    return std::string();
  }
  if (it->is_string()) {
    const auto& s = it->get_ref<const std::string&>();
    if (s.empty()) return at.Error("is empty; expected a value");
    return s;
  }
  if (it->is_number_unsigned()) return std::to_string(it->get<std::uint64_t>());
  return at.Error("expected a string or a non-negative integer, found " + TypeName(*it));
}

bool IsIpAddress(const std::string& s) {
  unsigned char buf[sizeof(struct in6_addr)];
  return inet_pton(AF_INET, s.c_str(), buf) == 1 || inet_pton(AF_INET6, s.c_str(), buf) == 1;
}

// server_id is matched against the host's own address; a host name is allowed, but no blanks or
// control characters, which only come from a broken generator.
bool IsSaneHost(const std::string& s) {
  if (s.empty() || s.size() > 253) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == ':' ||
           c == '_';
  });
}

Result<DeviceEntry> ParseEntry(const Json& v, const Where& where) {
  if (!v.is_object()) return where.Error("expected an object, found " + TypeName(v));
  DeviceEntry e;
  {
    const Where at = where.Field("server_id");
    auto it = v.find("server_id");
    if (it == v.end()) return at.Error("missing; expected the host address as a string");
    if (!it->is_string()) return at.Error("expected a string, found " + TypeName(*it));
    e.server_id = it->get<std::string>();
    if (!IsSaneHost(e.server_id)) {
      return at.Error("expected a host address or name, found " + Quote(e.server_id));
    }
  }
  KVFERRY_ASSIGN_OR_RETURN(e.device_id, StringOrInteger(v, "device_id", where, true));
  {
    const Where at = where.Field("device_ip");
    auto it = v.find("device_ip");
    if (it == v.end()) return at.Error("missing; expected an IPv4 or IPv6 address");
    if (!it->is_string()) return at.Error("expected a string, found " + TypeName(*it));
    e.device_ip = it->get<std::string>();
    if (!IsIpAddress(e.device_ip)) {
      return at.Error("expected an IPv4 or IPv6 address, found " + Quote(e.device_ip));
    }
  }
  KVFERRY_ASSIGN_OR_RETURN(std::string cluster, StringOrInteger(v, "cluster_id", where, true));
  if (!ParseU64(cluster, e.cluster_id)) {
    return where.Field("cluster_id")
        .Error("expected a non-negative integer (as a number or a string of digits), found " +
               Quote(cluster));
  }
  KVFERRY_ASSIGN_OR_RETURN(std::string pod, StringOrInteger(v, "super_pod_id", where, false));
  if (!pod.empty()) e.super_pod_id = pod;
  KVFERRY_ASSIGN_OR_RETURN(std::string sdid, StringOrInteger(v, "super_device_id", where, false));
  if (!sdid.empty()) e.super_device_id = sdid;
  return e;
}

Result<std::vector<DeviceEntry>> ParseList(const Json& root, const char* name,
                                           std::string_view source) {
  const Where at(source, name);
  auto it = root.find(name);
  if (it == root.end()) return at.Error("missing; expected an array of device entries");
  if (!it->is_array()) return at.Error("expected an array, found " + TypeName(*it));
  if (it->size() > kMaxEntries) {
    return at.Error("has " + std::to_string(it->size()) + " entries, more than the limit of " +
                    std::to_string(kMaxEntries));
  }
  std::vector<DeviceEntry> out;
  for (std::size_t i = 0; i < it->size(); ++i) {
    KVFERRY_ASSIGN_OR_RETURN(
        DeviceEntry e,
        ParseEntry((*it)[i], Where(source, std::string(name) + "[" + std::to_string(i) + "]")));
    out.push_back(std::move(e));
  }
  return out;
}

// Cross-entry rules: unique cluster ids, no device listed twice.
Status ValidateEntries(const std::vector<DeviceEntry>& prefill,
                       const std::vector<DeviceEntry>& decode, std::string_view source) {
  std::map<std::uint64_t, std::string> clusters;
  std::map<std::pair<std::string, std::string>, std::string> devices;
  for (const auto& [list, name] : {std::pair{&prefill, kPrefillList}, {&decode, kDecodeList}}) {
    for (std::size_t i = 0; i < list->size(); ++i) {
      const DeviceEntry& e = (*list)[i];
      const std::string here = std::string(name) + "[" + std::to_string(i) + "]";
      auto [c, fresh_cluster] = clusters.emplace(e.cluster_id, here);
      if (!fresh_cluster) {
        return Where(source, here + ".cluster_id")
            .Error("cluster id " + std::to_string(e.cluster_id) + " is already used by " +
                   c->second + "; every device needs its own cluster id");
      }
      auto [d, fresh_device] = devices.emplace(std::pair{e.server_id, e.device_id}, here);
      if (!fresh_device) {
        return Where(source, here)
            .Error("device " + Quote(e.device_id) + " of server " + Quote(e.server_id) +
                   " is already listed as " + d->second + "; a device can serve one worker");
      }
    }
  }
  return Status::Ok();
}

}  // namespace

const char* RoleName(Role role) {
  switch (role) {
    case Role::kPrefill:
      return "prefill";
    case Role::kDecode:
      return "decode";
    case Role::kBoth:
      return "both";
  }
  return "unknown";
}

Result<Role> ParseRole(std::string_view name) {
  if (name == "prefill" || name == "kv_producer") return Role::kPrefill;
  if (name == "decode" || name == "kv_consumer") return Role::kDecode;
  if (name == "both" || name == "kv_both") return Role::kBoth;
  return Status::InvalidArgument(
      "unknown role '" + std::string(name) +
      "': expected kv_producer (prefill), kv_consumer (decode) or kv_both (both, by request)");
}

Result<RankTable> RankTable::Parse(std::string_view json_text, std::string_view source) {
  Json root = Json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    SyntaxErrorCatcher catcher;
    Json::sax_parse(json_text, &catcher);
    return Status::InvalidArgument(std::string(source) + ": not valid JSON: " + catcher.message());
  }
  if (!root.is_object()) {
    return Status::InvalidArgument(std::string(source) + ": expected a JSON object, found " +
                                   TypeName(root));
  }
  RankTable table;
  const Where top(source, "(top level)");
  for (const char* name : {"version", "server_count", "status"}) {
    auto it = root.find(name);
    if (it == root.end()) continue;
    std::string value;
    if (it->is_string()) {
      value = it->get<std::string>();
    } else if (it->is_number_unsigned()) {
      value = std::to_string(it->get<std::uint64_t>());
    } else if (it->is_number_float() && std::string(name) == "version") {
      value = it->dump();
    } else {
      return Where(source, name).Error("expected a string, found " + TypeName(*it));
    }
    if (std::string(name) == "version") table.version_ = value;
    if (std::string(name) == "status") table.status_ = value;
    if (std::string(name) == "server_count") {
      std::uint64_t count = 0;
      if (!ParseU64(value, count) || count == 0) {
        return Where(source, name).Error("expected a positive integer, found " + Quote(value));
      }
      table.server_count_ = value;
    }
  }
  if (!table.status_.empty() && table.status_ != "completed") {
    return Where(source, "status")
        .Error("is " + Quote(table.status_) +
               "; expected \"completed\" (the generator had not finished this table)");
  }
  KVFERRY_ASSIGN_OR_RETURN(table.prefill_, ParseList(root, kPrefillList, source));
  KVFERRY_ASSIGN_OR_RETURN(table.decode_, ParseList(root, kDecodeList, source));
  if (table.prefill_.empty() && table.decode_.empty()) {
    return top.Error("both device lists are empty; expected at least one device");
  }
  KVFERRY_RETURN_IF_ERROR(ValidateEntries(table.prefill_, table.decode_, source));
  return table;
}

Result<RankTable> RankTable::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return Status::NotFound("cannot open rank table " + path +
                            ": check the path (DISAGGREGATED_PREFILL_RANK_TABLE_PATH or "
                            "--rank-table)");
  }
  std::string text;
  text.resize(kMaxFileBytes + 1);
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<std::size_t>(in.gcount()));
  if (text.size() > kMaxFileBytes) {
    return Status::InvalidArgument(path + ": larger than " + std::to_string(kMaxFileBytes) +
                                   " bytes; a rank table is a few kilobytes");
  }
  return Parse(text, path);
}

Result<RankTable> RankTable::FromEntries(std::vector<DeviceEntry> prefill,
                                         std::vector<DeviceEntry> decode, std::string version,
                                         std::optional<std::string> server_count) {
  // Validate exactly as a file would be: through the JSON form.
  RankTable draft;
  draft.version_ = std::move(version);
  draft.status_ = "completed";
  draft.server_count_ = std::move(server_count);
  draft.prefill_ = std::move(prefill);
  draft.decode_ = std::move(decode);
  return Parse(draft.ToJson(), "(generated rank table)");
}

Result<DeviceEntry> RankTable::SelectLocal(Role role, std::string_view server_id,
                                           const std::vector<std::string>& visible_devices,
                                           int tp_rank) const {
  const char* list_name = role == Role::kDecode ? kDecodeList : kPrefillList;
  const std::vector<DeviceEntry>& list = List(role);
  std::vector<const DeviceEntry*> matches;
  for (const DeviceEntry& e : list) {
    if (e.server_id != server_id) continue;
    if (!visible_devices.empty() && std::find(visible_devices.begin(), visible_devices.end(),
                                              e.device_id) == visible_devices.end()) {
      continue;
    }
    matches.push_back(&e);
  }
  if (tp_rank >= 0 && static_cast<std::size_t>(tp_rank) < matches.size()) {
    return *matches[static_cast<std::size_t>(tp_rank)];
  }
  std::ostringstream msg;
  msg << "no " << list_name << " entry for TP rank " << tp_rank << " on server_id "
      << Quote(server_id);
  if (!visible_devices.empty()) {
    msg << " with visible devices [";
    for (std::size_t i = 0; i < visible_devices.size(); ++i) {
      msg << (i ? "," : "") << visible_devices[i];
    }
    msg << "]";
  }
  msg << ": " << matches.size() << " entries match";
  if (!matches.empty()) {
    msg << " (device ids";
    for (const DeviceEntry* e : matches) msg << " " << e->device_id;
    msg << ")";
  }
  std::map<std::string, int> per_server;
  for (const DeviceEntry& e : list) ++per_server[e.server_id];
  msg << "; " << list_name << " holds " << list.size() << " entries";
  if (!per_server.empty()) {
    msg << " on";
    int shown = 0;
    for (const auto& [server, count] : per_server) {
      if (++shown > 8) {
        msg << " ...";
        break;
      }
      msg << " " << server << " (" << count << ")";
    }
  }
  msg << ". Check the host address kvferry uses as server_id, the visible devices "
         "(ASCEND_RT_VISIBLE_DEVICES) and the TP size";
  return Status::NotFound(msg.str());
}

std::string RankTable::ToJson() const {
  auto entries = [](const std::vector<DeviceEntry>& list) {
    OrderedJson arr = OrderedJson::array();
    for (const DeviceEntry& e : list) {
      OrderedJson o;
      o["server_id"] = e.server_id;
      o["device_id"] = e.device_id;
      o["device_ip"] = e.device_ip;
      if (e.super_pod_id) o["super_pod_id"] = *e.super_pod_id;
      if (e.super_device_id) o["super_device_id"] = *e.super_device_id;
      o["cluster_id"] = std::to_string(e.cluster_id);
      arr.push_back(std::move(o));
    }
    return arr;
  };
  OrderedJson root;
  root["version"] = version_.empty() ? "1.2" : version_;
  if (server_count_) root["server_count"] = *server_count_;
  root[kPrefillList] = entries(prefill_);
  root[kDecodeList] = entries(decode_);
  root["status"] = status_.empty() ? "completed" : status_;
  return root.dump(4) + "\n";
}

Result<RankTable> GenerateRankTable(const RankTableGenOptions& options) {
  if (options.hosts.empty()) {
    return Status::InvalidArgument("no hosts given: expected at least one host address");
  }
  if (!options.device_ips.empty() && options.device_ips.size() != options.hosts.size()) {
    return Status::InvalidArgument("expected one device ip per host (" +
                                   std::to_string(options.hosts.size()) + "), found " +
                                   std::to_string(options.device_ips.size()));
  }
  if (options.devices_per_host <= 0) {
    return Status::InvalidArgument("devices per host must be positive, found " +
                                   std::to_string(options.devices_per_host));
  }
  if (options.prefill_count < 0 || options.decode_count < 0 ||
      options.prefill_count + options.decode_count <= 0) {
    return Status::InvalidArgument(
        "expected non-negative prefill and decode device counts with "
        "a positive sum, found " +
        std::to_string(options.prefill_count) + " and " + std::to_string(options.decode_count));
  }
  const std::int64_t available =
      static_cast<std::int64_t>(options.hosts.size()) * options.devices_per_host;
  if (options.prefill_count + options.decode_count > available) {
    return Status::InvalidArgument("prefill + decode devices (" +
                                   std::to_string(options.prefill_count + options.decode_count) +
                                   ") exceed the " + std::to_string(available) + " devices of " +
                                   std::to_string(options.hosts.size()) + " hosts with " +
                                   std::to_string(options.devices_per_host) + " each");
  }
  std::vector<DeviceEntry> all;
  for (std::size_t h = 0; h < options.hosts.size(); ++h) {
    for (int d = 0; d < options.devices_per_host; ++d) {
      DeviceEntry e;
      e.server_id = options.hosts[h];
      e.device_id = std::to_string(d);
      e.device_ip = options.device_ips.empty() ? options.hosts[h] : options.device_ips[h];
      e.cluster_id = all.size() + 1;
      if (options.super_pod) {
        e.super_pod_id = options.super_pod_id;
        e.super_device_id = std::to_string(all.size());
      }
      all.push_back(std::move(e));
    }
  }
  auto prefill_end = all.begin() + options.prefill_count;
  std::vector<DeviceEntry> prefill(all.begin(), prefill_end);
  std::vector<DeviceEntry> decode(prefill_end, prefill_end + options.decode_count);
  return RankTable::FromEntries(std::move(prefill), std::move(decode), "1.2",
                                std::to_string(options.hosts.size()));
}

std::vector<std::string> ParseVisibleDevices(std::string_view value) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= value.size()) {
    std::size_t comma = value.find(',', start);
    if (comma == std::string_view::npos) comma = value.size();
    std::string_view item = value.substr(start, comma - start);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) {
      item.remove_prefix(1);
    }
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) {
      item.remove_suffix(1);
    }
    if (!item.empty()) out.emplace_back(item);
    start = comma + 1;
  }
  return out;
}

}  // namespace kvferry
