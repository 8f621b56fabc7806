// kvferry: the global rank table, in the format of vllm-ascend's disaggregated-prefill generator.
//
// {
//   "version": "1.2", "server_count": "2", "status": "completed",
//   "prefill_device_list": [ {"server_id": "10.0.0.1", "device_id": "0",
//                             "device_ip": "10.0.0.1", "cluster_id": "1",
//                             "super_pod_id": "0", "super_device_id": "0"}, ... ],
//   "decode_device_list":  [ ... ]
// }
//
// See docs/ranktable.md for every field, the accepted types and the validation rules.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"

namespace kvferry {

/// Which side of disaggregated serving a worker is on.
enum class Role : std::uint8_t {
  kPrefill = 0,  ///< vLLM kv_role "kv_producer"
  kDecode = 1,   ///< vLLM kv_role "kv_consumer"
  /// vLLM kv_role "kv_both": one instance that is the prefill side of some requests and the
  /// decode side of others, each request's kv_transfer_params saying which (do_remote_decode:
  /// it serves the request's KV; do_remote_prefill: it loads it). Its workers serve and read.
  kBoth = 2,
};
const char* RoleName(Role role);  // "prefill", "decode", "both"
/// Whether a worker of this role serves KV to readers (prefill, both) or reads KV (decode, both).
inline bool ServesKv(Role role) { return role != Role::kDecode; }
inline bool ReadsKv(Role role) { return role != Role::kPrefill; }
/// Accepts "prefill", "decode", "both", "kv_producer", "kv_consumer", "kv_both". Anything else is
/// InvalidArgument.
Result<Role> ParseRole(std::string_view name);

/// One device (one TP worker) of the table. Numbers that the reference's generator writes as
/// strings are kept as the strings they were, except cluster_id, which both sides use as an
/// integer.
struct DeviceEntry {
  std::string server_id;                    ///< the host, matched against the local host's address
  std::string device_id;                    ///< matched against the visible-devices list
  std::string device_ip;                    ///< address the data plane of this worker is reached on
  std::uint64_t cluster_id = 0;             ///< unique across the whole table
  std::optional<std::string> super_pod_id;  ///< A3 only
  std::optional<std::string> super_device_id;  ///< A3 only

  friend bool operator==(const DeviceEntry&, const DeviceEntry&) = default;
};

/// A validated rank table. Immutable value type.
class RankTable {
 public:
  /// Parses and validates JSON text. `source` names the input in every error (usually the path).
  static Result<RankTable> Parse(std::string_view json_text, std::string_view source);
  /// Reads a file (at most 16 MiB) and parses it.
  static Result<RankTable> Load(const std::string& path);
  /// Builds a table from entries, validating them as Parse would.
  static Result<RankTable> FromEntries(std::vector<DeviceEntry> prefill,
                                       std::vector<DeviceEntry> decode, std::string version = "1.2",
                                       std::optional<std::string> server_count = std::nullopt);

  const std::string& version() const { return version_; }
  const std::string& status() const { return status_; }
  const std::optional<std::string>& server_count() const { return server_count_; }
  const std::vector<DeviceEntry>& prefill() const { return prefill_; }
  const std::vector<DeviceEntry>& decode() const { return decode_; }
  const std::vector<DeviceEntry>& List(Role role) const {
    // An instance of both roles has its devices in the prefill list (it serves KV).
    return role == Role::kDecode ? decode_ : prefill_;
  }

  /// DESIGN rule 5: the entry of the worker at TP rank `tp_rank` on host `server_id`, counting
  /// only entries of `role`'s list on that host whose device id is in `visible_devices` (all of
  /// them when it is empty), in table order. NotFound names what was looked for and what the
  /// table holds.
  Result<DeviceEntry> SelectLocal(Role role, std::string_view server_id,
                                  const std::vector<std::string>& visible_devices,
                                  int tp_rank) const;

  /// The table as JSON in the generator's format and key order, indented by 4.
  std::string ToJson() const;

 private:
  RankTable() = default;

  std::string version_;
  std::string status_;
  std::optional<std::string> server_count_;
  std::vector<DeviceEntry> prefill_;
  std::vector<DeviceEntry> decode_;
};

/// What `kvferry ranktable gen` builds: `hosts` each with `devices_per_host` devices, device ids
/// 0..n-1 per host, cluster ids 1..N over all devices in host order; the first `prefill_count`
/// devices are prefill, the next `decode_count` decode (like the reference's generator).
struct RankTableGenOptions {
  std::vector<std::string> hosts;
  int devices_per_host = 0;
  int prefill_count = 0;
  int decode_count = 0;
  /// Data-plane address per host; defaults to the host itself.
  std::vector<std::string> device_ips;
  /// Write the A3 fields: super_pod_id and super_device_id (the global device index).
  bool super_pod = false;
  std::string super_pod_id = "0";
};
Result<RankTable> GenerateRankTable(const RankTableGenOptions& options);

/// Splits a visible-devices setting such as ASCEND_RT_VISIBLE_DEVICES="0,1,2" into its ids;
/// blanks around ids are dropped; an empty string gives an empty list (every device visible).
std::vector<std::string> ParseVisibleDevices(std::string_view value);

}  // namespace kvferry
