// kvferry serve: one engine instance (prefill or decode) with its TP workers, driven over a
// ZeroMQ control socket by a proxy (kvferry demo, bench e2e, or your own).
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>

#include "common/clock.h"
#include "common/log.h"
#include "engine/engine.h"
#include "sidechannel/zmq_util.h"
#include "tools/commands.h"
#include "tools/control_client.h"
#include "tools/engine_protocol.h"
#include "tools/fleet_register.h"
#include "tools/metrics_server.h"

namespace kvferry::cli {
namespace {

using Json = nlohmann::json;

struct ServeArgs {
  std::string role = "prefill";
  std::string engine_id;
  int tp = 1;
  int pp = 1;
  int dp_rank = 0;
  std::string host = "127.0.0.1";
  int base_port = 5557;
  std::string control_host = "127.0.0.1";
  int control_port = 0;
  std::string rank_table;
  std::string transport = "auto";
  std::vector<std::string> transport_opts;
  bool shm_permit_any_tracer = false;
  std::string visible_devices;
  ModelArgs model;
  int hold_lease_ms = 30000;
  int compute_us_per_token = 0;
  std::int64_t prefill_chunk_tokens = 0;
  int layers_per_notice = 1;
  int layerwise_start_timeout_ms = 30000;
  int layerwise_progress_timeout_ms = 5000;
  std::string memory = "host";
  bool exit_on_stdin_eof = false;
  std::string metrics_host = "127.0.0.1";
  int metrics_port = -1;      // -1: no metrics endpoint
  std::string register_etcd;  // etcd://HOST:PORT/PREFIX (docs/fleet.md); empty: none
  std::string register_name;  // default: the engine id
  std::string register_url;   // the OpenAI API in front of this instance, if any
  int register_ttl_s = 10;
};

// SIGTERM asks the instance to drain (docs/fleet.md); a second one ends it at once.
std::atomic<bool> g_drain_signal{false};

extern "C" void OnSigterm(int /*signo*/) {
  if (g_drain_signal.exchange(true)) _exit(128 + SIGTERM);
}

const char* OpName(ControlOp op) {
  switch (op) {
    case ControlOp::kGenerate:
      return "generate";
    case ControlOp::kAbort:
      return "abort";
    case ControlOp::kStats:
      return "stats";
    case ControlOp::kShutdown:
      return "shutdown";
    case ControlOp::kDrain:
      return "drain";
    case ControlOp::kUnknown:
      break;
  }
  return "unknown";
}

// The nonce an authentication header claims (bytes 12-27; zero if the header is not one), to
// bind a refusal to the request it refuses. Unverified: it only routes the answer.
sidechannel::AuthNonce ClaimedNonce(const std::vector<std::uint8_t>& header) {
  sidechannel::AuthNonce nonce{};
  if (header.size() == sidechannel::kAuthHeaderBytes) {
    std::copy_n(header.begin() + 12, nonce.size(), nonce.begin());
  }
  return nonce;
}

// What /proc/self/status says of this process: its threads, and its resident memory now and at
// its peak (VmRSS, VmHWM); zeros where it cannot be read.
struct ProcStatus {
  int threads = 0;
  std::uint64_t rss_bytes = 0;
  std::uint64_t rss_peak_bytes = 0;
};

ProcStatus ReadProcStatus() {
  ProcStatus out;
  std::ifstream status("/proc/self/status");
  std::string line;
  auto kib = [&](std::size_t at) { return std::stoull(line.substr(at)) * 1024; };
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) out.threads = std::stoi(line.substr(8));
    if (line.rfind("VmRSS:", 0) == 0) out.rss_bytes = kib(6);
    if (line.rfind("VmHWM:", 0) == 0) out.rss_peak_bytes = kib(6);
  }
  return out;
}

// Eight hex digits that differ between launches.
std::string LaunchTag() {
  std::random_device rd;
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", rd());
  return buf;
}

