// The connector's multi-process test harness: a prefill instance in another process
// (connector_peer) driven by lines on stdin, and a decode instance (TP workers, a scheduler, a
// block allocator) in the test's process, every byte checkable. Shared by connector_test.cc,
// connector_hardening_test.cc and layerwise_test.cc.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "common/clock.h"
#include "common/ports.h"
#include "common/subprocess.h"
#include "device/device.h"
#include "kv_test_cache.h"
#include "kvferry/connector.h"

namespace kvferry::testing {

using std::chrono::milliseconds;

// A base port with `count` free ports after it (checked a moment ago).
inline int FreeBasePort(int count) {
  const int base = FreeLoopbackPorts(count);
  return base != 0 ? base : 29000;
}

struct Params {
  std::vector<std::int64_t> blocks;
  int port = 0;
  int tp = 0;
};

// The prefill instance: a child process, its output lines collected by a thread.
class PrefillProcess {
 public:
  PrefillProcess(const std::string& kind, int tp, const std::string& engine, int lease_ms,
                 const std::string& secret = "", int base_port = 0)
      : base_port_(base_port != 0 ? base_port : FreeBasePort(tp)), engine_(engine) {
    std::vector<std::string> argv = {KVFERRY_CONNECTOR_PEER_PATH, kind,   std::to_string(tp),
                                     std::to_string(base_port_),  engine, std::to_string(lease_ms)};
    if (!secret.empty()) argv.push_back(secret);
    Result<Subprocess> p = Subprocess::Spawn(argv);
    EXPECT_TRUE(p.ok());
    process_.emplace(std::move(p).value());
    reader_ = std::thread([this] {
      for (;;) {
        Result<std::string> line = process_->ReadLine(milliseconds(100000));
        if (!line.ok()) return;
        std::lock_guard<std::mutex> lock(mu_);
        lines_.push_back(*line);
        cv_.notify_all();
      }
    });
    EXPECT_TRUE(WaitLine("READY", milliseconds(20000))) << "prefill process did not start";
  }
  ~PrefillProcess() {
    // Let the child exit first, so the reader thread sees EOF and ends before the pipes close.
    if (!process_->CloseAndWait(milliseconds(5000)).ok()) {
      process_->Signal(SIGKILL);
      (void)process_->CloseAndWait(milliseconds(5000));
    }
    reader_.join();
    process_.reset();
  }

