// kvferry bench control: the connector's control plane (one-block loads end to end, finished
// notices, scheduler bookkeeping, first handshakes), each figure against a baseline measured in the
// same run on the same machine.
#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <iostream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/ports.h"
#include "kvferry/connector.h"
#include "kvferry/transport.h"
#include "sidechannel/auth.h"
#include "sidechannel/client.h"
#include "sidechannel/listener.h"
#include "sidechannel/notifier.h"
#include "sidechannel/zmq_util.h"
#include "tools/commands.h"
#include "wire/messages.h"

namespace kvferry::cli {
namespace {

using Json = nlohmann::json;
using std::chrono::microseconds;
using std::chrono::milliseconds;

struct ControlArgs {
  std::vector<std::string> backends = {"shm", "tcp"};
  int loads = 2000;
  int scheduler_requests = 1000000;
  int notices = 100000;
  int handshakes = 20;
  bool json = false;
};

struct Summary {
  double p50_us = 0, p90_us = 0, p99_us = 0, max_us = 0;
};

Summary Summarize(std::vector<double> us) {
  Summary s;
  if (us.empty()) return s;
  std::sort(us.begin(), us.end());
  auto at = [&](double q) {
    return us[std::min(us.size() - 1,
                       static_cast<std::size_t>(q * static_cast<double>(us.size())))];
  };
  s.p50_us = at(0.50);
  s.p90_us = at(0.90);
  s.p99_us = at(0.99);
  s.max_us = us.back();
  return s;
}

Json ToJson(const Summary& s) {
  return {{"p50_us", s.p50_us}, {"p90_us", s.p90_us}, {"p99_us", s.p99_us}, {"max_us", s.max_us}};
}

double MicrosSince(Clock::time_point t) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t).count();
}

// A small MHA cache in host memory: 4 layers x (K, V), 64 blocks of 16 KiB per part.
constexpr int kLayers = 4;
constexpr std::int64_t kBlocks = 64;

struct HostCache {
  CacheSpec spec;
  std::vector<std::vector<std::uint8_t>> memory;  // one per (layer, part)
  std::vector<std::vector<std::uint64_t>> bases;

  static Result<HostCache> Create() {
    KVFERRY_ASSIGN_OR_RETURN(CacheSpec spec,
                             CacheSpec::Mha(kLayers, 8, 64, kBlocks, 16, DType::kBFloat16));
    HostCache c{spec, {}, {}};
    for (int l = 0; l < kLayers; ++l) {
      c.bases.emplace_back();
      for (int p = 0; p < spec.num_parts(); ++p) {
        c.memory.emplace_back(static_cast<std::size_t>(spec.PartBytes(p)),
                              static_cast<std::uint8_t>(l * 2 + p));
        c.bases.back().push_back(reinterpret_cast<std::uint64_t>(c.memory.back().data()));
      }
    }
    return c;
  }
};

Result<std::unique_ptr<Worker>> MakeWorker(Role role, const std::string& engine, int base_port,
                                           const std::string& backend, HostCache& cache) {
  WorkerConfig c;
  c.role = role;
  c.engine_id = engine;
  c.base_port = base_port;
  c.transport.backend = backend;
  c.hold_lease = milliseconds(60000);
  c.transfer_timeout = milliseconds(10000);
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<Worker> w, Worker::Create(c));
  KVFERRY_RETURN_IF_ERROR(w->RegisterKvCaches(cache.spec, cache.bases));
  return w;
}

// Waits until `worker` reports `id` as received; errors if it failed or took too long.
Status WaitReceived(Worker& worker, const std::string& id) {
  const Deadline deadline = DeadlineAfter(milliseconds(10000));
  for (;;) {
    for (const std::string& got : worker.GetFinished().receiving) {
      if (got == id) {
        std::vector<LoadError> errors = worker.TakeLoadErrors();
        if (!errors.empty()) return errors.front().status.WithContext("load " + id);
        return Status::Ok();
      }
    }
    if (Expired(deadline)) return Status::Timeout("load " + id + " did not finish in 10 s");
    std::this_thread::yield();
  }
}

