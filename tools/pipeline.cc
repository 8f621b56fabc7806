#include "tools/pipeline.h"

#include <openssl/rand.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <thread>

#include "common/clock.h"
#include "common/ports.h"
#include "common/subprocess.h"
#include "kvferry/rank_table.h"
#include "tools/control_client.h"
#include "tools/engine_protocol.h"
#include "tools/fleet_register.h"

namespace kvferry::cli {
namespace {

using Json = nlohmann::json;
using std::chrono::milliseconds;

// 32 random bytes as hex: the secret of instances the demo starts itself.
std::string RandomSecret() {
  std::array<std::uint8_t, 32> bytes{};
  RAND_bytes(bytes.data(), static_cast<int>(bytes.size()));
  std::string hex;
  for (std::uint8_t b : bytes) {
    static constexpr char kDigits[] = "0123456789abcdef";
    hex.push_back(kDigits[b >> 4]);
    hex.push_back(kDigits[b & 15]);
  }
  return hex;
}

// The instances and the proxy's control clients: started here (in a scratch directory with their
// rank table: prefill instance i on devices [i * prefill_tp, ...), decode instances after them),
// or already running (args.prefill_control and decode_control, comma-separated).
class Deployment {
 public:
  static Result<std::unique_ptr<Deployment>> Start(const PipelineArgs& a) {
    auto d = std::unique_ptr<Deployment>(new Deployment());
    d->external_ =
        (!a.prefill_control.empty() && !a.decode_control.empty()) || !a.discovery.empty();
    // Control messages are signed with the instances' secret (docs/control.md): KVFERRY_SECRET,
    // or for the instances started here when it is unset, a fresh random one passed to them.
    const char* env_secret = std::getenv("KVFERRY_SECRET");  // NOLINT(concurrency-mt-unsafe)
    std::string secret = env_secret != nullptr ? env_secret : "";
    if (secret.empty() && !d->external_) secret = RandomSecret();
    d->secret_ = secret;
    if (!a.discovery.empty()) {
      // The instances registered now (at least one serving of each role, waited for); the proxy
      // follows the membership during the run.
      KVFERRY_ASSIGN_OR_RETURN(EtcdTarget etcd, ParseEtcdUrl(a.discovery));
      const Deadline until = DeadlineAfter(milliseconds(30000));
      for (;;) {
        Result<std::vector<Json>> members = ListInstances(etcd);
        if (members.ok()) {
          int prefill = 0;
          int decode = 0;
          for (const Json& m : *members) {
            if (m.value("state", "") != "serving" || !m.contains("control")) continue;
            ++(m.value("role", "") == "prefill" ? prefill : decode);
          }
          if (prefill > 0 && decode > 0) break;
        }
        if (Clock::now() > until) {
          return Status::Unavailable(
              "--discovery " + a.discovery +
              ": expected a serving prefill and decode instance registered there (kvferry serve "
              "--register), found none within 30 s" +
              (members.ok() ? std::string() : ": " + members.status().ToString()));
        }
        std::this_thread::sleep_for(milliseconds(100));
      }
      d->etcd_ = etcd;
      return d;
    }
    if (d->external_) {
      for (const std::string& e : ParseVisibleDevices(a.prefill_control)) {
        d->prefill_.push_back(std::make_unique<ControlClient>(e, secret));
      }
      for (const std::string& e : ParseVisibleDevices(a.decode_control)) {
        d->decode_.push_back(std::make_unique<ControlClient>(e, secret));
      }
      return d;
    }
    if (a.prefill_instances < 1 || a.decode_instances < 1 || a.prefill_instances > 16 ||
        a.decode_instances > 16) {
      return Status::InvalidArgument("expected 1 to 16 prefill and decode instances, found " +
                                     std::to_string(a.prefill_instances) + " and " +
                                     std::to_string(a.decode_instances));
    }
    // The deployment's rank table: every instance on this host, each on its own devices.
    const int prefill_devices = a.prefill_instances * a.prefill_tp * a.prefill_pp;
    const int decode_devices = a.decode_instances * a.decode_tp * a.decode_pp;
    RankTableGenOptions gen;
    gen.hosts = {"127.0.0.1"};
    gen.devices_per_host = prefill_devices + decode_devices;
    gen.prefill_count = prefill_devices;
    gen.decode_count = decode_devices;
    KVFERRY_ASSIGN_OR_RETURN(RankTable table, GenerateRankTable(gen));
    d->dir_ = std::filesystem::temp_directory_path() / ("kvferry-demo-" + std::to_string(getpid()));
    std::filesystem::create_directories(d->dir_);
    const std::string table_path = (d->dir_ / "ranktable.json").string();
    std::ofstream(table_path) << table.ToJson();
    std::vector<int> taken;
    for (int role = 0; role < 2; ++role) {
      const bool prefill = role == 0;
      const int count = prefill ? a.prefill_instances : a.decode_instances;
      const int tp = prefill ? a.prefill_tp : a.decode_tp;
      const int pp = prefill ? a.prefill_pp : a.decode_pp;
      for (int i = 0; i < count; ++i) {
        const int base = FreeLoopbackPorts(tp * pp, taken);
        const int control = FreeLoopbackPorts(1, taken);
        if (base == 0 || control == 0) {
          return Status::Unavailable("could not find free ports on 127.0.0.1");
        }
        std::string devices;
        const int first = (prefill ? 0 : prefill_devices) + i * tp * pp;
        for (int dev = first; dev < first + tp * pp; ++dev) {
          devices += (devices.empty() ? "" : ",") + std::to_string(dev);
        }
        KVFERRY_ASSIGN_OR_RETURN(Subprocess proc,
                                 Spawn(a, prefill ? "prefill" : "decode", tp, pp, base, control,
                                       table_path, devices, secret));
        (prefill ? d->prefill_procs_ : d->decode_procs_).push_back(std::move(proc));
        (prefill ? d->prefill_ : d->decode_)
            .push_back(std::make_unique<ControlClient>("tcp://127.0.0.1:" + std::to_string(control),
                                                       secret));
      }
    }
    return d;
  }

