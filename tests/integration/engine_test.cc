// The reference engine (src/engine) with a prefill and a decode instance in this process, wired
// through the real connector: prefix-cache eviction under memory pressure and aborts on both
// sides, every byte verified and nothing left allocated.
#include "engine/engine.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/ports.h"
#include "tests/test_timing.h"

namespace kvferry::engine {
namespace {

using std::chrono::milliseconds;

CacheSpecOptions Model(std::int64_t num_blocks) {
  LayerSpec layer;
  layer.kind = CacheKind::kMha;
  layer.parts = {{"k", 2, 64}, {"v", 2, 64}};
  CacheSpecOptions o;
  o.layers.assign(2, layer);
  o.num_blocks = num_blocks;
  o.tokens_per_block = 16;
  return o;
}

std::unique_ptr<Instance> MakeInstance(Role role, std::int64_t num_blocks, int tp,
                                       std::chrono::milliseconds lease = milliseconds(30000),
                                       const std::string& memory = "host",
                                       const std::vector<CacheSpecOptions>& more_groups = {}) {
  InstanceConfig c;
  c.more_groups = more_groups;
  c.memory = memory;
  c.role = role;
  c.engine_id = std::string(RoleName(role)) + "-" + std::to_string(FreeLoopbackPorts(1));
  c.tp_size = tp;
  c.base_port = FreeLoopbackPorts(tp);
  c.model = Model(num_blocks);
  c.hold_lease = lease;
  Result<std::unique_ptr<Instance>> i = Instance::Create(c);
  EXPECT_TRUE(i.ok()) << i.status().ToString();
  return i.ok() ? std::move(i).value() : nullptr;
}

std::vector<std::int32_t> Prompt(std::size_t len, std::int32_t salt,
                                 const std::vector<std::int32_t>& prefix = {}) {
  std::vector<std::int32_t> p = prefix;
  for (std::size_t i = p.size(); i < len; ++i)
    p.push_back(static_cast<std::int32_t>(i) * 31 + salt);
  return p;
}

// A proxy in miniature: prefill, then decode with the params prefill returned.
class Pair {
 public:
  Pair(std::int64_t prefill_blocks, std::int64_t decode_blocks, int tp = 1,
       std::chrono::milliseconds lease = milliseconds(30000),
       const std::string& prefill_memory = "host", const std::string& decode_memory = "host",
       const std::vector<CacheSpecOptions>& more_groups = {})
      : prefill_(
            MakeInstance(Role::kPrefill, prefill_blocks, tp, lease, prefill_memory, more_groups)),
        decode_(MakeInstance(Role::kDecode, decode_blocks, tp, milliseconds(30000), decode_memory,
                             more_groups)) {}
  bool ok() const { return prefill_ != nullptr && decode_ != nullptr; }

  void SubmitPrefill(const std::string& id, std::vector<std::int32_t> prompt) {
    prompts_[id] = prompt;
    KvTransferParams p;
    p.do_remote_decode = true;
    prefill_->Submit({id, std::move(prompt), p});
  }
  // One step of both; prefill answers go on to decode unless `hold_back` says otherwise.
  void Step() {
    for (EngineResult& r : prefill_->Step()) {
      if (!r.status.ok() || hold_back_.count(r.request_id) != 0) {
        prefill_results_[r.request_id] = r;
        continue;
      }
      prefill_results_[r.request_id] = r;
      decode_->Submit({r.request_id, prompts_.at(r.request_id), r.params});
    }
    for (EngineResult& r : decode_->Step()) {
      EXPECT_EQ(decode_results_.count(r.request_id), 0u) << r.request_id << " ended twice";
      decode_results_[r.request_id] = r;
    }
  }
  // Steps until `done` holds or the deadline passes.
  template <typename Pred>
  bool RunUntil(Pred done, milliseconds timeout = milliseconds(20000) * testing::kTimingSlack) {
    const Deadline deadline = DeadlineAfter(timeout);
    while (!Expired(deadline)) {
      Step();
      if (done()) return true;
      std::this_thread::sleep_for(milliseconds(1));
    }
    return false;
  }
  bool AllReleased() {
    const InstanceStats p = prefill_->Stats();
    const InstanceStats d = decode_->Stats();
    return p.holds == 0 && p.used_blocks == 0 && d.used_blocks == 0 && d.loads_outstanding == 0;
  }
  // What AllReleased looks at, for a failure's message.
  std::string Held() {
    const InstanceStats p = prefill_->Stats();
    const InstanceStats d = decode_->Stats();
    return "prefill holds " + std::to_string(p.holds) + ", prefill used blocks " +
           std::to_string(p.used_blocks) + ", decode used blocks " + std::to_string(d.used_blocks) +
           ", decode loads outstanding " + std::to_string(d.loads_outstanding);
  }

  Instance& prefill() { return *prefill_; }
  Instance& decode() { return *decode_; }
  std::map<std::string, EngineResult>& prefill_results() { return prefill_results_; }
  std::map<std::string, EngineResult>& decode_results() { return decode_results_; }
  std::set<std::string>& hold_back() { return hold_back_; }

