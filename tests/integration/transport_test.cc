// Multi-process tests of both transport backends: a peer process (kvferry bench peer) registers
// patterned memory; this process reads it and checks every byte.
#include "kvferry/transport.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <thread>

#include "common/clock.h"
#include "common/digest.h"
#include "common/pattern.h"
#include "common/ports.h"
#include "common/subprocess.h"
#include "tests/bench_peer.h"
#include "tests/test_timing.h"
#include "transport/descriptor.h"
#include "transport/fault_transport.h"
#include "transport/shm/shm_section.h"
#include "transport/tcp/frames.h"
#include "transport/tcp/socket.h"
#include "transport/tcp/tcp_section.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr std::uint64_t kSeed = 0x6b76666572727900ull;  // the peer's default pattern seed
constexpr std::uint64_t kPeerBytes = 32u << 20;
constexpr int kPeerRegions = 4;
constexpr std::uint64_t kRegionBytes = kPeerBytes / kPeerRegions;

using Peer = testing::BenchPeer;

Peer StartPeer(const std::string& backend, const std::string& secret = "",
               const std::vector<std::string>& extra_args = {}) {
  std::vector<std::string> args = {"--backend", backend,
                                   "--bytes",   std::to_string(kPeerBytes),
                                   "--regions", std::to_string(kPeerRegions)};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  return testing::StartBenchPeer(args, secret);
}

// Local memory, registered as region 100.
class LocalMemory {
 public:
  explicit LocalMemory(std::uint64_t bytes) : bytes_(bytes) {
    data_ = static_cast<std::byte*>(
        mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  }
  ~LocalMemory() { munmap(data_, bytes_); }
  std::byte* data() const { return data_; }
  std::uint64_t size() const { return bytes_; }

 private:
  std::uint64_t bytes_;
  std::byte* data_;
};

std::unique_ptr<Transport> MakeClient(const std::string& backend, const std::string& secret = "") {
  TransportOptions o;
  o.backend = backend;
  o.serve = false;
  o.secret = secret;
  o.backend_options = {{"tcp.connections", "3"},
                       // many requests per batch, so striping is exercised
                       {"tcp.max_request_bytes", std::to_string(1u << 20)}};
  Result<std::unique_ptr<Transport>> t = CreateTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

struct Op {
  RegionId region;
  std::uint64_t remote_offset;
  std::uint64_t local_offset;
  std::uint64_t length;
};

// Random non-overlapping local destinations for random remote ranges.
std::vector<Op> RandomOps(std::mt19937_64& rng, int count, std::uint64_t local_bytes) {
  std::vector<Op> ops;
  std::uint64_t local = 0;
  for (int i = 0; i < count; ++i) {
    const std::uint64_t len = 1 + rng() % (rng() % 4 == 0 ? (256u << 10) : 8192u);
    if (local + len > local_bytes) break;
    const auto region = static_cast<RegionId>(rng() % kPeerRegions);
    ops.push_back({region, rng() % (kRegionBytes - len + 1), local, len});
    local += len + rng() % 64;
  }
  return ops;
}

std::vector<ReadOp> ToReadOps(const std::vector<Op>& ops, std::byte* base) {
  std::vector<ReadOp> out;
  for (const Op& o : ops)
    out.push_back({base + o.local_offset, o.region, o.remote_offset, o.length});
  return out;
}

void ExpectPattern(const std::vector<Op>& ops, const std::byte* base) {
  for (const Op& o : ops) {
    ASSERT_EQ(
        FirstPatternMismatch(base + o.local_offset, o.length, kSeed, o.region, o.remote_offset), -1)
        << "region " << o.region << " offset " << o.remote_offset << " length " << o.length;
  }
}

class TransportTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    peer_ = StartPeer(GetParam());
    client_ = MakeClient(GetParam());
    ASSERT_TRUE(client_->RegisterMemory(100, local_.data(), local_.size()).ok());
    Result<PeerId> p = client_->Connect(peer_->descriptor, DeadlineAfter(milliseconds(5000)));
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    peer_id_ = *p;
  }

  // Reads of 64 KiB filling all of local_: long in bytes (tens of milliseconds of copying even
  // on a fast machine) but cheap to submit. (Many tiny reads are not: reads start while
  // SubmitReads still queues the rest, and under TSan queuing outlasted the copying.)
  std::vector<ReadOp> BulkBatch() {
    constexpr std::uint64_t kRead = 64u << 10;
    std::vector<ReadOp> out;
    for (std::uint64_t k = 0; k < local_.size() / kRead; ++k) {
      out.push_back({local_.data() + k * kRead, static_cast<RegionId>(k % kPeerRegions),
                     (k * kRead) % kRegionBytes, kRead});
    }
    return out;
  }

  // A batch caught while it still runs; on a loaded machine one may end early, so retry.
  Result<BatchId> BatchInFlight() {
    for (int attempt = 0; attempt < 10; ++attempt) {
      Result<BatchId> b =
          client_->SubmitReads(peer_id_, BulkBatch(), DeadlineAfter(milliseconds(60000)));
      if (!b.ok()) return b;
      if (client_->Poll(*b).state == BatchState::kInProgress) return b;
      client_->Release(*b);
    }
    return Status::Internal("10 batches of " + std::to_string(local_.size() >> 20) +
                            " MiB each ended before SubmitReads returned");
  }