  ~Deployment() {
    if (!external_) {
      for (auto* clients : {&prefill_, &decode_}) {
        for (auto& c : *clients) (void)c->Call({{"op", "shutdown"}}, milliseconds(5000));
      }
      for (auto* procs : {&prefill_procs_, &decode_procs_}) {
        for (Subprocess& p : *procs) (void)p.CloseAndWait(milliseconds(10000));
      }
    }
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  Deployment(const Deployment&) = delete;
  Deployment& operator=(const Deployment&) = delete;

  bool external() const { return external_; }
  /// Where the membership is registered (--discovery); the proxy adds its instances.
  const std::optional<EtcdTarget>& etcd() const { return etcd_; }
  const std::string& secret() const { return secret_; }
  std::vector<std::unique_ptr<ControlClient>>& prefill() { return prefill_; }
  std::vector<std::unique_ptr<ControlClient>>& decode() { return decode_; }

 private:
  Deployment() = default;

  static Result<Subprocess> Spawn(const PipelineArgs& a, const char* role, int tp, int pp, int base,
                                  int control, const std::string& table_path,
                                  const std::string& devices, const std::string& secret) {
    std::vector<std::string> argv = {SelfExe(),
                                     "serve",
                                     "--role",
                                     role,
                                     "--tp",
                                     std::to_string(tp),
                                     "--pp",
                                     std::to_string(pp),
                                     "--base-port",
                                     std::to_string(base),
                                     "--control-port",
                                     std::to_string(control),
                                     "--rank-table",
                                     table_path,
                                     "--visible-devices",
                                     devices,
                                     "--transport",
                                     a.transport,
                                     "--hold-lease-ms",
                                     std::to_string(a.hold_lease_ms),
                                     "--compute-us-per-token",
                                     std::to_string(a.compute_us_per_token),
                                     "--prefill-chunk-tokens",
                                     std::to_string(a.prefill_chunk_tokens),
                                     "--layers-per-notice",
                                     std::to_string(a.layers_per_notice),
                                     "--memory",
                                     a.memory,
                                     "--exit-on-stdin-eof"};
    if (a.shm_permit_any_tracer) argv.emplace_back("--shm-permit-any-tracer");
    for (const std::string& s : TransportOptArgv(a.transport_opts)) argv.push_back(s);
    for (const std::string& s : ModelArgv(RoleModel(a, std::string(role) == "prefill"))) {
      argv.push_back(s);
    }
    KVFERRY_ASSIGN_OR_RETURN(Subprocess p, Subprocess::Spawn(argv, {"KVFERRY_SECRET=" + secret}));
    KVFERRY_ASSIGN_OR_RETURN(std::string line, p.ReadLine(milliseconds(60000)));
    if (line.rfind("READY ", 0) != 0) {
      return Status::Internal(std::string(role) + " instance did not start: " + line);
    }
    return p;
  }

  bool external_ = false;
  std::optional<EtcdTarget> etcd_;
  std::string secret_;
  std::filesystem::path dir_;
  std::vector<Subprocess> prefill_procs_;
  std::vector<Subprocess> decode_procs_;
  // The clients send shutdown before the processes are waited for.
  std::vector<std::unique_ptr<ControlClient>> prefill_;
  std::vector<std::unique_ptr<ControlClient>> decode_;
};

// The proxy's requests: prefill first (asking for remote decode), then decode with the params
// the prefill instance returned, as disaggregated-serving proxies forward them; each to the
// instance of its role with the fewest outstanding requests; client aborts at random moments; a
// request with no answer within the timeout fails.
class Proxy {
 public:
  Proxy(const PipelineArgs& a, const std::vector<std::vector<std::int32_t>>& prompts, Deployment& d,
        std::uint64_t block_bytes, std::vector<Json> prefill_connectors)
      : a_(a),
        prompts_(prompts),
        prefill_(d.prefill()),
        decode_(d.decode()),
        prefill_load_(d.prefill().size(), 0),
        decode_load_(d.decode().size(), 0),
        prefill_down_until_(d.prefill().size()),
        decode_down_until_(d.decode().size()),
        block_bytes_(block_bytes),
        rng_(a.seed),
        request_timeout_(a.request_timeout_ms),
        prefill_connectors_(std::move(prefill_connectors)),
        prefill_excluded_(d.prefill().size(), false),
        decode_excluded_(d.decode().size(), false),
        etcd_(d.etcd()),
        secret_(d.secret()) {}