// One-block loads through the connector (prefill and decode workers in this process, metadata
// cached after the first), against one ZeroMQ round trip plus one raw read of the same bytes.
Result<Json> MeasureLoads(const ControlArgs& a, const std::string& backend) {
  KVFERRY_ASSIGN_OR_RETURN(HostCache prefill_cache, HostCache::Create());
  KVFERRY_ASSIGN_OR_RETURN(HostCache decode_cache, HostCache::Create());
  std::vector<int> taken;
  const int prefill_port = FreeLoopbackPorts(1, taken);
  const int decode_port = FreeLoopbackPorts(1, taken);
  KVFERRY_ASSIGN_OR_RETURN(
      std::unique_ptr<Worker> prefill,
      MakeWorker(Role::kPrefill, "bench-prefill", prefill_port, backend, prefill_cache));
  KVFERRY_ASSIGN_OR_RETURN(
      std::unique_ptr<Worker> decode,
      MakeWorker(Role::kDecode, "bench-decode", decode_port, backend, decode_cache));
  constexpr int kWarmup = 20;
  std::vector<double> load_us;
  for (int i = 0; i < kWarmup + a.loads; ++i) {
    const std::string held = "r" + std::to_string(i);
    const std::string loaded = "d" + std::to_string(i);
    ConnectorMetadata hold;
    hold.holds.push_back({held, 60000, ""});
    prefill->StartLoadKv(hold);
    ConnectorMetadata load;
    const std::int64_t block = i % kBlocks;
    load.loads.push_back(
        {loaded, {block}, {block}, "bench-prefill", "127.0.0.1", prefill_port, 1, held, ""});
    const Clock::time_point start = Clock::now();
    decode->StartLoadKv(load);
    KVFERRY_RETURN_IF_ERROR(WaitReceived(*decode, loaded));
    if (i >= kWarmup) load_us.push_back(MicrosSince(start));
    (void)prefill->GetFinished();  // frees holds whose notices arrived
  }

  // Baseline 1: a ZeroMQ round trip (DEALER -> ROUTER -> DEALER, 64 bytes, over loopback tcp).
  sidechannel::ZmqSocket router(ZMQ_ROUTER);
  const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(FreeLoopbackPorts(1, taken));
  if (zmq_bind(router.get(), endpoint.c_str()) != 0) {
    return Status::Unavailable("cannot bind " + endpoint + ": " + sidechannel::ZmqError());
  }
  std::atomic<bool> stop{false};
  std::thread echo([&] {
    (void)router.SetInt(ZMQ_RCVTIMEO, 100);
    while (!stop.load()) {
      std::vector<std::vector<std::uint8_t>> frames;
      bool truncated = false;
      if (!sidechannel::RecvFrames(router.get(), &frames, 2, 1024, &truncated).ok()) continue;
      if (frames.size() == 2) (void)sidechannel::SendFrames(router.get(), {frames[0], frames[1]});
    }
  });
  sidechannel::ZmqSocket dealer(ZMQ_DEALER);
  KVFERRY_RETURN_IF_ERROR(dealer.SetInt(ZMQ_RCVTIMEO, 5000));
  zmq_connect(dealer.get(), endpoint.c_str());
  const std::vector<std::uint8_t> ping(64, 1);
  std::vector<double> rtt_us;
  for (int i = 0; i < kWarmup + a.loads; ++i) {
    const Clock::time_point start = Clock::now();
    KVFERRY_RETURN_IF_ERROR(sidechannel::SendFrames(dealer.get(), {ping}));
    std::vector<std::vector<std::uint8_t>> frames;
    bool truncated = false;
    KVFERRY_RETURN_IF_ERROR(sidechannel::RecvFrames(dealer.get(), &frames, 1, 1024, &truncated));
    if (i >= kWarmup) rtt_us.push_back(MicrosSince(start));
  }
  stop.store(true);
  echo.join();

  // Baseline 2: a raw read of one block of every layer and part through a transport alone.
  TransportOptions server_options;
  server_options.backend = backend;
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<Transport> server, CreateTransport(server_options));
  TransportOptions client_options = server_options;
  client_options.serve = false;
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<Transport> client, CreateTransport(client_options));
  const CacheSpec& spec = prefill_cache.spec;
  std::vector<ReadOp> ops;
  for (int l = 0; l < kLayers; ++l) {
    for (int p = 0; p < spec.num_parts(); ++p) {
      const auto id = static_cast<RegionId>(l * spec.num_parts() + p);
      std::vector<std::uint8_t>& src = prefill_cache.memory[static_cast<std::size_t>(id)];
      std::vector<std::uint8_t>& dst = decode_cache.memory[static_cast<std::size_t>(id)];
      KVFERRY_RETURN_IF_ERROR(server->RegisterMemory(id, src.data(), src.size()));
      KVFERRY_RETURN_IF_ERROR(client->RegisterMemory(id, dst.data(), dst.size()));
      ops.push_back({reinterpret_cast<std::byte*>(dst.data()), id, 0,
                     static_cast<std::uint64_t>(spec.BlockBytes(p))});
    }
  }
  KVFERRY_ASSIGN_OR_RETURN(std::vector<std::uint8_t> desc, server->Descriptor());
  KVFERRY_ASSIGN_OR_RETURN(PeerId peer, client->Connect(desc, DeadlineAfter(milliseconds(5000))));
  std::vector<double> read_us;
  for (int i = 0; i < kWarmup + a.loads; ++i) {
    const Clock::time_point start = Clock::now();
    KVFERRY_ASSIGN_OR_RETURN(BatchId b,
                             client->SubmitReads(peer, ops, DeadlineAfter(milliseconds(5000))));
    const BatchResult r = client->Wait(b, DeadlineAfter(milliseconds(10000)));
    client->Release(b);
    if (r.state != BatchState::kDone) return r.status.WithContext("raw one-block read");
    if (i >= kWarmup) read_us.push_back(MicrosSince(start));
  }
  const Summary load = Summarize(load_us);
  const Summary rtt = Summarize(rtt_us);
  const Summary read = Summarize(read_us);
  const double baseline = rtt.p50_us + read.p50_us;
  return Json{{"backend", backend},
              {"loads", a.loads},
              {"bytes_per_load", spec.BlockBytes(0) * spec.num_parts() * kLayers},
              {"load", ToJson(load)},
              {"zmq_round_trip", ToJson(rtt)},
              {"raw_read", ToJson(read)},
              {"baseline_p50_us", baseline},
              {"ratio_p50", load.p50_us / baseline},
              {"ratio_p99", load.p99_us / (rtt.p99_us + read.p99_us)}};
}

