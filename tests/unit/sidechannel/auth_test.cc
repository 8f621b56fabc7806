#include "sidechannel/auth.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

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

TEST(ReplayGuardTest, MemoryIsBounded) {
  ReplayGuard guard(milliseconds(1000), 100);
  for (int i = 0; i < 10000; ++i) {
    AuthHeader h{AuthKind::kRequest, UnixMillis(), {}};
    std::memcpy(h.nonce.data(), &i, sizeof(i));
    EXPECT_TRUE(guard.Accept(h));
  }
}

}  // namespace
}  // namespace kvferry::sidechannel
