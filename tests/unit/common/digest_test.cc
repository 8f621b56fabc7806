#include "common/digest.h"

#include <gtest/gtest.h>

#include <vector>

#include "common/checked_math.h"

namespace kvferry {
namespace {

TEST(DigestTest, Sha256KnownAnswer) {
  EXPECT_EQ(ToHex(Sha256("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(DigestTest, HmacSha256Rfc4231Case2) {
  const std::string data = "what do ya want for nothing?";
  std::vector<std::uint8_t> bytes(data.begin(), data.end());
  EXPECT_EQ(ToHex(HmacSha256("Jefe", bytes)),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(DigestTest, HexRoundTripsAndRejectsMalformedText) {
  const std::vector<std::uint8_t> bytes = {0x00, 0x7f, 0x80, 0xff, 0x5a};
  Result<std::vector<std::uint8_t>> back = FromHex(ToHex(bytes));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, bytes);
  EXPECT_EQ(*FromHex("ABcd"), (std::vector<std::uint8_t>{0xab, 0xcd}));
  EXPECT_EQ(FromHex("abc").status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(FromHex("ab0g").status().message().find("offset 3"), std::string_view::npos);
}

TEST(DigestTest, DigestEqualsComparesAllBytes) {
  Sha256Digest a = Sha256("a");
  Sha256Digest b = a;
  EXPECT_TRUE(DigestEquals(a, b));
  b[31] ^= 1;
  EXPECT_FALSE(DigestEquals(a, b));
}

TEST(CheckedMathTest, DetectsOverflowAndNegatives) {
  EXPECT_EQ(CheckedMul(1 << 20, 1 << 20), std::int64_t{1} << 40);
  EXPECT_FALSE(CheckedMul(std::int64_t{1} << 40, std::int64_t{1} << 30).has_value());
  EXPECT_FALSE(CheckedMul(-1, 2).has_value());
  EXPECT_FALSE(CheckedAdd(INT64_MAX, 1).has_value());
  EXPECT_EQ(CheckedAdd(2, 3), 5);
}

}  // namespace
}  // namespace kvferry
