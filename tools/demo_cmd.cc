// kvferry demo: a prefill and a decode instance (kvferry serve, TP workers each) on this host,
// driven through a proxy that forwards kv_transfer_params, with every byte verified.
// kvferry bench e2e: the same pipeline over a sweep of prompt lengths.
#include <openssl/rand.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/ports.h"
#include "common/subprocess.h"
#include "kvferry/rank_table.h"
#include "sidechannel/zmq_util.h"
#include "tools/commands.h"
#include "tools/control_client.h"
#include "tools/engine_protocol.h"

namespace kvferry::cli {
namespace {

using Json = nlohmann::json;
using std::chrono::milliseconds;

struct PipelineArgs {
  int prefill_tp = 2;
  int decode_tp = 2;
  ModelArgs model;
  std::string transport = "auto";
  std::vector<std::string> transport_opts;
  bool shm_permit_any_tracer = false;
  int concurrency = 16;
  int hold_lease_ms = 30000;
  int compute_us_per_token = 0;
  std::string memory = "host";
  bool progress = true;
  /// Share of requests the client abandons: at the prefill instance, between prefill and decode,
  /// or at the decode instance (a third each), at a random moment.
  double abort_rate = 0;
  /// A request with no answer from an instance in this long fails (a dead instance).
  int request_timeout_ms = 60000;
  std::uint32_t seed = 7;
  /// Drive instances that already run (kvferry serve) instead of starting two here.
  std::string prefill_control;
  std::string decode_control;
};

struct DemoArgs {
  PipelineArgs pipeline;
  int requests = 200;
  int min_prompt = 32;
  int max_prompt = 2048;
  double shared_prefix = 0.3;
  bool json = false;
};

struct RequestTiming {
  double prefill_ms = 0;  // proxy sent to prefill -> prefill answered
  double decode_ms = 0;   // proxy sent to decode -> decode answered (load and verify)
  double load_ms = 0;     // decode side: load started -> finished
  double ttft_ms = 0;     // proxy sent to prefill -> decode answered
  std::uint64_t loaded_bytes = 0;
};

struct PipelineResult {
  int done = 0;
  int failed = 0;
  int aborted_at_prefill = 0;     // the prefill instance ended it as aborted
  int aborted_after_prefill = 0;  // the client left after prefill: the hold ends by lease
  int aborted_at_decode = 0;      // the decode instance ended it as aborted (load stopped)
  int aborts_too_late = 0;        // abort sent, the request had already ended: done
  int aborted() const { return aborted_at_prefill + aborted_after_prefill + aborted_at_decode; }
  std::vector<std::string> errors;
  std::vector<RequestTiming> timings;
  std::uint64_t bytes_moved = 0;
  std::uint64_t bytes_verified = 0;
  std::int64_t prefix_hit_blocks = 0;
  std::int64_t recomputed_blocks = 0;
  double wall_s = 0;
  Json prefill_end;
  Json decode_end;
  bool leaked = false;
};

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

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto i = static_cast<std::size_t>(std::lround(q * static_cast<double>(v.size() - 1)));
  return v[std::min(i, v.size() - 1)];
}

// Bytes one block occupies across all layers, parts and TP ranks of an instance.
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
  std::vector<int> taken;
  const int prefill_base = FreeLoopbackPorts(a.prefill_tp, taken);
  const int decode_base = FreeLoopbackPorts(a.decode_tp, taken);
  const int prefill_control = FreeLoopbackPorts(1, taken);
  const int decode_control = FreeLoopbackPorts(1, taken);
  if (prefill_base == 0 || decode_base == 0 || prefill_control == 0 || decode_control == 0) {
    return Status::Unavailable("could not find free ports on 127.0.0.1");
  }
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t block_bytes, BytesPerBlock(a.model, a.decode_tp));

  // The deployment's rank table: one prefill and one decode instance on this host.
  RankTableGenOptions gen;
  gen.hosts = {"127.0.0.1"};
  gen.devices_per_host = a.prefill_tp + a.decode_tp;
  gen.prefill_count = a.prefill_tp;
  gen.decode_count = a.decode_tp;
  KVFERRY_ASSIGN_OR_RETURN(RankTable table, GenerateRankTable(gen));
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("kvferry-demo-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string table_path = (dir / "ranktable.json").string();
  std::ofstream(table_path) << table.ToJson();

  // Control messages are signed with the instances' secret (docs/control.md): KVFERRY_SECRET, or
  // for the instances started here when it is unset, a fresh random one passed to them.
  const bool external = !a.prefill_control.empty() && !a.decode_control.empty();
  const char* env_secret = std::getenv("KVFERRY_SECRET");  // NOLINT(concurrency-mt-unsafe)
  std::string secret = env_secret != nullptr ? env_secret : "";
  if (secret.empty() && !external) secret = RandomSecret();
  auto spawn = [&](const char* role, int tp, int base, int control) -> Result<Subprocess> {
    std::vector<std::string> argv = {SelfExe(),
                                     "serve",
                                     "--role",
                                     role,
                                     "--tp",
                                     std::to_string(tp),
                                     "--base-port",
                                     std::to_string(base),
                                     "--control-port",
                                     std::to_string(control),
                                     "--rank-table",
                                     table_path,
                                     "--transport",
                                     a.transport,
                                     "--hold-lease-ms",
                                     std::to_string(a.hold_lease_ms),
                                     "--compute-us-per-token",
                                     std::to_string(a.compute_us_per_token),
                                     "--memory",
                                     a.memory,
                                     "--exit-on-stdin-eof"};
    if (a.shm_permit_any_tracer) argv.emplace_back("--shm-permit-any-tracer");
    for (const std::string& s : TransportOptArgv(a.transport_opts)) argv.push_back(s);
    for (const std::string& s : ModelArgv(a.model)) argv.push_back(s);
    KVFERRY_ASSIGN_OR_RETURN(Subprocess p, Subprocess::Spawn(argv, {"KVFERRY_SECRET=" + secret}));
    KVFERRY_ASSIGN_OR_RETURN(std::string line, p.ReadLine(milliseconds(60000)));
    if (line.rfind("READY ", 0) != 0) {
      return Status::Internal(std::string(role) + " instance did not start: " + line);
    }
    return p;
  };
  std::optional<Subprocess> prefill_proc;
  std::optional<Subprocess> decode_proc;
  if (!external) {
    KVFERRY_ASSIGN_OR_RETURN(prefill_proc,
                             spawn("prefill", a.prefill_tp, prefill_base, prefill_control));
    KVFERRY_ASSIGN_OR_RETURN(decode_proc,
                             spawn("decode", a.decode_tp, decode_base, decode_control));
  }
  ControlClient prefill(
      external ? a.prefill_control : "tcp://127.0.0.1:" + std::to_string(prefill_control), secret);
  ControlClient decode(
      external ? a.decode_control : "tcp://127.0.0.1:" + std::to_string(decode_control), secret);
  // Instances that already ran count from before this run: report this run's bytes only.
  std::uint64_t bytes_before = 0;
  if (external) {
    Result<Json> d = decode.Call({{"op", "stats"}}, milliseconds(5000));
    if (!d.ok()) return d.status().WithContext("asking " + a.decode_control + " for its stats");
    bytes_before = d->value("bytes_read", std::uint64_t{0});
  }

  // The proxy: prefill first (asking for remote decode), then decode with the params the prefill
  // instance returned, as disaggregated-serving proxies forward them.
  PipelineResult out;
  enum class AbortAt { kNone, kPrefill, kBetween, kDecode };
  struct InFlight {
    Clock::time_point sent;
    Clock::time_point forwarded;  // unset until the prefill answer went on to decode
    AbortAt abort_at = AbortAt::kNone;
    bool at_decode() const { return forwarded != Clock::time_point{}; }
    // When the answer awaited now was asked for.
    Clock::time_point stage_start() const { return at_decode() ? forwarded : sent; }
  };
  struct PendingAbort {
    Clock::time_point due;
    bool decode = false;
    std::string id;
  };
  std::map<std::string, InFlight> inflight;
  std::vector<PendingAbort> aborts;
  std::mt19937 rng(a.seed);
  std::uniform_real_distribution<double> unit(0, 1);
  const milliseconds request_timeout(a.request_timeout_ms);

  std::size_t next = 0;
  int finished = 0;
  auto end_request = [&](std::map<std::string, InFlight>::iterator it) {
    inflight.erase(it);
    ++finished;
  };
  const auto random_delay = [&](int max_us) {
    return std::chrono::microseconds(static_cast<std::int64_t>(unit(rng) * max_us));
  };
  const auto start = Clock::now();
  auto last_progress = start;
  const Deadline deadline = DeadlineAfter(milliseconds(600000));
  while (finished < static_cast<int>(prompts.size()) && Clock::now() < deadline) {
    while (next < prompts.size() && static_cast<int>(inflight.size()) < a.concurrency) {
      const std::string id = "req-" + std::to_string(next);
      Json params = ParamsToJson(KvTransferParams{});
      params["do_remote_decode"] = true;
      (void)prefill.Send({{"op", "generate"},
                          {"request_id", id},
                          {"prompt", prompts[next]},
                          {"kv_transfer_params", params}});
      InFlight f;
      f.sent = Clock::now();
      if (a.abort_rate > 0 && unit(rng) < a.abort_rate) {
        f.abort_at = static_cast<AbortAt>(1 + rng() % 3);
        if (f.abort_at == AbortAt::kPrefill) {
          aborts.push_back({Clock::now() + random_delay(3000), false, id});
        }
      }
      inflight[id] = f;
      ++next;
    }
    // Aborts that are due; one for a request that already ended is still sent (a no-op there).
    const auto abort_now = Clock::now();
    for (auto it = aborts.begin(); it != aborts.end();) {
      if (it->due > abort_now) {
        ++it;
        continue;
      }
      (void)(it->decode ? decode : prefill).Send({{"op", "abort"}, {"request_id", it->id}});
      it = aborts.erase(it);
    }
    zmq_pollitem_t items[2] = {{prefill.socket(), 0, ZMQ_POLLIN, 0},
                               {decode.socket(), 0, ZMQ_POLLIN, 0}};
    zmq_poll(items, 2, 20);
    while (std::optional<Json> r = prefill.TryRecv()) {
      const std::string id = r->value("request_id", "");
      auto it = inflight.find(id);
      if (it == inflight.end()) continue;
      if (r->value("aborted", false)) {
        ++out.aborted_at_prefill;
        end_request(it);
        continue;
      }
      if (!r->value("ok", false)) {
        ++out.failed;
        out.errors.push_back(id + " (prefill): " + r->value("error", ""));
        end_request(it);
        continue;
      }
      if (it->second.abort_at == AbortAt::kPrefill || it->second.abort_at == AbortAt::kBetween) {
        ++out.aborted_after_prefill;  // never forwarded: the prefill hold ends by its lease
        end_request(it);
        continue;
      }
      it->second.forwarded = Clock::now();
      if (it->second.abort_at == AbortAt::kDecode) {
        aborts.push_back({Clock::now() + random_delay(20000), true, id});
      }
      const std::size_t index = static_cast<std::size_t>(std::stoul(id.substr(4)));
      (void)decode.Send({{"op", "generate"},
                         {"request_id", id},
                         {"prompt", prompts[index]},
                         {"kv_transfer_params", (*r)["kv_transfer_params"]}});
    }
    while (std::optional<Json> r = decode.TryRecv()) {
      const std::string id = r->value("request_id", "");
      auto it = inflight.find(id);
      if (it == inflight.end()) continue;
      const auto now = Clock::now();
      if (r->value("aborted", false)) {
        ++out.aborted_at_decode;
      } else if (r->value("ok", false)) {
        ++out.done;
        if (it->second.abort_at == AbortAt::kDecode) ++out.aborts_too_late;
        RequestTiming t;
        t.prefill_ms =
            std::chrono::duration<double, std::milli>(it->second.forwarded - it->second.sent)
                .count();
        t.decode_ms = std::chrono::duration<double, std::milli>(now - it->second.forwarded).count();
        t.ttft_ms = std::chrono::duration<double, std::milli>(now - it->second.sent).count();
        t.load_ms = r->value("load_ms", 0.0);
        t.loaded_bytes = static_cast<std::uint64_t>(r->value("loaded_blocks", 0)) * block_bytes;
        out.timings.push_back(t);
        out.bytes_verified += r->value("verified_bytes", std::uint64_t{0});
        out.prefix_hit_blocks += r->value("prefix_hit_blocks", 0);
        out.recomputed_blocks += r->value("recomputed_blocks", 0);
      } else {
        ++out.failed;
        out.errors.push_back(id + " (decode): " + r->value("error", ""));
      }
      end_request(it);
    }
    // An instance that died (or a message lost with it) must not stall the run.
    for (auto it = inflight.begin(); it != inflight.end();) {
      auto next_it = std::next(it);
      if (Clock::now() - it->second.stage_start() > request_timeout) {
        ++out.failed;
        out.errors.push_back(it->first + ": no answer from the " +
                             (it->second.at_decode() ? "decode" : "prefill") + " instance within " +
                             std::to_string(a.request_timeout_ms) + " ms");
        end_request(it);
      }
      it = next_it;
    }
    // On a terminal one line that updates in place; elsewhere (CI logs) a line every 2 s.
    const bool tty = isatty(STDERR_FILENO) != 0;
    if (a.progress && Clock::now() - last_progress > milliseconds(tty ? 500 : 2000)) {
      last_progress = Clock::now();
      std::fprintf(stderr,
                   "%s[kvferry] %d/%zu requests done, %d aborted, %d failed, %zu in flight%s",
                   tty ? "\r" : "", out.done, prompts.size(), out.aborted(), out.failed,
                   inflight.size(), tty ? "   " : "\n");
    }
  }
  out.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  if (a.progress && isatty(STDERR_FILENO) != 0) std::fprintf(stderr, "\r%80s\r", "");
  for (const auto& [id, f] : inflight) {
    ++out.failed;
    out.errors.push_back(id + ": no answer before the run's deadline");
  }
  // Everything must be released: holds end as notices arrive, and those of requests abandoned
  // after prefill when their lease runs out.
  const Deadline settle = DeadlineAfter(milliseconds(std::max(10000, a.hold_lease_ms + 5000)));
  for (;;) {
    Result<Json> p = prefill.Call({{"op", "stats"}}, milliseconds(5000));
    Result<Json> d = decode.Call({{"op", "stats"}}, milliseconds(5000));
    if (!p.ok() || !d.ok()) return p.ok() ? d.status() : p.status();
    out.prefill_end = *p;
    out.decode_end = *d;
    // A decode instance restarted during the run counts from its own start.
    const std::uint64_t bytes_end = d->value("bytes_read", std::uint64_t{0});
    out.bytes_moved = bytes_end >= bytes_before ? bytes_end - bytes_before : bytes_end;
    out.leaked = p->value("holds", 0) != 0 || p->value("used_blocks", 0) != 0 ||
                 d->value("used_blocks", 0) != 0 || d->value("loads_outstanding", 0) != 0;
    if (!out.leaked || Clock::now() > settle) break;
    std::this_thread::sleep_for(milliseconds(50));
  }
  if (!external) {
    (void)prefill.Call({{"op", "shutdown"}}, milliseconds(5000));
    (void)decode.Call({{"op", "shutdown"}}, milliseconds(5000));
    (void)prefill_proc->CloseAndWait(milliseconds(10000));
    (void)decode_proc->CloseAndWait(milliseconds(10000));
  }
  std::filesystem::remove_all(dir);
  return out;
}

