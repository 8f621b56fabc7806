// The cuda device on a real GPU (make test-gpu): the checks of device_checks.h. Where there is no
// driver or device each test SKIPs with the reason, or FAILs when KVFERRY_REQUIRE_GPU=1.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "device/device.h"
#include "tests/unit/device/device_checks.h"

namespace kvferry::device {
namespace {

bool RequireGpu() {
  const char* v = std::getenv("KVFERRY_REQUIRE_GPU");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

#define KVFERRY_OPEN_GPU(var)                                                                  \
  auto var##_result = OpenDevice("cuda:0");                                                    \
  if (!var##_result.ok()) {                                                                    \
    if (RequireGpu()) FAIL() << "KVFERRY_REQUIRE_GPU=1: " << var##_result.status().ToString(); \
    GTEST_SKIP() << "no CUDA driver/device: " << var##_result.status().ToString();             \
  }                                                                                            \
  Device& var = **var##_result

TEST(CudaGpuTest, CopiesInEveryDirectionAreByteExact) {
  KVFERRY_OPEN_GPU(dev);
  testing::CheckCopiesInEveryDirection(dev);
}

TEST(CudaGpuTest, RandomScatteredBlocksThroughPinnedStaging) {
  KVFERRY_OPEN_GPU(dev);
  testing::CheckScatteredBlocksThroughPinnedStaging(dev);
}

TEST(CudaGpuTest, QueryFindsTheAllocationOfAnInnerPointer) {
  KVFERRY_OPEN_GPU(dev);
  testing::CheckQueryOfAnInnerPointer(dev);
}

TEST(CudaGpuTest, AnEventOnANativeStreamFollowsItsCopies) {
  KVFERRY_OPEN_GPU(dev);
  testing::CheckEventOnANativeStream(dev);
}

TEST(CudaGpuTest, TwoProcessIpcOnTheSameGpu) {
  KVFERRY_OPEN_GPU(dev);
  testing::CheckTwoProcessIpc(dev);
}

}  // namespace
}  // namespace kvferry::device