int RunServe(const ServeArgs& a) {
  engine::InstanceConfig c;
  Result<Role> role = ParseRole(a.role);
  Result<TransportOptionMap> transport = ParseTransportOpts(a.transport_opts, a.transport);
  Result<std::vector<CacheSpecOptions>> model = BuildGroups(a.model);
  for (const Status& s : {role.status(), transport.status(), model.status()}) {
    if (!s.ok()) {
      std::cerr << "kvferry serve: " << s.ToString() << "\n";
      return 2;
    }
  }
  c.role = *role;
  // Like vLLM's default, a fresh id per launch: a restarted instance is a different engine, and
  // decode loads of KV the old one held fail clearly instead of reading the new one's blocks.
  c.engine_id = a.engine_id.empty() ? std::string(RoleName(*role)) + "-" +
                                          std::to_string(a.dp_rank) + "-" + LaunchTag()
                                    : a.engine_id;
  c.tp_size = a.tp;
  c.pp_size = a.pp;
  c.dp_rank = a.dp_rank;
  c.host = a.host;
  c.base_port = a.base_port;
  c.visible_devices = ParseVisibleDevices(a.visible_devices);
  const char* secret = std::getenv("KVFERRY_SECRET");  // NOLINT(concurrency-mt-unsafe): startup
  if (secret != nullptr) c.secret = secret;
  // The control socket (docs/control.md): loopback unless --control-host says otherwise, and
  // then only with a secret, because whoever can send it messages can shut the instance down.
  if (c.secret.empty() && !sidechannel::IsLoopbackHost(a.control_host)) {
    std::cerr << "kvferry serve: the control socket would listen on " << a.control_host
              << " without a secret, so anyone who reaches it could submit requests or shut this "
                 "instance down; set KVFERRY_SECRET (the proxy needs the same), or leave "
                 "--control-host at 127.0.0.1\n";
    return 2;
  }
  c.transport = a.transport;
  c.transport_options = *transport;
  // The flag is the option shm.permit_any_tracer by its own name; --transport-opt, when it sets
  // the option too, decides.
  if (a.shm_permit_any_tracer) c.transport_options.emplace("shm.permit_any_tracer", "true");
  c.model = model->front();
  c.more_groups.assign(model->begin() + 1, model->end());
  c.hold_lease = std::chrono::milliseconds(a.hold_lease_ms);
  c.compute_per_token = std::chrono::microseconds(a.compute_us_per_token);
  c.prefill_chunk_tokens = a.prefill_chunk_tokens;
  c.layers_per_notice = a.layers_per_notice;
  c.layerwise_start_timeout = std::chrono::milliseconds(a.layerwise_start_timeout_ms);
  c.layerwise_progress_timeout = std::chrono::milliseconds(a.layerwise_progress_timeout_ms);
  c.memory = a.memory;
  if (!a.rank_table.empty()) {
    Result<RankTable> t = RankTable::Load(a.rank_table);
    if (!t.ok()) {
      std::cerr << "kvferry serve: " << t.status().ToString() << "\n";
      return 1;
    }
    c.rank_table = *t;
  }
  Result<std::unique_ptr<engine::Instance>> instance = engine::Instance::Create(c);
  if (!instance.ok()) {
    std::cerr << "kvferry serve: " << instance.status().ToString() << "\n";
    return 1;
  }
  // GET /metrics (docs/observability.md), stopped before the instance it reads is destroyed.
  std::unique_ptr<MetricsServer> metrics;
  if (a.metrics_port >= 0) {
    const engine::Instance* source = instance->get();
    Result<std::unique_ptr<MetricsServer>> m = MetricsServer::Start(
        a.metrics_host, a.metrics_port,
        [source] { return PrometheusText(source->ConnectorMetrics(), source->EngineMetrics()); });
    if (!m.ok()) {
      std::cerr << "kvferry serve: " << m.status().ToString() << "\n";
      return 1;
    }
    metrics = std::move(m).value();
  }
  sidechannel::ZmqSocket control(ZMQ_ROUTER);
  (void)control.SetInt64(ZMQ_MAXMSGSIZE, static_cast<std::int64_t>(kMaxControlFrameBytes));
  (void)control.SetInt(ZMQ_SNDTIMEO, 0);  // a proxy that does not read loses its replies
  if (a.control_host.find(':') != std::string::npos) (void)control.SetInt(ZMQ_IPV6, 1);
  const std::string wanted =
      "tcp://" + sidechannel::BracketedHost(a.control_host) + ":" +
      (a.control_port == 0 ? std::string("*") : std::to_string(a.control_port));
  if (zmq_bind(control.get(), wanted.c_str()) != 0) {
    std::cerr << "kvferry serve: cannot bind the control socket " << wanted << ": "
              << sidechannel::ZmqError() << "\n";
    return 1;
  }
  char bound[256] = {};
  std::size_t bound_len = sizeof(bound);
  zmq_getsockopt(control.get(), ZMQ_LAST_ENDPOINT, bound, &bound_len);
  // Its key in etcd, revoked when it exits (docs/fleet.md), after the control socket is bound:
  // a proxy that finds the key can reach the instance.
  std::unique_ptr<FleetRegistration> registration;
  if (!a.register_etcd.empty()) {
    Result<EtcdTarget> etcd = ParseEtcdUrl(a.register_etcd);
    if (!etcd.ok()) {
      std::cerr << "kvferry serve: --register: " << etcd.status().ToString() << "\n";
      return 2;
    }
    Json value = {{"role", *role == Role::kDecode ? "decode" : "prefill"},
                  {"name", a.register_name.empty() ? c.engine_id : a.register_name},
                  {"url", a.register_url},
                  {"control", bound},
                  {"connector",
                   {{"engine_id", c.engine_id},
                    {"host", c.host},
                    {"port", c.base_port + c.dp_rank * c.pp_size * c.tp_size},
                    {"tp_size", c.tp_size},
                    {"pp_size", c.pp_size}}},
                  {"state", "serving"},
                  {"version", "kvferry serve"}};
    Result<std::unique_ptr<FleetRegistration>> r =
        FleetRegistration::Start(*etcd, std::move(value), a.register_ttl_s);
    if (!r.ok()) {
      std::cerr << "kvferry serve: --register: " << r.status().ToString() << "\n";
      return 1;
    }
    registration = std::move(r).value();
  }
  std::cout << "READY " << bound << std::endl;
  if (metrics) std::cout << "METRICS " << metrics->url() << std::endl;

  bool running = true;
  // Draining (SIGTERM or the control message "drain"): no new requests; the instance exits 0 once
  // the requests it has taken have ended, its holds have been read (or their leases ended) and
  // its loads have ended.
  bool draining = false;
  auto start_draining = [&](const char* why) {
    if (draining) return;
    std::cerr << "kvferry serve: draining (" << why << ")\n";
    draining = true;
    if (registration) registration->SetState("draining");
  };
  struct sigaction on_term {};
  on_term.sa_handler = OnSigterm;
  sigemptyset(&on_term.sa_mask);
  sigaction(SIGTERM, &on_term, nullptr);
  int threads_peak = 0;  // the process's, sampled every 20 ms and at each stats request
  Clock::time_point next_sample{};
  std::size_t max_prompt_tokens = 0;
  for (const CacheSpecOptions& g : *model) {
    if (g.layers.front().kind == CacheKind::kState) continue;  // one block holds any prompt
    const auto tokens = static_cast<std::size_t>(g.num_blocks * g.tokens_per_block);
    max_prompt_tokens = max_prompt_tokens == 0 ? tokens : std::min(max_prompt_tokens, tokens);
  }
  struct Pending {
    std::vector<std::uint8_t> identity;
    sidechannel::AuthNonce nonce;
  };
  std::map<std::string, Pending> reply_to;  // request id -> the proxy that asked, its nonce
  sidechannel::ReplayGuard replay(kControlMaxClockSkew, 1u << 16);
  RateLimitedCounter refusals;
  auto reply = [&](const std::vector<std::uint8_t>& identity, const sidechannel::AuthNonce& nonce,
                   Json j) {
    const SignedMessage m = SignControlReply(c.secret, nonce, std::move(j));
    (void)sidechannel::SendFrames(control.get(), {identity, m.header, m.body});
  };
  auto refuse = [&](const std::vector<std::uint8_t>& identity, const sidechannel::AuthNonce& nonce,
                    const Status& s, const ControlRequest* request) {
    if (const std::uint64_t n = refusals.Hit(); n != 0) {
      std::cerr << "kvferry serve: refused control message #" << n << ": " << s.ToString() << "\n";
    }
    Json j = {{"ok", false},
              {"aborted", false},
              {"code", StatusCodeName(s.code())},
              {"error", s.ToString()}};
    if (request != nullptr && request->op != ControlOp::kUnknown) j["op"] = OpName(request->op);
    if (request != nullptr && request->request_id) j["request_id"] = *request->request_id;
    reply(identity, nonce, std::move(j));
  };
  // One message: [identity][authentication header][JSON]. Every outcome is a signed reply bound to
  // the nonce the header claims (zero if it has none), except a message without an identity.
  auto handle = [&](const std::vector<std::vector<std::uint8_t>>& frames, bool truncated) {
    const std::vector<std::uint8_t>& identity = frames[0];
    const sidechannel::AuthNonce nonce =
        frames.size() >= 2 ? ClaimedNonce(frames[1]) : sidechannel::AuthNonce{};
    if (truncated) {
      refuse(identity, nonce,
             Status::ResourceExhausted(
                 "message: expected two frames, [authentication header][JSON]; found more"),
             nullptr);
      return;
    }
    if (frames.size() != 3) {
      refuse(identity, nonce,
             Status::InvalidArgument(
                 "message: expected two frames, [authentication header][JSON]; found " +
                 std::to_string(frames.size() - 1)),
             nullptr);
      return;
    }
    Result<sidechannel::AuthHeader> auth =
        sidechannel::VerifyMessage(c.secret, sidechannel::AuthKind::kRequest, frames[1], frames[2],
                                   sidechannel::AuthNonce{}, kControlMaxClockSkew);
    if (!auth.ok()) {
      refuse(identity, nonce, auth.status(), nullptr);
      return;
    }
    if (!replay.Accept(*auth)) {
      refuse(identity, nonce,
             Status::Unauthenticated(
                 "replayed message: this nonce was already accepted (under this or another "
                 "timestamp), or the replay guard is full and the message is not newer than the "
                 "newest nonce it had to forget; send a fresh message with a new nonce"),
             nullptr);
      return;
    }
    ParsedControlRequest parsed = ParseControlRequest(frames[2], max_prompt_tokens);
    if (!parsed.status.ok()) {
      refuse(identity, nonce, parsed.status, &parsed.request);
      return;
    }
    ControlRequest& r = parsed.request;
    switch (r.op) {
      case ControlOp::kGenerate: {
        if (draining) {
          refuse(identity, nonce,
                 Status::Unavailable("this instance is draining: it takes no new requests and "
                                     "exits once its requests, holds and loads have ended; send "
                                     "the request to another instance"),
                 &r);
          return;
        }
        if (reply_to.count(*r.request_id) != 0) {
          refuse(identity, nonce,
                 Status::InvalidArgument("request_id: \"" + *r.request_id +
                                         "\" is already in flight on this instance; expected a "
                                         "new id"),
                 &r);
          return;
        }
        reply_to[*r.request_id] = {identity, nonce};
        (*instance)->Submit({*r.request_id, std::move(r.prompt), std::move(r.params)});
        return;
      }
      case ControlOp::kAbort:
        // No reply of its own: the request's generate reply says how it ended.
        (*instance)->Abort(*r.request_id);
        return;
      case ControlOp::kStats: {
        const engine::InstanceStats s = (*instance)->Stats();
        const ProcStatus proc = ReadProcStatus();
        threads_peak = std::max(threads_peak, proc.threads);
        reply(identity, nonce,
              {{"ok", true},
               {"state", draining ? "draining" : "serving"},
               {"used_blocks", s.used_blocks},
               {"cached_blocks", s.cached_blocks},
               {"holds", s.holds},
               {"loads_outstanding", s.loads_outstanding},
               {"bytes_read", s.bytes_read},
               {"requests_done", s.requests_done},
               {"requests_failed", s.requests_failed},
               {"requests_aborted", s.requests_aborted},
               {"control_refused", refusals.count()},
               {"transfer_p50_us", s.transfer_p50_us},
               {"transfer_p90_us", s.transfer_p90_us},
               {"transfer_p99_us", s.transfer_p99_us},
               {"transfer_max_us", s.transfer_max_us},
               // The process: threads and resident memory now and at their peak (threads sampled
               // by the loop below, memory by the kernel), what a connector costs an engine.
               {"threads", proc.threads},
               {"threads_peak", threads_peak},
               {"rss_bytes", proc.rss_bytes},
               {"rss_peak_bytes", proc.rss_peak_bytes},
               // Where its connector listens, for a proxy that sends layer-wise decode legs
               // (kv_transfer_params remote_*) before this instance has answered anything.
               {"connector",
                {{"engine_id", c.engine_id},
                 {"host", c.host},
                 {"port", c.base_port + c.dp_rank * c.pp_size * c.tp_size},
                 {"tp_size", c.tp_size},
                 {"pp_size", c.pp_size},
                 {"features", {"layerwise"}}}}});
        return;
      }
      case ControlOp::kShutdown:
        reply(identity, nonce, {{"ok", true}});
        running = false;
        return;
      case ControlOp::kDrain: {
        start_draining("control message");
        const engine::InstanceStats s = (*instance)->Stats();
        reply(identity, nonce,
              {{"ok", true},
               {"state", "draining"},
               {"requests_in_flight", reply_to.size()},
               {"holds", s.holds},
               {"loads_outstanding", s.loads_outstanding}});
        return;
      }
      case ControlOp::kUnknown:
        return;  // ParseControlRequest refuses unknown ops
    }
  };

  while (running) {
    if (Clock::now() >= next_sample) {
      threads_peak = std::max(threads_peak, ReadProcStatus().threads);
      next_sample = Clock::now() + std::chrono::milliseconds(20);
      if (g_drain_signal.load()) start_draining("SIGTERM; a second one ends the instance now");
      if (draining && reply_to.empty() && (*instance)->Idle()) {
        const engine::InstanceStats s = (*instance)->Stats();
        if (s.holds == 0 && s.loads_outstanding == 0) {
          std::cerr << "kvferry serve: drained; exiting\n";
          break;
        }
      }
    }
    // With --exit-on-stdin-eof (kvferry demo passes it) the instance ends with its parent.
    zmq_pollitem_t items[2] = {{control.get(), 0, ZMQ_POLLIN, 0},
                               {nullptr, STDIN_FILENO, ZMQ_POLLIN, 0}};
    // Idle: wake for control messages. Work to do now: go on at once. Waiting for the connector
    // (loads in flight, holds being read): look again after 200 us, sleeping rather than
    // spinning, which would take a core from the transfers themselves; a load that ended is
    // taken up within that, which counts in time-to-first-token.
    const bool waiting = !(*instance)->Idle() && !(*instance)->HasWorkNow();
    const long timeout_ms = (*instance)->Idle() ? 5 : 0;
    if (zmq_poll(items, a.exit_on_stdin_eof ? 2 : 1, timeout_ms) == 0 && waiting) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (a.exit_on_stdin_eof && (items[1].revents & (ZMQ_POLLIN | ZMQ_POLLERR)) != 0) {
      char byte = 0;
      if (read(STDIN_FILENO, &byte, 1) <= 0) {
        std::cerr << "kvferry serve: parent went away; exiting\n";
        break;
      }
    }
    while (running) {
      int events = 0;
      std::size_t len = sizeof(events);
      zmq_getsockopt(control.get(), ZMQ_EVENTS, &events, &len);
      if ((events & ZMQ_POLLIN) == 0) break;
      std::vector<std::vector<std::uint8_t>> frames;
      bool truncated = false;
      if (!sidechannel::RecvFrames(control.get(), &frames, 3, kMaxControlFrameBytes, &truncated)
               .ok() ||
          frames.empty()) {
        continue;  // nothing to answer: no identity
      }
      handle(frames, truncated);
    }
    for (const engine::EngineResult& r : (*instance)->Step()) {
      auto it = reply_to.find(r.request_id);
      if (it == reply_to.end()) continue;
      reply(it->second.identity, it->second.nonce,
            {{"request_id", r.request_id},
             {"ok", r.status.ok()},
             {"aborted", r.status.code() == StatusCode::kCancelled},
             {"code", StatusCodeName(r.status.code())},
             {"error", r.status.ok() ? "" : r.status.ToString()},
             {"kv_transfer_params", ParamsToJson(r.params)},
             {"prefix_hit_blocks", r.prefix_hit_blocks},
             {"loaded_blocks", r.loaded_blocks},
             {"recomputed_blocks", r.recomputed_blocks},
             {"verified_bytes", r.verified_bytes},
             {"queue_ms", r.queue_ms},
             {"compute_ms", r.compute_ms},
             {"load_ms", r.load_ms},
             {"first_step_ms", r.first_step_ms},
             {"computed_at_us", r.computed_at_us},
             {"first_step_at_us", r.first_step_at_us},
             {"loaded_at_us", r.loaded_at_us},
             {"transfer_bytes", r.transfer_bytes},
             {"transfer_ms", r.transfer_ms}});
      reply_to.erase(it);
    }
  }
  return 0;
}

}  // namespace