// Prompt lengths spread log-uniformly; a share of them start with one of a few common system
// prompts, so the decode side's prefix cache gets hits.
std::vector<std::vector<std::int32_t>> MakePrompts(int n, int min_len, int max_len, double shared,
                                                   std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::int32_t>> prefixes(4);
  for (auto& p : prefixes) {
    for (int i = 0; i < 256; ++i) p.push_back(static_cast<std::int32_t>(rng() % 32000));
  }
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<std::vector<std::int32_t>> out;
  for (int i = 0; i < n; ++i) {
    const double x = std::log(min_len) + u(rng) * (std::log(max_len) - std::log(min_len));
    const auto len = static_cast<std::size_t>(std::exp(x));
    std::vector<std::int32_t> p;
    if (u(rng) < shared) p = prefixes[rng() % prefixes.size()];
    while (p.size() < std::max<std::size_t>(len, 1))
      p.push_back(static_cast<std::int32_t>(rng() % 32000));
    out.push_back(std::move(p));
  }
  return out;
}

int RunDemo(const DemoArgs& a) {
  if (!a.json) {
    std::cout << "kvferry demo: prefill TP " << a.pipeline.prefill_tp << " -> decode TP "
              << a.pipeline.decode_tp << ", " << a.requests << " requests, prompts " << a.min_prompt
              << ".." << a.max_prompt << " tokens, transport " << a.pipeline.transport << ", model "
              << a.pipeline.model.kind << " " << a.pipeline.model.layers << " layers" << std::endl;
  }
  const auto prompts =
      MakePrompts(a.requests, a.min_prompt, a.max_prompt, a.shared_prefix, a.pipeline.seed);
  Result<PipelineResult> r = RunPipeline(a.pipeline, prompts);
  if (!r.ok()) {
    std::cerr << "kvferry demo: " << r.status().ToString() << "\n";
    return 1;
  }
  std::vector<double> load, ttft, prefill, decode;
  for (const RequestTiming& t : r->timings) {
    load.push_back(t.load_ms);
    ttft.push_back(t.ttft_ms);
    prefill.push_back(t.prefill_ms);
    decode.push_back(t.decode_ms);
  }
  const double gb = static_cast<double>(r->bytes_moved) / 1e9;
  Json report = {
      {"requests", a.requests},
      {"done", r->done},
      {"failed", r->failed},
      {"aborted", r->aborted()},
      {"aborted_at_prefill", r->aborted_at_prefill},
      {"aborted_after_prefill", r->aborted_after_prefill},
      {"aborted_at_decode", r->aborted_at_decode},
      {"aborts_too_late", r->aborts_too_late},
      {"errors", std::vector<std::string>(
                     r->errors.begin(),
                     r->errors.begin() +
                         static_cast<std::ptrdiff_t>(std::min<std::size_t>(r->errors.size(), 50)))},
      {"bytes_moved", r->bytes_moved},
      {"bytes_verified", r->bytes_verified},
      {"wall_s", r->wall_s},
      {"throughput_gbps", r->wall_s > 0 ? gb / r->wall_s : 0},
      {"load_p50_ms", Percentile(load, 0.5)},
      {"load_p99_ms", Percentile(load, 0.99)},
      {"transfer_p50_us", r->decode_end.value("transfer_p50_us", 0)},
      {"transfer_p90_us", r->decode_end.value("transfer_p90_us", 0)},
      {"transfer_p99_us", r->decode_end.value("transfer_p99_us", 0)},
      {"transfer_max_us", r->decode_end.value("transfer_max_us", 0)},
      {"ttft_p50_ms", Percentile(ttft, 0.5)},
      {"ttft_p99_ms", Percentile(ttft, 0.99)},
      {"prefill_p50_ms", Percentile(prefill, 0.5)},
      {"decode_p50_ms", Percentile(decode, 0.5)},
      {"prefix_hit_blocks", r->prefix_hit_blocks},
      {"recomputed_blocks", r->recomputed_blocks},
      {"prefill_end", r->prefill_end},
      {"decode_end", r->decode_end},
      {"leaked", r->leaked}};
  if (a.json) {
    std::cout << report.dump(2) << std::endl;
  } else {
    char line[2048];
    std::snprintf(
        line, sizeof(line),
        "requests      %d done, %d aborted, %d failed (of %d)\n"
        "moved         %.3f GB in %.2f s: %.2f GB/s across the run\n"
        "transfer      p50 %.2f ms, p90 %.2f ms, p99 %.2f ms, max %.2f ms per request in the "
        "connector\n"
        "load          p50 %.2f ms, p99 %.2f ms as the decode engine saw it (queued "
        "behind verification)\n"
        "TTFT          p50 %.2f ms, p99 %.2f ms = prefill p50 %.2f ms + transfer and "
        "decode p50 %.2f ms\n"
        "verified      %.3f GB, every byte; %lld blocks from the decode prefix cache, "
        "%lld recomputed\n"
        "held at end   prefill %d blocks, %d holds; decode %d blocks\n",
        r->done, r->aborted(), r->failed, a.requests, gb, r->wall_s,
        r->wall_s > 0 ? gb / r->wall_s : 0, r->decode_end.value("transfer_p50_us", 0) / 1000.0,
        r->decode_end.value("transfer_p90_us", 0) / 1000.0,
        r->decode_end.value("transfer_p99_us", 0) / 1000.0,
        r->decode_end.value("transfer_max_us", 0) / 1000.0, Percentile(load, 0.5),
        Percentile(load, 0.99), Percentile(ttft, 0.5), Percentile(ttft, 0.99),
        Percentile(prefill, 0.5), Percentile(decode, 0.5),
        static_cast<double>(r->bytes_verified) / 1e9, static_cast<long long>(r->prefix_hit_blocks),
        static_cast<long long>(r->recomputed_blocks), r->prefill_end.value("used_blocks", -1),
        r->prefill_end.value("holds", -1), r->decode_end.value("used_blocks", -1));
    std::cout << line;
    for (std::size_t i = 0; i < std::min<std::size_t>(r->errors.size(), 10); ++i) {
      std::cout << "error         " << r->errors[i] << "\n";
    }
  }
  if (!a.json && a.pipeline.abort_rate > 0) {
    std::printf(
        "aborted       %d at prefill, %d after prefill (hold ended by lease), %d at decode "
        "(dropped while waiting, or load stopped and prefill told); %d aborts came after the "
        "request had ended\n",
        r->aborted_at_prefill, r->aborted_after_prefill, r->aborted_at_decode, r->aborts_too_late);
  }
  const bool ok = r->failed == 0 && !r->leaked && r->done + r->aborted() == a.requests;
  if (!a.json) std::cout << (ok ? "demo: ok" : "demo: FAILED") << std::endl;
  return ok ? 0 : 1;
}

