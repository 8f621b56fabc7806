#include "transport/descriptor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

namespace kvferry {
namespace {

using ::testing::HasSubstr;

PeerDescriptor Sample() {
  return PeerDescriptor{{"87d27ef8-ec29-4dbb-b1ee-24fd9ed0171c", 4026531836u, 4242},
                        TcpEndpoint{"127.0.0.1", 40001, 0xfedcba9876543210ull},
                        {{0, 0x7f0000001000, 1u << 20}, {5, 0x7f0000200000, 4096}}};
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

TEST(DescriptorTest, RandomCorruptionNeverCrashes) {
  const std::vector<std::uint8_t> good = EncodeDescriptor(Sample());
  std::mt19937 rng(3);
  for (int i = 0; i < 5000; ++i) {
    std::vector<std::uint8_t> bad = good;
    bad[rng() % bad.size()] = static_cast<std::uint8_t>(rng());
    if (rng() % 4 == 0) bad.resize(rng() % bad.size());
    (void)DecodeDescriptor(bad);
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