// Finished notices through the notifier to a listener, against raw DEALER -> ROUTER messages of
// the size of one single-id notice.
Result<Json> MeasureNotices(const ControlArgs& a) {
  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t counted = 0;
  sidechannel::ListenerOptions lo;
  lo.base_port = FreeLoopbackPorts(1);
  KVFERRY_ASSIGN_OR_RETURN(
      std::unique_ptr<sidechannel::Listener> listener,
      sidechannel::Listener::Start(lo, [&](const wire::Message& m) -> wire::Message {
        const auto* f = std::get_if<wire::FinishedNotice>(&m);
        const std::uint32_t n =
            f == nullptr ? 0 : static_cast<std::uint32_t>(f->request_ids.size());
        {
          std::lock_guard<std::mutex> lock(mu);
          counted += n;
        }
        cv.notify_all();
        return wire::Ack{n};
      }));
  sidechannel::Client client(sidechannel::ClientOptions{});
  const std::uint64_t n = static_cast<std::uint64_t>(a.notices);
  double notifier_s = 0;
  std::uint64_t batches = 0;
  {
    sidechannel::FinishedNotifier notifier(
        &client, {"bench-decode", 0, 0}, 1, sidechannel::NotifierOptions{},
        [](const std::string&, const std::vector<std::string>&, const Status&) {});
    const Clock::time_point start = Clock::now();
    for (std::uint64_t i = 0; i < n; ++i) {
      notifier.Finished(listener->endpoint(), "request-" + std::to_string(i),
                        DeadlineAfter(milliseconds(10000)));
    }
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, std::chrono::seconds(60), [&] { return counted >= n; })) {
      return Status::Timeout("only " + std::to_string(counted) + " of " + std::to_string(n) +
                             " notices arrived within 60 s");
    }
    notifier_s = std::chrono::duration<double>(Clock::now() - start).count();
    batches = notifier.batches_sent();
  }

  // The raw baseline: as many one-way messages, each the size of a signed single-id notice.
  const std::vector<std::uint8_t> body =
      wire::Encode(wire::FinishedNotice{{"bench-decode", 0, 0}, {"request-99999"}, 1});
  const std::vector<std::uint8_t> header(sidechannel::kAuthHeaderBytes, 0);
  sidechannel::ZmqSocket router(ZMQ_ROUTER);
  const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(FreeLoopbackPorts(1));
  if (zmq_bind(router.get(), endpoint.c_str()) != 0) {
    return Status::Unavailable("cannot bind " + endpoint + ": " + sidechannel::ZmqError());
  }
  KVFERRY_RETURN_IF_ERROR(router.SetInt(ZMQ_RCVTIMEO, 10000));
  sidechannel::ZmqSocket dealer(ZMQ_DEALER);
  KVFERRY_RETURN_IF_ERROR(dealer.SetInt(ZMQ_SNDHWM, 0));
  KVFERRY_RETURN_IF_ERROR(router.SetInt(ZMQ_RCVHWM, 0));
  zmq_connect(dealer.get(), endpoint.c_str());
  Status received = Status::Ok();
  const Clock::time_point start = Clock::now();
  std::thread sink([&] {
    for (std::uint64_t i = 0; i < n && received.ok(); ++i) {
      std::vector<std::vector<std::uint8_t>> frames;
      bool truncated = false;
      received = sidechannel::RecvFrames(router.get(), &frames, 3, 1 << 20, &truncated);
    }
  });
  for (std::uint64_t i = 0; i < n; ++i) {
    KVFERRY_RETURN_IF_ERROR(sidechannel::SendFrames(dealer.get(), {header, body}));
  }
  sink.join();
  KVFERRY_RETURN_IF_ERROR(received.WithContext("raw ZeroMQ baseline"));
  const double raw_s = std::chrono::duration<double>(Clock::now() - start).count();
  const double ours = static_cast<double>(n) / notifier_s;
  const double raw = static_cast<double>(n) / raw_s;
  return Json{{"notices", n},
              {"notices_per_s", ours},
              {"batches", batches},
              {"raw_zmq_messages_per_s", raw},
              {"message_bytes", body.size() + header.size()},
              {"ratio", ours / raw}};
}

