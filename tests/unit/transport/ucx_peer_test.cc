// The ucx backend against a real peer process (kvferry bench peer --backend ucx): a frozen peer,
// cancel with many gets in flight, many concurrent batches and idle progress threads, each under
// UCX's default transports, UCX_TLS=tcp and UCX_TLS=sm,self (no peer error handling there).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <thread>

#include "common/clock.h"
#include "common/pattern.h"
#include "kvferry/transport.h"
#include "tests/bench_peer.h"
#include "tests/test_timing.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

constexpr std::uint64_t kSeed = 0x6b76666572727900ull;  // the bench peer's default pattern seed
constexpr std::uint64_t kPeerBytes = 32u << 20;
constexpr int kPeerRegions = 4;
constexpr std::uint64_t kRegionBytes = kPeerBytes / kPeerRegions;

class LocalMemory {
 public:
  explicit LocalMemory(std::uint64_t bytes) : bytes_(bytes) {
    data_ = static_cast<std::byte*>(
        mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  }
  ~LocalMemory() { munmap(data_, bytes_); }
  LocalMemory(const LocalMemory&) = delete;
  LocalMemory& operator=(const LocalMemory&) = delete;
  std::byte* data() const { return data_; }
  std::uint64_t size() const { return bytes_; }

 private:
  std::uint64_t bytes_;
  std::byte* data_;
};

// UCX_TLS for the test (inherited by the peer process); "default" leaves it unset.
std::string TlsValue(const std::string& param) {
  if (param == "tcp") return "tcp";
  if (param == "sm_self") return "sm,self";
  return "";
}

class UcxPeerTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string tls = TlsValue(GetParam());
    if (tls.empty()) {
      unsetenv("UCX_TLS");
    } else {
      setenv("UCX_TLS", tls.c_str(), 1);
    }
    peer_ = testing::StartBenchPeer({"--backend", "ucx", "--bytes", std::to_string(kPeerBytes),
                                     "--regions", std::to_string(kPeerRegions)});
    ASSERT_FALSE(peer_.descriptor.empty());
  }
  void TearDown() override { unsetenv("UCX_TLS"); }

  // A client reading into `local` (region 100), connected to the peer.
  void Connect(const TransportOptionMap& options = {}) {
    TransportOptions o;
    o.backend = "ucx";
    o.serve = false;
    o.backend_options = options;
    Result<std::unique_ptr<Transport>> t = CreateTransport(o);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    client_ = std::move(t).value();
    ASSERT_TRUE(client_->RegisterMemory(100, local_.data(), local_.size()).ok());
    Result<PeerId> p = client_->Connect(peer_.descriptor, DeadlineAfter(milliseconds(5000)));
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    peer_id_ = *p;
  }

  // `count` reads of `bytes` each, back to back in local memory from `base`.
  static std::vector<ReadOp> Reads(std::byte* base, std::uint64_t count, std::uint64_t bytes) {
    std::vector<ReadOp> ops;
    for (std::uint64_t k = 0; k < count; ++k) {
      ops.push_back({base + k * bytes, static_cast<RegionId>(k % kPeerRegions),
                     (k * bytes) % (kRegionBytes - bytes + 1), bytes});
    }
    return ops;
  }

  static void ExpectPattern(const std::vector<ReadOp>& ops) {
    for (const ReadOp& op : ops) {
      ASSERT_EQ(
          FirstPatternMismatch(op.local, op.length, kSeed, op.remote_region, op.remote_offset), -1)
          << "region " << op.remote_region << " offset " << op.remote_offset;
    }
  }

  // A batch into `other` (registered as 101) that must complete and be correct.
  void ExpectAWorkingPeer(LocalMemory& other) {
    ASSERT_TRUE(client_->RegisterMemory(101, other.data(), other.size()).ok());
    const std::vector<ReadOp> ops = Reads(other.data(), other.size() / (256u << 10), 256u << 10);
    Result<BatchId> b = client_->SubmitReads(peer_id_, ops, DeadlineAfter(milliseconds(10000)));
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    const BatchResult r = client_->Wait(*b, DeadlineAfter(milliseconds(11000)));
    ASSERT_EQ(r.state, BatchState::kDone) << r.status.ToString();
    client_->Release(*b);
    ExpectPattern(ops);
    ASSERT_TRUE(client_->DeregisterMemory(101).ok());
  }

  void ExpectUntouched(std::byte value) {
    std::vector<std::byte> expected(1u << 20, value);
    for (std::uint64_t off = 0; off < local_.size(); off += expected.size()) {
      ASSERT_EQ(std::memcmp(local_.data() + off, expected.data(), expected.size()), 0)
          << "bytes written into an ended batch's memory near offset " << off;
    }
  }

  testing::BenchPeer peer_;
  LocalMemory local_{64u << 20};
  std::unique_ptr<Transport> client_;
  PeerId peer_id_ = 0;
};