  void Send(const std::string& line) { EXPECT_TRUE(process_->WriteLine(line).ok()); }
  bool WaitLine(const std::string& line, milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] {
      return std::find(lines_.begin(), lines_.end(), line) != lines_.end();
    });
  }
  bool HasLine(const std::string& line) {
    std::lock_guard<std::mutex> lock(mu_);
    return std::find(lines_.begin(), lines_.end(), line) != lines_.end();
  }
  std::optional<std::string> WaitPrefix(const std::string& prefix, milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    std::optional<std::string> found;
    cv_.wait_for(lock, timeout, [&] {
      for (const std::string& l : lines_) {
        if (l.rfind(prefix, 0) == 0) {
          found = l;
          return true;
        }
      }
      return false;
    });
    return found;
  }
  // Finishes a request on the prefill side and returns its kv_transfer_params.
  Params Hold(const std::string& req, int blocks) {
    Send("hold " + req + " " + std::to_string(blocks));
    std::optional<std::string> line = WaitPrefix("PARAMS " + req + " ", milliseconds(10000));
    EXPECT_TRUE(line.has_value());
    std::istringstream in(line.value_or(""));
    std::string tag, id, ids;
    Params p;
    in >> tag >> id >> ids >> p.port >> p.tp;
    if (ids != "-") {
      std::istringstream list(ids);
      std::string b;
      while (std::getline(list, b, ',')) p.blocks.push_back(std::stoll(b));
    }
    return p;
  }
  // Layer-wise: a step computing prompt tokens [first, end) of `req` under transfer `xfer`;
  // returns all of the request's blocks so far.
  std::vector<std::int64_t> Step(const std::string& req, const std::string& xfer,
                                 std::int64_t first, std::int64_t end, std::int64_t prompt) {
    const std::size_t before = LineCount();
    Send("lw_step " + req + " " + xfer + " " + std::to_string(first) + " " + std::to_string(end) +
         " " + std::to_string(prompt));
    std::optional<std::string> line =
        WaitPrefixAfter("LWSTEP " + req + " ", before, milliseconds(10000));
    EXPECT_TRUE(line.has_value());
    std::istringstream in(line.value_or(""));
    std::string tag, id, ids;
    in >> tag >> id >> ids;
    std::vector<std::int64_t> blocks;
    std::istringstream list(ids);
    std::string b;
    while (std::getline(list, b, ',')) blocks.push_back(std::stoll(b));
    return blocks;
  }
  // Writes and announces layer `layer` of the current step, and waits until it did.
  void Layer(int layer) {
    const std::size_t before = LineCount();
    Send("lw_layer " + std::to_string(layer));
    EXPECT_TRUE(WaitPrefixAfter("LAYER " + std::to_string(layer), before, milliseconds(10000)));
  }
  void Layers(int first, int end) {
    for (int l = first; l < end; ++l) Layer(l);
  }
  // The request stops on its length cap (held under its transfer id), or is aborted.
  void Finish(const std::string& req) {
    Send("lw_finish " + req);
    EXPECT_TRUE(WaitLine("HELD " + req, milliseconds(10000)));
  }
  void Abort(const std::string& req) {
    Send("lw_abort " + req);
    EXPECT_TRUE(WaitLine("FREED " + req, milliseconds(10000)));
  }
  // Side-channel messages of `type` the prefill ranks received, summed.
  std::uint64_t Count(const std::string& type) {
    const std::size_t before = LineCount();
    Send("count " + type);
    std::optional<std::string> line =
        WaitPrefixAfter("COUNT " + type + " ", before, milliseconds(5000));
    return line ? std::stoull(line->substr(7 + type.size())) : 0;
  }
  // Waits until the prefill ranks have taken `n` subscriptions in all.
  bool WaitSubscribed(std::uint64_t n, milliseconds timeout = milliseconds(10000)) {
    const Deadline deadline = DeadlineAfter(timeout);
    while (Clock::now() < deadline) {
      if (Count("subscribe") >= n) return true;
      std::this_thread::sleep_for(milliseconds(2));
    }
    return false;
  }
  std::size_t LineCount() {
    std::lock_guard<std::mutex> lock(mu_);
    return lines_.size();
  }
  std::optional<std::string> WaitPrefixAfter(const std::string& prefix, std::size_t after,
                                             milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    std::optional<std::string> found;
    cv_.wait_for(lock, timeout, [&] {
      for (std::size_t i = after; i < lines_.size(); ++i) {
        if (lines_[i].rfind(prefix, 0) == 0) {
          found = lines_[i];
          return true;
        }
      }
      return false;
    });
    return found;
  }
  std::string Stats() {
    std::size_t before = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      before = lines_.size();
    }
    Send("stats");
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, milliseconds(5000), [&] {
      for (std::size_t i = before; i < lines_.size(); ++i) {
        if (lines_[i].rfind("STATS", 0) == 0) return true;
      }
      return false;
    });
    for (std::size_t i = lines_.size(); i-- > before;) {
      if (lines_[i].rfind("STATS", 0) == 0) return lines_[i];
    }
    return "no stats";
  }
  // Kills the process and waits until it is gone: a process that is dying can still be read.
  void Kill() {
    process_->Signal(SIGKILL);
    (void)process_->CloseAndWait(milliseconds(5000));
  }
  void Signal(int sig) { process_->Signal(sig); }
  int base_port() const { return base_port_; }
  /// Rank 0's side channel, as a reader reaches it.
  std::string endpoint() const { return "tcp://127.0.0.1:" + std::to_string(base_port_); }
  const std::string& engine() const { return engine_; }

 private:
  int base_port_;
  std::string engine_;
  std::optional<Subprocess> process_;
  std::thread reader_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> lines_;
};

