// NPU memory ("npu:0") through the transport, on the fake libascendcl (host memory behind it):
// a serving and a reading transport in this process, tcp staging in every combination of host and
// npu memory, shm's IPC path (the reader asks the exporter's device to admit its pid, then imports
// the key) and shm's staging, and what backend auto picks. Run twice by CTest: with the fake of a
// current CANN (KVFERRY_TEST_ACL_RUNTIME unset) and of one older than 8.2.RC1 (=old), where
// same-host reads of NPU memory must fall back to tcp's staging and the log must say why.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include <cstdlib>
#include <random>
#include <sstream>
#include <string>

#include "common/clock.h"
#include "common/log.h"
#include "common/pattern.h"
#include "device/device.h"
#include "kvferry/transport.h"
#include "tests/unit/device/device_test_util.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;

constexpr std::uint64_t kBytes = 8u << 20;
constexpr std::uint64_t kSeed = 0x61636c00ull;
constexpr RegionId kRemote = 5;
constexpr RegionId kLocal = 50;

bool OldRuntime() {
  const char* v = std::getenv("KVFERRY_TEST_ACL_RUNTIME");  // NOLINT(concurrency-mt-unsafe)
  return v != nullptr && std::string(v) == "old";
}

// Points "npu:N" of this process (and of processes it starts) at the fake, before any test runs.
const bool fake_chosen = [] {
  // NOLINTNEXTLINE(concurrency-mt-unsafe): before main, one thread
  return setenv("KVFERRY_ACL_LIBRARY",
                OldRuntime() ? KVFERRY_FAKE_LIBASCENDCL_OLD_PATH : KVFERRY_FAKE_LIBASCENDCL_PATH,
                1) == 0;
}();