  // Runs until every prompt ended or the run's deadline passed.
  PipelineResult Run() {
    const auto start = Clock::now();
    last_progress_ = start;
    const Deadline deadline = DeadlineAfter(milliseconds(600000));
    Clock::time_point next_refresh{};
    while (finished_ < static_cast<int>(prompts_.size()) && Clock::now() < deadline) {
      if (etcd_ && Clock::now() >= next_refresh) {
        RefreshMembership();
        // Each look is a blocking call of up to 2 s: while etcd is away, look less often, so the
        // run keeps taking answers in between.
        next_refresh = Clock::now() + milliseconds(etcd_away_ ? 2000 : 200);
      }
      SubmitUpToConcurrency();
      SendDueAborts();
      std::vector<zmq_pollitem_t> items;
      for (auto* clients : {&prefill_, &decode_}) {
        for (auto& c : *clients) items.push_back({c->socket(), 0, ZMQ_POLLIN, 0});
      }
      zmq_poll(items.data(), static_cast<int>(items.size()), 20);
      for (std::size_t i = 0; i < prefill_.size(); ++i) {
        while (std::optional<Json> r = prefill_[i]->TryRecv()) {
          prefill_down_until_[i] = {};  // it answers: up again
          OnPrefillAnswer(*r);
        }
      }
      for (std::size_t i = 0; i < decode_.size(); ++i) {
        while (std::optional<Json> r = decode_[i]->TryRecv()) {
          decode_down_until_[i] = {};
          OnDecodeAnswer(*r);
        }
      }
      FailStalled();
      ReportProgress();
    }
    out_.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
    if (a_.progress && isatty(STDERR_FILENO) != 0) std::fprintf(stderr, "\r%80s\r", "");
    for (const auto& [id, f] : inflight_) {
      ++out_.failed;
      out_.errors.push_back(id + ": no answer before the run's deadline");
    }
    return out_;
  }

 private:
  enum class AbortAt { kNone, kPrefill, kBetween, kDecode };
  struct InFlight {
    Clock::time_point sent;
    Clock::time_point forwarded;  // unset until the prefill answer went on to decode
    AbortAt abort_at = AbortAt::kNone;
    std::size_t instance = 0;  // of the role the request waits on now
    // Layer-wise: both legs sent at once; the request ends when both have answered (the decode
    // answer decides its outcome).
    bool layerwise = false;
    std::size_t prefill_instance = 0;
    bool prefill_answered = false;
    bool decode_answered = false;
    double compute_ms = 0;
    double queue_ms = 0;
    std::int64_t computed_at_us = 0;
    bool at_decode() const { return forwarded != Clock::time_point{}; }
    // When the answer awaited now was asked for.
    Clock::time_point stage_start() const { return at_decode() ? forwarded : sent; }
  };
  struct PendingAbort {
    Clock::time_point due;
    bool decode = false;
    std::size_t instance = 0;
    std::string id;
  };
  using Iter = std::map<std::string, InFlight>::iterator;

  void End(Iter it) {
    if (auto t = pending_timings_.find(it->first); t != pending_timings_.end()) {
      if (it->second.prefill_answered) {
        t->second.compute_ms = it->second.compute_ms;
        t->second.queue_ms = it->second.queue_ms;
        t->second.computed_at_us = it->second.computed_at_us;
        out_.timings.push_back(t->second);
      }
      pending_timings_.erase(t);
    }
    if (!it->second.layerwise) {
      --(it->second.at_decode() ? decode_load_ : prefill_load_)[it->second.instance];
    } else {
      if (!it->second.prefill_answered) --prefill_load_[it->second.prefill_instance];
      if (!it->second.decode_answered) --decode_load_[it->second.instance];
    }
    forwarded_params_.erase(it->first);
    inflight_.erase(it);
    ++finished_;
  }
  // The instance with the fewest outstanding requests among those serving and not marked down
  // (among those serving when every one is down; any when none is serving: with --discovery a
  // caller checks Serving first); ties go to the lowest index.
  static std::size_t LeastLoaded(const std::vector<int>& load,
                                 const std::vector<Clock::time_point>& down_until,
                                 const std::vector<bool>& excluded) {
    const auto now = Clock::now();
    std::size_t best = load.size();
    for (int pass = 0; pass < 3 && best == load.size(); ++pass) {
      for (std::size_t i = 0; i < load.size(); ++i) {
        if (pass < 2 && excluded[i]) continue;
        if (pass == 0 && down_until[i] > now) continue;
        if (best == load.size() || load[i] < load[best]) best = i;
      }
    }
    return best;
  }
  static bool Serving(const std::vector<bool>& excluded) {
    return std::find(excluded.begin(), excluded.end(), false) != excluded.end();
  }

