// The ucx backend beyond the backend-parameterised tests of transport_test: loading, its
// descriptor section, options, memory kinds and which peers it can reach. Against a real peer
// process: ucx_peer_test.cc.
#include "transport/ucx/ucx_backend.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>

#include "common/clock.h"
#include "transport/descriptor.h"
#include "transport/region_registry.h"
#include "transport/ucx/ucx_section.h"
#include "transport/ucx/ucx_worker.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;

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
  std::vector<std::uint8_t> v3 = EncodeUcxSection(ValidSection());
  ASSERT_EQ(v3[3], 0x01);  // fixmap, "v" (fixstr 0xa1 0x76), 1: segments unknown
  v3[3] = 0x03;
  EXPECT_EQ(DecodeUcxSection(v3).status().code(), StatusCode::kNotSupported);
}

// Every section carries the TCP segment sizes; it is version 2 only when the server sends larger
// segments than a reader that knows nothing of them receives (UCX's default 64 KiB), so that such
// a reader refuses it. A version 1 section of an older kvferry still decodes, sizes unknown.
TEST(UcxSectionTest, TcpSegmentsRoundTripAndVersionOneHasThemUnknown) {
  UcxSection s = ValidSection();
  for (const UcxTcpSegments& seg : {UcxTcpSegments{8192, 262144}, UcxTcpSegments{65536, 65536},
                                    UcxTcpSegments{262144, 262144}, UcxTcpSegments{0, 0}}) {
    s.tcp_segments = seg;
    const std::vector<std::uint8_t> bytes = EncodeUcxSection(s);
    EXPECT_EQ(bytes[3], seg.tx > 65536 ? 0x02 : 0x01) << seg.tx;  // the "v" value
    Result<UcxSection> back = DecodeUcxSection(bytes);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->tcp_segments, seg);
  }
  // Version 1: the same map without the two sizes.
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(7);
  pk.pack(std::string("v"));
  pk.pack_uint32(1);
  pk.pack(std::string("worker"));
  pk.pack_bin(4);
  pk.pack_bin_body("\x01\x02\x03\x04", 4);
  PackProcessFields(pk, s.host, s.start_time);
  pk.pack(std::string("rkeys"));
  PackRegionList(pk, s.keys);
  const auto* p = reinterpret_cast<const std::uint8_t*>(buffer.data());
  Result<UcxSection> v1 = DecodeUcxSection(std::vector<std::uint8_t>(p, p + buffer.size()));
  ASSERT_TRUE(v1.ok()) << v1.status().ToString();
  EXPECT_EQ(v1->tcp_segments, UcxTcpSegments{});
  EXPECT_EQ(v1->keys, s.keys);
}

TEST(UcxTcpSegmentsTest, MemunitsParseAsUcxWritesThem) {
  EXPECT_EQ(ParseUcxMemunits("8K"), 8192u);
  EXPECT_EQ(ParseUcxMemunits("64kb"), 65536u);
  EXPECT_EQ(ParseUcxMemunits("1M"), 1u << 20);
  EXPECT_EQ(ParseUcxMemunits("1g"), 1u << 30);
  EXPECT_EQ(ParseUcxMemunits("262144"), 262144u);
  EXPECT_EQ(ParseUcxMemunits("100b"), 100u);
  // More than a section carries (1 GiB) is unknown, and nothing wraps around.
  for (const char* unknown : {"", "auto", "inf", "K", "8Q", "99999999999999999999", "2G",
                              "1099511627776", "17179869184G", "4194304M"}) {
    EXPECT_EQ(ParseUcxMemunits(unknown), 0u) << unknown;
  }
}