 private:
  std::unique_ptr<Instance> prefill_;
  std::unique_ptr<Instance> decode_;
  std::map<std::string, std::vector<std::int32_t>> prompts_;
  std::map<std::string, EngineResult> prefill_results_;
  std::map<std::string, EngineResult> decode_results_;
  std::set<std::string> hold_back_;
};

// Shared memory resident in this process (RssShmem of /proc/self/status), bytes.
std::int64_t ResidentShmemBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("RssShmem:", 0) == 0) return std::stoll(line.substr(9)) * 1024;  // kB
  }
  ADD_FAILURE() << "/proc/self/status has no RssShmem line";
  return 0;
}

// A GPU engine's KV cache is resident from start-up (vLLM zeroes it); the reference engine's is
// too, so no first write into a page faults inside a measured compute or transfer
// (docs/layerwise.md, "Concurrency 256"). Fails on an engine that leaves its caches untouched.
TEST(EngineTest, TheCachesAreResidentFromTheStart) {
  const std::int64_t before = ResidentShmemBytes();
  std::unique_ptr<Instance> p = MakeInstance(Role::kPrefill, 4096, 2);
  ASSERT_NE(p, nullptr);
  const std::int64_t bytes = p->caches(0).TotalBytes() + p->caches(1).TotalBytes();
  ASSERT_GE(bytes, std::int64_t{32} << 20);
  EXPECT_GE(ResidentShmemBytes() - before, bytes)
      << "the engine's " << bytes << " bytes of KV cache are not all resident after Create";
}

// The decode side's prefix cache fills the whole pool; a request that hits a cached prefix and
// needs fresh blocks must evict other entries, never its own hits (found by the two-host test:
// the hits were evicted and reused, and the engine died on a missing cache entry).
TEST(EngineTest, EvictionUnderPressureKeepsThePrefixHitsOfTheRequest) {
  Pair pair(/*prefill_blocks=*/64, /*decode_blocks=*/12);
  ASSERT_TRUE(pair.ok());
  const std::vector<std::int32_t> shared = Prompt(64, 7);  // 4 full blocks
  // "a" caches the shared prefix (the least recently used entries), "b" fills the pool, and "d"
  // hits the prefix and needs 6 fresh blocks with 2 free: the 4 oldest entries are its hits.
  const std::vector<std::pair<std::string, std::vector<std::int32_t>>> order = {
      {"a", Prompt(80, 1, shared)}, {"b", Prompt(90, 2)}, {"d", Prompt(150, 4, shared)}};
  for (const auto& [id, prompt] : order) {
    pair.SubmitPrefill(id, prompt);
    ASSERT_TRUE(pair.RunUntil([&] { return pair.decode_results().count(id) == 1; })) << id;
    const EngineResult& r = pair.decode_results().at(id);
    ASSERT_TRUE(r.status.ok()) << id << ": " << r.status.ToString();
    EXPECT_GT(r.verified_bytes, 0u);
  }
  EXPECT_EQ(pair.decode_results().at("d").prefix_hit_blocks, 4);
  EXPECT_GT(pair.decode().Stats().cached_blocks, 0);
  EXPECT_TRUE(pair.RunUntil([&] { return pair.AllReleased(); }));
}

// Issue 14: both instances keep their caches in device memory (two sim devices: addresses that
// fault if host code touches them), TP 2, with decode prefix hits; every byte is verified by
// copying the blocks back from the device.
TEST(EngineTest, DeviceMemoryOnBothSidesVerifiesEveryByte) {
  Pair pair(64, 64, /*tp=*/2, milliseconds(30000), "sim:0", "sim:1");
  ASSERT_TRUE(pair.ok());
  const std::vector<std::int32_t> shared = Prompt(64, 3);
  for (const auto& [id, prompt] : std::vector<std::pair<std::string, std::vector<std::int32_t>>>{
           {"a", Prompt(100, 1, shared)}, {"b", Prompt(130, 2, shared)}, {"c", Prompt(40, 5)}}) {
    pair.SubmitPrefill(id, prompt);
    ASSERT_TRUE(pair.RunUntil([&] { return pair.decode_results().count(id) == 1; })) << id;
    const EngineResult& r = pair.decode_results().at(id);
    ASSERT_TRUE(r.status.ok()) << id << ": " << r.status.ToString();
    EXPECT_GT(r.verified_bytes, 0u);
  }
  EXPECT_EQ(pair.decode_results().at("b").prefix_hit_blocks, 4);
  EXPECT_TRUE(pair.RunUntil([&] { return pair.AllReleased(); }));
}