  // --discovery: instances registered since are added (serving ones take requests at once);
  // those draining or gone take no new requests, and what they have in flight ends as it would.
  // etcd out of reach: the membership known stays (logged once).
  void RefreshMembership() {
    Result<std::vector<Json>> members = ListInstances(*etcd_);
    if (!members.ok()) {
      if (!etcd_away_) {
        std::fprintf(stderr,
                     "[kvferry] etcd out of reach (%s): keeping the %zu+%zu instances "
                     "known\n",
                     members.status().ToString().c_str(), prefill_.size(), decode_.size());
      }
      etcd_away_ = true;
      return;
    }
    etcd_away_ = false;
    std::vector<bool> prefill_seen(prefill_.size(), false);
    std::vector<bool> decode_seen(decode_.size(), false);
    for (const Json& m : *members) {
      if (!m.contains("control") || !m["control"].is_string()) continue;
      const bool prefill = m.value("role", "") == "prefill";
      const std::string control = m["control"].get<std::string>();
      const bool serving = m.value("state", "") == "serving";
      std::vector<std::string>& endpoints = prefill ? prefill_endpoints_ : decode_endpoints_;
      auto at = std::find(endpoints.begin(), endpoints.end(), control);
      if (at == endpoints.end()) {
        if (!serving) continue;
        (prefill ? prefill_ : decode_).push_back(std::make_unique<ControlClient>(control, secret_));
        (prefill ? prefill_load_ : decode_load_).push_back(0);
        (prefill ? prefill_down_until_ : decode_down_until_).emplace_back();
        (prefill ? prefill_excluded_ : decode_excluded_).push_back(false);
        (prefill ? prefill_seen : decode_seen).push_back(true);
        if (prefill) prefill_connectors_.push_back(m.value("connector", Json()));
        endpoints.push_back(control);
        std::fprintf(stderr, "[kvferry] %s instance %s joined (%s)\n",
                     prefill ? "prefill" : "decode", m.value("name", "").c_str(), control.c_str());
        continue;
      }
      const auto i = static_cast<std::size_t>(at - endpoints.begin());
      (prefill ? prefill_seen : decode_seen)[i] = true;
      std::vector<bool>& excluded = prefill ? prefill_excluded_ : decode_excluded_;
      if (excluded[i] == serving) {
        std::fprintf(stderr, "[kvferry] %s instance %s %s\n", prefill ? "prefill" : "decode",
                     m.value("name", "").c_str(), serving ? "serving again" : "draining");
      }
      excluded[i] = !serving;
    }
    for (bool prefill : {true, false}) {
      const std::vector<bool>& seen = prefill ? prefill_seen : decode_seen;
      std::vector<bool>& excluded = prefill ? prefill_excluded_ : decode_excluded_;
      for (std::size_t i = 0; i < seen.size(); ++i) {
        // Instances not registered at all (given as --prefill-control) are never dropped here.
        const auto& endpoints = prefill ? prefill_endpoints_ : decode_endpoints_;
        if (!seen[i] && i < endpoints.size() && !endpoints[i].empty() && !excluded[i]) {
          std::fprintf(stderr, "[kvferry] %s instance %s left\n", prefill ? "prefill" : "decode",
                       endpoints[i].c_str());
          excluded[i] = true;
        }
      }
    }
  }

  // A leg refused because its instance is draining (it began before this proxy saw it): the
  // instance takes no new requests from now on, and the leg goes to another one.
  bool RefusedAsDraining(const Json& r) const {
    return !r.value("ok", true) && r.value("code", "") == "Unavailable" &&
           r.value("error", "").find("draining") != std::string::npos;
  }
  std::chrono::microseconds RandomDelay(int max_us) {
    return std::chrono::microseconds(static_cast<std::int64_t>(unit_(rng_) * max_us));
  }

