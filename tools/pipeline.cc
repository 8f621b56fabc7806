#include "tools/pipeline.h"

#include <openssl/rand.h>
#include <unistd.h>
#include <zmq.h>

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

// The two instances and the proxy's control clients: started here (in a scratch directory with
// their rank table), or already running (args.prefill_control and decode_control).
class Deployment {
 public:
  static Result<std::unique_ptr<Deployment>> Start(const PipelineArgs& a) {
    auto d = std::unique_ptr<Deployment>(new Deployment());
    d->external_ = !a.prefill_control.empty() && !a.decode_control.empty();
    // Control messages are signed with the instances' secret (docs/control.md): KVFERRY_SECRET,
    // or for the instances started here when it is unset, a fresh random one passed to them.
    const char* env_secret = std::getenv("KVFERRY_SECRET");  // NOLINT(concurrency-mt-unsafe)
    std::string secret = env_secret != nullptr ? env_secret : "";
    if (secret.empty() && !d->external_) secret = RandomSecret();
    if (d->external_) {
      d->prefill_ = std::make_unique<ControlClient>(a.prefill_control, secret);
      d->decode_ = std::make_unique<ControlClient>(a.decode_control, secret);
      return d;
    }
    std::vector<int> taken;
    const int prefill_base = FreeLoopbackPorts(a.prefill_tp, taken);
    const int decode_base = FreeLoopbackPorts(a.decode_tp, taken);
    const int prefill_control = FreeLoopbackPorts(1, taken);
    const int decode_control = FreeLoopbackPorts(1, taken);
    if (prefill_base == 0 || decode_base == 0 || prefill_control == 0 || decode_control == 0) {
      return Status::Unavailable("could not find free ports on 127.0.0.1");
    }
    // The deployment's rank table: one prefill and one decode instance on this host.
    RankTableGenOptions gen;
    gen.hosts = {"127.0.0.1"};
    gen.devices_per_host = a.prefill_tp + a.decode_tp;
    gen.prefill_count = a.prefill_tp;
    gen.decode_count = a.decode_tp;
    KVFERRY_ASSIGN_OR_RETURN(RankTable table, GenerateRankTable(gen));
    d->dir_ = std::filesystem::temp_directory_path() / ("kvferry-demo-" + std::to_string(getpid()));
    std::filesystem::create_directories(d->dir_);
    const std::string table_path = (d->dir_ / "ranktable.json").string();
    std::ofstream(table_path) << table.ToJson();
    KVFERRY_ASSIGN_OR_RETURN(d->prefill_proc_, Spawn(a, "prefill", a.prefill_tp, prefill_base,
                                                     prefill_control, table_path, secret));
    KVFERRY_ASSIGN_OR_RETURN(d->decode_proc_, Spawn(a, "decode", a.decode_tp, decode_base,
                                                    decode_control, table_path, secret));
    d->prefill_ = std::make_unique<ControlClient>(
        "tcp://127.0.0.1:" + std::to_string(prefill_control), secret);
    d->decode_ = std::make_unique<ControlClient>(
        "tcp://127.0.0.1:" + std::to_string(decode_control), secret);
    return d;
  }

  ~Deployment() {
    if (!external_ && prefill_proc_ && decode_proc_) {
      (void)prefill_->Call({{"op", "shutdown"}}, milliseconds(5000));
      (void)decode_->Call({{"op", "shutdown"}}, milliseconds(5000));
      (void)prefill_proc_->CloseAndWait(milliseconds(10000));
      (void)decode_proc_->CloseAndWait(milliseconds(10000));
    }
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  Deployment(const Deployment&) = delete;
  Deployment& operator=(const Deployment&) = delete;

  bool external() const { return external_; }
  ControlClient& prefill() { return *prefill_; }
  ControlClient& decode() { return *decode_; }

 private:
  Deployment() = default;

  static Result<Subprocess> Spawn(const PipelineArgs& a, const char* role, int tp, int base,
                                  int control, const std::string& table_path,
                                  const std::string& secret) {
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
  }

  bool external_ = false;
  std::filesystem::path dir_;
  std::optional<Subprocess> prefill_proc_;
  std::optional<Subprocess> decode_proc_;
  std::unique_ptr<ControlClient> prefill_;  // before the processes end: shutdown goes through it
  std::unique_ptr<ControlClient> decode_;
};

// The proxy's requests: prefill first (asking for remote decode), then decode with the params
// the prefill instance returned, as disaggregated-serving proxies forward them; client aborts at
// random moments; a request with no answer within the timeout fails.
class Proxy {
 public:
  Proxy(const PipelineArgs& a, const std::vector<std::vector<std::int32_t>>& prompts, Deployment& d,
        std::uint64_t block_bytes)
      : a_(a),
        prompts_(prompts),
        prefill_(d.prefill()),
        decode_(d.decode()),
        block_bytes_(block_bytes),
        rng_(a.seed),
        request_timeout_(a.request_timeout_ms) {}

