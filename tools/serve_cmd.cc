// kvferry serve: one engine instance (prefill or decode) with its TP workers, driven over a
// ZeroMQ control socket by a proxy (kvferry demo, bench e2e, or your own).
#include <unistd.h>
#include <zmq.h>

#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "common/clock.h"
#include "engine/engine.h"
#include "sidechannel/zmq_util.h"
#include "tools/commands.h"
#include "tools/engine_protocol.h"

namespace kvferry::cli {
namespace {

using Json = nlohmann::json;

struct ServeArgs {
  std::string role = "prefill";
  std::string engine_id;
  int tp = 1;
  int dp_rank = 0;
  std::string host = "127.0.0.1";
  int base_port = 5557;
  int control_port = 0;
  std::string rank_table;
  std::string transport = "auto";
  bool shm_permit_any_tracer = false;
  std::string visible_devices;
  ModelArgs model;
  int hold_lease_ms = 30000;
  int compute_us_per_token = 0;
  bool exit_on_stdin_eof = false;
};

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
  Result<TransportKind> transport = ParseTransportKind(a.transport);
  Result<CacheSpecOptions> model = BuildModel(a.model);
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
  c.dp_rank = a.dp_rank;
  c.host = a.host;
  c.base_port = a.base_port;
  c.visible_devices = ParseVisibleDevices(a.visible_devices);
  const char* secret = std::getenv("KVFERRY_SECRET");  // NOLINT(concurrency-mt-unsafe): startup
  if (secret != nullptr) c.secret = secret;
  c.transport = *transport;
  c.shm_permit_any_tracer = a.shm_permit_any_tracer;
  c.model = *model;
  c.hold_lease = std::chrono::milliseconds(a.hold_lease_ms);
  c.compute_per_token = std::chrono::microseconds(a.compute_us_per_token);
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
  sidechannel::ZmqSocket control(ZMQ_ROUTER);
  const std::string endpoint = "tcp://" + a.host + ":" + std::to_string(a.control_port);
  if (zmq_bind(control.get(), endpoint.c_str()) != 0) {
    std::cerr << "kvferry serve: cannot bind the control socket " << endpoint << ": "
              << sidechannel::ZmqError() << "\n";
    return 1;
  }
  std::cout << "READY " << endpoint << std::endl;