// The decode instance: TP workers in this process, a scheduler and a block allocator.
class DecodeInstance {
 public:
  DecodeInstance(const std::string& kind, int tp, const std::string& secret = "",
                 milliseconds transfer_timeout = milliseconds(5000),
                 milliseconds handshake_timeout = milliseconds(2000),
                 const std::function<void(WorkerConfig&)>& configure = nullptr,
                 const std::string& memory = "host")
      : tp_(tp) {
    const int base = FreeBasePort(tp);
    for (int r = 0; r < tp; ++r) {
      CacheSpec spec = *TestSpec(kind, tp, r);
      caches_.push_back(std::make_unique<TestCache>(spec));
      std::vector<std::vector<std::uint64_t>> bases = caches_.back()->Bases();
      MemoryKind mem_kind;
      if (memory != "host") {
        // The cache lives in device memory; caches_ is its host mirror, filled by
        // SyncFromDevice for the checks.
        mem_kind = *ParseMemoryKind(memory);
        Result<device::Device*> dev = device::ProcessDevice(memory);
        EXPECT_TRUE(dev.ok()) << dev.status().ToString();
        device_ = *dev;
        for (int l = 0; l < spec.num_layers(); ++l) {
          for (int p = 0; p < spec.num_parts(); ++p) {
            auto alloc = device_->Allocate(static_cast<std::uint64_t>(spec.PartBytes(p)));
            EXPECT_TRUE(alloc.ok()) << alloc.status().ToString();
            bases[static_cast<std::size_t>(l)][static_cast<std::size_t>(p)] = (*alloc)->address();
            device_parts_.push_back({r, l, p, std::move(alloc).value()});
          }
        }
      }
      WorkerConfig c;
      c.role = Role::kDecode;
      c.engine_id = "decode-0";
      c.tp_size = tp;
      c.tp_rank = r;
      c.base_port = base;
      c.secret = secret;
      c.transfer_timeout = transfer_timeout;
      c.handshake_timeout = handshake_timeout;
      c.notice_timeout = milliseconds(1000);
      // The data plane the test runs over (ctest's connector_test_ucx sets ucx; default auto);
      // the prefill peer process reads the same variable.
      if (const char* t = std::getenv("KVFERRY_TEST_TRANSPORT"); t != nullptr) {  // NOLINT
        c.transport.backend = t;
      }
      if (configure) configure(c);
      Result<std::unique_ptr<Worker>> w = Worker::Create(c);
      EXPECT_TRUE(w.ok()) << w.status().ToString();
      EXPECT_TRUE((*w)->RegisterKvCaches(spec, bases, mem_kind).ok());
      workers_.push_back(std::move(w).value());
    }
    for (std::int64_t b = 0; b < caches_[0]->spec().num_blocks(); ++b) free_.insert(b);
    SchedulerConfig sc;
    sc.role = Role::kDecode;
    sc.engine_id = "decode-0";
    scheduler_ = std::make_unique<Scheduler>(sc);
  }

