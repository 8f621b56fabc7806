// The acl device on a real NPU (make test-npu, scripts/npu_check.sh): the checks of
// device_checks.h, as the cuda device passes them on a GPU. Where there is no CANN or
// NPU each test SKIPs with the reason, or FAILs when KVFERRY_REQUIRE_NPU=1. CTest also runs these
// tests on the fake libascendcl (KVFERRY_ACL_LIBRARY, KVFERRY_REQUIRE_NPU=1), which shows they
// can pass and cannot skip; only an NPU shows the real runtime agrees.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "device/device.h"
#include "tests/unit/device/device_checks.h"

namespace kvferry::device {
namespace {

bool RequireNpu() {
  const char* v = std::getenv("KVFERRY_REQUIRE_NPU");  // NOLINT(concurrency-mt-unsafe)
  return v != nullptr && std::strcmp(v, "1") == 0;
}

// NOLINTBEGIN(bugprone-macro-parentheses): `var` names a variable
#define KVFERRY_OPEN_NPU(var)                                                                  \
  auto var##_result = OpenDevice("npu:0");                                                     \
  if (!var##_result.ok()) {                                                                    \
    if (RequireNpu()) FAIL() << "KVFERRY_REQUIRE_NPU=1: " << var##_result.status().ToString(); \
    GTEST_SKIP() << "no NPU runtime/device: " << var##_result.status().ToString();             \
  }                                                                                            \
  Device& var = **var##_result
// NOLINTEND(bugprone-macro-parentheses)

TEST(AclNpuTest, CopiesInEveryDirectionAreByteExact) {
  KVFERRY_OPEN_NPU(dev);
  testing::CheckCopiesInEveryDirection(dev);
}

TEST(AclNpuTest, RandomScatteredBlocksThroughPinnedStaging) {
  KVFERRY_OPEN_NPU(dev);
  testing::CheckScatteredBlocksThroughPinnedStaging(dev);
}

TEST(AclNpuTest, QueryFindsTheAllocationOfAnInnerPointer) {
  KVFERRY_OPEN_NPU(dev);
  testing::CheckQueryOfAnInnerPointer(dev);
}

TEST(AclNpuTest, AnEventOnANativeStreamFollowsItsCopies) {
  KVFERRY_OPEN_NPU(dev);
  testing::CheckEventOnANativeStream(dev);
}

// The peer is admitted by its bare tgid before it imports (docs/device.md, "The acl device").
TEST(AclNpuTest, TwoProcessIpcOnTheSameNpu) {
  KVFERRY_OPEN_NPU(dev);
  testing::CheckTwoProcessIpc(dev);
}

}  // namespace
}  // namespace kvferry::device