  void SubmitUpToConcurrency() {
    while (next_ < prompts_.size() && static_cast<int>(inflight_.size()) < a_.concurrency &&
           Serving(prefill_excluded_) && Serving(decode_excluded_)) {
      const std::string id = "req-" + std::to_string(next_);
      Json params = ParamsToJson(KvTransferParams{});
      params["do_remote_decode"] = true;
      InFlight f;
      f.instance = LeastLoaded(prefill_load_, prefill_down_until_, prefill_excluded_);
      ++prefill_load_[f.instance];
      f.layerwise = a_.layerwise &&
                    static_cast<std::int64_t>(prompts_[next_].size()) >= a_.layerwise_min_tokens &&
                    !prefill_connectors_[f.instance].is_null();
      Json decode_params;
      if (f.layerwise) {
        // One transfer id for both legs; the decode leg names the prefill instance's connector,
        // as a proxy knows it from its configuration.
        const std::string transfer = "xfer-" + std::to_string(next_) + "-" + run_tag_;
        params["transfer_id"] = transfer;
        const Json& c = prefill_connectors_[f.instance];
        decode_params = {{"do_remote_prefill", true},
                         {"transfer_id", transfer},
                         {"remote_engine_id", c["engine_id"]},
                         {"remote_host", c["host"]},
                         {"remote_port", c["port"]},
                         {"remote_tp_size", c["tp_size"]},
                         {"remote_pp_size", c.value("pp_size", 1)}};
      }
      const bool lost =
          f.layerwise && a_.drop_prefill_legs > 0 && unit_(rng_) < a_.drop_prefill_legs;
      if (!lost) {
        (void)prefill_[f.instance]->Send({{"op", "generate"},
                                          {"request_id", id},
                                          {"prompt", prompts_[next_]},
                                          {"kv_transfer_params", params}});
      }
      f.sent = Clock::now();
      if (f.layerwise) {
        if (lost) {
          // Nothing to wait for from the prefill instance.
          f.prefill_answered = true;
          --prefill_load_[f.instance];
        }
        f.prefill_instance = f.instance;
        f.forwarded = f.sent;
        f.instance = LeastLoaded(decode_load_, decode_down_until_, decode_excluded_);
        ++decode_load_[f.instance];
        (void)decode_[f.instance]->Send({{"op", "generate"},
                                         {"request_id", id},
                                         {"prompt", prompts_[next_]},
                                         {"kv_transfer_params", decode_params}});
        if (a_.abort_rate > 0 && unit_(rng_) < a_.abort_rate) {
          // The client goes away: a proxy aborts both legs.
          f.abort_at = AbortAt::kDecode;
          const auto due = Clock::now() + RandomDelay(20000);
          aborts_.push_back({due, false, f.prefill_instance, id});
          aborts_.push_back({due, true, f.instance, id});
        }
        inflight_[id] = f;
        ++next_;
        continue;
      }
      if (a_.abort_rate > 0 && unit_(rng_) < a_.abort_rate) {
        f.abort_at = static_cast<AbortAt>(1 + rng_() % 3);
        if (f.abort_at == AbortAt::kPrefill) {
          aborts_.push_back({Clock::now() + RandomDelay(3000), false, f.instance, id});
        }
      }
      inflight_[id] = f;
      ++next_;
    }
  }

  // Aborts that are due; one for a request that already ended is still sent (a no-op there).
  void SendDueAborts() {
    const auto now = Clock::now();
    for (auto it = aborts_.begin(); it != aborts_.end();) {
      if (it->due > now) {
        ++it;
        continue;
      }
      (void)(it->decode ? decode_ : prefill_)[it->instance]->Send(
          {{"op", "abort"}, {"request_id", it->id}});
      it = aborts_.erase(it);
    }
  }

  void OnPrefillAnswer(const Json& r) {
    const std::string id = r.value("request_id", "");
    auto it = inflight_.find(id);
    if (it == inflight_.end()) return;
    if (it->second.layerwise) {
      // Its outcome is the decode leg's: a failed or aborted prefill fails the decode's load,
      // which the decode recomputes or reports.
      if (it->second.prefill_answered) return;
      it->second.prefill_answered = true;
      it->second.compute_ms = r.value("compute_ms", 0.0);
      it->second.queue_ms = r.value("queue_ms", 0.0);
      it->second.computed_at_us = r.value("computed_at_us", std::int64_t{0});
      --prefill_load_[it->second.prefill_instance];
      if (it->second.decode_answered) End(it);
      return;
    }
    if (r.value("aborted", false)) {
      ++out_.aborted_at_prefill;
      End(it);
      return;
    }
    if (RefusedAsDraining(r) && it->second.abort_at == AbortAt::kNone &&
        Serving(prefill_excluded_)) {
      prefill_excluded_[it->second.instance] = true;
      --prefill_load_[it->second.instance];
      it->second.instance = LeastLoaded(prefill_load_, prefill_down_until_, prefill_excluded_);
      ++prefill_load_[it->second.instance];
      it->second.sent = Clock::now();
      ++out_.resent_to_another_instance;
      const auto index = static_cast<std::size_t>(std::stoul(id.substr(4)));
      Json params = ParamsToJson(KvTransferParams{});
      params["do_remote_decode"] = true;
      (void)prefill_[it->second.instance]->Send({{"op", "generate"},
                                                 {"request_id", id},
                                                 {"prompt", prompts_[index]},
                                                 {"kv_transfer_params", params}});
      return;
    }
    if (!r.value("ok", false)) {
      ++out_.failed;
      out_.errors.push_back(id + " (prefill): " + r.value("error", ""));
      End(it);
      return;
    }
    if (it->second.abort_at == AbortAt::kPrefill || it->second.abort_at == AbortAt::kBetween) {
      ++out_.aborted_after_prefill;  // never forwarded: the prefill hold ends by its lease
      End(it);
      return;
    }
    it->second.compute_ms = r.value("compute_ms", 0.0);
    it->second.queue_ms = r.value("queue_ms", 0.0);
    it->second.computed_at_us = r.value("computed_at_us", std::int64_t{0});
    --prefill_load_[it->second.instance];
    it->second.forwarded = Clock::now();
    it->second.instance = LeastLoaded(decode_load_, decode_down_until_, decode_excluded_);
    ++decode_load_[it->second.instance];
    if (it->second.abort_at == AbortAt::kDecode) {
      aborts_.push_back({Clock::now() + RandomDelay(20000), true, it->second.instance, id});
    }
    const auto index = static_cast<std::size_t>(std::stoul(id.substr(4)));
    if (etcd_) forwarded_params_[id] = r["kv_transfer_params"];  // to resend to another decode
    (void)decode_[it->second.instance]->Send({{"op", "generate"},
                                              {"request_id", id},
                                              {"prompt", prompts_[index]},
                                              {"kv_transfer_params", r["kv_transfer_params"]}});
  }

