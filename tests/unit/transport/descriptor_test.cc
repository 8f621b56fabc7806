#include "transport/descriptor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "transport/shm/shm_section.h"
#include "transport/tcp/tcp_section.h"
#include "transport/ucx/ucx_section.h"

namespace kvferry {
namespace {

using ::testing::HasSubstr;

const ShmSection kShm{{"87d27ef8-ec29-4dbb-b1ee-24fd9ed0171c", 4026531836u, 4242},
                      {123456789, 0x55d0c0de1000ull, 0x0123456789abcdefull},
                      {},
                      {}};
const TcpEndpoint kTcp{"127.0.0.1", 40001, 0xfedcba9876543210ull};

PeerDescriptor Sample() {
  PeerDescriptor d;
  d.regions = {{0, 0x7f0000001000, 1u << 20, MemoryKind::Host()},
               {5, 0x7f0000200000, 4096, MemoryKind{"fake", 3}}};
  d.sections["tcp"] = EncodeTcpSection(kTcp);
  d.sections["shm"] = EncodeShmSection(kShm);
  return d;
}

TEST(DescriptorTest, RoundTripsRegionsKindsAndOpaqueSections) {
  const PeerDescriptor d = Sample();
  Result<PeerDescriptor> back = DecodeDescriptor(EncodeDescriptor(d));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, d);
  EXPECT_EQ(back->regions[1].kind.ToString(), "fake:3");
  PeerDescriptor no_tcp = d;
  no_tcp.sections.erase("tcp");
  EXPECT_EQ(*DecodeDescriptor(EncodeDescriptor(no_tcp)), no_tcp);
  EXPECT_TRUE(DecodeDescriptor(EncodeDescriptor(no_tcp))->Section("tcp").empty());
  // A section the core has no backend for is carried, not interpreted.
  PeerDescriptor other = d;
  other.sections["ucx"] = {1, 2, 3};
  EXPECT_EQ(*DecodeDescriptor(EncodeDescriptor(other)), other);
}

TEST(DescriptorTest, RefusesAnotherVersion) {
  std::vector<std::uint8_t> bytes = EncodeDescriptor(Sample());
  // {"v": 2, ...}: fixmap, fixstr "v", positive fixint.
  ASSERT_EQ(bytes[3], kDescriptorVersion);
  bytes[3] = 1;
  Result<PeerDescriptor> d = DecodeDescriptor(bytes);
  EXPECT_EQ(d.status().code(), StatusCode::kNotSupported);
  EXPECT_THAT(d.status().message(), HasSubstr("reads version 2"));
}

TEST(DescriptorTest, RefusesMalformedMemoryKinds) {
  PeerDescriptor d = Sample();
  d.regions[0].kind = MemoryKind{"Cuda", 0};
  EXPECT_THAT(DecodeDescriptor(EncodeDescriptor(d)).status().message(),
              HasSubstr("memory kind 'Cuda'"));
  d.regions[0].kind = MemoryKind{"host", 1};
  EXPECT_THAT(DecodeDescriptor(EncodeDescriptor(d)).status().message(),
              HasSubstr("out of range for memory kind host"));
}

TEST(MemoryKindTest, ParsesAndPrints) {
  EXPECT_EQ(ParseMemoryKind("host")->ToString(), "host");
  EXPECT_TRUE(ParseMemoryKind("host")->is_host());
  EXPECT_EQ(*ParseMemoryKind("cuda:1"), (MemoryKind{"cuda", 1}));
  EXPECT_EQ((MemoryKind{"sim", 0}).ToString(), "sim:0");
  for (const char* bad : {"", "host:1", "cuda:", "cuda:x", "CUDA:0", "a-b:0"}) {
    EXPECT_EQ(ParseMemoryKind(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

TEST(ShmSectionTest, RoundTrips) {
  Result<ShmSection> back = DecodeShmSection(EncodeShmSection(kShm));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, kShm);
}

// Issue 11: pid 0 names no process a reader could prove; it was accepted and handed to shm.
TEST(ShmSectionTest, RoundTripsIpcHandlesAndRefusesMalformedOnes) {
  ShmSection s = kShm;
  s.ipc = {{3, {1, 2, 3}}, {7, std::vector<std::uint8_t>(200, 9)}};
  Result<ShmSection> back = DecodeShmSection(EncodeShmSection(s));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, s);
  s.ipc = {{3, std::vector<std::uint8_t>(8192, 1)}};  // larger than any handle
  Result<ShmSection> big = DecodeShmSection(EncodeShmSection(s));
  ASSERT_FALSE(big.ok());
  EXPECT_THAT(big.status().message(),
              HasSubstr("ipc[0]: expected [region id, IPC handle (1 to 4160 bytes)]"));
}

TEST(ShmSectionTest, RefusesPidZeroAndNegativePids) {
  ShmSection s = kShm;
  s.host.pid = 0;
  Result<ShmSection> zero = DecodeShmSection(EncodeShmSection(s));
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(zero.status().message(), HasSubstr("pid (> 0), found 0"));
  s.host.pid = -7;
  Result<ShmSection> negative = DecodeShmSection(EncodeShmSection(s));
  ASSERT_FALSE(negative.ok());
  EXPECT_EQ(negative.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.status().message(), HasSubstr("found -7"));
}

TEST(ShmSectionTest, RefusesASectionWithoutANonceAddress) {
  ShmSection s = kShm;
  s.proof.nonce_addr = 0;
  Result<ShmSection> back = DecodeShmSection(EncodeShmSection(s));
  ASSERT_FALSE(back.ok());
  EXPECT_THAT(back.status().message(), HasSubstr("non-zero address of the instance nonce"));
}

TEST(TcpSectionTest, RoundTripsAndRefusesAnEmptyEndpoint) {
  EXPECT_EQ(*DecodeTcpSection(EncodeTcpSection(kTcp)), kTcp);
  EXPECT_EQ(DecodeTcpSection(EncodeTcpSection(TcpEndpoint{"", 1, 0})).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeTcpSection(EncodeTcpSection(TcpEndpoint{"h", 0, 0})).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(DescriptorTest, RefusesDuplicateAndWrappingRegions) {
  PeerDescriptor d = Sample();
  d.regions[1].id = 0;
  EXPECT_THAT(DecodeDescriptor(EncodeDescriptor(d)).status().message(), HasSubstr("appears twice"));
  d = Sample();
  d.regions[1].addr = ~0ull - 10;
  EXPECT_THAT(DecodeDescriptor(EncodeDescriptor(d)).status().message(),
              HasSubstr("non-empty range"));
}

TEST(DescriptorTest, RangeChecks) {
  const RemoteRegionTable t = IndexRegions(Sample().regions);
  EXPECT_TRUE(CheckRemoteRange(t, 5, 0, 4096).ok());
  EXPECT_FALSE(CheckRemoteRange(t, 5, 1, 4096).ok());
  EXPECT_FALSE(CheckRemoteRange(t, 5, ~0ull, 2).ok());
  EXPECT_FALSE(CheckRemoteRange(t, 6, 0, 1).ok());
  EXPECT_FALSE(CheckRemoteRange(t, 0, 0, 0).ok());
}

// Corrupted descriptors: each is either refused with a descriptor error that says what is wrong,
// or decodes to a descriptor that keeps the decoder's promises (unique region ids, non-empty
// ranges inside the address space, well-formed memory kinds) and round-trips. The sections are
// opaque here; their backends' decoders are tested above.
TEST(DescriptorTest, RandomCorruptionIsRefusedOrDecodesToAValidDescriptor) {
  const std::vector<std::uint8_t> good = EncodeDescriptor(Sample());
  std::mt19937 rng(3);
  int refused = 0;
  int decoded = 0;
  for (int i = 0; i < 5000; ++i) {
    std::vector<std::uint8_t> bad = good;
    bad[rng() % bad.size()] = static_cast<std::uint8_t>(rng());
    if (rng() % 4 == 0) bad.resize(rng() % bad.size());
    Result<PeerDescriptor> d = DecodeDescriptor(bad);
    if (!d.ok()) {
      ++refused;
      EXPECT_TRUE(d.status().code() == StatusCode::kInvalidArgument ||
                  d.status().code() == StatusCode::kNotSupported)
          << "input " << i << ": " << d.status().ToString();
      EXPECT_FALSE(d.status().message().empty()) << "input " << i;
      continue;
    }
    ++decoded;
    std::set<RegionId> ids;
    for (const RemoteRegion& r : d->regions) {
      EXPECT_TRUE(ids.insert(r.id).second) << "input " << i << ": region " << r.id << " twice";
      EXPECT_GT(r.length, 0u) << "input " << i;
      EXPECT_LE(r.addr, ~0ull - r.length) << "input " << i << ": region " << r.id << " wraps";
    }
    for (const RemoteRegion& r : d->regions) {
      EXPECT_TRUE(IsValidMemoryKindType(r.kind.type)) << "input " << i;
    }
    EXPECT_LE(d->sections.size(), kMaxDescriptorSections) << "input " << i;
    Result<PeerDescriptor> again = DecodeDescriptor(EncodeDescriptor(*d));
    ASSERT_TRUE(again.ok()) << "input " << i << ": " << again.status().ToString();
    EXPECT_EQ(*again, *d) << "input " << i;
  }
  // Both outcomes happened, so both branches above were exercised.
  EXPECT_GT(refused, 1000);
  EXPECT_GT(decoded, 100);
  // Every strict prefix of a good descriptor is refused.
  for (std::size_t n = 0; n < good.size(); ++n) {
    const std::vector<std::uint8_t> prefix(good.begin(), good.begin() + static_cast<long>(n));
    EXPECT_EQ(DecodeDescriptor(prefix).status().code(), StatusCode::kInvalidArgument)
        << "prefix of " << n << " bytes";
  }
}

// One region-list rule for every section (docs/transport.md, "The descriptor"): an entry
// without bytes and a region listed twice are refused, in the shm section's IPC handles as in the
// ucx section's rkeys. shm used to accept both (the second handle of a region silently won).
TEST(RegionListTest, EmptyAndRepeatedEntriesAreRefusedInEverySection) {
  ShmSection shm = kShm;
  shm.ipc = {{3, {1, 2}}, {4, {}}};
  Result<ShmSection> empty_shm = DecodeShmSection(EncodeShmSection(shm));
  EXPECT_EQ(empty_shm.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(empty_shm.status().message(), HasSubstr("descriptor.shm.ipc[1]"));
  shm.ipc = {{3, {1, 2}}, {3, {5}}};
  Result<ShmSection> twice_shm = DecodeShmSection(EncodeShmSection(shm));
  EXPECT_EQ(twice_shm.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(twice_shm.status().message(), HasSubstr("region 3 is listed twice"));

  UcxSection ucx;
  ucx.worker_address = {1, 2, 3};
  ucx.host = kShm.host;
  ucx.keys = {{3, {1, 2}}, {4, {}}};
  Result<UcxSection> empty_ucx = DecodeUcxSection(EncodeUcxSection(ucx));
  EXPECT_EQ(empty_ucx.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(empty_ucx.status().message(), HasSubstr("descriptor.ucx.rkeys[1]"));
  ucx.keys = {{3, {1, 2}}, {3, {5}}};
  Result<UcxSection> twice_ucx = DecodeUcxSection(EncodeUcxSection(ucx));
  EXPECT_EQ(twice_ucx.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(twice_ucx.status().message(), HasSubstr("region 3 is listed twice"));

  // Well-formed lists decode to what was encoded.
  shm.ipc = {{3, {1, 2}}, {4, {7}}};
  Result<ShmSection> good_shm = DecodeShmSection(EncodeShmSection(shm));
  ASSERT_TRUE(good_shm.ok()) << good_shm.status().ToString();
  EXPECT_EQ(*good_shm, shm);
  ucx.keys = {{3, {1, 2}}, {4, {7}}};
  Result<UcxSection> good_ucx = DecodeUcxSection(EncodeUcxSection(ucx));
  ASSERT_TRUE(good_ucx.ok()) << good_ucx.status().ToString();
  EXPECT_EQ(*good_ucx, ucx);
}

TEST(ShmSectionTest, LocalIdentityIsReadable) {
  Result<HostIdentity> id = LocalHostIdentity();
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  EXPECT_FALSE(id->boot_id.empty());
  EXPECT_GT(id->pid, 0);
}

}  // namespace
}  // namespace kvferry