// The scheduler's bookkeeping for one request on the decode side, against the least any such
// bookkeeping costs: one hash-map insert and erase of the request id.
Json MeasureScheduler(const ControlArgs& a) {
  Scheduler s({Role::kDecode, "bench-decode"});
  std::vector<std::string> ids;
  ids.reserve(static_cast<std::size_t>(a.scheduler_requests));
  for (int i = 0; i < a.scheduler_requests; ++i) ids.push_back("request-" + std::to_string(i));
  const std::vector<std::int64_t> blocks = {1, 2, 3, 4};
  std::uint64_t queued = 0;
  const Clock::time_point start = Clock::now();
  for (const std::string& id : ids) {
    KvTransferParams p;
    p.do_remote_prefill = true;
    p.remote_block_ids = blocks;
    p.remote_engine_id = "bench-prefill";
    p.remote_host = "127.0.0.1";
    p.remote_port = 5557;
    p.remote_tp_size = 1;
    p.remote_request_id = id;
    (void)s.GetNumNewMatchedTokens(p, 64, 0);
    (void)s.UpdateStateAfterAlloc(id, p, blocks);
    queued += s.BuildConnectorMeta().loads.size();
    (void)s.RequestFinished(id, p, FinishReason::kStopped, blocks);
  }
  const double ours_ns =
      std::chrono::duration<double, std::nano>(Clock::now() - start).count() / ids.size();
  std::unordered_map<std::string, std::vector<std::int64_t>> map;
  const Clock::time_point base_start = Clock::now();
  for (const std::string& id : ids) {
    map.emplace(id, blocks);
    map.erase(id);
  }
  const double base_ns =
      std::chrono::duration<double, std::nano>(Clock::now() - base_start).count() / ids.size();
  return Json{{"requests", a.scheduler_requests},
              {"loads_queued", queued},
              {"ns_per_request", ours_ns},
              {"hash_map_baseline_ns", base_ns},
              {"ratio", ours_ns / base_ns}};
}