  void OnDecodeAnswer(const Json& r) {
    const std::string id = r.value("request_id", "");
    auto it = inflight_.find(id);
    if (it == inflight_.end() || it->second.decode_answered) return;
    const auto now = Clock::now();
    if (RefusedAsDraining(r) && !it->second.layerwise && it->second.abort_at == AbortAt::kNone &&
        Serving(decode_excluded_)) {
      auto params = forwarded_params_.find(id);
      if (params != forwarded_params_.end()) {
        decode_excluded_[it->second.instance] = true;
        --decode_load_[it->second.instance];
        it->second.instance = LeastLoaded(decode_load_, decode_down_until_, decode_excluded_);
        ++decode_load_[it->second.instance];
        ++out_.resent_to_another_instance;
        const auto index = static_cast<std::size_t>(std::stoul(id.substr(4)));
        (void)decode_[it->second.instance]->Send({{"op", "generate"},
                                                  {"request_id", id},
                                                  {"prompt", prompts_[index]},
                                                  {"kv_transfer_params", params->second}});
        return;
      }
    }
    if (r.value("aborted", false)) {
      ++out_.aborted_at_decode;
    } else if (r.value("ok", false)) {
      ++out_.done;
      if (it->second.abort_at == AbortAt::kDecode) ++out_.aborts_too_late;
      const auto ms = [](Clock::duration d) {
        return std::chrono::duration<double, std::milli>(d).count();
      };
      RequestTiming t;
      t.index = static_cast<std::size_t>(std::stoul(id.substr(4)));
      t.prefill_ms = ms(it->second.forwarded - it->second.sent);
      t.decode_ms = ms(now - it->second.forwarded);
      t.ttft_ms = ms(now - it->second.sent);
      t.load_ms = r.value("load_ms", 0.0);
      t.loaded_bytes = static_cast<std::uint64_t>(r.value("loaded_blocks", 0)) * block_bytes_;
      t.transfer_bytes = r.value("transfer_bytes", std::uint64_t{0});
      t.transfer_ms = r.value("transfer_ms", 0.0);
      t.first_step_ms = r.value("first_step_ms", 0.0);
      t.first_step_at_us = r.value("first_step_at_us", std::int64_t{0});
      t.loaded_at_us = r.value("loaded_at_us", std::int64_t{0});
      t.layerwise = it->second.layerwise;
      if (!it->second.layerwise) {
        t.compute_ms = it->second.compute_ms;
        t.queue_ms = it->second.queue_ms;
        t.computed_at_us = it->second.computed_at_us;
        out_.timings.push_back(t);
      } else {
        // The prefill's compute arrives with its own answer, which may come later.
        pending_timings_[id] = t;
      }
      out_.bytes_verified += r.value("verified_bytes", std::uint64_t{0});
      out_.prefix_hit_blocks += r.value("prefix_hit_blocks", 0);
      out_.recomputed_blocks += r.value("recomputed_blocks", 0);
    } else {
      ++out_.failed;
      out_.errors.push_back(id + " (decode): " + r.value("error", ""));
    }
    if (it->second.layerwise) {
      it->second.decode_answered = true;
      --decode_load_[it->second.instance];
      if (!it->second.prefill_answered) return;
    }
    End(it);
  }

