// `kvferry serve --register etcd://HOST:PORT/PREFIX`: the instance's key in etcd (docs/fleet.md),
// on a lease kept alive by a thread, its state (serving, draining), revoked when it exits. The
// same keys and values as the Python kvferry.fleet.Registration, over etcd's v3 JSON gateway.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::cli {

/// etcd://HOST:PORT/PREFIX: the gateway's host, port and the prefix (no trailing slash;
/// /kvferry when none is given). InvalidArgument naming what was expected otherwise.
struct EtcdTarget {
  std::string host;
  int port = 0;
  std::string prefix;
};
Result<EtcdTarget> ParseEtcdUrl(const std::string& url);

/// The instances registered under the target's prefix (their values, each a JSON object with
/// "role" and "name"; values that are not JSON objects are left out). Unavailable when etcd
/// cannot be reached.
Result<std::vector<nlohmann::json>> ListInstances(const EtcdTarget& etcd);

/// One registered instance's value (the key PREFIX/instances/ROLE/NAME, whole) and its lease;
/// nullopt when the key is not there.
struct Registered {
  nlohmann::json value;
  std::int64_t lease = 0;
};
Result<std::optional<Registered>> GetRegistered(const EtcdTarget& etcd, const std::string& key);
/// Writes `state` into the key's value, under the lease it has (`kvferry drain etcd://...`).
/// NotFound when the key is not there.
Status SetRegisteredState(const EtcdTarget& etcd, const std::string& key, const std::string& state);

class FleetRegistration {
 public:
  /// Grants a lease of `ttl_s` seconds and writes PREFIX/instances/ROLE/NAME = `value` (which
  /// names "role" and "name") on it; Unavailable, naming the call, when etcd cannot be reached.
  /// A thread renews the lease every ttl_s / 3, retries every failure (logged once per outage)
  /// and writes the key again under a new lease when the lease was lost.
  static Result<std::unique_ptr<FleetRegistration>> Start(const EtcdTarget& etcd,
                                                          nlohmann::json value, int ttl_s);
  /// Stops the thread and revokes the lease (the key goes now).
  ~FleetRegistration();
  FleetRegistration(const FleetRegistration&) = delete;
  FleetRegistration& operator=(const FleetRegistration&) = delete;

  /// "serving" or "draining", written now (and again by the thread if etcd was away).
  void SetState(const std::string& state);
  const std::string& key() const;

  struct State;

 private:
  explicit FleetRegistration(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

}  // namespace kvferry::cli
