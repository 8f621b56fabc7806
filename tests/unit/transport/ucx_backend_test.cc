// The ucx backend beyond the backend-parameterised tests of transport_test: its descriptor
// section, options, memory kinds, and against a real peer process (kvferry bench peer --backend
// ucx) a frozen peer, cancel with many gets in flight and many concurrent batches, each under
// UCX's default transports, UCX_TLS=tcp and UCX_TLS=sm,self (no peer error handling there).
#include "transport/ucx/ucx_backend.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <random>
#include <sstream>
#include <thread>

#include "common/clock.h"
#include "common/pattern.h"
#include "tests/bench_peer.h"
#include "tests/test_timing.h"
#include "transport/descriptor.h"
#include "transport/region_registry.h"
#include "transport/ucx/ucx_section.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;

constexpr std::uint64_t kSeed = 0x6b76666572727900ull;  // the bench peer's default pattern seed
constexpr std::uint64_t kPeerBytes = 32u << 20;
constexpr int kPeerRegions = 4;
constexpr std::uint64_t kRegionBytes = kPeerBytes / kPeerRegions;

UcxSection ValidSection() {
  UcxSection s;
  s.worker_address = {1, 2, 3, 4};
  s.host = {"boot", 4026531836u, 1234};
  s.start_time = 99;
  s.keys = {{0, {9, 9}}, {7, {8}}};
  return s;
}

bool UcxMapped() {
  std::ifstream maps("/proc/self/maps");
  const std::string text((std::istreambuf_iterator<char>(maps)), std::istreambuf_iterator<char>());
  return text.find("libucp.so") != std::string::npos;
}

// UCX is opened only when a transport creates the ucx backend: a process that never names ucx
// does not load it (nor its signal handlers and memory hooks, which broke every ThreadSanitizer
// test of this project while UCX was linked in).
TEST(UcxLoadTest, UcxIsLoadedOnlyWhenAUcxTransportIsCreated) {
  // The first test of this file, and ctest runs each test in a process of its own: nothing has
  // created a transport yet.
  ASSERT_FALSE(UcxMapped()) << "UCX is loaded before any transport exists: is it linked in?";
  TransportOptions o;
  o.backend = "auto";
  auto plain = CreateTransport(o);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_FALSE(UcxMapped()) << "UCX was loaded by a transport that does not use it";
  o.backend = "ucx";
  auto ucx = CreateTransport(o);
  ASSERT_TRUE(ucx.ok()) << ucx.status().ToString();
  EXPECT_TRUE(UcxMapped());
}

TEST(UcxSectionTest, RoundTrips) {
  const UcxSection s = ValidSection();
  Result<UcxSection> back = DecodeUcxSection(EncodeUcxSection(s));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, s);
}

// The descriptor fuzzer's ucx seed is a valid section, so that fuzzing starts inside the format.
TEST(UcxSectionTest, TheFuzzSeedDecodes) {
  std::ifstream f(std::string(KVFERRY_TEST_DATA_DIR) +
                      "/../../fuzz/seeds/descriptor_decode/ucx_section.msgpack",
                  std::ios::binary);
  const std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(f)),
                                        std::istreambuf_iterator<char>());
  ASSERT_FALSE(bytes.empty());
  Result<UcxSection> s = DecodeUcxSection(bytes);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->keys.size(), 2u);
  EXPECT_EQ(s->host.pid, 4242);
}

