// A decode worker at real scale (issue 30): 1,024 layer-wise loads at once on one worker, each
// subscribed before its prefill starts, read as its layers are announced and verified, while the
// worker's threads stay bounded. A load is a state machine stepped by a few threads
// (WorkerConfig::layerwise_threads), not a thread that sleeps between announcements: with a
// thread per load, at most that many subscribed before the others' prefill had finished.
// Prefill and decode workers in one process over the real listener and the tcp transport.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <thread>

#include "common/clock.h"
#include "common/ports.h"
#include "kvferry/connector.h"
#include "tests/integration/test_workers.h"

namespace kvferry {
namespace {

constexpr int kLoads = 1024;
constexpr std::int64_t kTokens = 4;  // one block a request
constexpr int kLayers = 2;

// The process's threads now (/proc/self/status).
int Threads() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

struct Cache {
  CacheSpec spec;
  std::vector<std::vector<std::vector<std::uint8_t>>> bytes;  // [layer][part]

  explicit Cache(std::uint8_t seed)
      : spec(*CacheSpec::Mha(kLayers, 2, 8, kLoads + 8, kTokens, DType::kFloat16)) {
    for (int l = 0; l < kLayers; ++l) {
      auto& layer = bytes.emplace_back();
      for (int p = 0; p < spec.num_parts(); ++p) {
        auto& part = layer.emplace_back(static_cast<std::size_t>(spec.PartBytes(p)), 0);
        for (std::size_t i = 0; seed != 0 && i < part.size(); ++i) {
          part[i] = static_cast<std::uint8_t>(seed + l * 31 + p * 7 + i * 13);
        }
      }
    }
  }
  std::vector<std::vector<std::uint64_t>> Bases() {
    std::vector<std::vector<std::uint64_t>> out;
    for (auto& layer : bytes) {
      auto& l = out.emplace_back();
      for (auto& part : layer) l.push_back(reinterpret_cast<std::uint64_t>(part.data()));
    }
    return out;
  }
  const std::uint8_t* Block(int l, int p, std::int64_t b) const {
    return bytes[static_cast<std::size_t>(l)][static_cast<std::size_t>(p)].data() +
           static_cast<std::size_t>(b * spec.BlockBytes(p));
  }
};

std::unique_ptr<Worker> MakeWorker(Role role, const std::string& engine, int port) {
  return testing::MakeTestWorker(role, engine, port, "tcp", std::chrono::milliseconds(60000));
}

template <typename Pred>
bool PollUntil(Pred done, int* peak_threads) {
  const Deadline deadline = DeadlineAfter(std::chrono::milliseconds(60000));
  while (Clock::now() < deadline) {
    *peak_threads = std::max(*peak_threads, Threads());
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

TEST(LayerwiseScaleTest, AThousandLoadsAtOnceOnBoundedThreadsEachReadAsAnnounced) {
  std::vector<int> taken;
  const int pport = FreeLoopbackPorts(1, taken);
  const int dport = FreeLoopbackPorts(1, taken);
  Cache prefill_cache(1), decode_cache(0);
  std::unique_ptr<Worker> prefill = MakeWorker(Role::kPrefill, "prefill-s", pport);
  std::unique_ptr<Worker> decode = MakeWorker(Role::kDecode, "decode-s", dport);
  ASSERT_TRUE(prefill->RegisterKvCaches(prefill_cache.spec, prefill_cache.Bases()).ok());
  ASSERT_TRUE(decode->RegisterKvCaches(decode_cache.spec, decode_cache.Bases()).ok());
  const int before = Threads();
  int peak = before;

  // The decode legs first: every load subscribes before any prefill has begun.
  ConnectorMetadata loads;
  for (int i = 0; i < kLoads; ++i) {
    LoadSpec load;
    load.request_id = "d" + std::to_string(i);
    load.transfer_id = load.remote_request_id = "x" + std::to_string(i);
    load.local_block_ids = {i};
    load.first_token = 0;
    load.num_tokens = kTokens;
    load.remote_engine_id = "prefill-s";
    load.remote_host = "127.0.0.1";
    load.remote_port = pport;
    loads.loads.push_back(load);
  }
  decode->StartLoadKv(loads);
  // Subscribe messages (polls of loads that waited count too): as many as the loads, with none
  // ended. With a thread per load (64 of them) only 64 subscribed and polled until their start
  // timeout failed them; the count came from their polls.
  ASSERT_TRUE(PollUntil(
      [&] { return prefill->Stats().notices_received["subscribe"] >= std::uint64_t{kLoads}; },
      &peak))
      << "only " << prefill->Stats().notices_received["subscribe"] << " subscriptions for "
      << kLoads << " loads before their prefill began";
  ASSERT_EQ(decode->Stats().loads_failed, 0u)
      << "loads failed before every load had subscribed (they waited for a thread)";

  // One prefill step writes every request, layer by layer (the remote block of request i is
  // kLoads + 7 - i: not the local one).
  Scheduler scheduler({Role::kPrefill, "prefill-s", "127.0.0.1", pport});
  std::vector<KvTransferParams> params(kLoads);
  for (int i = 0; i < kLoads; ++i) {
    params[static_cast<std::size_t>(i)].do_remote_decode = true;
    params[static_cast<std::size_t>(i)].transfer_id = "x" + std::to_string(i);
    const std::vector<std::int64_t> block = {kLoads + 7 - i};
    scheduler.RequestScheduled("p" + std::to_string(i), params[static_cast<std::size_t>(i)], block,
                               0, kTokens, kTokens);
  }
  prefill->StartLoadKv(scheduler.BuildConnectorMeta());
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(prefill->SaveKvLayer(l).ok());
  std::vector<std::string> received;
  ASSERT_TRUE(PollUntil(
      [&] {
        for (std::string& r : decode->GetFinished().receiving) received.push_back(std::move(r));
        return received.size() == static_cast<std::size_t>(kLoads);
      },
      &peak))
      << received.size() << " of " << kLoads << " loads ended";
  const std::vector<LoadError> errors = decode->TakeLoadErrors();
  ASSERT_TRUE(errors.empty()) << errors.size()
                              << " failed, first: " << errors.front().status.ToString();
  for (int i = 0; i < kLoads; ++i) {
    for (int l = 0; l < kLayers; ++l) {
      for (int p = 0; p < decode_cache.spec.num_parts(); ++p) {
        ASSERT_EQ(
            std::memcmp(decode_cache.Block(l, p, i), prefill_cache.Block(l, p, kLoads + 7 - i),
                        static_cast<std::size_t>(decode_cache.spec.BlockBytes(p))),
            0)
            << "request " << i << " layer " << l << " part " << p;
      }
    }
  }
  // Each read as announced: layer by layer, not in one read after the hold.
  EXPECT_EQ(decode->Stats().loads_done, std::uint64_t{kLoads});

  // The prefill requests end on their length cap: held, and released by their readers'
  // confirmations, which came first (kept as early notices).
  for (int i = 0; i < kLoads; ++i) {
    const std::vector<std::int64_t> block = {kLoads + 7 - i};
    (void)scheduler.RequestFinished("p" + std::to_string(i), params[static_cast<std::size_t>(i)],
                                    FinishReason::kLengthCapped, block);
  }
  prefill->StartLoadKv(scheduler.BuildConnectorMeta());
  std::size_t released = 0;
  ASSERT_TRUE(PollUntil(
      [&] {
        released += prefill->GetFinished().sending.size();
        return released == static_cast<std::size_t>(kLoads);
      },
      &peak));
  EXPECT_EQ(prefill->Stats().holds_outstanding, 0u);
  EXPECT_EQ(decode->Stats().loads_outstanding, 0u);
  // Bounded: a thousand loads in flight add no thread per load (before: one each, up to 64).
  std::printf("threads: %d before the loads, at most %d with %d in flight\n", before, peak, kLoads);
  EXPECT_LE(peak - before, 8) << "threads grew with the loads in flight";
}

}  // namespace
}  // namespace kvferry
