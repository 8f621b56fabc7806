// Device memory through the transport (issue 14 item 2, docs/device.md): a serving transport and a
// reading transport in this process, each region host memory or memory of a simulated device
// (whose addresses fault when host code touches them), read over tcp in every combination of
// kinds: random scattered reads verified byte for byte by copying the device memory back, a cancel
// while reads stage, and registrations that name the wrong kind refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/digest.h"
#include "common/pattern.h"
#include "common/subprocess.h"
#include "device/device.h"
#include "device/sim/sim_device.h"
#include "kvferry/transport.h"
#include "tests/bench_peer.h"
#include "tests/unit/device/device_test_util.h"
#include "transport/descriptor.h"
#include "transport/shm/shm_section.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;

constexpr std::uint64_t kBytes = 16u << 20;  // per side
constexpr std::uint64_t kSeed = 0x64657669636500ull;
constexpr RegionId kRemoteRegion = 7;
constexpr RegionId kLocalRegion = 100;

// kBytes of one kind ("host", "sim:0", ...), filled with a pattern or zeros, readable back.
class Memory {
 public:
  Memory(const std::string& kind, bool patterned) : kind_(kind) {
    std::vector<std::byte> init(kBytes);
    if (patterned) FillPattern(init.data(), kBytes, kSeed, kRemoteRegion, 0);
    if (kind == "host") {
      host_ = std::move(init);
      return;
    }
    Result<device::Device*> dev = device::ProcessDevice(kind);
    EXPECT_TRUE(dev.ok()) << dev.status().ToString();
    dev_ = *dev;
    auto alloc = dev_->Allocate(kBytes);
    EXPECT_TRUE(alloc.ok()) << alloc.status().ToString();
    alloc_ = std::move(alloc).value();
    auto stream = dev_->CreateStream();
    EXPECT_TRUE(stream.ok());
    stream_ = std::move(stream).value();
    EXPECT_TRUE(device::testing::Upload(*stream_, alloc_->address(), init).ok());
  }
  MemoryKind kind() const { return kind_ == "host" ? MemoryKind::Host() : *ParseMemoryKind(kind_); }
  // The address to register and read into: a host pointer, or a device address as one.
  std::byte* base() {
    return dev_ == nullptr ? host_.data()
                           : reinterpret_cast<std::byte*>(alloc_->address());  // NOLINT
  }
  std::vector<std::byte> Contents() {
    if (dev_ == nullptr) return host_;
    auto bytes = device::testing::Download(*stream_, alloc_->address(), kBytes);
    EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
    return bytes.ok() ? *bytes : std::vector<std::byte>{};
  }

 private:
  std::string kind_;
  std::vector<std::byte> host_;
  device::Device* dev_ = nullptr;
  std::unique_ptr<device::DeviceAllocation> alloc_;
  std::unique_ptr<device::Stream> stream_;
};