// The reference connector's environment variables, honoured as defaults.
std::string Env(const char* name) {
  const char* v = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read at startup
  return v == nullptr ? "" : v;
}

void AddServeCommand(CLI::App& app, int& exit_code) {
  auto a = std::make_shared<ServeArgs>();
  if (!Env("VLLM_ASCEND_LLMDD_RPC_IP").empty()) a->host = Env("VLLM_ASCEND_LLMDD_RPC_IP");
  if (!Env("VLLM_ASCEND_LLMDD_RPC_PORT").empty()) {
    a->base_port = std::atoi(Env("VLLM_ASCEND_LLMDD_RPC_PORT").c_str());
  }
  a->rank_table = Env("DISAGGREGATED_PREFILL_RANK_TABLE_PATH");
  a->visible_devices = Env("ASCEND_RT_VISIBLE_DEVICES");
  CLI::App* serve = app.add_subcommand("serve", "Run a prefill or decode engine instance");
  serve->add_option("--role", a->role, "prefill|decode (kv_producer|kv_consumer)")->required();
  serve->add_option("--engine-id", a->engine_id,
                    "Engine id (default: <role>-<dp rank>-<random>, new at every launch)");
  serve->add_option("--tp", a->tp, "TP size: one worker with its own cache per rank")
      ->capture_default_str();
  serve
      ->add_option("--pp", a->pp,
                   "Pipeline stages, each with its own TP workers and its share of the layers "
                   "(vLLM's split); stage s TP rank r listens on base port + (dp rank * pp + s) "
                   "* tp + r")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  serve->add_option("--dp-rank", a->dp_rank, "DP rank")->capture_default_str();
  serve->add_option("--host", a->host, "Address to bind and advertise")->capture_default_str();
  serve->add_option("--base-port", a->base_port, "Side-channel base port")->capture_default_str();
  serve
      ->add_option("--control-port", a->control_port,
                   "Proxy control port (0: any free port, named in the READY line)")
      ->required()
      ->check(CLI::Range(0, 65535));
  serve
      ->add_option("--control-host", a->control_host,
                   "Address of the control socket; anything but loopback needs KVFERRY_SECRET")
      ->capture_default_str();
  serve->add_option("--rank-table", a->rank_table,
                    "Global rank table (JSON; default DISAGGREGATED_PREFILL_RANK_TABLE_PATH)");
  serve->add_option("--visible-devices", a->visible_devices,
                    "Device ids of this instance in the rank table (default "
                    "ASCEND_RT_VISIBLE_DEVICES)");
  serve->add_option("--transport", a->transport, TransportChoices())->capture_default_str();
  AddTransportOptOption(*serve, a->transport_opts);
  serve->add_flag("--shm-permit-any-tracer", a->shm_permit_any_tracer,
                  "Prefill: the transport option shm.permit_any_tracer=true, prctl("
                  "PR_SET_PTRACER_ANY), so that under Yama ptrace_scope=1 decode instances beside "
                  "this one can read it over shm; it lets every same-user process ptrace this one "
                  "(docs/transport.md)");
  serve->add_option("--hold-lease-ms", a->hold_lease_ms, "Prefill hold lease")
      ->capture_default_str();
  serve->add_option("--compute-us-per-token", a->compute_us_per_token,
                    "Simulated prefill compute time per token");
  serve
      ->add_option("--prefill-chunk-tokens", a->prefill_chunk_tokens,
                   "Prefill: compute layer-wise requests in chunks of this many tokens (chunked "
                   "prefill; 0: whole prompts)")
      ->check(CLI::NonNegativeNumber);
  serve
      ->add_option("--layers-per-notice", a->layers_per_notice,
                   "Prefill: announce layer-wise progress every this many layers")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  serve
      ->add_option("--layerwise-start-timeout-ms", a->layerwise_start_timeout_ms,
                   "Decode: a layer-wise load fails when the prefill side has not started its "
                   "request this long after subscribing")
      ->capture_default_str()
      ->check(CLI::Range(1, 3600000));
  serve
      ->add_option("--layerwise-progress-timeout-ms", a->layerwise_progress_timeout_ms,
                   "Decode: a started layer-wise load fails when nothing is announced for this "
                   "long")
      ->capture_default_str()
      ->check(CLI::Range(1, 3600000));
  serve
      ->add_option("--memory", a->memory,
                   "Where the KV caches are: host, or a device such as sim:0 or cuda:0 "
                   "(docs/device.md)")
      ->capture_default_str();
  serve->add_flag("--exit-on-stdin-eof", a->exit_on_stdin_eof,
                  "Exit when stdin closes (for instances started by another process)");
  serve->add_option("--register", a->register_etcd,
                    "etcd://HOST:PORT/PREFIX: register this instance there under a lease, mark it "
                    "draining when it drains, revoke it when it exits (docs/fleet.md)");
  serve->add_option("--register-name", a->register_name,
                    "Its name in the fleet (default: the engine id)");
  serve->add_option("--register-url", a->register_url,
                    "The OpenAI API in front of this instance, which a proxy routes to");
  serve->add_option("--register-ttl-s", a->register_ttl_s, "The lease's TTL, seconds")
      ->capture_default_str()
      ->check(CLI::Range(2, 3600));
  serve
      ->add_option("--metrics-port", a->metrics_port,
                   "Serve GET /metrics (Prometheus text) on this port (0: any free port, named in "
                   "the METRICS line after READY); off when not given")
      ->check(CLI::Range(0, 65535));
  serve
      ->add_option("--metrics-host", a->metrics_host,
                   "Address of the metrics endpoint (read-only, no authentication)")
      ->capture_default_str();
  AddModelOptions(*serve, a->model);
  serve->callback([a, &exit_code] { exit_code = RunServe(*a); });
}