TEST(UcxSectionTest, MalformedSectionsAreRefused) {
  UcxSection no_worker = ValidSection();
  no_worker.worker_address.clear();
  EXPECT_THAT(DecodeUcxSection(EncodeUcxSection(no_worker)).status().message(),
              HasSubstr("descriptor.ucx.worker"));
  UcxSection pid0 = ValidSection();
  pid0.host.pid = 0;
  EXPECT_THAT(DecodeUcxSection(EncodeUcxSection(pid0)).status().message(),
              HasSubstr("descriptor.ucx.pid"));
  UcxSection twice = ValidSection();
  twice.keys.push_back({7, {1}});
  EXPECT_THAT(DecodeUcxSection(EncodeUcxSection(twice)).status().message(),
              HasSubstr("region 7 is listed twice"));
  UcxSection empty_key = ValidSection();
  empty_key.keys[0].bytes.clear();
  EXPECT_EQ(DecodeUcxSection(EncodeUcxSection(empty_key)).status().code(),
            StatusCode::kInvalidArgument);
  const std::vector<std::uint8_t> garbage = {0xc1, 0x00};
  EXPECT_EQ(DecodeUcxSection(garbage).status().code(), StatusCode::kInvalidArgument);
  // Another version: the first value after the "v" key.
  std::vector<std::uint8_t> v2 = EncodeUcxSection(ValidSection());
  ASSERT_EQ(v2[3], 0x01);  // fixmap, "v" (fixstr 0xa1 0x76), 1
  v2[3] = 0x02;
  EXPECT_EQ(DecodeUcxSection(v2).status().code(), StatusCode::kNotSupported);
}

TEST(UcxOptionsTest, UnknownKeysAndBadValuesAreRefusedNamingTheKey) {
  TransportOptions o;
  EXPECT_TRUE(ParseUcxOptions(o, {{"max_inflight", "8"}, {"chunk_bytes", "65536"}}).ok());
  const Result<UcxOptions> parsed =
      ParseUcxOptions(o, {{"max_inflight", "8"}, {"chunk_bytes", "65536"}});
  EXPECT_EQ(parsed->max_inflight, 8u);
  EXPECT_EQ(parsed->chunk_bytes, 65536u);
  struct Case {
    const char* key;
    const char* value;
  };
  for (const Case& c : {Case{"ucx.nope", "1"}, Case{"ucx.max_inflight", "0"},
                        Case{"ucx.max_inflight", "lots"}, Case{"ucx.chunk_bytes", "1"}}) {
    o.backend_options = {{c.key, c.value}};
    const Status s = CheckTransportOptions(o);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.key << "=" << c.value;
    EXPECT_THAT(s.message(), HasSubstr(c.key)) << s.ToString();
  }
}

TEST(UcxBackendTest, RunsOnlyWhenNamed) {
  EXPECT_EQ(*SelectedTransportBackends("auto"), (std::vector<std::string>{"shm", "tcp"}));
  EXPECT_EQ(*SelectedTransportBackends("shm,ucx,tcp"),
            (std::vector<std::string>{"shm", "ucx", "tcp"}));
  const BackendFactory* f = FindBackend("ucx");
  ASSERT_NE(f, nullptr);
  EXPECT_FALSE(f->in_auto);
}

// The memory kinds the backend reads follow the memory types the loaded UCX reports: host always,
// cuda only with CUDA's bit, sim never.
TEST(UcxKindsTest, CudaOnlyWhereUcxReportsItAndSimNever) {
  const MemoryKind host = MemoryKind::Host();
  const MemoryKind cuda{"cuda", 1};
  const MemoryKind sim{"sim", 0};
  const std::uint64_t host_only = UCS_BIT(UCS_MEMORY_TYPE_HOST);
  const std::uint64_t with_cuda = host_only | UCS_BIT(UCS_MEMORY_TYPE_CUDA);
  EXPECT_TRUE(UcxCanRead(host_only, host, host));
  EXPECT_FALSE(UcxCanRead(host_only, cuda, host));
  EXPECT_FALSE(UcxCanRead(host_only, host, cuda));
  EXPECT_TRUE(UcxCanRead(with_cuda, cuda, host));
  EXPECT_TRUE(UcxCanRead(with_cuda, host, cuda));
  EXPECT_TRUE(UcxCanRead(with_cuda, cuda, cuda));
  for (const std::uint64_t types : {host_only, with_cuda, ~std::uint64_t{0}}) {
    EXPECT_FALSE(UcxCanRead(types, sim, host));
    EXPECT_FALSE(UcxCanRead(types, host, sim));
    EXPECT_FALSE(UcxCanRead(types, MemoryKind{"rocm", 0}, host));
  }
  EXPECT_EQ(UcxMemoryType(host), UCS_MEMORY_TYPE_HOST);
  EXPECT_EQ(UcxMemoryType(cuda), UCS_MEMORY_TYPE_CUDA);
}

