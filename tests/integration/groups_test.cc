// KV cache groups end to end (issue 29): a prefill and a decode worker in one process, each with a
// hybrid cache of a full-attention group and a sliding-window group (a gpt-oss-like model: the
// two kinds of layers, a window of 24 tokens), over the real listener and transport. Every byte of
// the full group lands; of the window's group exactly the blocks of the prompt's last 24 tokens,
// and nothing else is written. Both orders of groups, shm and tcp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "common/clock.h"
#include "common/ports.h"
#include "kvferry/connector.h"
#include "tests/integration/test_workers.h"

namespace kvferry {
namespace {

using ::testing::HasSubstr;

constexpr std::int64_t kTokensPerBlock = 8;
constexpr std::int64_t kBlocks = 32;
constexpr std::int64_t kWindow = 24;

CacheSpec Group(int layers, std::int64_t window) {
  CacheSpecOptions o =
      CacheSpec::Mha(layers, 2, 16, kBlocks, kTokensPerBlock, DType::kFloat16)->options();
  o.sliding_window = window;
  return *CacheSpec::Create(o);
}

// One worker's caches: per group, per layer, per part, its bytes (zero, or a pattern of who and
// where on the prefill side).
struct HybridCaches {
  CacheGroups groups;
  std::vector<std::vector<std::vector<std::vector<std::uint8_t>>>> bytes;  // [g][l][p]

