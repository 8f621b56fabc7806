#include "transport/tcp/frames.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvferry::tcp {
namespace {

using ::testing::HasSubstr;

TEST(FramesTest, RequestAndOpRoundTrip) {
  std::uint8_t buf[kRequestHeaderBytes + kOpBytes];
  EncodeRequestHeader({3, 0x1122334455667788ull}, buf);
  EncodeOp({9, 1ull << 40, 4096}, buf + kRequestHeaderBytes);
  Result<RequestHeader> h = ParseRequestHeader(
      std::span<const std::uint8_t, kRequestHeaderBytes>(buf, kRequestHeaderBytes));
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->op_count, 3u);
  EXPECT_EQ(h->request_id, 0x1122334455667788ull);
  Result<WireOp> op =
      ParseOp(std::span<const std::uint8_t, kOpBytes>(buf + kRequestHeaderBytes, kOpBytes));
  ASSERT_TRUE(op.ok());
  EXPECT_EQ(op->region, 9u);
  EXPECT_EQ(op->offset, 1ull << 40);
  EXPECT_EQ(op->length, 4096u);
}

TEST(FramesTest, MalformedRequestsAreRefused) {
  std::uint8_t h[kRequestHeaderBytes] = {};
  EXPECT_THAT(
      ParseRequestHeader(std::span<const std::uint8_t, kRequestHeaderBytes>(h)).status().message(),
      HasSubstr("magic"));
  EncodeRequestHeader({0, 1}, h);
  EXPECT_THAT(
      ParseRequestHeader(std::span<const std::uint8_t, kRequestHeaderBytes>(h)).status().message(),
      HasSubstr("has 0 ops"));
  EncodeRequestHeader({kMaxOpsPerRequest + 1, 1}, h);
  EXPECT_FALSE(ParseRequestHeader(std::span<const std::uint8_t, kRequestHeaderBytes>(h)).ok());
  std::uint8_t op[kOpBytes] = {};
  EncodeOp({1, 0, 0}, op);
  Result<WireOp> empty = ParseOp(std::span<const std::uint8_t, kOpBytes>(op));
  ASSERT_TRUE(empty.ok());
  EXPECT_THAT(CheckOpLength(*empty).message(), HasSubstr("read op of 0 bytes"));
  EXPECT_FALSE(CheckOpLength({1, 0, kMaxRequestBytes + 1}).ok());
  EXPECT_TRUE(CheckOpLength({1, 0, kMaxRequestBytes}).ok());
  EncodeOp({1, 0, 8}, op);
  op[5] = 1;  // reserved
  EXPECT_THAT(ParseOp(std::span<const std::uint8_t, kOpBytes>(op)).status().message(),
              HasSubstr("reserved"));
  std::uint8_t r[kResponseHeaderBytes];
  EncodeResponseHeader({1, 5, kMaxErrorBytes + 1}, r);
  EXPECT_FALSE(ParseResponseHeader(std::span<const std::uint8_t, kResponseHeaderBytes>(r)).ok());
}

TEST(FramesTest, MacsBindBothNoncesAndTheDirection) {
  const Nonce a = RandomNonce();
  const Nonce b = RandomNonce();
  EXPECT_NE(a, b);
  EXPECT_EQ(ClientMac("s", a, b), ClientMac("s", a, b));
  EXPECT_NE(ClientMac("s", a, b), ClientMac("t", a, b));
  EXPECT_NE(ClientMac("s", a, b), ClientMac("s", b, a));
  EXPECT_NE(ClientMac("s", a, b), ServerMac("s", a, b, 1));
  EXPECT_NE(ServerMac("s", a, b, 1), ServerMac("s", a, b, 2)) << "binds the server instance";
}

}  // namespace
}  // namespace kvferry::tcp