TEST_P(UcxPeerTest, FrozenPeerIsTimeoutAtTheDeadlineAndNothingLandsAfter) {
  Connect({{"ucx.chunk_bytes", "65536"}});
  // A first batch, so that the endpoint is wired up before the peer freezes.
  LocalMemory warm(4u << 20);
  ExpectAWorkingPeer(warm);
  peer_.process->Signal(SIGSTOP);
  const auto submitted = Clock::now();
  const milliseconds limit(500);
  Result<BatchId> b =
      client_->SubmitReads(peer_id_, Reads(local_.data(), 256, 256u << 10), submitted + limit);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  const BatchResult r = client_->Wait(*b, submitted + milliseconds(5000));
  const auto ended = Clock::now();
  EXPECT_EQ(r.state, BatchState::kFailed);
  EXPECT_EQ(r.status.code(), StatusCode::kTimeout) << r.status.ToString();
  EXPECT_GE(ended - submitted, limit);
  // The sweep (50 ms) and the grace before a forced close (100 ms), with room for a slow host.
  EXPECT_LT(ended - submitted, limit + milliseconds(700) * testing::kTimingSlack);
  client_->Release(*b);
  std::memset(local_.data(), 0x22, local_.size());
  peer_.process->Signal(SIGCONT);
  // The peer answers again; whatever it still sends for the ended batch must not land.
  LocalMemory other(8u << 20);
  ExpectAWorkingPeer(other);
  ExpectUntouched(std::byte{0x22});
}

TEST_P(UcxPeerTest, CancelWithManyGetsInFlightEndsPromptlyAndNothingLandsAfter) {
  Connect({{"ucx.chunk_bytes", "16384"}, {"ucx.max_inflight", "512"}});
  const std::vector<ReadOp> ops = Reads(local_.data(), local_.size() / (64u << 10), 64u << 10);
  Result<BatchId> b = Status::Internal("not submitted");
  for (int attempt = 0; attempt < 10; ++attempt) {
    b = client_->SubmitReads(peer_id_, ops, DeadlineAfter(milliseconds(60000)));
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    if (client_->Poll(*b).state == BatchState::kInProgress) break;
    client_->Release(*b);
  }
  ASSERT_EQ(client_->Poll(*b).state, BatchState::kInProgress);
  const auto start = Clock::now();
  client_->Cancel(*b);
  EXPECT_LT(Clock::now() - start, milliseconds(1000) * testing::kTimingSlack);
  EXPECT_EQ(client_->Poll(*b).state, BatchState::kCancelled);
  std::memset(local_.data(), 0x11, local_.size());
  LocalMemory other(16u << 20);
  ExpectAWorkingPeer(other);
  ExpectUntouched(std::byte{0x11});
}