  // An instance that died (or a message lost with it) must not stall the run. One that let a
  // request time out gets no new requests for a timeout's length (unless every instance of its
  // role is down), so a dead instance costs the requests it had, not a stream of new ones.
  void FailStalled() {
    const auto now = Clock::now();
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      auto next_it = std::next(it);
      if (now - it->second.stage_start() > request_timeout_) {
        if (it->second.layerwise && it->second.decode_answered) {
          // Answered by the decode leg (counted then); the prefill leg's answer never came.
          prefill_down_until_[it->second.prefill_instance] = now + request_timeout_;
          End(it);
          it = next_it;
          continue;
        }
        const bool decode = it->second.at_decode();
        const bool several = (decode ? decode_ : prefill_).size() > 1;
        ++out_.failed;
        out_.errors.push_back(
            it->first + ": no answer from the " + (decode ? "decode" : "prefill") + " instance" +
            (several ? " " + std::to_string(it->second.instance) : std::string()) + " within " +
            std::to_string(a_.request_timeout_ms) + " ms");
        (decode ? decode_down_until_ : prefill_down_until_)[it->second.instance] =
            now + request_timeout_;
        End(it);
      }
      it = next_it;
    }
  }

  // On a terminal one line that updates in place; elsewhere (CI logs) a line every 2 s.
  void ReportProgress() {
    const bool tty = isatty(STDERR_FILENO) != 0;
    if (!a_.progress || Clock::now() - last_progress_ <= milliseconds(tty ? 500 : 2000)) return;
    last_progress_ = Clock::now();
    std::fprintf(stderr, "%s[kvferry] %d/%zu requests done, %d aborted, %d failed, %zu in flight%s",
                 tty ? "\r" : "", out_.done, prompts_.size(), out_.aborted(), out_.failed,
                 inflight_.size(), tty ? "   " : "\n");
  }

  const PipelineArgs& a_;
  const std::vector<std::vector<std::int32_t>>& prompts_;
  std::vector<std::unique_ptr<ControlClient>>& prefill_;
  std::vector<std::unique_ptr<ControlClient>>& decode_;
  std::vector<int> prefill_load_;  // outstanding requests per instance
  std::vector<int> decode_load_;
  // An instance that let a request time out is skipped until then.
  std::vector<Clock::time_point> prefill_down_until_;
  std::vector<Clock::time_point> decode_down_until_;
  const std::uint64_t block_bytes_;
  std::mt19937 rng_;
  std::uniform_real_distribution<double> unit_{0, 1};
  const milliseconds request_timeout_;
  PipelineResult out_;
  std::map<std::string, InFlight> inflight_;
  std::map<std::string, RequestTiming> pending_timings_;  // layer-wise, until the prefill answers
  // The prefill instances' connectors (stats "connector"), for layer-wise decode legs; null for
  // an instance that did not say (an older kvferry serve: it gets whole-request legs).
  std::vector<Json> prefill_connectors_;
  // Instances draining or gone (--discovery): no new requests.
  std::vector<bool> prefill_excluded_;
  std::vector<bool> decode_excluded_;
  // --discovery: the registered control endpoints, by index; "" for one given otherwise.
  std::vector<std::string> prefill_endpoints_ =
      std::vector<std::string>(prefill_.size(), std::string());
  std::vector<std::string> decode_endpoints_ =
      std::vector<std::string>(decode_.size(), std::string());
  const std::optional<EtcdTarget> etcd_;
  const std::string secret_;
  bool etcd_away_ = false;
  std::map<std::string, Json> forwarded_params_;  // whole-request, --discovery: by request id
  // Makes transfer ids unique across runs against the same instances.
  const std::string run_tag_ = std::to_string(getpid()) + "-" +
                               std::to_string(Clock::now().time_since_epoch().count() % 1000000);
  std::vector<PendingAbort> aborts_;
  std::size_t next_ = 0;
  int finished_ = 0;
  Clock::time_point last_progress_;
};

// The stats of every instance of a role, numbers summed; the transfer percentiles are the
// slowest instance's. An instance that does not answer (it died) is left out and counted in
// "unreachable"; an error only when none answers.
Result<Json> RoleStats(std::vector<std::unique_ptr<ControlClient>>& clients) {
  Json sum = Json::object();
  int unreachable = 0;
  Status last;
  for (auto& c : clients) {
    Result<Json> got = c->Call({{"op", "stats"}}, milliseconds(5000));
    if (!got.ok()) {
      ++unreachable;
      last = got.status();
      continue;
    }
    const Json& s = *got;
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (!it.value().is_number()) {
        if (!sum.contains(it.key())) sum[it.key()] = it.value();
        continue;
      }
      const bool slowest = it.key().rfind("transfer_p", 0) == 0 || it.key() == "transfer_max_us";
      if (!sum.contains(it.key())) {
        sum[it.key()] = it.value();
      } else if (slowest) {
        sum[it.key()] = std::max(sum[it.key()].get<double>(), it.value().get<double>());
      } else if (it.value().is_number_integer()) {
        sum[it.key()] = sum[it.key()].get<std::int64_t>() + it.value().get<std::int64_t>();
      } else {
        sum[it.key()] = sum[it.key()].get<double>() + it.value().get<double>();
      }
    }
  }
  if (unreachable == static_cast<int>(clients.size())) return last;
  sum["unreachable"] = unreachable;
  return sum;
}

// Everything must be released: holds end as notices arrive, and those of requests abandoned
// after prefill when their lease runs out. Fills the end-of-run fields of `out`.
Status Settle(Deployment& d, const PipelineArgs& a, std::uint64_t bytes_before,
              PipelineResult& out) {
  const Deadline settle = DeadlineAfter(milliseconds(std::max(10000, a.hold_lease_ms + 5000)));
  for (;;) {
    KVFERRY_ASSIGN_OR_RETURN(Json p, RoleStats(d.prefill()));
    KVFERRY_ASSIGN_OR_RETURN(Json dec, RoleStats(d.decode()));
    out.prefill_end = p;
    out.decode_end = dec;
    // A decode instance restarted during the run counts from its own start.
    const std::uint64_t bytes_end = dec.value("bytes_read", std::uint64_t{0});
    out.bytes_moved = bytes_end >= bytes_before ? bytes_end - bytes_before : bytes_end;
    out.leaked = p.value("holds", 0) != 0 || p.value("used_blocks", 0) != 0 ||
                 dec.value("used_blocks", 0) != 0 || dec.value("loads_outstanding", 0) != 0;
    if (!out.leaked || Clock::now() > settle) return Status::Ok();
    std::this_thread::sleep_for(milliseconds(50));
  }
}

}  // namespace

