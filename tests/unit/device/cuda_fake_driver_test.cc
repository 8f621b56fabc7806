// The cuda device's own logic on a fake libcuda (fake_libcuda.cc), where no GPU exists: offsets in
// IPC handles, the NotSupported fallback logged once, event states, errors. The fake follows the
// driver API as kvferry reads it; only make test-gpu shows the real driver agrees.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include <sstream>

#include "common/log.h"
#include "device/cuda/cuda_device.h"
#include "tests/unit/device/device_test_util.h"

namespace kvferry::device {
namespace {

using testing::Download;
using testing::PatternBytes;
using testing::Upload;

class CudaFakeDriverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto driver = CudaDriver::Load(KVFERRY_FAKE_LIBCUDA_PATH);
    ASSERT_TRUE(driver.ok()) << driver.status().ToString();
    auto dev = CudaDevice::Open(0, *driver);
    ASSERT_TRUE(dev.ok()) << dev.status().ToString();
    dev_ = std::move(dev).value();
    // The test reaches the fake's controls in the library the driver loaded.
    lib_ = dlopen(KVFERRY_FAKE_LIBCUDA_PATH, RTLD_NOW | RTLD_NOLOAD);
    ASSERT_NE(lib_, nullptr);
    set_ipc_capable_ = reinterpret_cast<void (*)(int)>(dlsym(lib_, "fake_cuda_set_ipc_capable"));
    set_event_result_ =
        reinterpret_cast<void (*)(int)>(dlsym(lib_, "fake_cuda_set_event_query_result"));
    ASSERT_TRUE(set_ipc_capable_ != nullptr && set_event_result_ != nullptr);
  }
  void TearDown() override {
    if (set_ipc_capable_ != nullptr) set_ipc_capable_(1);
    if (set_event_result_ != nullptr) set_event_result_(cu::CUDA_SUCCESS);
    dev_.reset();
    if (lib_ != nullptr) dlclose(lib_);
  }

  std::unique_ptr<CudaDevice> dev_;
  void* lib_ = nullptr;
  void (*set_ipc_capable_)(int) = nullptr;
  void (*set_event_result_)(int) = nullptr;
};

TEST_F(CudaFakeDriverTest, OpenChecksTheIndex) {
  auto driver = CudaDriver::Load(KVFERRY_FAKE_LIBCUDA_PATH);
  ASSERT_TRUE(driver.ok());
  EXPECT_EQ((*driver)->device_count(), 1);
  EXPECT_EQ(CudaDevice::Open(1, *driver).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dev_->name(), "cuda:0");
}

TEST_F(CudaFakeDriverTest, CopiesAndQueryGoThroughTheDriver) {
  auto a = dev_->Allocate(1 << 20);
  auto b = dev_->Allocate(1 << 20);
  ASSERT_TRUE(a.ok() && b.ok());
  auto stream = dev_->CreateStream();
  ASSERT_TRUE(stream.ok());
  const auto bytes = PatternBytes(1 << 20, 3);
  ASSERT_TRUE(Upload(**stream, (*a)->address(), bytes).ok());
  ASSERT_TRUE((*stream)->CopyDeviceToDevice((*b)->address(), (*a)->address(), 1 << 20).ok());
  auto back = Download(**stream, (*b)->address(), 1 << 20);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, bytes);
  auto info = dev_->Query((*a)->address() + 777);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->alloc_base, (*a)->address());
  EXPECT_EQ(info->alloc_size, 1u << 20);
  EXPECT_EQ(info->device, "cuda:0");
  std::vector<std::byte> host(16);
  EXPECT_EQ(dev_->Query(reinterpret_cast<DeviceAddress>(host.data())).status().code(),
            StatusCode::kNotFound);
}

// PyTorch hands out sub-ranges of larger allocations: the handle names the base plus the offset.
TEST_F(CudaFakeDriverTest, ExportOfAnInnerPointerCarriesBaseAndOffset) {
  auto a = dev_->Allocate(1 << 20);
  ASSERT_TRUE(a.ok());
  auto handle = dev_->ExportIpc((*a)->address() + 4096 + 3);
  ASSERT_TRUE(handle.ok()) << handle.status().ToString();
  EXPECT_EQ(handle->kind, "cuda");
  EXPECT_EQ(handle->offset, 4096u + 3);
  EXPECT_EQ(handle->alloc_size, 1u << 20);
  EXPECT_EQ(handle->opaque.size(), cu::kIpcHandleSize);
  auto decoded = IpcHandle::Decode(handle->Encode());
  ASSERT_TRUE(decoded.ok());
  auto imported = dev_->ImportIpc(*decoded);
  ASSERT_TRUE(imported.ok()) << imported.status().ToString();
  EXPECT_EQ((*imported)->address(decoded->offset), (*a)->address() + 4096 + 3);
  IpcHandle sim = *decoded;
  sim.kind = "sim";
  EXPECT_EQ(dev_->ImportIpc(sim).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(CudaFakeDriverTest, NonExportableAllocationIsNotSupportedAndLoggedOnce) {
  std::ostringstream log;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(log);
  Log().sinks().push_back(sink);
  set_ipc_capable_(0);  // as cuMemCreate / expandable segments
  auto vmm = dev_->Allocate(65536);
  ASSERT_TRUE(vmm.ok());
  for (int i = 0; i < 3; ++i) {
    auto h = dev_->ExportIpc((*vmm)->address() + 100);
    EXPECT_EQ(h.status().code(), StatusCode::kNotSupported) << h.status().ToString();
  }
  Log().flush();
  Log().sinks().pop_back();
  const std::string text = log.str();
  std::size_t count = 0;
  for (std::size_t at = text.find("cannot be exported"); at != std::string::npos;
       at = text.find("cannot be exported", at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 1u) << text;
}

TEST_F(CudaFakeDriverTest, EventStatesFollowCuEventQuery) {
  auto stream = dev_->CreateStream();
  ASSERT_TRUE(stream.ok());
  set_event_result_(cu::CUDA_ERROR_NOT_READY);
  auto event = (*stream)->RecordEvent();
  ASSERT_TRUE(event.ok());
  EXPECT_EQ((*event)->Poll().state, EventState::kPending);
  EXPECT_EQ((*event)->Wait(DeadlineAfter(std::chrono::milliseconds(20))).code(),
            StatusCode::kTimeout);
  set_event_result_(cu::CUDA_SUCCESS);
  EXPECT_TRUE((*event)->Wait(DeadlineAfter(std::chrono::seconds(10))).ok());
  set_event_result_(cu::CUDA_ERROR_INVALID_VALUE);  // an asynchronous copy error
  const EventPoll failed = (*event)->Poll();
  EXPECT_EQ(failed.state, EventState::kFailed);
  EXPECT_FALSE(failed.status.ok());
  EXPECT_FALSE((*event)->Wait(DeadlineAfter(std::chrono::seconds(10))).ok());
}

TEST_F(CudaFakeDriverTest, DriverErrorsBecomeStatuses) {
  auto stream = dev_->CreateStream();
  ASSERT_TRUE(stream.ok());
  std::vector<std::byte> host(16);
  // Not an allocation: the fake's cuMemcpy does not check, but Query and Export do.
  EXPECT_EQ(dev_->ExportIpc(reinterpret_cast<DeviceAddress>(host.data())).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(dev_->Allocate(0).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvferry::device