  std::optional<Peer> peer_;
  LocalMemory local_{256u << 20};
  std::unique_ptr<Transport> client_;
  PeerId peer_id_ = 0;
};

TEST_P(TransportTest, ChoosesTheRequestedBackend) {
  Result<std::string> backend = client_->PeerBackend(peer_id_);
  ASSERT_TRUE(backend.ok());
  EXPECT_EQ(*backend, GetParam());
}

TEST_P(TransportTest, RandomScatteredReadsAreVerifiedByteForByte) {
  std::mt19937_64 rng(1234);
  for (int round = 0; round < 5; ++round) {
    const std::vector<Op> ops = RandomOps(rng, 400, local_.size());
    Result<BatchId> b = client_->SubmitReads(peer_id_, ToReadOps(ops, local_.data()),
                                             DeadlineAfter(milliseconds(20000)));
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    BatchResult r = client_->Wait(*b, DeadlineAfter(milliseconds(21000)));
    ASSERT_EQ(r.state, BatchState::kDone) << r.status.ToString();
    EXPECT_EQ(client_->Poll(*b).state, BatchState::kDone);
    client_->Release(*b);
    ExpectPattern(ops, local_.data());
  }
  TransportStats s = client_->Stats();
  EXPECT_EQ(s.batches_done, 5u);
  EXPECT_GT(s.bytes_read, 0u);
}

