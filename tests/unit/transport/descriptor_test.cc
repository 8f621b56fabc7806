#include "transport/descriptor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <set>

namespace kvferry {
namespace {

using ::testing::HasSubstr;

PeerDescriptor Sample() {
  return PeerDescriptor{{"87d27ef8-ec29-4dbb-b1ee-24fd9ed0171c", 4026531836u, 4242},
                        TcpEndpoint{"127.0.0.1", 40001, 0xfedcba9876543210ull},
                        {{0, 0x7f0000001000, 1u << 20}, {5, 0x7f0000200000, 4096}},
                        std::nullopt};
}

TEST(DescriptorTest, RoundTrips) {
  const PeerDescriptor d = Sample();
  Result<PeerDescriptor> back = DecodeDescriptor(EncodeDescriptor(d));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, d);
  PeerDescriptor no_tcp = d;
  no_tcp.tcp.reset();
  EXPECT_EQ(*DecodeDescriptor(EncodeDescriptor(no_tcp)), no_tcp);
}

TEST(DescriptorTest, ShmProofRoundTrips) {
  PeerDescriptor d = Sample();
  d.shm = ShmProof{123456789, 0x55d0c0de1000ull, 0x0123456789abcdefull};
  Result<PeerDescriptor> back = DecodeDescriptor(EncodeDescriptor(d));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, d);
}

// Issue 11: pid 0 names no process a reader could prove; it was accepted and handed to shm.
TEST(DescriptorTest, RefusesPidZeroAndNegativePids) {
  PeerDescriptor d = Sample();
  d.host.pid = 0;
  Result<PeerDescriptor> zero = DecodeDescriptor(EncodeDescriptor(d));
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(zero.status().message(), HasSubstr("pid (> 0), found 0"));
  d.host.pid = -7;
  Result<PeerDescriptor> negative = DecodeDescriptor(EncodeDescriptor(d));
  ASSERT_FALSE(negative.ok());
  EXPECT_EQ(negative.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.status().message(), HasSubstr("found -7"));
}

TEST(DescriptorTest, RefusesAnShmSectionWithoutANonceAddress) {
  PeerDescriptor d = Sample();
  d.shm = ShmProof{1, 0, 42};
  Result<PeerDescriptor> back = DecodeDescriptor(EncodeDescriptor(d));
  ASSERT_FALSE(back.ok());
  EXPECT_THAT(back.status().message(), HasSubstr("non-zero address of the instance nonce"));
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
  const RemoteRegionTable t = IndexRegions(Sample());
  EXPECT_TRUE(CheckRemoteRange(t, 5, 0, 4096).ok());
  EXPECT_FALSE(CheckRemoteRange(t, 5, 1, 4096).ok());
  EXPECT_FALSE(CheckRemoteRange(t, 5, ~0ull, 2).ok());
  EXPECT_FALSE(CheckRemoteRange(t, 6, 0, 1).ok());
  EXPECT_FALSE(CheckRemoteRange(t, 0, 0, 0).ok());
}

// Corrupted descriptors: each is either refused with a descriptor error that says what is wrong,
// or decodes to a descriptor that keeps the decoder's promises (unique region ids, non-empty
// ranges inside the address space, a tcp endpoint with a host and a port) and round-trips.
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
    if (d->tcp) {
      EXPECT_FALSE(d->tcp->host.empty()) << "input " << i;
      EXPECT_NE(d->tcp->port, 0) << "input " << i;
    }
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

TEST(DescriptorTest, LocalIdentityIsReadable) {
  Result<HostIdentity> id = LocalHostIdentity();
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  EXPECT_FALSE(id->boot_id.empty());
  EXPECT_GT(id->pid, 0);
}

}  // namespace
}  // namespace kvferry