void AddPipelineOptions(CLI::App& cmd, PipelineArgs& p) {
  cmd.add_option("--prefill-tp", p.prefill_tp, "TP size of the prefill instance")
      ->capture_default_str();
  cmd.add_option("--decode-tp", p.decode_tp, "TP size of the decode instance")
      ->capture_default_str();
  cmd.add_option("--transport", p.transport, TransportChoices())->capture_default_str();
  AddTransportOptOption(cmd, p.transport_opts);
  cmd.add_flag("--shm-permit-any-tracer", p.shm_permit_any_tracer,
               "Pass --shm-permit-any-tracer to the instances started here (shm between them "
               "under Yama ptrace_scope=1)");
  cmd.add_option("--concurrency", p.concurrency, "Requests in flight")->capture_default_str();
  cmd.add_option("--hold-lease-ms", p.hold_lease_ms,
                 "Prefill hold lease (of the instances started here; with --prefill-control, "
                 "say theirs: the run waits that long for abandoned holds to end)")
      ->capture_default_str();
  cmd.add_option("--abort-rate", p.abort_rate,
                 "Share of requests abandoned by the client, at prefill, between prefill and "
                 "decode, or at decode")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  cmd.add_option("--request-timeout-ms", p.request_timeout_ms,
                 "A request with no answer from an instance in this long fails")
      ->capture_default_str();
  cmd.add_option("--seed", p.seed, "Seed of the prompts and of the abort choices")
      ->capture_default_str();
  cmd.add_option("--compute-us-per-token", p.compute_us_per_token,
                 "Simulated prefill compute per token");
  cmd.add_option("--memory", p.memory,
                 "Where both instances keep their KV caches: host, or a device (sim:0, cuda:0); "
                 "every byte is verified by copying it back")
      ->capture_default_str();
  cmd.add_option("--prefill-control", p.prefill_control,
                 "Control endpoint of a running prefill instance (with --decode-control: drive "
                 "those instead of starting two here)");
  cmd.add_option("--decode-control", p.decode_control,
                 "Control endpoint of a running decode instance");
  AddModelOptions(cmd, p.model);
}

