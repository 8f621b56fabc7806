// The cuda device where there is no driver: Unavailable with a reason, never a crash.
#include <gtest/gtest.h>

#include <filesystem>

#include "device/cuda/cuda_device.h"
#include "device/cuda/cuda_driver.h"
#include "device/device.h"

namespace kvferry::device {
namespace {

TEST(CudaLoaderTest, MissingLibraryIsUnavailableNoCudaDriver) {
  auto d = CudaDriver::Load("/nonexistent/libcuda.so.1");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(d.status().message().find("no CUDA driver"), std::string_view::npos)
      << d.status().ToString();
}

TEST(CudaLoaderTest, LibraryWithoutTheDriverApiIsUnavailable) {
  auto d = CudaDriver::Load("libc.so.6");  // loads, but has no cuInit
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(d.status().message().find("lacks cuGetErrorString"), std::string_view::npos)
      << d.status().ToString();
}

// The toolkit's stub libcuda exports every symbol but cuInit fails: still Unavailable.
TEST(CudaLoaderTest, ToolkitStubIsUnavailable) {
  const char* stub = "/usr/local/cuda/lib64/stubs/libcuda.so";
  if (!std::filesystem::exists(stub)) {
    GTEST_SKIP() << "no CUDA toolkit stub at " << stub << ": nothing to load";
  }
  auto d = CudaDriver::Load(stub);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(d.status().message().find("no CUDA"), std::string_view::npos) << d.status().ToString();
}

// Through the public entry point: a machine without a GPU gets Unavailable "no CUDA ...".
TEST(CudaLoaderTest, OpenDeviceWithoutDriverOrGpuIsUnavailable) {
  auto dev = OpenDevice("cuda:0");
  if (dev.ok()) GTEST_SKIP() << "this machine has " << (*dev)->name() << ": see make test-gpu";
  EXPECT_EQ(dev.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(dev.status().message().rfind("no CUDA", 0), 0u) << dev.status().ToString();
}

TEST(OpenDeviceTest, NamesAreChecked) {
  EXPECT_EQ(OpenDevice("tpu:0").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenDevice("sim").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenDevice("sim:-1").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenDevice("sim:1x").status().code(), StatusCode::kInvalidArgument);
  auto sim = OpenDevice("sim:2");
  ASSERT_TRUE(sim.ok()) << sim.status().ToString();
  EXPECT_EQ((*sim)->name(), "sim:2");
  EXPECT_EQ((*sim)->kind(), "sim");
}

}  // namespace
}  // namespace kvferry::device