// Aborts while waiting on either side end the request at once; nothing is held afterwards.
TEST(EngineTest, AbortWhileWaitingEndsTheRequestOnceOnEitherSide) {
  Pair pair(64, 64);
  ASSERT_TRUE(pair.ok());
  pair.SubmitPrefill("p", Prompt(100, 1));
  pair.prefill().Abort("p");  // before the prefill engine schedules it
  pair.prefill().Abort("p");  // twice: still one end
  ASSERT_TRUE(pair.RunUntil([&] { return pair.prefill_results().count("p") == 1; }));
  EXPECT_EQ(pair.prefill_results().at("p").status.code(), StatusCode::kCancelled);
  EXPECT_EQ(pair.decode_results().count("p"), 0u);

  pair.SubmitPrefill("d", Prompt(100, 2));
  pair.hold_back().insert("d");
  ASSERT_TRUE(pair.RunUntil([&] { return pair.prefill_results().count("d") == 1; }));
  const EngineResult held = pair.prefill_results().at("d");
  ASSERT_TRUE(held.status.ok());
  pair.decode().Submit({"d", Prompt(100, 2), held.params});
  pair.decode().Abort("d");  // before the decode engine allocates for it
  ASSERT_TRUE(pair.RunUntil([&] { return pair.decode_results().count("d") == 1; }));
  EXPECT_EQ(pair.decode_results().at("d").status.code(), StatusCode::kCancelled);
  EXPECT_EQ(pair.decode().Stats().requests_aborted, 1u);
  EXPECT_EQ(pair.prefill().Stats().requests_aborted, 1u);
  // The decode side never loaded "d", yet the prefill hold ends now (a load of no blocks notifies
  // it), not at its 30 s lease.
  EXPECT_TRUE(pair.RunUntil([&] { return pair.AllReleased(); }, milliseconds(5000)));
}

// A decode request aborted while its KV loads: the connector stops the load and tells the
// prefill side, whose hold ends at once (not at its lease); the request ends once, Cancelled.
TEST(EngineTest, AbortDuringALoadReleasesBothSides) {
  // TP 2 and long prompts so the load is still running when the abort comes in most runs; when
  // it is not, the request completes verified, which is also a correct outcome of an abort.
  Pair pair(512, 512, /*tp=*/2, /*lease=*/milliseconds(600000));
  ASSERT_TRUE(pair.ok());
  int aborted = 0;
  for (int i = 0; i < 8; ++i) {
    const std::string id = "r" + std::to_string(i);
    pair.SubmitPrefill(id, Prompt(2000, i));
    // The step that ends the prefill also hands the request to decode, which starts its load.
    ASSERT_TRUE(pair.RunUntil([&] { return pair.prefill_results().count(id) == 1; }));
    pair.decode().Abort(id);
    ASSERT_TRUE(pair.RunUntil([&] { return pair.decode_results().count(id) == 1; })) << id;
    const EngineResult& r = pair.decode_results().at(id);
    if (r.status.code() == StatusCode::kCancelled) {
      ++aborted;
    } else {
      EXPECT_TRUE(r.status.ok()) << r.status.ToString();
    }
  }
  EXPECT_GT(aborted, 0) << "no abort landed while a load ran";
  // Holds end by readers or by the abort notice, long before the 10-minute lease.
  EXPECT_TRUE(pair.RunUntil([&] { return pair.AllReleased(); }, milliseconds(10000)))
      << pair.Held();
  EXPECT_EQ(pair.decode().Stats().requests_aborted, static_cast<std::uint64_t>(aborted));
}

// A hybrid model (full attention, a sliding window, a state group) whose load fails: the prefill
// hold ended by its lease before the decode side read it. The decode engine recomputes what the
// load should have brought, every group's (the state as of the prompt less its last token, vLLM's
// rule), and verifies it; nothing is left allocated. Found by review: the recompute wrote the
// state after the whole prompt, and the request failed verification.
TEST(EngineTest, AHybridLoadThatFailsIsRecomputedGroupByGroupAndVerified) {
  CacheSpecOptions swa = Model(64);
  swa.sliding_window = 24;
  CacheSpecOptions state;
  state.layers.assign(2,
                      {CacheKind::kState, {{"conv", 8, 3}, {"ssm", 2, 16, DType::kFloat32}}, {}});
  state.num_blocks = 8;
  state.tokens_per_block = 16;
  Pair pair(64, 64, 1, milliseconds(50), "host", "host", {swa, state});
  ASSERT_TRUE(pair.ok());
  pair.SubmitPrefill("h", Prompt(100, 3));
  pair.hold_back().insert("h");
  ASSERT_TRUE(pair.RunUntil([&] { return pair.prefill_results().count("h") == 1; }));
  const EngineResult held = pair.prefill_results().at("h");
  ASSERT_TRUE(held.status.ok()) << held.status.ToString();
  ASSERT_TRUE(held.params.remote_group_block_ids.has_value());
  // The lease ends the hold: its blocks go back to the prefill pool.
  ASSERT_TRUE(pair.RunUntil([&] { return pair.prefill().Stats().holds == 0; }));
  pair.decode().Submit({"h", Prompt(100, 3), held.params});
  ASSERT_TRUE(pair.RunUntil([&] { return pair.decode_results().count("h") == 1; }));
  const EngineResult r = pair.decode_results().at("h");
  EXPECT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_GT(r.recomputed_blocks, 0);
  EXPECT_GT(r.verified_bytes, 0u);
  EXPECT_TRUE(pair.RunUntil([&] { return pair.AllReleased(); })) << pair.Held();
}

}  // namespace
}  // namespace kvferry::engine
