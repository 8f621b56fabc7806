#include "tools/fleet_register.h"

#include <httplib.h>
#include <openssl/evp.h>

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/log.h"
#include "common/mutex.h"

namespace kvferry::cli {

using Json = nlohmann::json;

namespace {

std::string Base64(const std::string& text) {
  std::vector<unsigned char> out(4 * ((text.size() + 2) / 3) + 1);
  const int n = EVP_EncodeBlock(out.data(), reinterpret_cast<const unsigned char*>(text.data()),
                                static_cast<int>(text.size()));
  return {reinterpret_cast<const char*>(out.data()), static_cast<std::size_t>(n)};
}

std::string Unbase64(const std::string& text) {
  std::vector<unsigned char> out(3 * (text.size() / 4) + 3);
  const int n = EVP_DecodeBlock(out.data(), reinterpret_cast<const unsigned char*>(text.data()),
                                static_cast<int>(text.size()));
  if (n < 0) return {};
  // EVP_DecodeBlock counts the padding's zero bytes.
  std::size_t len = static_cast<std::size_t>(n);
  for (auto it = text.rbegin(); it != text.rend() && *it == '=' && len > 0; ++it) --len;
  return {reinterpret_cast<const char*>(out.data()), len};
}

// The range end of every key that starts with `prefix`: its last byte plus one.
std::string PrefixEnd(std::string prefix) {
  prefix.back() = static_cast<char>(prefix.back() + 1);
  return prefix;
}

constexpr int kCallTimeoutS = 2;

// One JSON call to etcd's v3 gateway: its answer ("result" of a streamed call's first line), or
// Unavailable naming the call and what went wrong.
Result<Json> Call(const EtcdTarget& etcd, const std::string& path, const Json& body) {
  httplib::Client client(etcd.host, etcd.port);
  client.set_connection_timeout(kCallTimeoutS, 0);
  client.set_read_timeout(kCallTimeoutS, 0);
  client.set_write_timeout(kCallTimeoutS, 0);
  const std::string where =
      "etcd http://" + etcd.host + ":" + std::to_string(etcd.port) + path + ": ";
  httplib::Result r = client.Post(path, body.dump(), "application/json");
  if (!r) return Status::Unavailable(where + httplib::to_string(r.error()));
  if (r->status != 200) {
    return Status::Unavailable(where + "status " + std::to_string(r->status) + ": " +
                               r->body.substr(0, 300));
  }
  const std::string line = r->body.substr(0, r->body.find('\n'));
  Json j = Json::parse(line, nullptr, false);
  if (!j.is_object())
    return Status::Unavailable(where + "expected JSON, found " + line.substr(0, 200));
  if (j.contains("error")) return Status::Unavailable(where + j["error"].dump());
  return j.contains("result") ? j["result"] : j;
}

// An int64 field, which the gateway writes as a string; 0 when absent or not a number.
std::int64_t IdOf(const Json& j, const char* key) {
  if (!j.contains(key)) return 0;
  const Json& v = j[key];
  if (v.is_string()) return std::strtoll(v.get_ref<const std::string&>().c_str(), nullptr, 10);
  return v.is_number_integer() ? v.get<std::int64_t>() : 0;
}

}  // namespace

Result<EtcdTarget> ParseEtcdUrl(const std::string& url) {
  const std::string bad =
      "expected etcd://HOST:PORT/PREFIX (for example "
      "etcd://127.0.0.1:2379/kvferry), found '" +
      url + "'";
  constexpr std::string_view kScheme = "etcd://";
  if (url.rfind(kScheme, 0) != 0) return Status::InvalidArgument(bad);
  const std::string rest = url.substr(kScheme.size());
  const std::size_t slash = rest.find('/');
  const std::string hostport = rest.substr(0, slash);
  const std::size_t colon = hostport.rfind(':');
  if (colon == std::string::npos || colon == 0) return Status::InvalidArgument(bad);
  EtcdTarget t;
  t.host = hostport.substr(0, colon);
  if (t.host.size() > 2 && t.host.front() == '[' && t.host.back() == ']') {
    t.host = t.host.substr(1, t.host.size() - 2);
  }
  const std::string port = hostport.substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
    return Status::InvalidArgument(bad);
  }
  t.port = std::stoi(port);
  if (t.port < 1 || t.port > 65535) return Status::InvalidArgument(bad);
  t.prefix = slash == std::string::npos ? "" : rest.substr(slash);
  while (!t.prefix.empty() && t.prefix.back() == '/') t.prefix.pop_back();
  if (t.prefix.empty()) t.prefix = "/kvferry";
  if (t.prefix.find('?') != std::string::npos) return Status::InvalidArgument(bad);
  return t;
}

Result<std::vector<Json>> ListInstances(const EtcdTarget& etcd) {
  const std::string prefix = etcd.prefix + "/instances/";
  KVFERRY_ASSIGN_OR_RETURN(
      Json r, Call(etcd, "/v3/kv/range",
                   {{"key", Base64(prefix)}, {"range_end", Base64(PrefixEnd(prefix))}}));
  std::vector<Json> out;
  if (!r.contains("kvs") || !r["kvs"].is_array()) return out;
  for (const Json& kv : r["kvs"]) {
    if (!kv.contains("value") || !kv["value"].is_string()) continue;
    Json v = Json::parse(Unbase64(kv["value"].get<std::string>()), nullptr, false);
    if (v.is_object() && v.contains("role") && v.contains("name")) out.push_back(std::move(v));
  }
  return out;
}

