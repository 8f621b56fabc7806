#include "sidechannel/auth.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <thread>

namespace kvferry::sidechannel {
namespace {

using std::chrono::milliseconds;
using ::testing::HasSubstr;

const std::vector<std::uint8_t> kBody = {1, 2, 3, 4};

TEST(AuthTest, SignedRequestVerifies) {
  AuthNonce nonce{};
  auto h = SignMessage("s3cret", AuthKind::kRequest, kBody, {}, &nonce);
  Result<AuthHeader> r =
      VerifyMessage("s3cret", AuthKind::kRequest, h, kBody, {}, milliseconds(1000));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->nonce, nonce);
}

TEST(AuthTest, WrongSecretTamperedBodyAndWrongKindFail) {
  auto h = SignMessage("s3cret", AuthKind::kRequest, kBody, {}, nullptr);
  EXPECT_EQ(
      VerifyMessage("other", AuthKind::kRequest, h, kBody, {}, milliseconds(1000)).status().code(),
      StatusCode::kUnauthenticated);
  std::vector<std::uint8_t> body = kBody;
  body[0] ^= 1;
  EXPECT_FALSE(VerifyMessage("s3cret", AuthKind::kRequest, h, body, {}, milliseconds(1000)).ok());
  EXPECT_FALSE(VerifyMessage("s3cret", AuthKind::kReply, h, kBody, {}, milliseconds(1000)).ok());
  h.pop_back();
  EXPECT_THAT(VerifyMessage("s3cret", AuthKind::kRequest, h, kBody, {}, milliseconds(1000))
                  .status()
                  .message(),
              HasSubstr("header of 59 bytes"));
}

TEST(AuthTest, ReplyIsBoundToItsRequest) {
  AuthNonce req{};
  req[0] = 7;
  auto h = SignMessage("k", AuthKind::kReply, kBody, req, nullptr);
  EXPECT_TRUE(VerifyMessage("k", AuthKind::kReply, h, kBody, req, milliseconds(1000)).ok());
  AuthNonce other = req;
  other[0] = 8;
  EXPECT_FALSE(VerifyMessage("k", AuthKind::kReply, h, kBody, other, milliseconds(1000)).ok());
}

TEST(AuthTest, StaleTimestampsAreRefused) {
  auto h = SignMessageAt("k", AuthKind::kRequest, kBody, {}, UnixMillis() - 60000, AuthNonce{});
  Result<AuthHeader> r = VerifyMessage("k", AuthKind::kRequest, h, kBody, {}, milliseconds(30000));
  EXPECT_EQ(r.status().code(), StatusCode::kUnauthenticated);
  EXPECT_THAT(r.status().message(), HasSubstr("stale or replayed"));
  h = SignMessageAt("k", AuthKind::kRequest, kBody, {}, UnixMillis() + 60000, AuthNonce{});
  EXPECT_FALSE(VerifyMessage("k", AuthKind::kRequest, h, kBody, {}, milliseconds(30000)).ok());
}

TEST(ReplayGuardTest, SecondUseOfANonceIsRefused) {
  ReplayGuard guard(milliseconds(1000), 4);
  AuthHeader a{AuthKind::kRequest, UnixMillis(), {}};
  a.nonce[0] = 1;
  AuthHeader b = a;
  b.nonce[0] = 2;
  EXPECT_TRUE(guard.Accept(a));
  EXPECT_TRUE(guard.Accept(b));
  EXPECT_FALSE(guard.Accept(a));
  EXPECT_FALSE(guard.Accept(b));
}

// A nonce is accepted once, whatever timestamp comes with it: a sender that signs the same nonce
// again under a new timestamp (a valid MAC) is refused as a replay (docs/control.md,
// docs/protocol.md). The guard used to remember (timestamp, nonce) pairs and accepted this.
TEST(ReplayGuardTest, ANonceIsRefusedUnderANewTimestampToo) {
  ReplayGuard guard(milliseconds(30000), 4);
  const std::uint64_t now = UnixMillis();
  AuthHeader first{AuthKind::kRequest, now - 10, {}};
  first.nonce[0] = 9;
  AuthHeader again = first;
  again.timestamp_ms = now;
  AuthHeader earlier = first;
  earlier.timestamp_ms = now - 20;
  EXPECT_TRUE(guard.Accept(first));
  EXPECT_FALSE(guard.Accept(again));
  EXPECT_FALSE(guard.Accept(earlier));
  EXPECT_EQ(guard.size(), 1u);
}

AuthHeader Header(std::uint64_t timestamp_ms, int id) {
  AuthHeader h{AuthKind::kRequest, timestamp_ms, {}};
  std::memcpy(h.nonce.data(), &id, sizeof(id));
  return h;
}

// Ten times the capacity of fresh messages: the guard never holds more than its capacity, and
// forgetting headers whose timestamps are still inside the window must not let them be replayed
// (the guard used to forget the oldest nonce and then accept its replay).
TEST(ReplayGuardTest, MemoryIsBoundedAndEvictionOpensNoReplayGap) {
  constexpr std::size_t kCapacity = 100;
  ReplayGuard guard(milliseconds(30000), kCapacity);
  // Timestamps 1 ms apart, all well inside the 30 s window (now - 20 s .. now - 19 s).
  const std::uint64_t base = UnixMillis() - 20000;
  constexpr int kMessages = 1000;
  for (int i = 0; i < kMessages; ++i) {
    EXPECT_TRUE(guard.Accept(Header(base + static_cast<std::uint64_t>(i), i))) << i;
    ASSERT_LE(guard.size(), kCapacity) << "after " << i + 1 << " messages";
  }
  EXPECT_EQ(guard.size(), kCapacity);
  EXPECT_EQ(guard.capacity(), kCapacity);
  // Every one of them replayed, the 900 forgotten ones included: all refused.
  int replays_accepted = 0;
  for (int i = 0; i < kMessages; ++i) {
    if (guard.Accept(Header(base + static_cast<std::uint64_t>(i), i))) ++replays_accepted;
  }
  EXPECT_EQ(replays_accepted, 0);
  EXPECT_EQ(guard.low_water_ms(), base + kMessages - kCapacity - 1);
  // A late message older than the newest forgotten header is refused too (it cannot be told from
  // a replay); newer messages still go through, and the bound holds.
  EXPECT_FALSE(guard.Accept(Header(base + 5, 100000)));
  EXPECT_TRUE(guard.Accept(Header(base + kMessages, 100001)));
  EXPECT_TRUE(guard.Accept(Header(base + kMessages - 50, 100002)));
  EXPECT_LE(guard.size(), kCapacity);
}

// Headers more than two windows old are forgotten (their replays are stale), without any refusal.
TEST(ReplayGuardTest, StaleHeadersAreForgottenWithoutALowWaterMark) {
  ReplayGuard guard(milliseconds(1000), 100);
  // 1.9 s old with a 1 s window: kept for another 100 ms, forgotten after.
  const std::uint64_t now = UnixMillis();
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(guard.Accept(Header(now - 1900, i)));
  EXPECT_EQ(guard.size(), 50u);
  // The event waited for is the clock passing the expiry (bounded: 100 ms from `now`).
  while (UnixMillis() <= now + 101) std::this_thread::yield();
  EXPECT_TRUE(guard.Accept(Header(UnixMillis(), 1000)));
  EXPECT_EQ(guard.size(), 1u) << "headers more than two windows old were kept";
  EXPECT_EQ(guard.low_water_ms(), 0u);
  EXPECT_TRUE(guard.Accept(Header(now - 1900, 2000))) << "no low-water mark: not refused";
}

}  // namespace
}  // namespace kvferry::sidechannel