// The first handshake to a new peer (metadata request, descriptor, transport connect), from a
// fresh decode worker each time, against one ZeroMQ round trip of the metadata request alone.
Result<Json> MeasureHandshakes(const ControlArgs& a, const std::string& backend) {
  KVFERRY_ASSIGN_OR_RETURN(HostCache prefill_cache, HostCache::Create());
  const int prefill_port = FreeLoopbackPorts(1);
  KVFERRY_ASSIGN_OR_RETURN(
      std::unique_ptr<Worker> prefill,
      MakeWorker(Role::kPrefill, "bench-prefill", prefill_port, backend, prefill_cache));
  std::vector<double> first_us;
  for (int i = 0; i < a.handshakes; ++i) {
    KVFERRY_ASSIGN_OR_RETURN(HostCache decode_cache, HostCache::Create());
    KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<Worker> decode,
                             MakeWorker(Role::kDecode, "bench-decode-" + std::to_string(i),
                                        FreeLoopbackPorts(1), backend, decode_cache));
    const std::string held = "h" + std::to_string(i);
    ConnectorMetadata hold;
    hold.holds.push_back({held, 60000, ""});
    prefill->StartLoadKv(hold);
    ConnectorMetadata load;
    load.loads.push_back({"l" + std::to_string(i),
                          {0},
                          {0},
                          "bench-prefill",
                          "127.0.0.1",
                          prefill_port,
                          1,
                          held,
                          ""});
    decode->StartLoadKv(load);
    KVFERRY_RETURN_IF_ERROR(WaitReceived(*decode, "l" + std::to_string(i)));
    const WorkerStats st = decode->Stats();
    if (st.handshakes != 1) return Status::Internal("expected one handshake per fresh worker");
    first_us.push_back(static_cast<double>(st.handshake_latency.sum_us()));
    (void)prefill->GetFinished();
  }
  sidechannel::Client client(sidechannel::ClientOptions{});
  const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(prefill_port);
  std::vector<double> call_us;
  for (int i = 0; i < a.handshakes; ++i) {
    const Clock::time_point start = Clock::now();
    KVFERRY_ASSIGN_OR_RETURN(wire::Message reply,
                             client.Call(endpoint, wire::MetadataRequest{{"bench", 0, 0}},
                                         DeadlineAfter(milliseconds(5000))));
    (void)reply;
    call_us.push_back(MicrosSince(start));
  }
  const Summary first = Summarize(first_us);
  const Summary call = Summarize(call_us);
  return Json{{"backend", backend},
              {"handshakes", a.handshakes},
              {"first_handshake", ToJson(first)},
              {"metadata_call", ToJson(call)},
              {"ratio_p50", first.p50_us / call.p50_us}};
}