TEST(UcxTcpSegmentsTest, TheReaderMustReceiveWhatThePeerSends) {
  EXPECT_TRUE(CheckUcxTcpSegments({262144, 262144}, {262144, 262144}).ok());
  EXPECT_TRUE(CheckUcxTcpSegments({262144, 262144}, {8192, 65536}).ok());  // UCX's defaults
  EXPECT_TRUE(CheckUcxTcpSegments({262144, 262144}, {}).ok());             // a version 1 peer
  EXPECT_TRUE(CheckUcxTcpSegments({0, 0}, {1u << 20, 1u << 20}).ok());     // unknown here
  const Status bigger_replies = CheckUcxTcpSegments({8192, 65536}, {262144, 262144});
  EXPECT_EQ(bigger_replies.code(), StatusCode::kUnavailable);
  EXPECT_THAT(bigger_replies.message(), HasSubstr("the peer's UCX sends TCP segments of 262144"));
  EXPECT_THAT(bigger_replies.message(), HasSubstr("UCX_TCP_RX_SEG_SIZE"));
  EXPECT_THAT(bigger_replies.message(), HasSubstr("this process's receives at most 65536"));
  // The reader sends only small get requests: a peer with smaller segments is read.
  EXPECT_TRUE(CheckUcxTcpSegments({1u << 20, 1u << 20}, {8192, 8192}).ok());
}

// The sizes a worker's context gets: kvferry's default where the environment sets neither, the
// environment's where it sets them, and an unset one made to fit a set one.
TEST(UcxTcpSegmentsTest, TheWorkerTakesTheDefaultOrTheEnvironmentAndFitsOneToTheOther) {
  struct Case {
    const char* tx;
    const char* rx;
    UcxTcpSegments expected;
  };
  const std::uint64_t d = kUcxDefaultTcpSegBytes;
  for (const Case& c : {Case{nullptr, nullptr, {d, d}}, Case{"8K", "64K", {8192, 65536}},
                        Case{"8K", nullptr, {8192, d}}, Case{"1M", nullptr, {1u << 20, 1u << 20}},
                        Case{nullptr, "64K", {65536, 65536}}, Case{nullptr, "1M", {d, 1u << 20}}}) {
    auto set = [](const char* name, const char* value) {
      if (value == nullptr) {
        unsetenv(name);
      } else {
        setenv(name, value, 1);
      }
    };
    set("UCX_TCP_TX_SEG_SIZE", c.tx);
    set("UCX_TCP_RX_SEG_SIZE", c.rx);
    Result<std::unique_ptr<UcxWorker>> w = UcxWorker::Create(
        milliseconds(50), [](ucp_worker_h) {}, [](ucp_worker_h) {});
    unsetenv("UCX_TCP_TX_SEG_SIZE");
    unsetenv("UCX_TCP_RX_SEG_SIZE");
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    EXPECT_EQ((*w)->tcp_segments(), c.expected)
        << "tx " << (c.tx ? c.tx : "unset") << ", rx " << (c.rx ? c.rx : "unset");
  }
  // Where UCX will not open tcp, nothing is set (UCX would warn on stdout) and both are unknown.
  struct Tls {
    const char* tls;
    const char* devices;
    bool tcp;
  };
  for (const Tls& c :
       {Tls{"sm,self", nullptr, false}, Tls{"^tcp", nullptr, false}, Tls{"^sm", nullptr, true},
        Tls{"self,tcp", nullptr, true}, Tls{"all", nullptr, true}, Tls{"tcp", "lo", true},
        Tls{"tcp", "mlx5_0:1", false}}) {
    setenv("UCX_TLS", c.tls, 1);
    if (c.devices != nullptr) setenv("UCX_NET_DEVICES", c.devices, 1);
    Result<std::unique_ptr<UcxWorker>> w = UcxWorker::Create(
        milliseconds(50), [](ucp_worker_h) {}, [](ucp_worker_h) {});
    unsetenv("UCX_TLS");
    unsetenv("UCX_NET_DEVICES");
    if (!w.ok()) {
      // UCX_TLS=tcp with only an RDMA device: UCX finds no transport, which is its own error.
      EXPECT_FALSE(c.tcp) << c.tls << ": " << w.status().ToString();
      continue;
    }
    EXPECT_EQ((*w)->tcp_segments(), (c.tcp ? UcxTcpSegments{d, d} : UcxTcpSegments{}))
        << "UCX_TLS=" << c.tls << " UCX_NET_DEVICES=" << (c.devices ? c.devices : "unset");
  }
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

}  // namespace
}  // namespace kvferry