struct E2eArgs {
  PipelineArgs pipeline;
  std::vector<int> prompts = {128, 512, 2048};
  int requests = 24;
  bool json = false;
  std::string chart;
};

// The transport baselines for the model's block size, measured now by bench transport.
Json TransportBaselines(const ModelArgs& m, int tp) {
  Result<CacheSpecOptions> o = BuildModel(m);
  if (!o.ok()) return Json::object();
  o->tp_size = tp;
  Result<CacheSpec> spec = CacheSpec::Create(*o);
  if (!spec.ok()) return Json::object();
  const std::string block = std::to_string(spec->BlockBytes(0));
  Result<Subprocess> p = Subprocess::Spawn({SelfExe(), "bench", "transport", "--sizes", block,
                                            "--repeat", "1", "--min-seconds", "0.3", "--json"});
  if (!p.ok()) return Json::object();
  Result<std::string> line = p->ReadLine(milliseconds(120000));
  (void)p->CloseAndWait(milliseconds(5000));
  if (!line.ok()) return Json::object();
  Json j = Json::parse(*line, nullptr, false);
  return j.is_discarded() ? Json::object() : j;
}

int RunE2e(const E2eArgs& a) {
  Json points = Json::array();
  for (int len : a.prompts) {
    const auto prompts = MakePrompts(a.requests, len, len, 0.0, static_cast<std::uint32_t>(len));
    PipelineArgs p = a.pipeline;
    p.progress = false;
    Result<PipelineResult> r = RunPipeline(p, prompts);
    if (!r.ok()) {
      std::cerr << "kvferry bench e2e: " << r.status().ToString() << "\n";
      return 1;
    }
    std::vector<double> ttft;
    for (const RequestTiming& t : r->timings) ttft.push_back(t.ttft_ms);
    const double gb = static_cast<double>(r->bytes_moved) / 1e9;
    points.push_back({{"prompt_tokens", len},
                      {"requests", a.requests},
                      {"failed", r->failed},
                      {"leaked", r->leaked},
                      {"bytes_moved", r->bytes_moved},
                      {"wall_s", r->wall_s},
                      {"gbps", r->wall_s > 0 ? gb / r->wall_s : 0},
                      {"transfer_p50_us", r->decode_end.value("transfer_p50_us", 0)},
                      {"transfer_p90_us", r->decode_end.value("transfer_p90_us", 0)},
                      {"transfer_p99_us", r->decode_end.value("transfer_p99_us", 0)},
                      {"transfer_max_us", r->decode_end.value("transfer_max_us", 0)},
                      {"ttft_p50_ms", Percentile(ttft, 0.5)},
                      {"ttft_p99_ms", Percentile(ttft, 0.99)}});
    if (!a.json) {
      std::fprintf(stdout,
                   "prompt %6d tokens: %3d requests, %d failed, %.3f GB in %.2f s = %.2f GB/s; "
                   "transfer p50 %.2f p90 %.2f p99 %.2f max %.2f ms; TTFT p50 %.1f ms\n",
                   len, a.requests, r->failed, gb, r->wall_s, r->wall_s > 0 ? gb / r->wall_s : 0,
                   r->decode_end.value("transfer_p50_us", 0) / 1000.0,
                   r->decode_end.value("transfer_p90_us", 0) / 1000.0,
                   r->decode_end.value("transfer_p99_us", 0) / 1000.0,
                   r->decode_end.value("transfer_max_us", 0) / 1000.0, Percentile(ttft, 0.5));
      std::fflush(stdout);
    }
  }
  const Json baselines = TransportBaselines(a.pipeline.model, a.pipeline.decode_tp);
  const Json report = {{"points", points}, {"transport_baselines", baselines}};
  if (a.json) {
    std::cout << report.dump(2) << std::endl;
  } else if (baselines.contains("results")) {
    for (const Json& b : baselines["results"]) {
      std::fprintf(stdout, "baseline %s at %llu-byte blocks: %.2f GB/s (%s %.2f GB/s)\n",
                   b.value("backend", "").c_str(),
                   static_cast<unsigned long long>(b.value("block_bytes", 0)), b.value("gbps", 0.0),
                   b.value("baseline", "").c_str(), b.value("baseline_gbps", 0.0));
    }
  }
  if (!a.chart.empty()) {
    const std::string data = a.chart + ".dat";
    {
      std::ofstream out(data);
      for (const Json& pt : points) {
        out << pt["prompt_tokens"].get<int>() << " " << pt["gbps"].get<double>() << "\n";
      }
    }
    const std::string script = a.chart + ".gp";
    {
      std::ofstream gp(script);
      gp << "set terminal png size 800,500\n"
         << "set output '" << a.chart << "'\n"
         << "set title 'kvferry end to end: prefill TP " << a.pipeline.prefill_tp
         << " -> decode TP " << a.pipeline.decode_tp << "'\n"
         << "set xlabel 'prompt length (tokens)'\nset ylabel 'GB/s moved across the run'\n"
         << "set logscale x 2\nset grid\nset key off\n"
         << "plot '" << data << "' using 1:2 with linespoints lw 2 pt 7\n";
    }
    const std::string cmd = "gnuplot " + script;
    if (std::system(cmd.c_str()) != 0) {  // NOLINT(concurrency-mt-unsafe): one thread here
      std::cerr << "kvferry bench e2e: gnuplot failed; is gnuplot installed (make deps)?\n";
      return 1;
    }
    std::filesystem::remove(data);
    std::filesystem::remove(script);
    if (!a.json) std::cout << "chart: " << a.chart << "\n";
  }
  for (const Json& pt : points) {
    if (pt["failed"].get<int>() != 0 || pt["leaked"].get<bool>()) return 1;
  }
  return 0;
}

}  // namespace