  // Runs until every prompt ended or the run's deadline passed.
  PipelineResult Run() {
    const auto start = Clock::now();
    last_progress_ = start;
    const Deadline deadline = DeadlineAfter(milliseconds(600000));
    while (finished_ < static_cast<int>(prompts_.size()) && Clock::now() < deadline) {
      SubmitUpToConcurrency();
      SendDueAborts();
      zmq_pollitem_t items[2] = {{prefill_.socket(), 0, ZMQ_POLLIN, 0},
                                 {decode_.socket(), 0, ZMQ_POLLIN, 0}};
      zmq_poll(items, 2, 20);
      while (std::optional<Json> r = prefill_.TryRecv()) OnPrefillAnswer(*r);
      while (std::optional<Json> r = decode_.TryRecv()) OnDecodeAnswer(*r);
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
    bool at_decode() const { return forwarded != Clock::time_point{}; }
    // When the answer awaited now was asked for.
    Clock::time_point stage_start() const { return at_decode() ? forwarded : sent; }
  };
  struct PendingAbort {
    Clock::time_point due;
    bool decode = false;
    std::string id;
  };
  using Iter = std::map<std::string, InFlight>::iterator;

  void End(Iter it) {
    inflight_.erase(it);
    ++finished_;
  }
  std::chrono::microseconds RandomDelay(int max_us) {
    return std::chrono::microseconds(static_cast<std::int64_t>(unit_(rng_) * max_us));
  }

  void SubmitUpToConcurrency() {
    while (next_ < prompts_.size() && static_cast<int>(inflight_.size()) < a_.concurrency) {
      const std::string id = "req-" + std::to_string(next_);
      Json params = ParamsToJson(KvTransferParams{});
      params["do_remote_decode"] = true;
      (void)prefill_.Send({{"op", "generate"},
                           {"request_id", id},
                           {"prompt", prompts_[next_]},
                           {"kv_transfer_params", params}});
      InFlight f;
      f.sent = Clock::now();
      if (a_.abort_rate > 0 && unit_(rng_) < a_.abort_rate) {
        f.abort_at = static_cast<AbortAt>(1 + rng_() % 3);
        if (f.abort_at == AbortAt::kPrefill) {
          aborts_.push_back({Clock::now() + RandomDelay(3000), false, id});
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
      (void)(it->decode ? decode_ : prefill_).Send({{"op", "abort"}, {"request_id", it->id}});
      it = aborts_.erase(it);
    }
  }

  void OnPrefillAnswer(const Json& r) {
    const std::string id = r.value("request_id", "");
    auto it = inflight_.find(id);
    if (it == inflight_.end()) return;
    if (r.value("aborted", false)) {
      ++out_.aborted_at_prefill;
      End(it);
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
    it->second.forwarded = Clock::now();
    if (it->second.abort_at == AbortAt::kDecode) {
      aborts_.push_back({Clock::now() + RandomDelay(20000), true, id});
    }
    const auto index = static_cast<std::size_t>(std::stoul(id.substr(4)));
    (void)decode_.Send({{"op", "generate"},
                        {"request_id", id},
                        {"prompt", prompts_[index]},
                        {"kv_transfer_params", r["kv_transfer_params"]}});
  }

  void OnDecodeAnswer(const Json& r) {
    const std::string id = r.value("request_id", "");
    auto it = inflight_.find(id);
    if (it == inflight_.end()) return;
    const auto now = Clock::now();
    if (r.value("aborted", false)) {
      ++out_.aborted_at_decode;
    } else if (r.value("ok", false)) {
      ++out_.done;
      if (it->second.abort_at == AbortAt::kDecode) ++out_.aborts_too_late;
      const auto ms = [](Clock::duration d) {
        return std::chrono::duration<double, std::milli>(d).count();
      };
      RequestTiming t;
      t.prefill_ms = ms(it->second.forwarded - it->second.sent);
      t.decode_ms = ms(now - it->second.forwarded);
      t.ttft_ms = ms(now - it->second.sent);
      t.load_ms = r.value("load_ms", 0.0);
      t.loaded_bytes = static_cast<std::uint64_t>(r.value("loaded_blocks", 0)) * block_bytes_;
      out_.timings.push_back(t);
      out_.bytes_verified += r.value("verified_bytes", std::uint64_t{0});
      out_.prefix_hit_blocks += r.value("prefix_hit_blocks", 0);
      out_.recomputed_blocks += r.value("recomputed_blocks", 0);
    } else {
      ++out_.failed;
      out_.errors.push_back(id + " (decode): " + r.value("error", ""));
    }
    End(it);
  }

  // An instance that died (or a message lost with it) must not stall the run.
  void FailStalled() {
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      auto next_it = std::next(it);
      if (Clock::now() - it->second.stage_start() > request_timeout_) {
        ++out_.failed;
        out_.errors.push_back(it->first + ": no answer from the " +
                              (it->second.at_decode() ? "decode" : "prefill") +
                              " instance within " + std::to_string(a_.request_timeout_ms) + " ms");
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
  ControlClient& prefill_;
  ControlClient& decode_;
  const std::uint64_t block_bytes_;
  std::mt19937 rng_;
  std::uniform_real_distribution<double> unit_{0, 1};
  const milliseconds request_timeout_;
  PipelineResult out_;
  std::map<std::string, InFlight> inflight_;
  std::vector<PendingAbort> aborts_;
  std::size_t next_ = 0;
  int finished_ = 0;
  Clock::time_point last_progress_;
};

// Everything must be released: holds end as notices arrive, and those of requests abandoned
// after prefill when their lease runs out. Fills the end-of-run fields of `out`.
Status Settle(Deployment& d, const PipelineArgs& a, std::uint64_t bytes_before,
              PipelineResult& out) {
  const Deadline settle = DeadlineAfter(milliseconds(std::max(10000, a.hold_lease_ms + 5000)));
  for (;;) {
    Result<Json> p = d.prefill().Call({{"op", "stats"}}, milliseconds(5000));
    Result<Json> dec = d.decode().Call({{"op", "stats"}}, milliseconds(5000));
    if (!p.ok() || !dec.ok()) return p.ok() ? dec.status() : p.status();
    out.prefill_end = *p;
    out.decode_end = *dec;
    // A decode instance restarted during the run counts from its own start.
    const std::uint64_t bytes_end = dec->value("bytes_read", std::uint64_t{0});
    out.bytes_moved = bytes_end >= bytes_before ? bytes_end - bytes_before : bytes_end;
    out.leaked = p->value("holds", 0) != 0 || p->value("used_blocks", 0) != 0 ||
                 dec->value("used_blocks", 0) != 0 || dec->value("loads_outstanding", 0) != 0;
    if (!out.leaked || Clock::now() > settle) return Status::Ok();
    std::this_thread::sleep_for(milliseconds(50));
  }
}

}  // namespace

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
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t block_bytes, BytesPerBlock(a.model, a.decode_tp));
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<Deployment> d, Deployment::Start(a));
  // Instances that already ran count from before this run: report this run's bytes only.
  std::uint64_t bytes_before = 0;
  if (d->external()) {
    Result<Json> s = d->decode().Call({{"op", "stats"}}, milliseconds(5000));
    if (!s.ok()) return s.status().WithContext("asking " + a.decode_control + " for its stats");
    bytes_before = s->value("bytes_read", std::uint64_t{0});
  }
  PipelineResult out = Proxy(a, prompts, *d, block_bytes).Run();
  KVFERRY_RETURN_IF_ERROR(Settle(*d, a, bytes_before, out));
  return out;
}

}  // namespace kvferry::cli