// kBytes of host or npu memory, patterned or zero, readable back.
class Region {
 public:
  Region(const std::string& kind, bool patterned) : kind_(kind) {
    std::vector<std::byte> init(kBytes);
    if (patterned) FillPattern(init.data(), kBytes, kSeed, kRemote, 0);
    if (kind == "host") {
      host_ = std::move(init);
      return;
    }
    auto dev = device::ProcessDevice(kind);
    EXPECT_TRUE(dev.ok()) << dev.status().ToString();
    if (!dev.ok()) return;
    dev_ = *dev;
    auto alloc = dev_->Allocate(kBytes);
    auto stream = dev_->CreateStream();
    EXPECT_TRUE(alloc.ok() && stream.ok());
    alloc_ = std::move(alloc).value();
    stream_ = std::move(stream).value();
    EXPECT_TRUE(device::testing::Upload(*stream_, alloc_->address(), init).ok());
  }
  MemoryKind kind() const { return *ParseMemoryKind(kind_); }
  std::byte* base() {
    // A device address carried in a pointer, never dereferenced (docs/device.md).
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

struct Path {
  std::string remote, local, backend;
};
void PrintTo(const Path& p, std::ostream* os) {
  *os << p.remote << " -> " << p.local << " over " << p.backend;
}

std::unique_ptr<Transport> Make(const std::string& backend, bool serve) {
  TransportOptions o;
  o.backend = backend;
  o.serve = serve;
  o.backend_options["tcp.max_request_bytes"] = std::to_string(1u << 20);
  auto t = CreateTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

// Serves `remote`, connects a reader of `local` with `backend`: the connected peer, or why not.
struct Pair {
  std::unique_ptr<Transport> server, client;
  Result<PeerId> peer = Status::Internal("not connected");
};
Pair Connect(const std::string& backend, Region& remote, Region& local) {
  Pair p{Make(backend, true), Make(backend, false)};
  if (!p.server || !p.client) return p;
  EXPECT_TRUE(p.server->RegisterMemory(kRemote, remote.base(), kBytes, remote.kind()).ok());
  EXPECT_TRUE(p.client->RegisterMemory(kLocal, local.base(), kBytes, local.kind()).ok());
  auto d = p.server->Descriptor();
  EXPECT_TRUE(d.ok());
  if (d.ok()) p.peer = p.client->Connect(*d, DeadlineAfter(milliseconds(5000)));
  return p;
}

// 120 scattered reads of 1 B to 2 MiB, every byte checked, the bytes between them untouched.
void ReadScatteredAndCheck(Transport& client, PeerId peer, Region& local) {
  std::mt19937_64 rng(11);
  struct Op {
    std::uint64_t remote, local, length;
  };
  std::vector<Op> ops;
  std::vector<ReadOp> reads;
  for (std::uint64_t at = 0, i = 0; i < 120; ++i) {
    const std::uint64_t r = rng() % 10;
    const std::uint64_t len = r == 0 ? 1 + rng() % 100 : r == 1 ? (2u << 20) : (64u << 10);
    if (at + len > kBytes) break;
    ops.push_back({rng() % (kBytes - len + 1), at, len});
    reads.push_back({local.base() + at, kRemote, ops.back().remote, len});
    at += len + rng() % 512;
  }
  auto b = client.SubmitReads(peer, reads, DeadlineAfter(milliseconds(30000)));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  const BatchResult r = client.Wait(*b, DeadlineAfter(milliseconds(40000)));
  ASSERT_EQ(r.state, BatchState::kDone) << r.status.ToString();
  client.Release(*b);
  const auto got = local.Contents();
  ASSERT_EQ(got.size(), kBytes);
  std::uint64_t next = 0;
  for (const Op& o : ops) {
    for (std::uint64_t k = next; k < o.local; ++k) ASSERT_EQ(got[k], std::byte{0}) << k;
    ASSERT_EQ(FirstPatternMismatch(got.data() + o.local, o.length, kSeed, kRemote, o.remote), -1)
        << "remote offset " << o.remote << " length " << o.length;
    next = o.local + o.length;
  }
}

class AclTransportTest : public ::testing::TestWithParam<Path> {};

TEST_P(AclTransportTest, ScatteredReadsAreByteExact) {
  ASSERT_TRUE(fake_chosen);
  const Path& path = GetParam();
  Region remote(path.remote, true);
  Region local(path.local, false);
  Pair p = Connect(path.backend, remote, local);
  ASSERT_TRUE(p.peer.ok()) << p.peer.status().ToString();
  EXPECT_EQ(*p.client->PeerBackend(*p.peer), path.backend);
  ReadScatteredAndCheck(*p.client, *p.peer, local);
}

std::string PathName(const ::testing::TestParamInfo<Path>& param) {
  std::string n = param.param.remote + "_to_" + param.param.local + "_" + param.param.backend;
  for (char& c : n) c = c == ':' ? '_' : c;
  return n;
}

INSTANTIATE_TEST_SUITE_P(Staged, AclTransportTest,
                         ::testing::Values(Path{"host", "npu:0", "tcp"},
                                           Path{"npu:0", "host", "tcp"},
                                           Path{"npu:0", "npu:0", "tcp"},
                                           Path{"host", "npu:0", "shm"}),
                         PathName);

// The peer's NPU memory over shm's IPC path: imported once per allocation, after the exporter
// admitted this process. On an old runtime nothing is exported, so shm cannot read the peer.
TEST(AclIpcTransportTest, NpuMemoryOverShmGoesThroughIpcOrIsRefused) {
  for (const std::string local_kind : {"host", "npu:0"}) {
    SCOPED_TRACE(local_kind);
    Region remote("npu:0", true);
    Region local(local_kind, false);
    Pair p = Connect("shm", remote, local);
    if (OldRuntime()) {
      ASSERT_FALSE(p.peer.ok());
      EXPECT_THAT(std::string(p.peer.status().message()), HasSubstr("IPC"));
      continue;
    }
    ASSERT_TRUE(p.peer.ok()) << p.peer.status().ToString();
    ReadScatteredAndCheck(*p.client, *p.peer, local);
  }
}

// backend auto on one host: npu:0 into npu:0 goes over shm's IPC path where the runtime has it,
// and over tcp's staging where it does not, with the reason in the log.
TEST(AclIpcTransportTest, AutoPicksIpcOrFallsBackToStagedTcpAndSaysWhy) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  Log().sinks().push_back(sink);
  Region remote("npu:0", true);
  Region local("npu:0", false);
  Pair p = Connect("auto", remote, local);
  Log().flush();
  Log().sinks().pop_back();
  ASSERT_TRUE(p.peer.ok()) << p.peer.status().ToString();
  EXPECT_EQ(*p.client->PeerBackend(*p.peer), OldRuntime() ? "tcp" : "shm");
  if (OldRuntime()) {
    EXPECT_THAT(out.str(), HasSubstr("lacks aclrtIpcMemGetExportKey")) << out.str();
    EXPECT_THAT(out.str(), HasSubstr("CANN 8.2.RC1")) << out.str();
  }
  ReadScatteredAndCheck(*p.client, *p.peer, local);
}

TEST(AclRegistrationTest, MemoryNotOfTheNpuIsRefused) {
  auto t = Make("tcp", false);
  ASSERT_TRUE(t);
  std::vector<std::byte> host(1 << 16);
  const Status s = t->RegisterMemory(1, host.data(), host.size(), MemoryKind{"npu", 0});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_THAT(std::string(s.message()), HasSubstr("not inside one allocation"));
  Region npu("npu:0", false);
  EXPECT_FALSE(t->RegisterMemory(2, npu.base(), kBytes + 1, MemoryKind{"npu", 0}).ok());
  EXPECT_TRUE(t->RegisterMemory(3, npu.base(), kBytes, MemoryKind{"npu", 0}).ok());
}

}  // namespace
}  // namespace kvferry