// kvferry drain etcd://HOST:PORT/PREFIX/instances/ROLE/NAME: the instance's key says draining
// (proxies stop sending it requests; the vLLM adapter, which watches its key, reports "drained"
// there once nothing is held or loading). --wait: until it says drained, or its key is gone.
static int DrainRegistered(const std::string& url, bool wait, int timeout_ms) {
  Result<EtcdTarget> etcd = ParseEtcdUrl(url);
  if (!etcd.ok() || etcd->prefix.find("/instances/") == std::string::npos) {
    std::cerr << "kvferry drain: expected etcd://HOST:PORT/PREFIX/instances/ROLE/NAME, found '"
              << url << "'\n";
    return 2;
  }
  const std::string key = etcd->prefix;
  if (Status s = SetRegisteredState(*etcd, key, "draining"); !s.ok()) {
    std::cerr << "kvferry drain: " << s.ToString() << "\n";
    return 1;
  }
  std::cout << "draining: " << key << std::endl;
  if (!wait) return 0;
  const Deadline deadline = DeadlineAfter(std::chrono::milliseconds(timeout_ms));
  while (Clock::now() < deadline) {
    Result<std::optional<Registered>> r = GetRegistered(*etcd, key);
    if (r.ok() && (!*r || (*r)->value.value("state", "") == "drained")) {
      std::cout << "drained: " << (*r ? "the instance reports it" : "the key is gone") << std::endl;
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::cerr << "kvferry drain: " << key << " not drained after " << timeout_ms << " ms\n";
  return 1;
}

void AddDrainCommand(CLI::App& app, int& exit_code) {
  struct DrainArgs {
    std::string endpoint;
    bool wait = false;
    int timeout_ms = 180000;
  };
  auto a = std::make_shared<DrainArgs>();
  CLI::App* drain = app.add_subcommand(
      "drain",
      "Tell a kvferry serve instance to drain: it takes no new requests, keeps serving its holds "
      "until their readers confirm (or their leases end), finishes its loads, then exits 0 "
      "(docs/fleet.md). Signed with KVFERRY_SECRET, as every control message");
  drain
      ->add_option("endpoint", a->endpoint,
                   "The instance's control endpoint, tcp://HOST:PORT (kvferry serve), or its key "
                   "in etcd, etcd://HOST:PORT/PREFIX/instances/ROLE/NAME (any registered "
                   "instance, the vLLM adapter's included)")
      ->required();
  drain->add_flag("--wait", a->wait, "Wait until the instance has drained and exited");
  drain->add_option("--timeout-ms", a->timeout_ms, "How long --wait waits")->capture_default_str();
  drain->callback([a, &exit_code] {
    if (a->endpoint.rfind("etcd://", 0) == 0) {
      exit_code = DrainRegistered(a->endpoint, a->wait, a->timeout_ms);
      return;
    }
    const char* env = std::getenv("KVFERRY_SECRET");  // NOLINT(concurrency-mt-unsafe)
    ControlClient client(a->endpoint, env == nullptr ? "" : env);
    Result<Json> r = client.Call({{"op", "drain"}}, std::chrono::milliseconds(5000));
    if (!r.ok() || !r->value("ok", false)) {
      std::cerr << "kvferry drain: " << a->endpoint << ": "
                << (r.ok() ? r->dump() : r.status().ToString()) << "\n";
      exit_code = 1;
      return;
    }
    std::cout << "draining: " << r->dump() << std::endl;
    if (!a->wait) return;
    // Drained once the instance stops answering: it exits when its requests, holds and loads
    // have ended.
    const Deadline deadline = DeadlineAfter(std::chrono::milliseconds(a->timeout_ms));
    while (Clock::now() < deadline) {
      Result<Json> s = client.Call({{"op", "stats"}}, std::chrono::milliseconds(1000));
      if (!s.ok()) {
        std::cout << "drained: the instance no longer answers" << std::endl;
        return;
      }
      std::cout << "holds " << s->value("holds", 0) << ", loads "
                << s->value("loads_outstanding", 0) << std::endl;
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
    std::cerr << "kvferry drain: " << a->endpoint << " still answers after " << a->timeout_ms
              << " ms\n";
    exit_code = 1;
  });
}

}  // namespace kvferry::cli