TEST_P(UcxPeerTest, ManyConcurrentBatchesFromSeveralThreadsQueueBehindASmallWindow) {
  Connect({{"ucx.max_inflight", "4"}, {"ucx.chunk_bytes", "8192"}});
  constexpr int kThreads = 6;
  constexpr int kBatches = 15;
  const std::uint64_t slice = local_.size() / kThreads;
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 7);
      std::byte* base = local_.data() + slice * static_cast<std::uint64_t>(t);
      for (int i = 0; i < kBatches; ++i) {
        std::vector<ReadOp> ops;
        std::uint64_t at = 0;
        for (int k = 0; k < 40; ++k) {
          const std::uint64_t len = 1 + rng() % 40000;
          if (at + len > slice) break;
          const auto region = static_cast<RegionId>(rng() % kPeerRegions);
          ops.push_back({base + at, region, rng() % (kRegionBytes - len + 1), len});
          at += len + rng() % 16;
        }
        Result<BatchId> b = client_->SubmitReads(peer_id_, ops, DeadlineAfter(milliseconds(20000)));
        ASSERT_TRUE(b.ok()) << b.status().ToString();
        const BatchResult r = client_->Wait(*b, DeadlineAfter(milliseconds(21000)));
        ASSERT_EQ(r.state, BatchState::kDone) << r.status.ToString();
        client_->Release(*b);
        ExpectPattern(ops);
        done.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(done.load(), kThreads * kBatches);
}

// CPU time (user + system, clock ticks) of process `pid` so far: fields 14 and 15 of its stat.
std::uint64_t CpuTicks(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::istringstream rest(text.substr(text.rfind(')') + 2));
  std::string field;
  std::uint64_t ticks = 0;
  for (int i = 3; i <= 15; ++i) {
    rest >> field;
    if (i >= 14) ticks += std::stoull(field);
  }
  return ticks;
}

// The progress threads sleep in poll when nothing is to be done (woken at most every 50 ms),
// on both sides of a connected, idle peer: no busy spin.
TEST_P(UcxPeerTest, AnIdleConnectedPeerSpinsOnNeitherSide) {
  Connect();
  LocalMemory warm(4u << 20);
  ExpectAWorkingPeer(warm);
  const std::uint64_t self_before = CpuTicks(getpid());
  const std::uint64_t peer_before = CpuTicks(peer_.process->pid());
  // Measuring CPU use over an interval is the one thing here that needs a sleep.
  constexpr int kSeconds = 2;
  std::this_thread::sleep_for(milliseconds(kSeconds * 1000));
  const auto ticks_per_second = static_cast<std::uint64_t>(sysconf(_SC_CLK_TCK));
  // A spinning thread would use the whole interval; issue 24 allows 2 % of a core on each side
  // (a process's ticks: its progress thread wakes every 50 ms, and the clock counts in 10 ms).
  // Under the sanitizers each wake-up costs several times more: 5 % there.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  constexpr std::uint64_t kPercent = 5;
#else
  constexpr std::uint64_t kPercent = 2;
#endif
  const std::uint64_t allowed = kSeconds * ticks_per_second * kPercent / 100;
  const std::uint64_t self = CpuTicks(getpid()) - self_before;
  const std::uint64_t peer = CpuTicks(peer_.process->pid()) - peer_before;
  EXPECT_LE(self, allowed) << "the reader used " << self << " of " << kSeconds * ticks_per_second
                           << " clock ticks while idle";
  EXPECT_LE(peer, allowed) << "the serving peer used " << peer << " of "
                           << kSeconds * ticks_per_second << " clock ticks while idle";
}

// Over UCX_TLS=tcp, a serving peer whose environment sets both TCP segment sizes to `size`, and
// readers whose environment sets UCX_TCP_RX_SEG_SIZE to `rx` (nullptr: unset, kvferry's own).
class UcxTcpSegmentPeerTest : public ::testing::Test {
 protected:
  void StartPeer(const char* size) {
    setenv("UCX_TLS", "tcp", 1);
    setenv("UCX_TCP_TX_SEG_SIZE", size, 1);
    setenv("UCX_TCP_RX_SEG_SIZE", size, 1);
    peer_ = testing::StartBenchPeer(
        {"--backend", "ucx", "--bytes", std::to_string(kPeerBytes), "--regions", "1"});
    unsetenv("UCX_TCP_TX_SEG_SIZE");
    unsetenv("UCX_TCP_RX_SEG_SIZE");
    ASSERT_FALSE(peer_.descriptor.empty());
  }
  void TearDown() override { unsetenv("UCX_TLS"); }