  // Rules 1-3 as an engine drives them, then StartLoadKv on `ranks` (default: all).
  Status Load(const std::string& req, const PrefillProcess& prefill, const Params& p,
              int prefix_hit_blocks = 0, std::vector<int> ranks = {}) {
    return LoadFrom(req, prefill.engine(), p, prefix_hit_blocks, std::move(ranks));
  }
  // The same from engine `engine` at 127.0.0.1:p.port (a peer that is not a PrefillProcess).
  Status LoadFrom(const std::string& req, const std::string& engine, const Params& p,
                  int prefix_hit_blocks = 0, std::vector<int> ranks = {}) {
    KvTransferParams params;
    params.do_remote_prefill = true;
    params.remote_block_ids = p.blocks;
    params.remote_engine_id = engine;
    params.remote_host = "127.0.0.1";
    params.remote_port = p.port;
    params.remote_tp_size = p.tp;
    params.remote_request_id = req;
    const std::int64_t tokens_per_block = caches_[0]->spec().tokens_per_block();
    const std::int64_t prompt = static_cast<std::int64_t>(p.blocks.size()) * tokens_per_block;
    auto [count, async] =
        scheduler_->GetNumNewMatchedTokens(params, prompt, prefix_hit_blocks * tokens_per_block);
    EXPECT_EQ(count, prompt - prefix_hit_blocks * tokens_per_block);
    std::vector<std::int64_t> local;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(p.blocks.size()) - prefix_hit_blocks;
         ++i) {
      local.push_back(*free_.begin());
      free_.erase(free_.begin());
    }
    allocated_[req] = local;
    remote_[req] = p.blocks;
    KVFERRY_RETURN_IF_ERROR(scheduler_->UpdateStateAfterAlloc(req, params, local));
    EXPECT_FALSE(params.do_remote_prefill);
    (void)async;
    Result<ConnectorMetadata> meta =
        ConnectorMetadata::Decode(scheduler_->BuildConnectorMeta().Encode());
    KVFERRY_RETURN_IF_ERROR(meta.status());
    if (ranks.empty()) {
      for (int r = 0; r < tp_; ++r) ranks.push_back(r);
    }
    for (int r : ranks) workers_[static_cast<std::size_t>(r)]->StartLoadKv(*meta);
    return Status::Ok();
  }

  // A layer-wise load of `prompt` tokens (rule 16): the decode leg's params name the prefill
  // instance and the transfer, not its blocks; `prefix_hit_blocks` blocks are already here.
  Status LoadLayerwise(const std::string& req, const std::string& xfer,
                       const PrefillProcess& prefill, int prefill_tp, std::int64_t prompt,
                       int prefix_hit_blocks = 0) {
    KvTransferParams params;
    params.do_remote_prefill = true;
    params.transfer_id = xfer;
    params.remote_engine_id = prefill.engine();
    params.remote_host = "127.0.0.1";
    params.remote_port = prefill.base_port();
    params.remote_tp_size = prefill_tp;
    const std::int64_t tokens_per_block = caches_[0]->spec().tokens_per_block();
    const std::int64_t blocks = (prompt + tokens_per_block - 1) / tokens_per_block;
    auto [count, async] =
        scheduler_->GetNumNewMatchedTokens(params, prompt, prefix_hit_blocks * tokens_per_block);
    EXPECT_EQ(count, prompt - prefix_hit_blocks * tokens_per_block);
    EXPECT_TRUE(async);
    std::vector<std::int64_t> local;
    for (std::int64_t i = 0; i < blocks - prefix_hit_blocks; ++i) {
      local.push_back(*free_.begin());
      free_.erase(free_.begin());
    }
    allocated_[req] = local;
    KVFERRY_RETURN_IF_ERROR(scheduler_->UpdateStateAfterAlloc(req, params, local));
    Result<ConnectorMetadata> meta =
        ConnectorMetadata::Decode(scheduler_->BuildConnectorMeta().Encode());
    KVFERRY_RETURN_IF_ERROR(meta.status());
    for (auto& w : workers_) w->StartLoadKv(*meta);
    return Status::Ok();
  }
  // The remote blocks a layer-wise request was read from (the prefill's LWSTEP line), for
  // Mismatches.
  void SetRemoteBlocks(const std::string& req, std::vector<std::int64_t> blocks) {
    remote_[req] = std::move(blocks);
  }
  // Whether any rank has reported `req` so far (without waiting).
  bool Reported(const std::string& req) {
    (void)WaitReceived(req, {}, milliseconds(0));
    return !received_[req].empty();
  }

  // Device memory: copies every part back into the host mirror that Mismatches checks.
  void SyncFromDevice() {
    auto stream = device_->CreateStream();
    ASSERT_TRUE(stream.ok());
    for (const DevicePart& d : device_parts_) {
      TestCache& cache = *caches_[static_cast<std::size_t>(d.rank)];
      auto* host = reinterpret_cast<std::byte*>(  // NOLINT(performance-no-int-to-ptr)
          cache.Bases()[static_cast<std::size_t>(d.layer)][static_cast<std::size_t>(d.part)]);
      ASSERT_TRUE((*stream)
                      ->CopyDeviceToHost(host, d.alloc->address(),
                                         static_cast<std::uint64_t>(cache.spec().PartBytes(d.part)))
                      .ok());
    }
    auto event = (*stream)->RecordEvent();
    ASSERT_TRUE(event.ok());
    ASSERT_TRUE((*event)->Wait(DeadlineAfter(milliseconds(10000))).ok());
  }

  // Waits until each of `ranks` reports `req` as received; collects load errors.
  bool WaitReceived(const std::string& req, std::vector<int> ranks, milliseconds timeout) {
    if (ranks.empty()) {
      for (int r = 0; r < tp_; ++r) ranks.push_back(r);
    }
    const Deadline deadline = DeadlineAfter(timeout);
    for (bool first = true; first || Clock::now() < deadline; first = false) {
      for (int r = 0; r < tp_; ++r) {
        for (const std::string& id :
             workers_[static_cast<std::size_t>(r)]->GetFinished().receiving) {
          EXPECT_EQ(received_[id].count(r), 0u) << id << " reported twice by rank " << r;
          received_[id].insert(r);
        }
        for (LoadError& e : workers_[static_cast<std::size_t>(r)]->TakeLoadErrors()) {
          errors_[e.request_id].push_back(std::move(e));
        }
      }
      bool all = true;
      for (int r : ranks) all = all && received_[req].count(r) != 0;
      if (all) return true;
      std::this_thread::sleep_for(milliseconds(5));
    }
    return false;
  }

  std::int64_t Mismatches(const std::string& req, std::vector<int> ranks = {}) {
    if (ranks.empty()) {
      for (int r = 0; r < tp_; ++r) ranks.push_back(r);
    }
    const std::vector<std::int64_t>& local = allocated_[req];
    const std::vector<std::int64_t>& remote = remote_[req];
    const std::size_t offset = remote.size() - local.size();  // the tail rule
    std::int64_t bad = 0;
    for (int r : ranks) {
      for (std::size_t i = 0; i < local.size(); ++i) {
        bad += caches_[static_cast<std::size_t>(r)]->Mismatches(local[i], remote[offset + i]);
      }
    }
    return bad;
  }
  const std::vector<LoadError>& Errors(const std::string& req) { return errors_[req]; }
  const std::vector<std::int64_t>& LocalBlocks(const std::string& req) { return allocated_[req]; }
  void Free(const std::string& req) {
    for (std::int64_t b : allocated_[req]) free_.insert(b);
    allocated_.erase(req);
  }
  std::size_t allocated() const {
    std::size_t n = 0;
    for (const auto& [id, b] : allocated_) n += b.size();
    return n;
  }
  std::uint64_t loads_outstanding() const {
    std::uint64_t n = 0;
    for (const auto& w : workers_) n += w->Stats().loads_outstanding;
    return n;
  }
  Worker& worker(int r) { return *workers_[static_cast<std::size_t>(r)]; }

 private:
  int tp_;
  std::vector<std::unique_ptr<TestCache>> caches_;
  struct DevicePart {
    int rank, layer, part;
    std::unique_ptr<device::DeviceAllocation> alloc;
  };
  device::Device* device_ = nullptr;
  std::vector<DevicePart> device_parts_;  // declared before workers_: freed after they stop
  std::vector<std::unique_ptr<Worker>> workers_;
  std::unique_ptr<Scheduler> scheduler_;
  std::set<std::int64_t> free_;
  std::map<std::string, std::vector<std::int64_t>> allocated_;
  std::map<std::string, std::vector<std::int64_t>> remote_;
  std::map<std::string, std::set<int>> received_;
  std::map<std::string, std::vector<LoadError>> errors_;
};