int RunControl(const ControlArgs& a) {
  Json out = Json::object();
  auto fail = [](const std::string& what, const Status& s) {
    std::cerr << "kvferry bench control: " << what << ": " << s.ToString() << "\n";
    return 1;
  };
  out["loads"] = Json::array();
  out["handshakes"] = Json::array();
  for (const std::string& name : a.backends) {
    if (Status s = CheckTransportBackend(name); !s.ok() || name == "auto") {
      std::cerr << "kvferry bench control: backend '" << name
                << "': expected one of this build's backends, not auto\n";
      return 2;
    }
    Result<Json> loads = MeasureLoads(a, name);
    if (!loads.ok()) return fail("one-block loads over " + name, loads.status());
    out["loads"].push_back(*loads);
    Result<Json> hs = MeasureHandshakes(a, name);
    if (!hs.ok()) return fail("handshakes over " + name, hs.status());
    out["handshakes"].push_back(*hs);
  }
  Result<Json> notices = MeasureNotices(a);
  if (!notices.ok()) return fail("notices", notices.status());
  out["notices"] = *notices;
  out["scheduler"] = MeasureScheduler(a);
  if (a.json) {
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  for (const Json& l : out["loads"]) {
    std::printf(
        "one-block load (%s, %lld bytes): p50 %.0f us p90 %.0f p99 %.0f max %.0f; baseline "
        "(zmq round trip + raw read) p50 %.0f us: %.2fx\n",
        l["backend"].get<std::string>().c_str(), l["bytes_per_load"].get<long long>(),
        l["load"]["p50_us"].get<double>(), l["load"]["p90_us"].get<double>(),
        l["load"]["p99_us"].get<double>(), l["load"]["max_us"].get<double>(),
        l["baseline_p50_us"].get<double>(), l["ratio_p50"].get<double>());
  }
  for (const Json& h : out["handshakes"]) {
    std::printf(
        "first handshake (%s): p50 %.0f us p99 %.0f; metadata call alone p50 %.0f us\n",
        h["backend"].get<std::string>().c_str(), h["first_handshake"]["p50_us"].get<double>(),
        h["first_handshake"]["p99_us"].get<double>(), h["metadata_call"]["p50_us"].get<double>());
  }
  const Json& n = out["notices"];
  std::printf("finished notices: %.0f/s (%llu batches) vs raw ZeroMQ %.0f msgs/s: %.2fx\n",
              n["notices_per_s"].get<double>(), n["batches"].get<unsigned long long>(),
              n["raw_zmq_messages_per_s"].get<double>(), n["ratio"].get<double>());
  const Json& s = out["scheduler"];
  std::printf("scheduler: %.0f ns per request (hash-map insert+erase %.0f ns: %.1fx)\n",
              s["ns_per_request"].get<double>(), s["hash_map_baseline_ns"].get<double>(),
              s["ratio"].get<double>());
  return 0;
}

}  // namespace

void AddBenchControlCommand(CLI::App& bench, int& exit_code) {
  auto a = std::make_shared<ControlArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "control",
      "The connector's control plane against same-run baselines: one-block loads, "
      "finished notices, scheduler bookkeeping, first handshakes");
  cmd->add_option("--backends", a->backends, "Backends for loads and handshakes")
      ->capture_default_str();
  cmd->add_option("--loads", a->loads, "One-block loads per backend")->capture_default_str();
  cmd->add_option("--scheduler-requests", a->scheduler_requests,
                  "Requests through the scheduler's hooks")
      ->capture_default_str();
  cmd->add_option("--notices", a->notices, "Finished notices")->capture_default_str();
  cmd->add_option("--handshakes", a->handshakes, "First handshakes per backend")
      ->capture_default_str();
  cmd->add_flag("--json", a->json, "Machine-readable output");
  cmd->callback([a, &exit_code] { exit_code = RunControl(*a); });
}

}  // namespace kvferry::cli