std::unique_ptr<Transport> MakeTransport(bool serve, const std::string& backend = "tcp") {
  TransportOptions o;
  o.backend = backend;
  o.serve = serve;
  o.backend_options = {{"tcp.connections", "2"},
                       {"tcp.max_request_bytes", std::to_string(1u << 20)}};  // several per batch
  Result<std::unique_ptr<Transport>> t = CreateTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

struct Kinds {
  std::string remote;
  std::string local;
  std::string backend = "tcp";
};
void PrintTo(const Kinds& k, std::ostream* os) {
  *os << k.remote << " -> " << k.local << " over " << k.backend;
}
std::string KindsName(const ::testing::TestParamInfo<Kinds>& param_info) {
  std::string n =
      param_info.param.remote + "_to_" + param_info.param.local + "_" + param_info.param.backend;
  for (char& c : n) c = c == ':' ? '_' : c;
  return n;
}

bool RequireGpu() {
  const char* v = std::getenv("KVFERRY_REQUIRE_GPU");  // NOLINT(concurrency-mt-unsafe)
  return v != nullptr && std::string(v) == "1";
}

class DeviceTransportTest : public ::testing::TestWithParam<Kinds> {
 protected:
  void SetUp() override {
    // The cuda instances run on a GPU (make test-gpu); elsewhere they SKIP saying why, or FAIL
    // under KVFERRY_REQUIRE_GPU=1.
    for (const std::string& kind : {GetParam().remote, GetParam().local}) {
      if (kind.rfind("cuda", 0) != 0) continue;
      Result<device::Device*> dev = device::ProcessDevice(kind);
      if (!dev.ok()) {
        if (RequireGpu()) FAIL() << "KVFERRY_REQUIRE_GPU=1: " << dev.status().ToString();
        GTEST_SKIP() << "no CUDA driver/device: " << dev.status().ToString();
      }
    }
    remote_ = std::make_unique<Memory>(GetParam().remote, true);
    local_ = std::make_unique<Memory>(GetParam().local, false);
    server_ = MakeTransport(true, GetParam().backend);
    client_ = MakeTransport(false, GetParam().backend);
    ASSERT_TRUE(server_ && client_);
    ASSERT_TRUE(
        server_->RegisterMemory(kRemoteRegion, remote_->base(), kBytes, remote_->kind()).ok());
    ASSERT_TRUE(client_->RegisterMemory(kLocalRegion, local_->base(), kBytes, local_->kind()).ok());
    Result<std::vector<std::uint8_t>> d = server_->Descriptor();
    ASSERT_TRUE(d.ok());
    Result<PeerId> p = client_->Connect(*d, DeadlineAfter(milliseconds(5000)));
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    peer_ = *p;
  }

  std::unique_ptr<Memory> remote_;
  std::unique_ptr<Memory> local_;
  std::unique_ptr<Transport> server_;
  std::unique_ptr<Transport> client_;
  PeerId peer_ = 0;
};

TEST_P(DeviceTransportTest, RandomScatteredReadsAreByteExact) {
  std::mt19937_64 rng(42);
  struct Op {
    std::uint64_t remote, local, length;
  };
  std::vector<Op> ops;
  std::uint64_t local = 0;
  for (int i = 0; i < 400; ++i) {
    // Mostly block-sized reads, some tiny, some several staging buffers long.
    const std::uint64_t kind = rng() % 10;
    const std::uint64_t len = kind == 0 ? 1 + rng() % 100 : kind == 1 ? (5u << 20) : (64u << 10);
    if (local + len > kBytes) break;
    ops.push_back({rng() % (kBytes - len + 1), local, len});
    local += len + rng() % 4096;
  }
  std::vector<ReadOp> reads;
  for (const Op& o : ops)
    reads.push_back({local_->base() + o.local, kRemoteRegion, o.remote, o.length});
  Result<BatchId> b = client_->SubmitReads(peer_, reads, DeadlineAfter(milliseconds(30000)));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  const BatchResult r = client_->Wait(*b, DeadlineAfter(milliseconds(40000)));
  ASSERT_EQ(r.state, BatchState::kDone) << r.status.ToString();
  client_->Release(*b);
  const std::vector<std::byte> got = local_->Contents();
  ASSERT_EQ(got.size(), kBytes);
  std::uint64_t next = 0;  // bytes between reads stay zero: nothing landed outside them
  std::uint64_t total = 0;
  for (const Op& o : ops) {
    total += o.length;
    for (std::uint64_t k = next; k < o.local; ++k) ASSERT_EQ(got[k], std::byte{0}) << k;
    ASSERT_EQ(FirstPatternMismatch(got.data() + o.local, o.length, kSeed, kRemoteRegion, o.remote),
              -1)
        << GetParam().remote << " -> " << GetParam().local << ": remote offset " << o.remote
        << " length " << o.length;
    next = o.local + o.length;
  }
  EXPECT_EQ(client_->Stats().bytes_read, total);
  // This side holds pinned staging when bytes land in a device through host memory: tcp's
  // receive buffers, or shm's lanes for the peer's host memory; IPC copies need none.
  const Kinds& k = GetParam();
  const bool stages = k.local != "host" && (k.backend == "tcp" || k.remote == "host");
  EXPECT_EQ(client_->Stats().staging_bytes > 0, stages) << client_->Stats().staging_bytes;
}

TEST_P(DeviceTransportTest, CancelWhileStagingEndsTheBatchAndNothingLandsAfter) {
  std::vector<ReadOp> reads;
  for (std::uint64_t off = 0; off < kBytes; off += 64u << 10) {
    reads.push_back({local_->base() + off, kRemoteRegion, off, 64u << 10});
  }
  Result<BatchId> b = client_->SubmitReads(peer_, reads, DeadlineAfter(milliseconds(30000)));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  client_->Cancel(*b);
  const BatchState state = client_->Poll(*b).state;
  EXPECT_TRUE(state == BatchState::kCancelled || state == BatchState::kDone)
      << BatchStateName(state);
  const std::vector<std::byte> after_cancel = local_->Contents();
  // Give any straggler the time to land, then look again: nothing changed.
  for (int i = 0; i < 3; ++i) {
    Result<BatchId> probe = client_->SubmitReads(peer_, {}, DeadlineAfter(milliseconds(1000)));
    ASSERT_TRUE(probe.ok());
    client_->Wait(*probe, DeadlineAfter(milliseconds(1000)));
    client_->Release(*probe);
  }
  EXPECT_TRUE(local_->Contents() == after_cancel) << "bytes landed after Cancel returned";
  client_->Release(*b);
  // The connection still serves a fresh batch.
  Result<BatchId> again = client_->SubmitReads(peer_, {{local_->base(), kRemoteRegion, 0, 4096}},
                                               DeadlineAfter(milliseconds(10000)));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(client_->Wait(*again, DeadlineAfter(milliseconds(15000))).state, BatchState::kDone);
  client_->Release(*again);
}

// tcp stages device memory through pinned buffers of fixed size: two per connection on the server
// (docs/device.md, "tcp") and two per connection and device on the client, however many batches
// and bytes go through. Many concurrent batches of scattered reads must not raise the peak.
TEST(DeviceStagingTest, StagingMemoryStaysBoundedWhileManyBatchesRun) {
  Memory remote("sim:0", true);
  Memory local("sim:1", false);
  auto* server_dev = dynamic_cast<device::SimDevice*>(*device::ProcessDevice("sim:0"));
  auto* client_dev = dynamic_cast<device::SimDevice*>(*device::ProcessDevice("sim:1"));
  ASSERT_TRUE(server_dev != nullptr && client_dev != nullptr);
  server_dev->ResetPinnedPeak();
  client_dev->ResetPinnedPeak();
  std::unique_ptr<Transport> server = MakeTransport(true);
  std::unique_ptr<Transport> client = MakeTransport(false);
  ASSERT_TRUE(server && client);
  ASSERT_TRUE(server->RegisterMemory(kRemoteRegion, remote.base(), kBytes, remote.kind()).ok());
  ASSERT_TRUE(client->RegisterMemory(kLocalRegion, local.base(), kBytes, local.kind()).ok());
  Result<std::vector<std::uint8_t>> d = server->Descriptor();
  ASSERT_TRUE(d.ok());
  Result<PeerId> peer = client->Connect(*d, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();

  constexpr std::uint64_t kBlock = 64u << 10;
  constexpr std::uint64_t kBlocks = kBytes / kBlock;
  std::mt19937_64 rng(21);
  std::uint64_t moved = 0;
  for (int round = 0; round < 6; ++round) {
    // Four batches at once, each a quarter of the blocks in a random order: every local block is
    // written once per round, from a random remote block.
    std::vector<std::uint64_t> order(kBlocks);
    for (std::uint64_t i = 0; i < kBlocks; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<BatchId> batches;
    for (int b = 0; b < 4; ++b) {
      std::vector<ReadOp> reads;
      for (std::uint64_t i = b * kBlocks / 4; i < (b + 1) * kBlocks / 4; ++i) {
        reads.push_back({local.base() + i * kBlock, kRemoteRegion, order[i] * kBlock, kBlock});
      }
      Result<BatchId> id = client->SubmitReads(*peer, reads, DeadlineAfter(milliseconds(30000)));
      ASSERT_TRUE(id.ok()) << id.status().ToString();
      batches.push_back(*id);
    }
    for (BatchId id : batches) {
      BatchResult st = client->Wait(id, DeadlineAfter(milliseconds(40000)));
      ASSERT_EQ(st.state, BatchState::kDone) << st.status.ToString();
      client->Release(id);
    }
    moved += kBytes;
    const std::vector<std::byte> got = local.Contents();
    for (std::uint64_t i = 0; i < kBlocks; ++i) {
      ASSERT_TRUE(FirstPatternMismatch(got.data() + i * kBlock, kBlock, kSeed, kRemoteRegion,
                                       order[i] * kBlock) == -1)
          << "round " << round << " block " << i;
    }
  }
  // The transports report what they hold (kvferry_transport_staging_bytes), and what is
  // registered by memory kind (kvferry_registered_bytes).
  const TransportStats server_stats = server->Stats();
  const TransportStats client_stats = client->Stats();
  EXPECT_GT(server_stats.staging_bytes, 0u);
  EXPECT_EQ(server_stats.staging_bytes, server_dev->pinned_bytes());
  EXPECT_GT(client_stats.staging_bytes, 0u);
  EXPECT_EQ(client_stats.staging_bytes, client_dev->pinned_bytes());
  EXPECT_EQ(server_stats.registered_bytes,
            (std::map<std::string, std::uint64_t>{{"sim:0", kBytes}}));
  EXPECT_EQ(client_stats.registered_bytes,
            (std::map<std::string, std::uint64_t>{{"sim:1", kBytes}}));
  // 2 connections per peer (MakeTransport), 2 buffers of 2 MiB each on either side.
  constexpr std::uint64_t kBound = 2 * 2 * (std::uint64_t{2} << 20);
  EXPECT_GT(server_dev->pinned_peak_bytes(), 0u);
  EXPECT_LE(server_dev->pinned_peak_bytes(), kBound) << "after " << moved << " bytes";
  EXPECT_GT(client_dev->pinned_peak_bytes(), 0u);
  EXPECT_LE(client_dev->pinned_peak_bytes(), kBound) << "after " << moved << " bytes";
  // Closed transports hold no staging.
  client.reset();
  server.reset();
  EXPECT_EQ(server_dev->pinned_bytes(), 0u);
  EXPECT_EQ(client_dev->pinned_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Kinds, DeviceTransportTest,
                         ::testing::Values(Kinds{"host", "sim:1"}, Kinds{"sim:0", "host"},
                                           Kinds{"sim:0", "sim:1"}, Kinds{"sim:0", "sim:0"},
                                           Kinds{"host", "host"}, Kinds{"sim:0", "host", "shm"},
                                           Kinds{"sim:0", "sim:0", "shm"},
                                           Kinds{"host", "sim:1", "shm"}),
                         KindsName);

INSTANTIATE_TEST_SUITE_P(CudaKinds, DeviceTransportTest,
                         ::testing::Values(Kinds{"host", "cuda:0"}, Kinds{"cuda:0", "host"},
                                           Kinds{"cuda:0", "cuda:0"}),
                         KindsName);

// Reads 1 MiB of the peer's region kRemoteRegion from `offset` into the start of `local`, and
// checks it byte for byte against the pattern.
void ReadOneMiBAndCheck(Transport& client, PeerId peer, Memory& local, std::uint64_t offset) {
  Result<BatchId> b = client.SubmitReads(peer, {{local.base(), kRemoteRegion, offset, 1u << 20}},
                                         DeadlineAfter(milliseconds(10000)));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(client.Wait(*b, DeadlineAfter(milliseconds(15000))).state, BatchState::kDone);
  client.Release(*b);
  const std::vector<std::byte> got = local.Contents();
  EXPECT_EQ(FirstPatternMismatch(got.data(), 1u << 20, kSeed, kRemoteRegion, offset), -1);
}

// A serving transport with `remote` registered as kRemoteRegion and a reading one with `local` as
// kLocalRegion, both with backend list `backends`.
void ServeAndRead(const std::string& backends, Memory& remote, Memory& local,
                  std::unique_ptr<Transport>* server, std::unique_ptr<Transport>* client) {
  TransportOptions o;
  o.backend = backends;
  Result<std::unique_ptr<Transport>> s = CreateTransport(o);
  o.serve = false;
  Result<std::unique_ptr<Transport>> c = CreateTransport(o);
  ASSERT_TRUE(s.ok() && c.ok());
  *server = std::move(s).value();
  *client = std::move(c).value();
  ASSERT_TRUE((*server)->RegisterMemory(kRemoteRegion, remote.base(), kBytes, remote.kind()).ok());
  ASSERT_TRUE((*client)->RegisterMemory(kLocalRegion, local.base(), kBytes, local.kind()).ok());
}

// Connects with backend list `backends`, expects the peer carried by k.backend, and reads 1 MiB
// of k.remote memory into k.local memory through it, checked byte for byte.
void ReadOverTheChosenBackend(const std::string& backends, const Kinds& k) {
  SCOPED_TRACE(k.remote + " -> " + k.local + " with " + backends);
  Memory remote(k.remote, true);
  Memory local(k.local, false);
  std::unique_ptr<Transport> server;
  std::unique_ptr<Transport> client;
  ServeAndRead(backends, remote, local, &server, &client);
  if (::testing::Test::HasFatalFailure()) return;
  Result<PeerId> p = client->Connect(*server->Descriptor(), DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(*client->PeerBackend(*p), k.backend);
  ReadOneMiBAndCheck(*client, *p, local, 4096);
}

// With backend auto on one host, a backend that cannot read the peer's kinds into ours is passed
// over.
TEST(DeviceAutoTest, AutoOnOneHostPicksABackendThatReadsTheKinds) {
  // shm opens the peer's device memory through IPC into host memory or the same device, and
  // stages the peer's host memory into a device; it cannot read one device's memory into
  // another's: tcp does.
  for (const Kinds& k : {Kinds{"sim:0", "host", "shm"}, Kinds{"sim:0", "sim:0", "shm"},
                         Kinds{"host", "sim:1", "shm"}, Kinds{"sim:0", "sim:1", "tcp"}}) {
    ReadOverTheChosenBackend("auto", k);
  }
}

// With a preference list that names ucx first (docs/transport.md, "ucx"), memory UCX cannot read
// (the sim device's here; cuda too where the loaded UCX has no CUDA) goes over the next backend,
// and host memory over ucx.
TEST(DeviceAutoTest, UcxFirstPassesDeviceMemoryOnToTcp) {
  for (const Kinds& k : {Kinds{"host", "host", "ucx"}, Kinds{"sim:0", "host", "tcp"},
                         Kinds{"host", "sim:1", "tcp"}}) {
    ReadOverTheChosenBackend("ucx,tcp", k);
  }
}

// The IPC path between processes: a peer process (kvferry bench peer) serves sim memory; this
// process reads it over shm (IPC) into host memory and into its own sim memory, every byte
// checked; once the peer is killed, the next batch fails PeerDisconnected at once.
TEST(DeviceIpcTest, ReadsAnotherProcesssDeviceMemoryAndNoticesItsDeath) {
  constexpr std::uint64_t kPeerBytes = 16u << 20;
  constexpr std::uint64_t kPeerSeed = 0x6b76666572727900ull;  // bench peer's default
  testing::BenchPeer peer = testing::StartBenchPeer(
      {"--backend", "auto", "--bytes", std::to_string(kPeerBytes), "--memory", "sim:0"});
  ASSERT_FALSE(peer.descriptor.empty());
  for (const std::string local_kind : {"host", "sim:0"}) {
    SCOPED_TRACE(local_kind);
    Memory local(local_kind, false);
    std::unique_ptr<Transport> client = MakeTransport(false, "auto");
    ASSERT_TRUE(client->RegisterMemory(kLocalRegion, local.base(), kBytes, local.kind()).ok());
    Result<PeerId> p = client->Connect(peer.descriptor, DeadlineAfter(milliseconds(5000)));
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_EQ(*client->PeerBackend(*p), "shm");
    std::mt19937_64 rng(7);
    std::vector<ReadOp> reads;
    std::vector<std::uint64_t> remote;
    for (std::uint64_t k = 0; k < 64; ++k) {  // 64 blocks of 64 KiB, scattered
      remote.push_back((rng() % (kPeerBytes / 65536)) * 65536);
      reads.push_back({local.base() + k * 65536, 0, remote.back(), 65536});
    }
    Result<BatchId> b = client->SubmitReads(*p, reads, DeadlineAfter(milliseconds(10000)));
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    const BatchResult r = client->Wait(*b, DeadlineAfter(milliseconds(15000)));
    ASSERT_EQ(r.state, BatchState::kDone) << r.status.ToString();
    client->Release(*b);
    const std::vector<std::byte> got = local.Contents();
    for (std::uint64_t k = 0; k < remote.size(); ++k) {
      ASSERT_EQ(FirstPatternMismatch(got.data() + k * 65536, 65536, kPeerSeed, 0, remote[k]), -1)
          << "block " << k;
    }
    if (local_kind == "sim:0") {
      peer.process->Signal(SIGKILL);
      (void)peer.process->CloseAndWait(milliseconds(5000));
      const auto killed = Clock::now();
      Result<BatchId> after =
          client->SubmitReads(*p, {reads[0]}, DeadlineAfter(milliseconds(10000)));
      ASSERT_TRUE(after.ok());
      const BatchResult dead = client->Wait(*after, DeadlineAfter(milliseconds(15000)));
      EXPECT_EQ(dead.state, BatchState::kFailed);
      EXPECT_EQ(dead.status.code(), StatusCode::kPeerDisconnected) << dead.status.ToString();
      EXPECT_LT(Clock::now() - killed, milliseconds(2000));
      client->Release(*after);
    }
  }
}

// An IPC handle that does not open (here: the peer's handle altered to name a descriptor that is
// not its memfd) makes shm unusable for that peer; auto falls back to tcp's staging, and the
// reads still deliver every byte.
TEST(DeviceIpcTest, AHandleThatDoesNotOpenFallsBackToStagedTcp) {
  Memory remote("sim:0", true);
  Memory local("host", false);
  std::unique_ptr<Transport> server;
  std::unique_ptr<Transport> client;
  ServeAndRead("auto", remote, local, &server, &client);
  if (HasFatalFailure()) return;
  Result<PeerDescriptor> d = DecodeDescriptor(*server->Descriptor());
  ASSERT_TRUE(d.ok());
  Result<ShmSection> shm = DecodeShmSection(d->Section("shm"));
  ASSERT_TRUE(shm.ok());
  ASSERT_EQ(shm->ipc.size(), 1u);
  Result<device::IpcHandle> h = device::IpcHandle::Decode(shm->ipc[0].bytes);
  ASSERT_TRUE(h.ok());
  // The sim handle's opaque bytes start with the exporter's pid and the memfd's descriptor
  // number (docs/device.md): point it at descriptor 0, which is no memfd of that allocation.
  ASSERT_GE(h->opaque.size(), 8u);
  std::memset(h->opaque.data() + 4, 0, 4);
  shm->ipc[0].bytes = h->Encode();
  d->sections["shm"] = EncodeShmSection(*shm);
  Result<PeerId> p = client->Connect(EncodeDescriptor(*d), DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(*client->PeerBackend(*p), "tcp");
  ReadOneMiBAndCheck(*client, *p, local, 8192);
  // A forced shm transport says why it cannot read the peer.
  TransportOptions forced;
  forced.backend = "shm";
  forced.serve = false;
  Result<std::unique_ptr<Transport>> shm_only = CreateTransport(forced);
  ASSERT_TRUE(shm_only.ok());
  Result<PeerId> refused =
      (*shm_only)->Connect(EncodeDescriptor(*d), DeadlineAfter(milliseconds(5000)));
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("IPC handle of region"));
}

// A peer serving device memory over tcp killed in the middle of a large batch into device
// memory: the batch fails PeerDisconnected well before its deadline, and nothing is written into
// the local device memory after it ended.
TEST(DeviceTcpTest, PeerKilledMidBatchFailsAndNothingLandsAfter) {
  constexpr std::uint64_t kPeerBytes = 64u << 20;
  testing::BenchPeer peer = testing::StartBenchPeer(
      {"--backend", "tcp", "--bytes", std::to_string(kPeerBytes), "--memory", "sim:0"});
  ASSERT_FALSE(peer.descriptor.empty());
  Memory local("sim:1", false);
  std::unique_ptr<Transport> client = MakeTransport(false, "tcp");
  ASSERT_TRUE(client->RegisterMemory(kLocalRegion, local.base(), kBytes, local.kind()).ok());
  Result<PeerId> p = client->Connect(peer.descriptor, DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  // Many batches over the whole local pool, until one is caught running when the peer dies.
  std::vector<ReadOp> reads;
  for (std::uint64_t off = 0; off < kBytes; off += 64u << 10) {
    reads.push_back({local.base() + off, 0, (off * 3) % kPeerBytes, 64u << 10});
  }
  std::vector<BatchId> batches;
  for (int i = 0; i < 32; ++i) {  // 512 MiB: far more than goes by before the kill lands
    Result<BatchId> b = client->SubmitReads(*p, reads, DeadlineAfter(milliseconds(30000)));
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    batches.push_back(*b);
  }
  peer.process->Signal(SIGKILL);
  const auto killed = Clock::now();
  bool failed = false;
  for (BatchId b : batches) {
    const BatchResult r = client->Wait(b, DeadlineAfter(milliseconds(30000)));
    ASSERT_NE(r.state, BatchState::kInProgress);
    if (r.state == BatchState::kFailed) {
      failed = true;
      EXPECT_EQ(r.status.code(), StatusCode::kPeerDisconnected) << r.status.ToString();
    }
  }
  EXPECT_LT(Clock::now() - killed, milliseconds(5000)) << "the death was not noticed";
  const std::vector<std::byte> ended = local.Contents();
  for (BatchId b : batches) client->Release(b);
  // After every batch ended: nothing lands any more.
  Result<BatchId> probe = client->SubmitReads(*p, {}, DeadlineAfter(milliseconds(1000)));
  ASSERT_TRUE(probe.ok());
  client->Wait(*probe, DeadlineAfter(milliseconds(2000)));
  client->Release(*probe);
  EXPECT_TRUE(local.Contents() == ended) << "bytes landed after the batches ended";
  EXPECT_TRUE(failed) << "all 512 MiB arrived before the kill landed: the death was not seen";
  (void)peer.process->CloseAndWait(milliseconds(5000));
}

// Reads submitted to a peer another thread has just disconnected fail as the peer's failure
// (PeerDisconnected), not as a caller's mistake; an id never issued is NotFound. (A load racing
// another load's disconnect of a dead peer was reported NotFound.)
TEST(TransportPeerIdTest, ADisconnectedPeerIsPeerDisconnectedAndAnUnknownOneNotFound) {
  Memory remote("host", true);
  Memory local("host", false);
  std::unique_ptr<Transport> server = MakeTransport(true);
  std::unique_ptr<Transport> client = MakeTransport(false);
  ASSERT_TRUE(server->RegisterMemory(kRemoteRegion, remote.base(), kBytes).ok());
  ASSERT_TRUE(client->RegisterMemory(kLocalRegion, local.base(), kBytes).ok());
  Result<PeerId> p = client->Connect(*server->Descriptor(), DeadlineAfter(milliseconds(5000)));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  client->Disconnect(*p);
  Result<BatchId> gone = client->SubmitReads(*p, {{local.base(), kRemoteRegion, 0, 4096}},
                                             DeadlineAfter(milliseconds(5000)));
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code(), StatusCode::kPeerDisconnected);
  Result<BatchId> unknown = client->SubmitReads(*p + 1000, {{local.base(), kRemoteRegion, 0, 4096}},
                                                DeadlineAfter(milliseconds(5000)));
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
}

TEST(DeviceRegistrationTest, MemoryNotOfTheNamedDeviceIsRefused) {
  std::unique_ptr<Transport> t = MakeTransport(false);
  std::vector<std::byte> host(8192);
  // Host memory registered as device memory: the device does not know it.
  Status s = t->RegisterMemory(1, host.data(), 4096, MemoryKind{"sim", 0});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("not inside one allocation of that device"));
  // A range running past the end of its allocation.
  Result<device::Device*> dev = device::ProcessDevice("sim:0");
  ASSERT_TRUE(dev.ok());
  auto alloc = (*dev)->Allocate(8192);
  ASSERT_TRUE(alloc.ok());
  auto* base = reinterpret_cast<std::byte*>((*alloc)->address());  // NOLINT
  s = t->RegisterMemory(2, base + 4096, 8192, MemoryKind{"sim", 0});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  // Another device's memory.
  s = t->RegisterMemory(3, base, 8192, MemoryKind{"sim", 3});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(t->RegisterMemory(4, base, 8192, MemoryKind{"sim", 0}).ok());
}

}  // namespace
}  // namespace kvferry