ModelArgs RoleModel(const PipelineArgs& a, bool prefill) {
  ModelArgs m = a.model;
  const std::int64_t tpb = prefill ? a.prefill_tokens_per_block : a.decode_tokens_per_block;
  if (tpb > 0) m.tokens_per_block = tpb;
  return m;
}

Result<std::uint64_t> BytesPerBlock(const ModelArgs& m, int tp) {
  KVFERRY_ASSIGN_OR_RETURN(CacheSpecOptions o, BuildModel(m));
  std::uint64_t total = 0;
  for (int r = 0; r < tp; ++r) {
    o.tp_size = tp;
    o.tp_rank = r;
    KVFERRY_ASSIGN_OR_RETURN(CacheSpec spec, CacheSpec::Create(o));
    for (int p = 0; p < spec.num_parts(); ++p) {
      total += static_cast<std::uint64_t>(spec.BlockBytes(p)) *
               static_cast<std::uint64_t>(spec.num_layers());
    }
  }
  return total;
}

Result<PipelineResult> RunPipeline(const PipelineArgs& a,
                                   const std::vector<std::vector<std::int32_t>>& prompts) {
  // A model the instances would refuse is refused here, before any process starts.
  for (bool prefill : {true, false}) {
    KVFERRY_RETURN_IF_ERROR(BuildGroups(RoleModel(a, prefill)).status());
  }
  if (a.layerwise && a.prefill_pp != a.decode_pp) {
    return Status::NotSupported(
        "--prefill-pp " + std::to_string(a.prefill_pp) + " and --decode-pp " +
        std::to_string(a.decode_pp) +
        " with --layerwise: layer-wise transfer reads a decode stage's layers from the prefill "
        "stage of its own index, so it needs one pipeline-parallel size on both sides "
        "(whole-request legs read unequal pipelines by layer ranges)");
  }
  if (a.layerwise && RoleModel(a, true).tokens_per_block != RoleModel(a, false).tokens_per_block) {
    return Status::InvalidArgument(
        "--layerwise needs one block size on both roles, found " +
        std::to_string(RoleModel(a, true).tokens_per_block) + " prefill and " +
        std::to_string(RoleModel(a, false).tokens_per_block) +
        " decode tokens per block: drop --layerwise (whole-request loads take any sizes) or give "
        "both one size");
  }
  // The decode instances count what they loaded in their own blocks.
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t block_bytes,
                           BytesPerBlock(RoleModel(a, false), a.decode_tp));
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<Deployment> d, Deployment::Start(a));
  // Instances that already ran count from before this run: report this run's bytes only.
  std::uint64_t bytes_before = 0;
  if (d->external() && !d->decode().empty()) {
    Result<Json> s = RoleStats(d->decode());
    if (!s.ok()) return s.status().WithContext("asking " + a.decode_control + " for its stats");
    bytes_before = s->value("bytes_read", std::uint64_t{0});
  }
  // Where each prefill instance's connector listens, for layer-wise decode legs.
  std::vector<Json> connectors;
  for (auto& c : d->prefill()) {
    Json info;
    if (a.layerwise) {
      Result<Json> s = c->Call({{"op", "stats"}}, milliseconds(5000));
      if (!s.ok()) return s.status().WithContext("asking a prefill instance for its connector");
      info = s->value("connector", Json());
    }
    connectors.push_back(std::move(info));
  }
  PipelineResult out = Proxy(a, prompts, *d, block_bytes, std::move(connectors)).Run();
  KVFERRY_RETURN_IF_ERROR(Settle(*d, a, bytes_before, out));
  return out;
}

}  // namespace kvferry::cli