  explicit HybridCaches(CacheGroups g) : groups(std::move(g)) {
    for (int i = 0; i < groups.size(); ++i) {
      const CacheSpec& s = groups[i];
      auto& group = bytes.emplace_back();
      for (int l = 0; l < s.num_layers(); ++l) {
        auto& layer = group.emplace_back();
        for (int p = 0; p < s.num_parts(); ++p) {
          layer.emplace_back(static_cast<std::size_t>(s.PartBytes(p)), 0);
        }
      }
    }
  }
  void Fill(int seed = 0) {
    for (std::size_t g = 0; g < bytes.size(); ++g) {
      for (std::size_t l = 0; l < bytes[g].size(); ++l) {
        for (std::size_t p = 0; p < bytes[g][l].size(); ++p) {
          for (std::size_t i = 0; i < bytes[g][l][p].size(); ++i) {
            bytes[g][l][p][i] =
                static_cast<std::uint8_t>(seed * 59 + g * 97 + l * 31 + p * 7 + i * 13 + 1);
          }
        }
      }
    }
  }
  std::vector<std::vector<std::vector<std::uint64_t>>> Bases() {
    std::vector<std::vector<std::vector<std::uint64_t>>> out;
    for (auto& group : bytes) {
      auto& g = out.emplace_back();
      for (auto& layer : group) {
        auto& l = g.emplace_back();
        for (auto& part : layer) l.push_back(reinterpret_cast<std::uint64_t>(part.data()));
      }
    }
    return out;
  }
  // Block `b` of group g, layer l, part p.
  const std::uint8_t* Block(int g, int l, int p, std::int64_t b) const {
    const auto bb = static_cast<std::size_t>(groups[g].BlockBytes(p));
    return bytes[static_cast<std::size_t>(g)][static_cast<std::size_t>(l)]
                [static_cast<std::size_t>(p)]
                    .data() +
           static_cast<std::size_t>(b) * bb;
  }
};

std::unique_ptr<Worker> MakeWorker(Role role, const std::string& engine, int port,
                                   const std::string& backend) {
  return testing::MakeTestWorker(role, engine, port, backend, std::chrono::milliseconds(10000));
}

template <typename Pred>
bool PollFinished(Worker& w, Pred done) {
  const Deadline deadline = DeadlineAfter(std::chrono::milliseconds(10000));
  while (Clock::now() < deadline) {
    if (done(w.GetFinished())) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

using Bases = std::vector<std::vector<std::vector<std::uint64_t>>>;

// A prefill worker "prefill-<name>" and a decode worker "decode-<name>" on free loopback ports,
// their caches registered, the prefill side holding request "req".
struct WorkerPair {
  int pport = 0;
  std::unique_ptr<Worker> prefill;
  std::unique_ptr<Worker> decode;
};

WorkerPair StartPair(const std::string& name, const std::string& backend,
                     const CacheGroups& prefill_groups, Bases prefill_bases,
                     const CacheGroups& decode_groups, Bases decode_bases) {
  std::vector<int> taken;
  WorkerPair w;
  w.pport = FreeLoopbackPorts(1, taken);
  const int dport = FreeLoopbackPorts(1, taken);
  w.prefill = MakeWorker(Role::kPrefill, "prefill-" + name, w.pport, backend);
  w.decode = MakeWorker(Role::kDecode, "decode-" + name, dport, backend);
  EXPECT_TRUE(w.prefill->RegisterKvCaches(prefill_groups, std::move(prefill_bases)).ok());
  EXPECT_TRUE(w.decode->RegisterKvCaches(decode_groups, std::move(decode_bases)).ok());
  ConnectorMetadata hold;
  hold.holds.push_back({"req", 60000, ""});
  w.prefill->StartLoadKv(hold);
  return w;
}

// A load of a 32-token prompt (4 blocks) into a full and a window group (24 tokens: blocks 1..3,
// block 0 freed on both sides), from `engine` at `port`.
LoadSpec ThirtyTwoTokens(const std::string& engine, int port) {
  LoadSpec load;
  load.request_id = load.remote_request_id = "req";
  load.remote_block_ids = {2, 4, 6, 8};
  load.local_block_ids = {1, 3, 5, 7};
  load.more_groups = {{{kNoBlock, 9, 11, 13}, {kNoBlock, 10, 12, 14}}};
  load.first_token = 0;
  load.num_tokens = 32;
  load.remote_engine_id = engine;
  load.remote_host = "127.0.0.1";
  load.remote_port = port;
  return load;
}

// Runs one load on `decode` and waits for its end; its errors.
std::vector<LoadError> LoadAndWait(Worker& decode, const LoadSpec& load) {
  ConnectorMetadata md;
  md.loads.push_back(load);
  decode.StartLoadKv(md);
  EXPECT_TRUE(PollFinished(decode, [](const FinishedRequests& r) { return !r.receiving.empty(); }));
  return decode.TakeLoadErrors();
}

class GroupsTest : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(GroupsTest, FullGroupEveryByteSlidingWindowOnlyItsWindow) {
  const auto [backend, window_first] = GetParam();
  const CacheSpec full = Group(2, 0);
  const CacheSpec window = Group(3, kWindow);
  const CacheGroups groups = *CacheGroups::Create(
      window_first ? std::vector<CacheSpec>{window, full} : std::vector<CacheSpec>{full, window});
  const int w = window_first ? 0 : 1;  // the window's group
  const int f = 1 - w;
  HybridCaches prefill_caches(groups), decode_caches(groups);
  prefill_caches.Fill();
  WorkerPair pair =
      StartPair("g", backend, groups, prefill_caches.Bases(), groups, decode_caches.Bases());
  ASSERT_FALSE(::testing::Test::HasFailure()) << "the workers did not start";
  const int pport = pair.pport;
  Worker* decode = pair.decode.get();

  // A 60-token prompt: 8 blocks; the decode side had 2 blocks (16 tokens) in its prefix cache,
  // so it loads tokens [16, 60). The window (the last 24 tokens, [36, 60)) is in blocks 4..7.
  // Either side may have freed the window group's other blocks (vLLM's null block): kNoBlock.
  const std::vector<std::int64_t> p_full = {9, 3, 12, 5, 20, 21, 7, 30};
  const std::vector<std::int64_t> p_window = {kNoBlock, kNoBlock, kNoBlock, kNoBlock, 4, 6, 8, 10};
  const std::vector<std::int64_t> d_full = {1, 2, 3, 4, 5, 6};                // prompt blocks 2..7
  const std::vector<std::int64_t> d_window = {kNoBlock, 11, 14, 15, 16, 17};  // 2..7
  KvTransferParams params;
  params.do_remote_prefill = true;
  params.remote_block_ids = f == 0 ? p_full : p_window;
  params.remote_group_block_ids = {{f == 0 ? p_window : p_full}};
  params.remote_engine_id = "prefill-g";
  params.remote_host = "127.0.0.1";
  params.remote_port = pport;
  params.remote_tp_size = 1;
  params.remote_request_id = "req";
  Scheduler scheduler({Role::kDecode, "decode-g"});
  std::vector<std::vector<std::int64_t>> local(2);
  local[static_cast<std::size_t>(f)] = d_full;
  local[static_cast<std::size_t>(w)] = d_window;
  ASSERT_TRUE(scheduler.UpdateStateAfterAllocAllGroups("req", params, local, 44, 60).ok());
  ConnectorMetadata md = scheduler.BuildConnectorMeta();
  ASSERT_EQ(md.loads.size(), 1u);
  Result<ConnectorMetadata> wire = ConnectorMetadata::Decode(md.Encode());
  ASSERT_TRUE(wire.ok()) << wire.status().ToString();
  ASSERT_EQ(*wire, md) << "the groups' block ids survive the metadata";
  decode->StartLoadKv(*wire);
  ASSERT_TRUE(PollFinished(*decode, [](const FinishedRequests& r) {
    return std::find(r.receiving.begin(), r.receiving.end(), "req") != r.receiving.end();
  }));
  const std::vector<LoadError> errors = decode->TakeLoadErrors();
  ASSERT_TRUE(errors.empty()) << errors.front().status.ToString();
  ASSERT_TRUE(PollFinished(*pair.prefill, [](const FinishedRequests& r) {
    return std::find(r.sending.begin(), r.sending.end(), "req") != r.sending.end();
  })) << "the reader released the hold";

  const std::int64_t bb = groups[0].BlockBytes(0);
  std::uint64_t expected = 0;
  for (int l = 0; l < groups[f].num_layers(); ++l) {
    for (int p = 0; p < 2; ++p) {
      for (std::size_t i = 0; i < d_full.size(); ++i) {
        EXPECT_EQ(
            std::memcmp(decode_caches.Block(f, l, p, d_full[i]),
                        prefill_caches.Block(f, l, p, p_full[i + 2]), static_cast<std::size_t>(bb)),
            0)
            << "full group layer " << l << " part " << p << " block " << i;
        expected += static_cast<std::uint64_t>(bb);
      }
    }
  }
  for (int l = 0; l < groups[w].num_layers(); ++l) {
    for (int p = 0; p < 2; ++p) {
      for (std::size_t i = 0; i < d_window.size(); ++i) {
        const std::int64_t prompt_block = static_cast<std::int64_t>(i) + 2;
        if (d_window[i] == kNoBlock) continue;
        const std::uint8_t* got = decode_caches.Block(w, l, p, d_window[i]);
        if (prompt_block >= 4) {  // in the window, read from the start of its first block
          // The prompt's last block holds 4 of its 8 tokens (token-major: 4 rows).
          const std::int64_t rows = prompt_block == 7 ? 4 : kTokensPerBlock;
          const auto bytes = static_cast<std::size_t>(bb / kTokensPerBlock * rows);
          EXPECT_EQ(std::memcmp(got,
                                prefill_caches.Block(
                                    w, l, p, p_window[static_cast<std::size_t>(prompt_block)]),
                                bytes),
                    0)
              << "window group layer " << l << " block " << prompt_block;
          expected += bytes;
        } else {  // before the window: never written
          const std::vector<std::uint8_t> zero(static_cast<std::size_t>(bb), 0);
          EXPECT_EQ(std::memcmp(got, zero.data(), zero.size()), 0)
              << "window group layer " << l << " block " << prompt_block << " was written";
        }
      }
    }
  }
  const std::vector<LoadTransfer> transfers = decode->TakeLoadTransfers();
  ASSERT_EQ(transfers.size(), 1u);
  EXPECT_EQ(transfers[0].bytes, expected) << "the window's blocks only";
}

// vLLM's hybrid allocator gives layer i of every group one tensor (KVCacheTensor shared_by), the
// groups' block ids never overlapping: both groups register the same memory (aliased regions).
TEST(GroupsSharedTest, GroupsSharingTensorsReadEachGroupsBlocks) {
  const CacheGroups groups = *CacheGroups::Create({Group(2, 0), Group(2, kWindow)});
  HybridCaches prefill_caches(groups), decode_caches(groups);
  prefill_caches.Fill();
  auto shared = [](HybridCaches& c) {
    auto bases = c.Bases();
    bases[1] = bases[0];  // group 1's layer l is group 0's layer l's tensor
    return bases;
  };
  WorkerPair pair =
      StartPair("s", "tcp", groups, shared(prefill_caches), groups, shared(decode_caches));
  ASSERT_FALSE(::testing::Test::HasFailure()) << "the workers did not start";
  const int pport = pair.pport;
  Worker* decode = pair.decode.get();
  // 32 tokens, 4 blocks; the window (24 tokens, [8, 32)) is blocks 1..3.
  LoadSpec load = ThirtyTwoTokens("prefill-s", pport);
  const std::vector<LoadError> errors = LoadAndWait(*decode, load);
  ASSERT_TRUE(errors.empty()) << errors.front().status.ToString();
  const auto bb = static_cast<std::size_t>(groups[0].BlockBytes(0));
  const std::vector<std::pair<std::int64_t, std::int64_t>> landed = {
      {1, 2}, {3, 4}, {5, 6}, {7, 8}, {9, 10}, {11, 12}, {13, 14}};
  for (int l = 0; l < 2; ++l) {
    for (int p = 0; p < 2; ++p) {
      for (const auto& [local, remote] : landed) {
        EXPECT_EQ(std::memcmp(decode_caches.Block(0, l, p, local),
                              prefill_caches.Block(0, l, p, remote), bb),
                  0)
            << "layer " << l << " part " << p << " block " << local;
      }
    }
  }
}

// vLLM's decode side counts the loaded prompt as computed and frees the window group's blocks
// before token end - W + 1: when that is a block boundary, the block whose last token is the
// window's first (end - W) is gone. The load starts after it instead of failing.
TEST(GroupsWindowTest, AWindowWhoseFirstBlockTheDecodeSideFreedStartsAfterIt) {
  const CacheGroups groups = *CacheGroups::Create({Group(1, 0), Group(1, 21)});
  HybridCaches prefill_caches(groups), decode_caches(groups);
  prefill_caches.Fill();
  WorkerPair pair =
      StartPair("w", "tcp", groups, prefill_caches.Bases(), groups, decode_caches.Bases());
  ASSERT_FALSE(::testing::Test::HasFailure()) << "the workers did not start";
  const int pport = pair.pport;
  Worker* decode = pair.decode.get();
  // 60 tokens; the window (21) starts at token 39, the last of block 4 (32..39), which the
  // decode side freed; the prefill side kept it.
  LoadSpec load;
  load.request_id = load.remote_request_id = "req";
  load.remote_block_ids = {1, 2, 3, 4, 5, 6, 7, 8};
  load.local_block_ids = {9, 10, 11, 12, 13, 14, 15, 16};
  load.more_groups = {{{kNoBlock, kNoBlock, kNoBlock, kNoBlock, kNoBlock, 17, 18, 19},
                       {kNoBlock, kNoBlock, kNoBlock, kNoBlock, 20, 21, 22, 23}}};
  load.first_token = 0;
  load.num_tokens = 60;
  load.remote_engine_id = "prefill-w";
  load.remote_host = "127.0.0.1";
  load.remote_port = pport;
  const std::vector<LoadError> errors = LoadAndWait(*decode, load);
  ASSERT_TRUE(errors.empty()) << errors.front().status.ToString();
  const auto bb = static_cast<std::size_t>(groups[1].BlockBytes(0));
  for (int p = 0; p < 2; ++p) {
    EXPECT_EQ(std::memcmp(decode_caches.Block(1, 0, p, 17), prefill_caches.Block(1, 0, p, 21), bb),
              0);
    EXPECT_EQ(std::memcmp(decode_caches.Block(1, 0, p, 18), prefill_caches.Block(1, 0, p, 22), bb),
              0);
  }
}

// Heterogeneous TP with groups (issue 29 item 2): a full and a sliding-window group of 2 KV heads,
// prefill TP p -> decode TP d (2 -> 1: the decode rank gathers each head from the prefill rank
// holding it; 1 -> 2: each decode rank reads its head's slice), every group from the same ranks;
// every byte of every token of the load checked per head, and every prefill rank's hold released.
class GroupsTpTest : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(GroupsTpTest, EveryGroupMovesItsHeadsAcrossTpSizes) {
  const auto [p_tp, d_tp] = GetParam();
  auto groups_of = [](int tp, int rank) {
    std::vector<CacheSpec> g;
    for (std::int64_t window : {std::int64_t{0}, kWindow}) {
      CacheSpecOptions o =
          CacheSpec::Mha(2, 2, 16, kBlocks, kTokensPerBlock, DType::kFloat16, tp, rank)->options();
      o.sliding_window = window;
      g.push_back(*CacheSpec::Create(o));
    }
    return *CacheGroups::Create(std::move(g));
  };
  std::vector<int> taken;
  const int pbase = FreeLoopbackPorts(p_tp, taken);
  const int dbase = FreeLoopbackPorts(d_tp, taken);
  std::vector<HybridCaches> p_caches, d_caches;
  std::vector<std::unique_ptr<Worker>> prefill, decode;
  for (int r = 0; r < p_tp; ++r) p_caches.emplace_back(groups_of(p_tp, r));
  for (int r = 0; r < d_tp; ++r) d_caches.emplace_back(groups_of(d_tp, r));
  auto make = [](Role role, const std::string& engine, int base, int tp, int rank) {
    return testing::MakeTestWorker(role, engine, base, "tcp", std::chrono::milliseconds(10000), tp,
                                   rank);
  };
  ConnectorMetadata hold;
  hold.holds.push_back({"req", 60000, ""});
  for (int r = 0; r < p_tp; ++r) {
    p_caches[static_cast<std::size_t>(r)].Fill(r + 1);  // each rank's bytes its own
    prefill.push_back(make(Role::kPrefill, "prefill-t", pbase, p_tp, r));
    ASSERT_TRUE(prefill.back()
                    ->RegisterKvCaches(p_caches[static_cast<std::size_t>(r)].groups,
                                       p_caches[static_cast<std::size_t>(r)].Bases())
                    .ok());
    prefill.back()->StartLoadKv(hold);
  }
  // 32 tokens in 4 blocks, all loaded; the window (24 tokens) is blocks 1..3.
  LoadSpec load = ThirtyTwoTokens("prefill-t", pbase);
  load.remote_tp_size = p_tp;
  for (int r = 0; r < d_tp; ++r) {
    decode.push_back(make(Role::kDecode, "decode-t", dbase, d_tp, r));
    ASSERT_TRUE(decode.back()
                    ->RegisterKvCaches(d_caches[static_cast<std::size_t>(r)].groups,
                                       d_caches[static_cast<std::size_t>(r)].Bases())
                    .ok());
  }
  for (int r = 0; r < d_tp; ++r) {
    const std::vector<LoadError> errors = LoadAndWait(*decode[static_cast<std::size_t>(r)], load);
    ASSERT_TRUE(errors.empty()) << errors.front().status.ToString();
  }
  for (int r = 0; r < p_tp; ++r) {
    EXPECT_TRUE(PollFinished(*prefill[static_cast<std::size_t>(r)],
                             [](const FinishedRequests& f) {
                               return std::find(f.sending.begin(), f.sending.end(), "req") !=
                                      f.sending.end();
                             }))
        << "prefill rank " << r << " was not released by its readers";
  }
  // Model-wide head h of token slot t of a block: on a rank of TP n, head h % (2 / n)... each
  // rank of TP n holds 2 / n heads, [rank * 2 / n, +2 / n); token-major rows of heads x 16 dims.
  constexpr std::size_t kHeadBytes = 16 * 2;
  auto head_at = [](const HybridCaches& c, int tp, int g, int l, int p, std::int64_t block,
                    std::int64_t slot, int head) {
    const int per_rank = 2 / tp;
    return c.Block(g, l, p, block) +
           (static_cast<std::size_t>(slot) * static_cast<std::size_t>(per_rank) +
            static_cast<std::size_t>(head % per_rank)) *
               kHeadBytes;
  };
  for (int g = 0; g < 2; ++g) {
    for (int l = 0; l < 2; ++l) {
      for (int p = 0; p < 2; ++p) {
        for (std::size_t i = 0; i < 4; ++i) {
          const std::int64_t local = load.LocalIds(g)[i];
          const std::int64_t remote = load.RemoteIds(g)[i];
          if (local == kNoBlock) continue;
          for (std::int64_t slot = 0; slot < kTokensPerBlock; ++slot) {
            for (int h = 0; h < 2; ++h) {
              const int d_rank = h / (2 / d_tp);
              const int p_rank = h / (2 / p_tp);
              EXPECT_EQ(std::memcmp(head_at(d_caches[static_cast<std::size_t>(d_rank)], d_tp, g, l,
                                            p, local, slot, h),
                                    head_at(p_caches[static_cast<std::size_t>(p_rank)], p_tp, g, l,
                                            p, remote, slot, h),
                                    kHeadBytes),
                        0)
                  << "group " << g << " layer " << l << " part " << p << " block " << i << " slot "
                  << slot << " head " << h;
            }
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TpSizes, GroupsTpTest,
                         ::testing::Values(std::pair{2, 1}, std::pair{1, 2}));

INSTANTIATE_TEST_SUITE_P(Backends, GroupsTest,
                         ::testing::Combine(::testing::Values("shm", "tcp", "ucx"),
                                            ::testing::Bool()));

// A decode side whose groups differ from the prefill's (no window, or another one) is refused at
// the handshake, before any byte moves, with both caches' texts.
TEST(GroupsRefusalTest, PeersWithOtherGroupsAreRefusedBeforeAnyByteMoves) {
  const CacheGroups prefill_groups = *CacheGroups::Create({Group(2, 0), Group(2, kWindow)});
  const CacheGroups decode_groups = *CacheGroups::Create({Group(2, 0), Group(2, 2 * kWindow)});
  HybridCaches prefill_caches(prefill_groups), decode_caches(decode_groups);
  prefill_caches.Fill();
  WorkerPair pair = StartPair("r", "tcp", prefill_groups, prefill_caches.Bases(), decode_groups,
                              decode_caches.Bases());
  ASSERT_FALSE(::testing::Test::HasFailure()) << "the workers did not start";
  const int pport = pair.pport;
  Worker* decode = pair.decode.get();
  LoadSpec load;
  load.request_id = "req";
  load.remote_request_id = "req";
  load.local_block_ids = {1, 2};
  load.remote_block_ids = {3, 4};
  load.more_groups = {{{5, 6}, {7, 8}}};
  load.remote_engine_id = "prefill-r";
  load.remote_host = "127.0.0.1";
  load.remote_port = pport;
  const std::vector<LoadError> errors = LoadAndWait(*decode, load);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].status.code(), StatusCode::kNotSupported);
  EXPECT_THAT(errors[0].status.message(),
              HasSubstr("first difference: KV cache group 1: window=48 here, window=24 there"));
  for (const auto& group : decode_caches.bytes) {
    for (const auto& layer : group) {
      for (const auto& part : layer) {
        EXPECT_TRUE(std::all_of(part.begin(), part.end(), [](std::uint8_t b) { return b == 0; }))
            << "a byte moved";
      }
    }
  }
}

}  // namespace
}  // namespace kvferry