// A reader whose UCX has CUDA meeting a server whose UCX has not: the server publishes no key for
// its cuda regions. Decided when connecting, not at the first read, so a preference list goes on
// to its next backend (the memory types are faked, as UCX would report them).
TEST(UcxKindsTest, CudaOnOneSideOnlyIsDecidedWhenConnecting) {
  const std::uint64_t host_only = UCS_BIT(UCS_MEMORY_TYPE_HOST);
  const std::uint64_t with_cuda = host_only | UCS_BIT(UCS_MEMORY_TYPE_CUDA);
  const std::vector<RemoteRegion> regions = {{0, 0x10000, 4096, MemoryKind::Host()},
                                             {1, 0x20000, 4096, MemoryKind{"cuda", 0}}};
  UcxSection server_without_cuda = ValidSection();
  server_without_cuda.keys = {{0, {9}}};
  const std::vector<std::uint8_t> without = EncodeUcxSection(server_without_cuda);
  const Status refused = UcxCanReach(with_cuda, PeerView{regions, without});
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable) << refused.ToString();
  EXPECT_THAT(refused.message(), HasSubstr("no ucx key for its region 1 (cuda:0 memory)"));
  // A reader without CUDA reaches it: CanRead refuses its cuda region, per read or, with a list,
  // per peer in the core.
  EXPECT_TRUE(UcxCanReach(host_only, PeerView{regions, without}).ok());
  // Both sides with CUDA: a key for every region.
  UcxSection server_with_cuda = ValidSection();
  server_with_cuda.keys = {{0, {9}}, {1, {8}}};
  EXPECT_TRUE(UcxCanReach(with_cuda, PeerView{regions, EncodeUcxSection(server_with_cuda)}).ok());
}