  // A reader of `local` (region 100) and its Connect to the peer.
  Result<PeerId> Connect(const char* rx, LocalMemory& local) {
    if (rx != nullptr) setenv("UCX_TCP_RX_SEG_SIZE", rx, 1);
    TransportOptions o;
    o.backend = "ucx";
    o.serve = false;
    Result<std::unique_ptr<Transport>> t = CreateTransport(o);
    unsetenv("UCX_TCP_RX_SEG_SIZE");
    if (!t.ok()) return t.status();
    reader_ = std::move(t).value();
    KVFERRY_RETURN_IF_ERROR(reader_->RegisterMemory(100, local.data(), local.size()));
    return reader_->Connect(peer_.descriptor, DeadlineAfter(milliseconds(5000)));
  }

  // Reads `ops` from region 0 and checks every byte.
  void ExpectRead(PeerId peer, const std::vector<ReadOp>& ops) {
    Result<BatchId> b = reader_->SubmitReads(peer, ops, DeadlineAfter(milliseconds(10000)));
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    const BatchResult r = reader_->Wait(*b, DeadlineAfter(milliseconds(11000)));
    ASSERT_EQ(r.state, BatchState::kDone) << r.status.ToString();
    reader_->Release(*b);
    for (const ReadOp& op : ops) {
      ASSERT_EQ(FirstPatternMismatch(op.local, op.length, kSeed, 0, op.remote_offset), -1);
    }
  }

  testing::BenchPeer peer_;
  std::unique_ptr<Transport> reader_;
};

// A peer whose UCX sends larger TCP segments than this process receives would abort this process
// on the first reply (UCX asserts); it is refused at Connect instead, saying what to set, and a
// reader with matching sizes reads it.
TEST_F(UcxTcpSegmentPeerTest, APeerSendingLargerSegmentsIsRefusedAtConnectNotFatal) {
  ASSERT_NO_FATAL_FAILURE(StartPeer("512K"));
  LocalMemory local(1u << 20);
  // kvferry's default here (256 KiB) is smaller than the peer's 512 KiB.
  const Result<PeerId> refused = Connect(nullptr, local);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable) << refused.status().ToString();
  EXPECT_THAT(refused.status().message(),
              ::testing::HasSubstr("sends TCP segments of 524288 bytes and this process's "
                                   "receives at most 262144"));
  EXPECT_THAT(refused.status().message(), ::testing::HasSubstr("UCX_TCP_RX_SEG_SIZE"));
  const Result<PeerId> matching = Connect("512K", local);
  ASSERT_TRUE(matching.ok()) << matching.status().ToString();
  ExpectRead(*matching, {{local.data(), 0, 4096, 1u << 20}});
}

// kvferry's own sizes reach UCX (ucp_config_modify, which takes a key no transport knows without
// complaint): a reader that sets nothing receives the 256 KiB segments of a server whose
// environment sends them, where UCX's default 64 KiB rx would abort it.
TEST_F(UcxTcpSegmentPeerTest, TheDefaultSegmentsAreTheOnesUcxUses) {
  ASSERT_NO_FATAL_FAILURE(StartPeer("256K"));
  LocalMemory local(8u << 20);
  const Result<PeerId> p = Connect(nullptr, local);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  // Blocks of 256 KiB, each answered in segments as large as the server sends.
  std::vector<ReadOp> ops;
  for (std::uint64_t k = 0; k < 32; ++k) {
    ops.push_back({local.data() + k * (256u << 10), 0, (k * 7 % 64) * (256u << 10), 256u << 10});
  }
  ExpectRead(*p, ops);
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxPeerTest, ::testing::Values("default", "tcp", "sm_self"),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace kvferry