Result<std::optional<Registered>> GetRegistered(const EtcdTarget& etcd, const std::string& key) {
  KVFERRY_ASSIGN_OR_RETURN(Json r, Call(etcd, "/v3/kv/range", {{"key", Base64(key)}}));
  if (!r.contains("kvs") || !r["kvs"].is_array() || r["kvs"].empty()) {
    return std::optional<Registered>();
  }
  const Json& kv = r["kvs"][0];
  Registered out;
  out.value = Json::parse(Unbase64(kv.value("value", "")), nullptr, false);
  if (!out.value.is_object()) {
    return Status::InvalidArgument("etcd key " + key + ": expected a JSON object, found '" +
                                   Unbase64(kv.value("value", "")).substr(0, 200) + "'");
  }
  out.lease = IdOf(kv, "lease");
  return std::optional<Registered>(std::move(out));
}

Status SetRegisteredState(const EtcdTarget& etcd, const std::string& key,
                          const std::string& state) {
  KVFERRY_ASSIGN_OR_RETURN(std::optional<Registered> r, GetRegistered(etcd, key));
  if (!r) return Status::NotFound("etcd key " + key + " is not there: no instance registered so");
  r->value["state"] = state;
  Json put = {{"key", Base64(key)}, {"value", Base64(r->value.dump())}};
  if (r->lease != 0) put["lease"] = std::to_string(r->lease);
  return Call(etcd, "/v3/kv/put", put).status();
}

struct FleetRegistration::State {
  EtcdTarget etcd;
  std::string key;
  int ttl_s = 10;
  Mutex mu;
  CondVar cv;
  Json value GUARDED_BY(mu);
  std::int64_t lease GUARDED_BY(mu) = 0;
  bool stop GUARDED_BY(mu) = false;
  bool out GUARDED_BY(mu) = false;  // etcd unreachable since the last failure was logged
  std::thread thread;

  Status Put() REQUIRES(mu) {
    return Call(etcd, "/v3/kv/put",
                {{"key", Base64(key)},
                 {"value", Base64(value.dump())},
                 {"lease", std::to_string(lease)}})
        .status();
  }
  Status Register() REQUIRES(mu) {
    KVFERRY_ASSIGN_OR_RETURN(Json grant, Call(etcd, "/v3/lease/grant", {{"TTL", ttl_s}}));
    lease = IdOf(grant, "ID");
    if (lease == 0) return Status::Unavailable("etcd granted no lease: " + grant.dump());
    return Put();
  }
  // Etcd calls are made under mu: they are bounded (kCallTimeoutS each), and only SetState and
  // the destructor wait for it.
  void Run() EXCLUDES(mu) {
    MutexLock lock(mu);
    while (!stop) {
      const Deadline next = DeadlineAfter(std::chrono::milliseconds(ttl_s * 1000 / 3));
      while (!stop && !cv.WaitUntil(mu, next)) {
      }
      if (stop) return;
      Status s = Status::Ok();
      Result<Json> alive = Call(etcd, "/v3/lease/keepalive", {{"ID", std::to_string(lease)}});
      if (!alive.ok()) {
        s = alive.status();
      } else if (IdOf(*alive, "TTL") <= 0) {
        Log().warn("the lease of {} ended; registering again", key);
        s = Register();
      } else if (out) {
        s = Put();  // a state set while etcd was away
      }
      if (!s.ok() && !out) {
        Log().warn("cannot renew {} in etcd: {}; retrying every {} ms", key, s.ToString(),
                   ttl_s * 1000 / 3);
        out = true;
      } else if (s.ok() && out) {
        Log().info("etcd is back; {} is registered", key);
        out = false;
      }
    }
  }
};

Result<std::unique_ptr<FleetRegistration>> FleetRegistration::Start(const EtcdTarget& etcd,
                                                                    Json value, int ttl_s) {
  if (ttl_s < 2) {
    return Status::InvalidArgument("the lease's TTL: expected at least 2 s, found " +
                                   std::to_string(ttl_s));
  }
  auto state = std::make_shared<State>();
  state->etcd = etcd;
  state->ttl_s = ttl_s;
  state->key =
      etcd.prefix + "/instances/" + value.value("role", "") + "/" + value.value("name", "");
  {
    MutexLock lock(state->mu);
    state->value = std::move(value);
    KVFERRY_RETURN_IF_ERROR(state->Register());
  }
  Log().info("registered {} in etcd {}:{} (lease {} s)", state->key, etcd.host, etcd.port, ttl_s);
  state->thread = std::thread([s = state.get()] { s->Run(); });
  return std::unique_ptr<FleetRegistration>(new FleetRegistration(std::move(state)));
}

FleetRegistration::~FleetRegistration() {
  std::int64_t lease = 0;
  {
    MutexLock lock(state_->mu);
    state_->stop = true;
    state_->cv.SignalAll();
    lease = state_->lease;
  }
  state_->thread.join();
  Result<Json> r = Call(state_->etcd, "/v3/lease/revoke", {{"ID", std::to_string(lease)}});
  if (!r.ok()) {
    Log().warn("leaving the fleet: {}; the key {} goes with its lease ({} s)",
               r.status().ToString(), state_->key, state_->ttl_s);
  }
}

void FleetRegistration::SetState(const std::string& state) {
  MutexLock lock(state_->mu);
  state_->value["state"] = state;
  if (Status s = state_->Put(); !s.ok()) {
    Log().warn("cannot write {}'s state {} to etcd now: {}; it is written when etcd is back",
               state_->key, state, s.ToString());
    state_->out = true;
  }
}

const std::string& FleetRegistration::key() const { return state_->key; }

}  // namespace kvferry::cli