// The same through the transport, with host memory: a server whose section has no key for one of
// its regions (as its UCX leaves out memory it cannot read) is read over the next backend of the
// list, and refused at Connect with ucx alone. Both used to connect over ucx and fail at the
// first read of that region ("the peer published no ucx key").
TEST(UcxReachTest, ARegionWithoutAKeyIsRefusedAtConnectSoAListFallsThrough) {
  constexpr std::uint64_t kBytes = 1u << 20;
  std::vector<std::byte> served(2 * kBytes);
  for (std::size_t i = 0; i < served.size(); ++i) served[i] = static_cast<std::byte>(i * 7 + 3);
  TransportOptions so;
  so.backend = "ucx,tcp";
  Result<std::unique_ptr<Transport>> server = CreateTransport(so);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  ASSERT_TRUE((*server)->RegisterMemory(0, served.data(), kBytes).ok());
  ASSERT_TRUE((*server)->RegisterMemory(1, served.data() + kBytes, kBytes).ok());
  Result<std::vector<std::uint8_t>> descriptor = (*server)->Descriptor();
  ASSERT_TRUE(descriptor.ok()) << descriptor.status().ToString();
  Result<PeerDescriptor> d = DecodeDescriptor(*descriptor);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  Result<UcxSection> ucx = DecodeUcxSection(d->Section("ucx"));
  ASSERT_TRUE(ucx.ok()) << ucx.status().ToString();
  ASSERT_EQ(ucx->keys.size(), 2u);
  std::erase_if(ucx->keys, [](const UcxRegionKey& k) { return k.region == 1; });
  d->sections["ucx"] = EncodeUcxSection(*ucx);
  const std::vector<std::uint8_t> without_key = EncodeDescriptor(*d);

  std::vector<std::byte> local(kBytes);
  for (const std::string backend : {"ucx,tcp", "ucx"}) {
    SCOPED_TRACE(backend);
    TransportOptions co;
    co.backend = backend;
    co.serve = false;
    Result<std::unique_ptr<Transport>> client = CreateTransport(co);
    ASSERT_TRUE(client.ok()) << client.status().ToString();
    ASSERT_TRUE((*client)->RegisterMemory(100, local.data(), local.size()).ok());
    Result<PeerId> p = (*client)->Connect(without_key, DeadlineAfter(milliseconds(5000)));
    if (backend == "ucx") {
      ASSERT_FALSE(p.ok()) << "connected over ucx to a peer without a key for region 1";
      EXPECT_EQ(p.status().code(), StatusCode::kUnavailable);
      EXPECT_THAT(p.status().message(), HasSubstr("no ucx key for its region 1"));
      continue;
    }
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_EQ(*(*client)->PeerBackend(*p), "tcp");
    Result<BatchId> b = (*client)->SubmitReads(*p, {{local.data(), 1, 0, kBytes}},
                                               DeadlineAfter(milliseconds(5000)));
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    const BatchResult r = (*client)->Wait(*b, DeadlineAfter(milliseconds(10000)));
    ASSERT_EQ(r.state, BatchState::kDone) << r.status.ToString();
    (*client)->Release(*b);
    EXPECT_EQ(std::memcmp(local.data(), served.data() + kBytes, kBytes), 0);
  }
}

TEST(UcxBackendTest, ReadsTheKindsTheLoadedUcxSupportsAndNeverSimMemory) {
  TransportOptions o;
  o.serve = false;
  RegionRegistry regions;
  const TransportOptionMap own;
  Result<std::unique_ptr<Backend>> b = FindBackend("ucx")->create(BackendContext{o, own, &regions});
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  const auto* ucx = dynamic_cast<const UcxBackend*>(b->get());
  ASSERT_NE(ucx, nullptr);
  const std::uint64_t types = ucx->memory_types();
  EXPECT_NE(types & UCS_BIT(UCS_MEMORY_TYPE_HOST), 0u) << "UCX reports no host memory";
  const bool has_cuda = (types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  std::cout << "the loaded UCX " << (has_cuda ? "supports" : "does not support")
            << " CUDA memory (memory types 0x" << std::hex << types << std::dec << ")\n";
  const MemoryKind host = MemoryKind::Host();
  const MemoryKind sim{"sim", 0};
  EXPECT_TRUE((*b)->CanRead(host, host));
  EXPECT_FALSE((*b)->CanRead(sim, host));
  EXPECT_FALSE((*b)->CanRead(host, sim));
  EXPECT_FALSE((*b)->CanRead(sim, sim));
  EXPECT_EQ((*b)->CanRead({"cuda", 0}, host), has_cuda);
  // Not serving: nothing to publish.
  EXPECT_TRUE((*b)->DescriptorSection().empty());
  const std::vector<RemoteRegion> none;
  EXPECT_EQ((*b)->CanReach(PeerView{none, {}}).code(), StatusCode::kUnavailable);
}

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
  std::this_thread::sleep_for(milliseconds(1000));
  const long ticks_per_second = sysconf(_SC_CLK_TCK);
  // A spinning thread would use the whole second; allow 10%.
  EXPECT_LT(CpuTicks(getpid()) - self_before, static_cast<std::uint64_t>(ticks_per_second / 10));
  EXPECT_LT(CpuTicks(peer_.process->pid()) - peer_before,
            static_cast<std::uint64_t>(ticks_per_second / 10));
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxPeerTest, ::testing::Values("default", "tcp", "sm_self"),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace kvferry
