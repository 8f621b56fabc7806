#include "kvferry/status.h"

#include <gtest/gtest.h>

#include <string>

namespace kvferry {
namespace {

TEST(StatusTest, DefaultIsOkAndCarriesNoMessage) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.message(), "");
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(StatusTest, ErrorKeepsCodeAndMessage) {
  Status s = Status::Timeout("read of 3 blocks did not finish in 2000 ms");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kTimeout);
  EXPECT_EQ(s.ToString(), "Timeout: read of 3 blocks did not finish in 2000 ms");
}

TEST(StatusTest, CopyIsDeepAndMoveLeavesOk) {
  Status a = Status::NotFound("x");
  Status b = a;
  EXPECT_EQ(a, b);
  Status c = std::move(a);
  EXPECT_EQ(c.code(), StatusCode::kNotFound);
  EXPECT_TRUE(a.ok());  // NOLINT(bugprone-use-after-move): moved-from is documented as OK
}

TEST(StatusTest, WithContextPrefixesAndKeepsOk) {
  EXPECT_TRUE(Status::Ok().WithContext("ctx").ok());
  Status s = Status::InvalidArgument("bad").WithContext("layer 3");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "layer 3: bad");
}

TEST(StatusTest, EveryCodeHasANameAndRoundTripsThroughTheWire) {
  for (int c = 0; c <= static_cast<int>(StatusCode::kUnauthenticated); ++c) {
    const auto code = static_cast<StatusCode>(c);
    EXPECT_STRNE(StatusCodeName(code), "Unknown");
    EXPECT_EQ(StatusCodeFromWire(static_cast<std::uint64_t>(c)), code);
  }
  EXPECT_EQ(StatusCodeFromWire(200), StatusCode::kInternal);
}

Result<int> Half(int x) {
  if (x % 2 != 0) return Status::InvalidArgument("odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  KVFERRY_ASSIGN_OR_RETURN(int h, Half(x));
  KVFERRY_ASSIGN_OR_RETURN(h, Half(h));
  return h;
}

Status CheckEven(int x) {
  KVFERRY_RETURN_IF_ERROR(Half(x).status());
  return Status::Ok();
}

TEST(ResultTest, ValueAndErrorPaths) {
  Result<int> ok = Quarter(8);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 2);
  EXPECT_TRUE(ok.status().ok());
  Result<int> bad = Quarter(6);
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "odd");
  EXPECT_TRUE(CheckEven(4).ok());
  EXPECT_EQ(CheckEven(3).code(), StatusCode::kInvalidArgument);
}

TEST(ResultTest, OkStatusWithoutValueBecomesInternal) {
  Result<std::string> r = Status::Ok();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace kvferry