  std::map<std::string, std::vector<std::uint8_t>> reply_to;  // request id -> proxy identity
  auto reply = [&](const std::vector<std::uint8_t>& identity, const Json& j) {
    const std::string text = j.dump();
    (void)sidechannel::SendFrames(
        control.get(),
        {identity, std::span(reinterpret_cast<const std::uint8_t*>(text.data()), text.size())});
  };
  bool running = true;
  while (running) {
    // With --exit-on-stdin-eof (kvferry demo passes it) the instance ends with its parent.
    zmq_pollitem_t items[2] = {{control.get(), 0, ZMQ_POLLIN, 0},
                               {nullptr, STDIN_FILENO, ZMQ_POLLIN, 0}};
    zmq_poll(items, a.exit_on_stdin_eof ? 2 : 1, (*instance)->Idle() ? 5 : 0);
    if (a.exit_on_stdin_eof && (items[1].revents & (ZMQ_POLLIN | ZMQ_POLLERR)) != 0) {
      char byte = 0;
      if (read(STDIN_FILENO, &byte, 1) <= 0) {
        std::cerr << "kvferry serve: parent went away; exiting\n";
        break;
      }
    }
    for (;;) {
      int events = 0;
      std::size_t len = sizeof(events);
      zmq_getsockopt(control.get(), ZMQ_EVENTS, &events, &len);
      if ((events & ZMQ_POLLIN) == 0) break;
      std::vector<std::vector<std::uint8_t>> frames;
      bool truncated = false;
      if (!sidechannel::RecvFrames(control.get(), &frames, 2, 64 << 20, &truncated).ok() ||
          frames.size() != 2) {
        continue;
      }
      const Json req = Json::parse(frames[1].begin(), frames[1].end(), nullptr, false);
      if (req.is_discarded() || !req.is_object()) {
        reply(frames[0], {{"error", "expected a JSON object"}});
        continue;
      }
      const std::string op = req.value("op", "");
      if (op == "generate") {
        engine::EngineRequest r;
        r.request_id = req.value("request_id", "");
        r.prompt = req.value("prompt", std::vector<std::int32_t>{});
        r.params = ParamsFromJson(req.value("kv_transfer_params", Json::object()));
        reply_to[r.request_id] = frames[0];
        (*instance)->Submit(std::move(r));
      } else if (op == "abort") {
        // No reply of its own: the request's generate reply says how it ended.
        (*instance)->Abort(req.value("request_id", ""));
      } else if (op == "stats") {
        const engine::InstanceStats s = (*instance)->Stats();
        reply(frames[0], {{"used_blocks", s.used_blocks},
                          {"cached_blocks", s.cached_blocks},
                          {"holds", s.holds},
                          {"loads_outstanding", s.loads_outstanding},
                          {"bytes_read", s.bytes_read},
                          {"requests_done", s.requests_done},
                          {"requests_failed", s.requests_failed},
                          {"requests_aborted", s.requests_aborted},
                          {"transfer_p50_us", s.transfer_p50_us},
                          {"transfer_p99_us", s.transfer_p99_us}});
      } else if (op == "shutdown") {
        reply(frames[0], {{"ok", true}});
        running = false;
      } else {
        reply(frames[0], {{"error", "unknown op '" + op + "'"}});
      }
    }
    for (const engine::EngineResult& r : (*instance)->Step()) {
      auto it = reply_to.find(r.request_id);
      if (it == reply_to.end()) continue;
      reply(it->second, {{"request_id", r.request_id},
                         {"ok", r.status.ok()},
                         {"aborted", r.status.code() == StatusCode::kCancelled},
                         {"error", r.status.ok() ? "" : r.status.ToString()},
                         {"kv_transfer_params", ParamsToJson(r.params)},
                         {"prefix_hit_blocks", r.prefix_hit_blocks},
                         {"loaded_blocks", r.loaded_blocks},
                         {"recomputed_blocks", r.recomputed_blocks},
                         {"verified_bytes", r.verified_bytes},
                         {"queue_ms", r.queue_ms},
                         {"compute_ms", r.compute_ms},
                         {"load_ms", r.load_ms}});
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
  serve->add_option("--dp-rank", a->dp_rank, "DP rank")->capture_default_str();
  serve->add_option("--host", a->host, "Address to bind and advertise")->capture_default_str();
  serve->add_option("--base-port", a->base_port, "Side-channel base port")->capture_default_str();
  serve->add_option("--control-port", a->control_port, "Proxy control port")->required();
  serve->add_option("--rank-table", a->rank_table,
                    "Global rank table (JSON; default DISAGGREGATED_PREFILL_RANK_TABLE_PATH)");
  serve->add_option("--visible-devices", a->visible_devices,
                    "Device ids of this instance in the rank table (default "
                    "ASCEND_RT_VISIBLE_DEVICES)");
  serve->add_option("--transport", a->transport, "auto|shm|tcp")->capture_default_str();
  serve->add_flag("--shm-permit-any-tracer", a->shm_permit_any_tracer,
                  "Prefill: prctl(PR_SET_PTRACER_ANY), so that under Yama ptrace_scope=1 decode "
                  "instances beside this one can read it over shm; it lets every same-user "
                  "process ptrace this one (docs/transport.md)");
  serve->add_option("--hold-lease-ms", a->hold_lease_ms, "Prefill hold lease")
      ->capture_default_str();
  serve->add_option("--compute-us-per-token", a->compute_us_per_token,
                    "Simulated prefill compute time per token");
  serve->add_flag("--exit-on-stdin-eof", a->exit_on_stdin_eof,
                  "Exit when stdin closes (for instances started by another process)");
  AddModelOptions(*serve, a->model);
  serve->callback([a, &exit_code] { exit_code = RunServe(*a); });
}

}  // namespace kvferry::cli