// A strided read (issue 22 item 6): count pieces, a remote and a local stride apart, each landing
// byte for byte, the bytes between them left alone, and only the pieces counted as read; bad
// counts and strides refused before any byte moves.
TEST_P(TransportTest, StridedReadsMoveOnlyTheirPieces) {
  std::memset(local_.data(), 0x5a, 64 << 10);
  const std::uint64_t before = client_->Stats().bytes_read;
  // 16 pieces of 96 bytes, 256 bytes apart remotely and 160 locally, in two ops.
  std::vector<ReadOp> ops = {{local_.data(), 1, 1000, 96, 16, 256, 160},
                             {local_.data() + (32 << 10), 2, 7, 96, 16, 256, 160}};
  Result<BatchId> b = client_->SubmitReads(peer_id_, ops, DeadlineAfter(milliseconds(20000)));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  BatchResult r = client_->Wait(*b, DeadlineAfter(milliseconds(21000)));
  ASSERT_EQ(r.state, BatchState::kDone) << r.status.ToString();
  client_->Release(*b);
  for (const ReadOp& op : ops) {
    for (std::uint64_t i = 0; i < op.count; ++i) {
      const std::byte* piece = op.local + i * op.local_stride;
      ASSERT_EQ(FirstPatternMismatch(piece, op.length, kSeed, op.remote_region,
                                     op.remote_offset + i * op.remote_stride),
                -1)
          << "piece " << i;
      for (std::uint64_t g = op.length; g < op.local_stride; ++g) {
        ASSERT_EQ(piece[g], std::byte{0x5a}) << "a gap between pieces was written";
      }
    }
  }
  EXPECT_EQ(client_->Stats().bytes_read - before, 2u * 16u * 96u) << "only the pieces are read";
  auto submit = [&](ReadOp op) {
    return client_->SubmitReads(peer_id_, {op}, DeadlineAfter(milliseconds(2000))).status();
  };
  EXPECT_EQ(submit({local_.data(), 1, 0, 96, 0, 256, 160}).code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(submit({local_.data(), 1, 0, 96, 4, 64, 160}).message(),
              HasSubstr("strides of at least the piece"));
  EXPECT_EQ(submit({local_.data(), 1, 0, 96, 4, 256, 32}).code(), StatusCode::kInvalidArgument);
  // The last piece past the end of the remote region.
  EXPECT_EQ(submit({local_.data(), 1, kRegionBytes - 1024, 96, 16, 256, 160}).code(),
            StatusCode::kInvalidArgument);
}

TEST_P(TransportTest, EmptyBatchIsDoneAtOnce) {
  Result<BatchId> b = client_->SubmitReads(peer_id_, {}, DeadlineAfter(milliseconds(1000)));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(client_->Poll(*b).state, BatchState::kDone);
}

TEST_P(TransportTest, OutOfRangeReadsAreRefusedBeforeAnyByteMoves) {
  std::memset(local_.data(), 0x5a, 4096);
  auto submit = [&](std::vector<ReadOp> ops) {
    return client_->SubmitReads(peer_id_, std::move(ops), DeadlineAfter(milliseconds(2000)));
  };
  // Remote range past the end of its region, in a later op: the first op must not run either.
  Result<BatchId> b =
      submit({{local_.data(), 0, 0, 16}, {local_.data() + 16, 0, kRegionBytes - 8, 16}});
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(b.status().message(), HasSubstr("read 1: read of 16 bytes at offset"));
  EXPECT_EQ(submit({{local_.data(), 77, 0, 16}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(submit({{local_.data(), 0, 0, 0}}).status().code(), StatusCode::kInvalidArgument);
  // Local destination outside any registered region.
  std::vector<std::byte> unregistered(64);
  Result<BatchId> c = submit({{unregistered.data(), 0, 0, 64}});
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("not inside a registered region"));
  // Two reads into overlapping local bytes.
  Result<BatchId> overlap = submit({{local_.data(), 0, 0, 64}, {local_.data() + 32, 1, 0, 64}});
  EXPECT_EQ(overlap.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(overlap.status().message(), HasSubstr("overlapping local bytes"));
  // Straddling the end of the local region.
  EXPECT_EQ(submit({{local_.data() + local_.size() - 8, 0, 0, 16}}).status().code(),
            StatusCode::kInvalidArgument);
  for (int i = 0; i < 4096; ++i) ASSERT_EQ(local_.data()[i], std::byte{0x5a});
  EXPECT_GE(client_->Stats().requests_refused, 6u);
}

TEST_P(TransportTest, PeerKilledMidBatchIsPeerDisconnectedWithinTwoSeconds) {
  Result<BatchId> b = BatchInFlight();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  const auto killed = Clock::now();
  peer_->process->Signal(SIGKILL);
  BatchResult r = client_->Wait(*b, killed + milliseconds(2000) * testing::kTimingSlack);
  EXPECT_EQ(r.state, BatchState::kFailed);
  EXPECT_EQ(r.status.code(), StatusCode::kPeerDisconnected) << r.status.ToString();
  EXPECT_LT(Clock::now() - killed, milliseconds(2000) * testing::kTimingSlack);
}

TEST_P(TransportTest, CancelStopsEveryWriteBeforeItReturns) {
  Result<BatchId> b = BatchInFlight();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  const auto start = Clock::now();
  client_->Cancel(*b);
  EXPECT_LT(Clock::now() - start, milliseconds(1000) * testing::kTimingSlack);
  EXPECT_EQ(client_->Poll(*b).state, BatchState::kCancelled);
  EXPECT_EQ(client_->Poll(*b).status.code(), StatusCode::kCancelled);
  // After Cancel returned the memory is the caller's again: nothing may write into it.
  std::memset(local_.data(), 0x11, local_.size());
  // A later batch to the same peer, into other memory, large enough to use every tcp connection
  // and every copy thread: each serves its work in order, so once this batch is done anything
  // left of the cancelled one would already have landed.
  LocalMemory other(16u << 20);
  ASSERT_TRUE(client_->RegisterMemory(101, other.data(), other.size()).ok());
  std::mt19937_64 rng(5);
  std::vector<Op> ops;
  for (std::uint64_t off = 0; off + (256u << 10) <= other.size(); off += 256u << 10) {
    const auto region = static_cast<RegionId>(rng() % kPeerRegions);
    ops.push_back({region, rng() % (kRegionBytes - (256u << 10)), off, 256u << 10});
  }
  Result<BatchId> c = client_->SubmitReads(peer_id_, ToReadOps(ops, other.data()),
                                           DeadlineAfter(milliseconds(10000)));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(client_->Wait(*c, DeadlineAfter(milliseconds(11000))).state, BatchState::kDone)
      << "the peer connection no longer works after a cancel";
  ExpectPattern(ops, other.data());
  client_->Release(*c);
  EXPECT_TRUE(client_->DeregisterMemory(101).ok());
  std::vector<std::byte> expected(1u << 20, std::byte{0x11});
  for (std::uint64_t off = 0; off < local_.size(); off += expected.size()) {
    ASSERT_EQ(std::memcmp(local_.data() + off, expected.data(), expected.size()), 0)
        << "bytes written into the cancelled batch's memory near offset " << off;
  }
}

TEST_P(TransportTest, ManyConcurrentBatchesFromSeveralThreads) {
  constexpr int kThreads = 4;
  constexpr int kBatches = 25;
  const std::uint64_t slice = local_.size() / kThreads;
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 100);
      std::byte* base = local_.data() + slice * static_cast<std::uint64_t>(t);
      for (int i = 0; i < kBatches; ++i) {
        const std::vector<Op> ops = RandomOps(rng, 60, slice);
        Result<BatchId> b = client_->SubmitReads(peer_id_, ToReadOps(ops, base),
                                                 DeadlineAfter(milliseconds(20000)));
        ASSERT_TRUE(b.ok());
        BatchResult r = client_->Wait(*b, DeadlineAfter(milliseconds(21000)));
        ASSERT_EQ(r.state, BatchState::kDone) << r.status.ToString();
        client_->Release(*b);
        ExpectPattern(ops, base);
        done.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(done.load(), kThreads * kBatches);
}

TEST_P(TransportTest, DeadlineIsTimeout) {
  // A deadline already in the past: the batch ends as Timeout without hanging.
  Result<BatchId> b = client_->SubmitReads(peer_id_, BulkBatch(), Clock::now());
  ASSERT_TRUE(b.ok());
  BatchResult r = client_->Wait(*b, DeadlineAfter(milliseconds(2000)));
  EXPECT_EQ(r.state, BatchState::kFailed);
  EXPECT_EQ(r.status.code(), StatusCode::kTimeout);
}

// Issue 13 item 2: the core asks the peer's backend whether it can read the remote region's
// memory kind into the local region's, and refuses before any byte moves when it cannot.
TEST_P(TransportTest, ARemoteRegionOfAKindTheBackendCannotReadIsRefused) {
  Result<PeerDescriptor> d = DecodeDescriptor(peer_->descriptor);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ASSERT_GE(d->regions.size(), 2u);
  for (const RemoteRegion& r : d->regions) EXPECT_TRUE(r.kind.is_host());
  for (RemoteRegion& r : d->regions) {
    if (r.id == 1) r.kind = MemoryKind{"fake", 1};
  }
  Result<PeerId> p = client_->Connect(EncodeDescriptor(*d), DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(*client_->PeerBackend(*p), GetParam());
  const std::uint64_t refused_before = client_->Stats().requests_refused;

  Result<BatchId> host =
      client_->SubmitReads(*p, {{local_.data(), 0, 0, 4096}}, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  EXPECT_EQ(client_->Wait(*host, DeadlineAfter(milliseconds(6000))).state, BatchState::kDone);
  client_->Release(*host);

  Result<BatchId> fake =
      client_->SubmitReads(*p, {{local_.data(), 0, 0, 4096}, {local_.data() + 4096, 1, 0, 4096}},
                           DeadlineAfter(milliseconds(5000)));
  ASSERT_FALSE(fake.ok());
  EXPECT_EQ(fake.status().code(), StatusCode::kNotSupported);
  EXPECT_THAT(fake.status().message(), HasSubstr("read 1: the " + GetParam() +
                                                 " backend cannot read fake:1 memory (the peer's "
                                                 "region 1) into host memory (local region 100)"));
  EXPECT_EQ(client_->Stats().requests_refused, refused_before + 1);
  client_->Disconnect(*p);
}

INSTANTIATE_TEST_SUITE_P(Backends, TransportTest, ::testing::ValuesIn(TransportBackendNames()),
                         [](const auto& param_info) { return param_info.param; });

TEST(TcpTransportTest, FrozenPeerIsTimeoutAtTheDeadline) {
  Peer peer = StartPeer("tcp");
  std::unique_ptr<Transport> client = MakeClient("tcp");
  LocalMemory local(16u << 20);
  ASSERT_TRUE(client->RegisterMemory(1, local.data(), local.size()).ok());
  Result<PeerId> p = client->Connect(peer.descriptor, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(p.ok());
  peer.process->Signal(SIGSTOP);
  std::vector<ReadOp> ops;
  for (int i = 0; i < 512; ++i)
    ops.push_back({local.data() + i * 16384, 0, static_cast<std::uint64_t>(i) * 16384, 16384});
  const Deadline deadline = DeadlineAfter(milliseconds(800));
  Result<BatchId> b = client->SubmitReads(*p, std::move(ops), deadline);
  ASSERT_TRUE(b.ok());
  BatchResult r = client->Wait(*b, deadline + milliseconds(2000));
  EXPECT_EQ(r.state, BatchState::kFailed);
  EXPECT_EQ(r.status.code(), StatusCode::kTimeout) << r.status.ToString();
  EXPECT_GE(Clock::now(), deadline);
  EXPECT_LT(Clock::now(), deadline + milliseconds(1000) * testing::kTimingSlack)
      << "Timeout came well after the deadline";
  peer.process->Signal(SIGCONT);
}

// shm reads need no CPU from the peer, so a stopped peer's memory is still read, at full speed.
TEST(ShmTransportTest, FrozenPeerIsStillReadable) {
  Peer peer = StartPeer("shm");
  std::unique_ptr<Transport> client = MakeClient("shm");
  LocalMemory local(8u << 20);
  ASSERT_TRUE(client->RegisterMemory(1, local.data(), local.size()).ok());
  Result<PeerId> p = client->Connect(peer.descriptor, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(p.ok());
  peer.process->Signal(SIGSTOP);
  Result<BatchId> b = client->SubmitReads(*p, {{local.data(), 2, 4096, 1u << 20}},
                                          DeadlineAfter(milliseconds(2000)));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(client->Wait(*b, DeadlineAfter(milliseconds(3000))).state, BatchState::kDone);
  EXPECT_EQ(FirstPatternMismatch(local.data(), 1u << 20, kSeed, 2, 4096), -1);
  peer.process->Signal(SIGCONT);
}

// The read-only mappings of kvferry::HostMemory in this process (/proc/self/maps lines).
std::vector<std::string> ServedMappings() {
  std::ifstream maps("/proc/self/maps");
  std::vector<std::string> out;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/memfd:kvferry-served") != std::string::npos) out.push_back(line);
  }
  return out;
}

// Issue 30 item 6: memory the serving process allocated with kvferry::HostMemory (bench peer's
// default) is mapped read-only by a same-host reader, once per region, and read with memcpy;
// anonymous memory (--anonymous) is read with process_vm_readv. Both read the same bytes.
TEST(ShmTransportTest, HostMemoryIsMappedReadOnceAndAnonymousMemoryIsReadThroughThePageTable) {
  for (const bool anonymous : {false, true}) {
    SCOPED_TRACE(anonymous ? "anonymous" : "HostMemory");
    const std::size_t before = ServedMappings().size();
    Peer peer =
        StartPeer("shm", "",
                  anonymous ? std::vector<std::string>{"--anonymous"} : std::vector<std::string>{});
    ASSERT_FALSE(peer.descriptor.empty());
    std::unique_ptr<Transport> client = MakeClient("shm");
    LocalMemory local(16u << 20);
    ASSERT_TRUE(client->RegisterMemory(1, local.data(), local.size()).ok());
    Result<PeerId> p = client->Connect(peer.descriptor, DeadlineAfter(milliseconds(5000)));
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    const std::vector<std::string> mapped = ServedMappings();
    EXPECT_EQ(mapped.size() - before, anonymous ? 0u : static_cast<std::size_t>(kPeerRegions));
    for (const std::string& line : mapped) {
      // Read-only and shared: "r--s".
      EXPECT_NE(line.find(" r--s "), std::string::npos) << line;
    }
    std::mt19937_64 rng(77);
    for (int round = 0; round < 3; ++round) {
      const std::vector<Op> ops = RandomOps(rng, 300, local.size());
      Result<BatchId> b =
          client->SubmitReads(*p, ToReadOps(ops, local.data()), DeadlineAfter(milliseconds(20000)));
      ASSERT_TRUE(b.ok()) << b.status().ToString();
      const BatchResult r = client->Wait(*b, DeadlineAfter(milliseconds(20000)));
      ASSERT_EQ(r.state, BatchState::kDone) << r.status.ToString();
      client->Release(*b);
      ExpectPattern(ops, local.data());
    }
    client->Disconnect(*p);
    EXPECT_EQ(ServedMappings().size(), before) << "the mappings outlived the peer";
  }
}

TEST(TcpTransportTest, WrongOrMissingSecretIsRefused) {
  Peer peer = StartPeer("tcp", "the-right-secret");
  for (const std::string secret : {"a-wrong-secret", ""}) {
    std::unique_ptr<Transport> client = MakeClient("tcp", secret);
    Result<PeerId> p = client->Connect(peer.descriptor, DeadlineAfter(milliseconds(5000)));
    EXPECT_EQ(p.status().code(), StatusCode::kUnauthenticated) << secret;
  }
  std::unique_ptr<Transport> client = MakeClient("tcp", "the-right-secret");
  LocalMemory local(1u << 20);
  ASSERT_TRUE(client->RegisterMemory(1, local.data(), local.size()).ok());
  Result<PeerId> p = client->Connect(peer.descriptor, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  Result<BatchId> b =
      client->SubmitReads(*p, {{local.data(), 1, 100, 5000}}, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(client->Wait(*b, DeadlineAfter(milliseconds(6000))).state, BatchState::kDone);
  EXPECT_EQ(FirstPatternMismatch(local.data(), 5000, kSeed, 1, 100), -1);
}

// A peer that dies and is replaced by another process on the same port (a restarted prefill
// instance) must not be read through the old peer: the connection's automatic reconnect reaches
// the new process, which cannot prove it is the instance the descriptor named.
TEST(TcpTransportTest, APeerRestartedOnTheSamePortIsNotReadAsTheOldOne) {
  const std::string port = std::to_string(FreeLoopbackPorts(1));
  Peer first = StartPeer("tcp", "s3cret", {"--transport-opt", "tcp.port=" + port});
  std::unique_ptr<Transport> client = MakeClient("tcp", "s3cret");
  LocalMemory local(1u << 20);
  ASSERT_TRUE(client->RegisterMemory(1, local.data(), local.size()).ok());
  Result<PeerId> p = client->Connect(first.descriptor, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  Result<BatchId> b =
      client->SubmitReads(*p, {{local.data(), 1, 100, 5000}}, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(client->Wait(*b, DeadlineAfter(milliseconds(6000))).state, BatchState::kDone);

  first.process->Signal(SIGKILL);
  (void)first.process->CloseAndWait(milliseconds(5000));
  Peer second = StartPeer("tcp", "s3cret", {"--transport-opt", "tcp.port=" + port, "--seed", "99"});
  std::memset(local.data(), 0x11, 5000);
  b = client->SubmitReads(*p, {{local.data(), 1, 100, 5000}}, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(b.ok());
  const BatchResult r = client->Wait(*b, DeadlineAfter(milliseconds(6000)));
  EXPECT_EQ(r.state, BatchState::kFailed);
  EXPECT_EQ(r.status.code(), StatusCode::kPeerDisconnected) << r.status.ToString();
  for (std::size_t i = 0; i < 5000; ++i) ASSERT_EQ(local.data()[i], std::byte{0x11}) << i;
  // Connecting with the new descriptor reads the new process.
  Result<PeerId> q = client->Connect(second.descriptor, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  b = client->SubmitReads(*q, {{local.data(), 1, 100, 5000}}, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(client->Wait(*b, DeadlineAfter(milliseconds(6000))).state, BatchState::kDone);
  EXPECT_EQ(FirstPatternMismatch(local.data(), 5000, 99, 1, 100), -1);
}

// Speaks the tcp frames directly, as a hostile or buggy client would.
class RawClient {
 public:
  explicit RawClient(const TcpEndpoint& ep) {
    Result<tcp::Fd> fd =
        tcp::Connect(ep.host, ep.port, DeadlineAfter(milliseconds(2000)), milliseconds(2000));
    EXPECT_TRUE(fd.ok());
    fd_ = std::move(fd).value();
  }
  Status Handshake() {
    std::uint8_t hello[tcp::kHelloBytes];
    KVFERRY_RETURN_IF_ERROR(Recv(hello, sizeof(hello)));
    tcp::Nonce server{};
    std::memcpy(server.data(), hello + 8, server.size());
    const tcp::Nonce client = tcp::RandomNonce();
    std::uint8_t auth[tcp::kAuthBytes];
    tcp::PutU32(auth, tcp::kAuthMagic);
    tcp::PutU32(auth + 4, tcp::kVersion);
    std::memcpy(auth + 8, client.data(), client.size());
    const Sha256Digest mac = tcp::ClientMac("", server, client);
    std::memcpy(auth + 8 + client.size(), mac.data(), mac.size());
    KVFERRY_RETURN_IF_ERROR(Send(auth, sizeof(auth)));
    std::uint8_t result[tcp::kResultBytes];
    return Recv(result, sizeof(result));
  }
  Status Send(const void* p, std::size_t n) {
    iovec iov{const_cast<void*>(p), n};
    return tcp::SendAll(fd_.get(), &iov, 1, Stop());
  }
  Status Recv(void* p, std::size_t n) {
    iovec iov{p, n};
    std::uint64_t got = 0;
    return tcp::RecvAll(fd_.get(), &iov, 1, Stop(), &got);
  }

 private:
  static tcp::StopCheck Stop() {
    const Deadline d = DeadlineAfter(milliseconds(3000));
    return [d]() -> Status { return Expired(d) ? Status::Timeout("raw client") : Status::Ok(); };
  }
  tcp::Fd fd_;
};

TEST(TcpTransportTest, ServerRefusesOutOfRangeAndDropsOnlyMalformedConnections) {
  Peer peer = StartPeer("tcp");
  Result<PeerDescriptor> d = DecodeDescriptor(peer.descriptor);
  ASSERT_TRUE(d.ok());
  Result<TcpEndpoint> endpoint = DecodeTcpSection(d->Section("tcp"));
  ASSERT_TRUE(endpoint.ok()) << endpoint.status().ToString();

  // An out-of-range read is answered with an error, and the connection stays usable.
  RawClient good(*endpoint);
  ASSERT_TRUE(good.Handshake().ok());
  std::uint8_t req[tcp::kRequestHeaderBytes + tcp::kOpBytes];
  tcp::EncodeRequestHeader({1, 7}, req);
  tcp::EncodeOp({0, kRegionBytes - 4, 8}, req + tcp::kRequestHeaderBytes);
  ASSERT_TRUE(good.Send(req, sizeof(req)).ok());
  std::uint8_t head[tcp::kResponseHeaderBytes];
  ASSERT_TRUE(good.Recv(head, sizeof(head)).ok());
  Result<tcp::ResponseHeader> h =
      tcp::ParseResponseHeader(std::span<const std::uint8_t, tcp::kResponseHeaderBytes>(head));
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->status, static_cast<std::uint32_t>(StatusCode::kInvalidArgument));
  std::string text(h->payload_length, '\0');
  ASSERT_TRUE(good.Recv(text.data(), text.size()).ok());
  EXPECT_THAT(text, HasSubstr("outside region 0"));

  // A malformed frame (bad magic) closes that connection only.
  RawClient bad(*endpoint);
  ASSERT_TRUE(bad.Handshake().ok());
  std::uint8_t junk[tcp::kRequestHeaderBytes] = {1, 2, 3, 4};
  ASSERT_TRUE(bad.Send(junk, sizeof(junk)).ok());
  std::uint8_t byte = 0;
  EXPECT_EQ(bad.Recv(&byte, 1).code(), StatusCode::kPeerDisconnected);

  // The first connection still gets served.
  tcp::EncodeRequestHeader({1, 8}, req);
  tcp::EncodeOp({3, 64, 32}, req + tcp::kRequestHeaderBytes);
  ASSERT_TRUE(good.Send(req, sizeof(req)).ok());
  ASSERT_TRUE(good.Recv(head, sizeof(head)).ok());
  h = tcp::ParseResponseHeader(std::span<const std::uint8_t, tcp::kResponseHeaderBytes>(head));
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->status, 0u);
  EXPECT_EQ(h->request_id, 8u);
  std::vector<std::byte> data(32);
  ASSERT_TRUE(good.Recv(data.data(), data.size()).ok());
  EXPECT_EQ(FirstPatternMismatch(data.data(), 32, kSeed, 3, 64), -1);
}

TEST(TransportSelectionTest, AutoPicksShmOnThisHostAndForcedShmRefusesOtherHosts) {
  Peer peer = StartPeer("auto");
  std::unique_ptr<Transport> client = MakeClient("auto");
  Result<PeerId> p = client->Connect(peer.descriptor, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*client->PeerBackend(*p), "shm");

  Result<PeerDescriptor> d = DecodeDescriptor(peer.descriptor);
  ASSERT_TRUE(d.ok());
  Result<ShmSection> shm = DecodeShmSection(d->Section("shm"));
  ASSERT_TRUE(shm.ok()) << shm.status().ToString();
  shm->host.boot_id = "00000000-0000-0000-0000-000000000000";  // as if on another machine
  d->sections["shm"] = EncodeShmSection(*shm);
  const std::vector<std::uint8_t> elsewhere = EncodeDescriptor(*d);
  std::unique_ptr<Transport> shm_only = MakeClient("shm");
  Result<PeerId> refused = shm_only->Connect(elsewhere, DeadlineAfter(milliseconds(5000)));
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(refused.status().message(), HasSubstr("shm needs the peer on this kernel"));
  // auto falls back to tcp for it.
  Result<PeerId> fallback = client->Connect(elsewhere, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(fallback.ok()) << fallback.status().ToString();
  EXPECT_EQ(*client->PeerBackend(*fallback), "tcp");
}

TEST(TransportRegistrationTest, OverlapsDuplicatesAndUnknownIdsAreRefused) {
  std::unique_ptr<Transport> t = MakeClient("auto");
  std::vector<std::byte> mem(8192);
  EXPECT_TRUE(t->RegisterMemory(1, mem.data(), 4096).ok());
  EXPECT_EQ(t->RegisterMemory(1, mem.data() + 4096, 4096).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->RegisterMemory(2, mem.data() + 100, 4096).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->RegisterMemory(3, nullptr, 16).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->RegisterMemory(4, mem.data(), 0).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(t->RegisterMemory(2, mem.data() + 4096, 4096).ok());
  EXPECT_TRUE(t->DeregisterMemory(1).ok());
  EXPECT_EQ(t->DeregisterMemory(1).code(), StatusCode::kNotFound);
  EXPECT_EQ(t->Connect(std::vector<std::uint8_t>{1, 2, 3}, DeadlineAfter(milliseconds(100)))
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

TEST(FaultInjectionTest, DelaysFailsAndCutsChosenBatchesOfARealBackend) {
  Peer peer = StartPeer("tcp");
  auto faulty = std::make_unique<FaultInjectingTransport>(MakeClient("tcp"));
  LocalMemory local(4u << 20);
  ASSERT_TRUE(faulty->RegisterMemory(1, local.data(), local.size()).ok());
  Result<PeerId> p = faulty->Connect(peer.descriptor, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(p.ok());
  faulty->AddRule({FaultRule::Action::kFail, [](std::uint64_t seq, PeerId) { return seq == 0; },
                   milliseconds(0), Status::PeerDisconnected("injected: link down"), nullptr});
  faulty->AddRule({FaultRule::Action::kDelay, [](std::uint64_t seq, PeerId) { return seq == 1; },
                   milliseconds(300), Status::Ok(), nullptr});
  faulty->AddRule({FaultRule::Action::kCut, [](std::uint64_t seq, PeerId) { return seq == 2; },
                   milliseconds(0), Status::PeerDisconnected("injected: cut"), nullptr});
  auto ops = [&] {
    return std::vector<ReadOp>{{local.data(), 0, 0, 4096}, {local.data() + 4096, 0, 8192, 4096}};
  };
  std::memset(local.data(), 0, 8192);
  Result<BatchId> failed = faulty->SubmitReads(*p, ops(), DeadlineAfter(milliseconds(5000)));
  BatchResult r = faulty->Wait(*failed, DeadlineAfter(milliseconds(5000)));
  EXPECT_EQ(r.state, BatchState::kFailed);
  EXPECT_THAT(r.status.message(), HasSubstr("link down"));
  EXPECT_EQ(local.data()[0], std::byte{0}) << "a failed-at-once batch moves nothing";

  const auto start = Clock::now();
  Result<BatchId> delayed = faulty->SubmitReads(*p, ops(), DeadlineAfter(milliseconds(5000)));
  EXPECT_EQ(faulty->Wait(*delayed, DeadlineAfter(milliseconds(5000))).state, BatchState::kDone);
  EXPECT_GE(Clock::now() - start, milliseconds(300));

  std::memset(local.data(), 0, 8192);
  Result<BatchId> cut = faulty->SubmitReads(*p, ops(), DeadlineAfter(milliseconds(5000)));
  r = faulty->Wait(*cut, DeadlineAfter(milliseconds(5000)));
  EXPECT_EQ(r.state, BatchState::kFailed);
  EXPECT_EQ(FirstPatternMismatch(local.data(), 4096, kSeed, 0, 0), -1) << "the first half ran";
  EXPECT_EQ(local.data()[4096], std::byte{0}) << "the second half did not";
  EXPECT_EQ(faulty->faults_injected(), 3u);
}

}  // namespace
}  // namespace kvferry

namespace kvferry {
namespace {

// Issue 13 item 2: a region whose memory kind no backend of the transport can use is refused at
// registration, naming the kind and the backends.
TEST(TransportMemoryKindTest, RegisteringAKindNoBackendUsesIsRefused) {
  std::unique_ptr<Transport> t = MakeClient("auto");
  std::vector<std::byte> mem(8192);
  const Status fake = t->RegisterMemory(1, mem.data(), 4096, MemoryKind{"fake", 0});
  EXPECT_EQ(fake.code(), StatusCode::kInvalidArgument);
  const Result<std::vector<std::string>> in_auto = SelectedTransportBackends("auto");
  ASSERT_TRUE(in_auto.ok());
  std::string backends;
  for (const std::string& n : *in_auto) backends += (backends.empty() ? "" : ", ") + n;
  EXPECT_THAT(fake.message(),
              HasSubstr("fake:0 memory, which no backend of this transport (" + backends + ")"));
  const Status malformed = t->RegisterMemory(2, mem.data(), 4096, MemoryKind{"Fake!", 0});
  EXPECT_EQ(malformed.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(malformed.message(), HasSubstr("malformed"));
  EXPECT_TRUE(t->RegisterMemory(1, mem.data(), 4096, MemoryKind::Host()).ok());
  EXPECT_TRUE(t->RegisterMemory(2, mem.data() + 4096, 4096).ok());  // host by default
}

// Issue 15: `backend` takes a preference order; auto is shm then tcp; a peer is carried by the
// first backend of the list that reaches it.
TEST(TransportOptionsTest, ABackendListIsCheckedAndTriedInItsOrder) {
  EXPECT_EQ(*SelectedTransportBackends("auto"), (std::vector<std::string>{"shm", "tcp"}));
  EXPECT_EQ(*SelectedTransportBackends("tcp,shm"), (std::vector<std::string>{"tcp", "shm"}));
  EXPECT_EQ(*SelectedTransportBackends("shm"), (std::vector<std::string>{"shm"}));
  const Status twice = CheckTransportBackend("tcp,shm,tcp");
  EXPECT_EQ(twice.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(twice.message(), HasSubstr("names tcp twice"));
  for (const char* bad : {"tcp,nope", "", "tcp,", ",tcp", "auto,tcp"}) {
    const Status s = CheckTransportBackend(bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.message(), HasSubstr("unknown transport")) << bad;
  }
  TransportOptions bad;
  bad.backend = "tcp,nope";
  EXPECT_EQ(CreateTransport(bad).status().code(), StatusCode::kInvalidArgument);

  // Both orders reach a same-host peer that runs both backends: the first one carries it.
  TransportOptions so;
  so.backend = "auto";
  so.serve = true;
  auto created = CreateTransport(so);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  std::unique_ptr<Transport> server = std::move(created).value();
  std::vector<std::byte> mem(4096);
  ASSERT_TRUE(server->RegisterMemory(1, mem.data(), mem.size()).ok());
  auto d = server->Descriptor();
  ASSERT_TRUE(d.ok());
  for (const std::string order : {"tcp,shm", "shm,tcp"}) {
    std::unique_ptr<Transport> client = MakeClient(order);
    auto peer = client->Connect(*d, DeadlineAfter(std::chrono::milliseconds(5000)));
    ASSERT_TRUE(peer.ok()) << order << ": " << peer.status().ToString();
    EXPECT_EQ(*client->PeerBackend(*peer), order.substr(0, 3)) << order;
  }
}

// Issue 13 item 1: backend options come as "<backend>.<key>" strings, are checked for every
// backend of the build, and every error names the key.
TEST(TransportOptionsTest, BadBackendOptionsAreRefusedNamingTheKey) {
  auto refusal = [](TransportOptions o) {
    o.serve = false;
    const Status check = CheckTransportOptions(o);
    Result<std::unique_ptr<Transport>> t = CreateTransport(o);
    EXPECT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << t.status().ToString();
    EXPECT_EQ(check.code(), StatusCode::kInvalidArgument);
    return std::string(t.status().message());
  };
  TransportOptions o;
  o.backend_options = {{"tcp.connectionz", "4"}};
  EXPECT_THAT(refusal(o), AllOf(HasSubstr("unknown transport option tcp.connectionz"),
                                HasSubstr("tcp.connections")));
  o.backend_options = {{"tcp.connections", "0"}};
  EXPECT_THAT(refusal(o), AllOf(HasSubstr("tcp.connections"), HasSubstr("found '0'")));
  o.backend_options = {{"shm.threads", "many"}};
  EXPECT_THAT(refusal(o), HasSubstr("shm.threads: expected an integer"));
  o.backend_options = {{"shm.permit_any_tracer", "yes please"}};
  EXPECT_THAT(refusal(o), HasSubstr("shm.permit_any_tracer"));
  o.backend_options = {{"rdma.lanes", "2"}};
  EXPECT_THAT(refusal(o), HasSubstr("transport option rdma.lanes"));
  // Options of a backend this transport does not use are checked too: a typo never hides.
  o.backend = "tcp";
  o.backend_options = {{"shm.threads", "0"}};
  EXPECT_THAT(refusal(o), HasSubstr("shm.threads"));
  o.backend_options.clear();
  o.backend = "rdma";
  EXPECT_THAT(refusal(o), HasSubstr("unknown transport 'rdma': expected auto"));
  TransportOptionMap map;
  EXPECT_EQ(AddTransportOption("tcp.connections", &map).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(AddTransportOption("=4", &map).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(AddTransportOption("tcp.advertise_host=a=b", &map).ok());
  EXPECT_EQ(map.at("tcp.advertise_host"), "a=b");
}

// Backend options are set by key only (TransportOptions has no field of any backend): the keys
// reach the backend.
TEST(TransportOptionsTest, BackendOptionsAreSetByKey) {
  const int free_port = FreeLoopbackPorts(1);
  ASSERT_GT(free_port, 0);
  const auto port = static_cast<std::uint16_t>(free_port);

  TransportOptions o;
  o.backend = "tcp";
  o.backend_options = {{"tcp.port", std::to_string(port)}, {"tcp.advertise_host", "localhost"}};
  Result<std::unique_ptr<Transport>> t = CreateTransport(o);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  Result<PeerDescriptor> d = DecodeDescriptor(*(*t)->Descriptor());
  ASSERT_TRUE(d.ok());
  Result<TcpEndpoint> endpoint = DecodeTcpSection(d->Section("tcp"));
  ASSERT_TRUE(endpoint.ok()) << endpoint.status().ToString();
  EXPECT_EQ(endpoint->port, port);
  EXPECT_EQ(endpoint->host, "localhost");
  EXPECT_TRUE(d->Section("shm").empty());  // backend tcp: no shm section
}

}  // namespace
}  // namespace kvferry