inline void ExpectNothingLeft(PrefillProcess& prefill, DecodeInstance& decode) {
  // Holds may take a moment to be released after the last notice.
  const Deadline deadline = DeadlineAfter(milliseconds(5000));
  std::string stats;
  while (Clock::now() < deadline) {
    stats = prefill.Stats();
    if (stats == "STATS holds=0 allocated=0") break;
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_EQ(stats, "STATS holds=0 allocated=0");
  EXPECT_EQ(decode.allocated(), 0u);
  EXPECT_EQ(decode.loads_outstanding(), 0u);
}

// The transfer records (Worker::TakeLoadTransfers) of every decode rank since the last call, by
// request id: how many ranks listed it and the bytes they read.
inline std::map<std::string, std::pair<int, std::uint64_t>> TakeTransfers(DecodeInstance& decode,
                                                                          int tp) {
  std::map<std::string, std::pair<int, std::uint64_t>> out;
  for (int r = 0; r < tp; ++r) {
    for (const LoadTransfer& t : decode.worker(r).TakeLoadTransfers()) {
      EXPECT_GT(t.duration.count(), 0) << t.request_id;
      ++out[t.request_id].first;
      out[t.request_id].second += t.bytes;
    }
  }
  return out;
}

inline std::uint64_t BytesRead(DecodeInstance& decode, int tp) {
  std::uint64_t n = 0;
  for (int r = 0; r < tp; ++r) n += decode.worker(r).Stats().bytes_read;
  return n;
}

}  // namespace kvferry::testing