void AddDemoCommands(CLI::App& app, int& exit_code) {
  auto a = std::make_shared<DemoArgs>();
  CLI::App* demo = app.add_subcommand(
      "demo", "Prefill and decode instances on this host moving real KV bytes, all verified");
  demo->add_option("--requests", a->requests, "Requests to drive")->capture_default_str();
  demo->add_option("--min-prompt", a->min_prompt, "Shortest prompt, tokens")->capture_default_str();
  demo->add_option("--max-prompt", a->max_prompt, "Longest prompt, tokens")->capture_default_str();
  demo->add_option("--shared-prefix", a->shared_prefix,
                   "Share of prompts starting with a common system prompt")
      ->capture_default_str();
  demo->add_flag("--json", a->json, "Machine-readable report");
  demo->add_flag("!--no-progress", a->pipeline.progress, "No progress line");
  AddPipelineOptions(*demo, a->pipeline);
  demo->callback([a, &exit_code] { exit_code = RunDemo(*a); });

  auto e = std::make_shared<E2eArgs>();
  CLI::App* bench = app.get_subcommand("bench");
  CLI::App* e2e = bench->add_subcommand(
      "e2e", "The demo pipeline over a sweep of prompt lengths, with transport baselines");
  e2e->add_option("--prompts", e->prompts, "Prompt lengths in tokens")->delimiter(',');
  e2e->add_option("--requests", e->requests, "Requests per prompt length")->capture_default_str();
  e2e->add_flag("--json", e->json, "Machine-readable output");
  e2e->add_option("--chart", e->chart, "Write a PNG chart of GB/s against prompt length (gnuplot)");
  AddPipelineOptions(*e2e, e->pipeline);
  e2e->callback([e, &exit_code] { exit_code = RunE2e(*e); });
}

}  // namespace kvferry::cli
