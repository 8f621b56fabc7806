// Pinned staging buffers: bounded, reused, and usable as both ends of device copies.
#include "device/staging_pool.h"

#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "device/sim/sim_device.h"
#include "tests/unit/device/device_test_util.h"

namespace kvferry::device {
namespace {

std::unique_ptr<SimDevice> MakeSim() { return std::move(SimDevice::Create({})).value(); }

TEST(StagingPoolTest, NeverHoldsMoreThanItsBound) {
  auto dev = MakeSim();
  auto pool = StagingPool::Create(*dev, 4096, 2);
  ASSERT_TRUE(pool.ok());
  auto a = (*pool)->Acquire(DeadlineAfter(std::chrono::seconds(1)));
  auto b = (*pool)->Acquire(DeadlineAfter(std::chrono::seconds(1)));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*pool)->allocated_bytes(), 8192u);
  auto c = (*pool)->Acquire(DeadlineAfter(std::chrono::milliseconds(30)));
  EXPECT_EQ(c.status().code(), StatusCode::kTimeout) << c.status().ToString();
  EXPECT_EQ((*pool)->allocated_bytes(), 8192u);
  // Many more rounds reuse the same two buffers.
  *a = StagingLease();
  *b = StagingLease();
  for (int i = 0; i < 50; ++i) {
    auto x = (*pool)->Acquire(DeadlineAfter(std::chrono::seconds(1)));
    auto y = (*pool)->Acquire(DeadlineAfter(std::chrono::seconds(1)));
    ASSERT_TRUE(x.ok() && y.ok());
    EXPECT_NE(x->data(), y->data());
  }
  EXPECT_EQ((*pool)->allocated_bytes(), 8192u);
}

TEST(StagingPoolTest, AWaiterGetsTheBufferThatIsReturned) {
  auto dev = MakeSim();
  auto pool = StagingPool::Create(*dev, 4096, 1);
  ASSERT_TRUE(pool.ok());
  auto held = (*pool)->Acquire(DeadlineAfter(std::chrono::seconds(1)));
  ASSERT_TRUE(held.ok());
  std::byte* const buffer = held->data();
  std::promise<void> waiting;
  auto got = std::async(std::launch::async, [&] {
    waiting.set_value();
    auto lease = (*pool)->Acquire(DeadlineAfter(std::chrono::seconds(30)));
    return lease.ok() ? lease->data() : nullptr;
  });
  waiting.get_future().wait();
  *held = StagingLease();  // return it: the waiter (blocked or about to block) takes it
  EXPECT_EQ(got.get(), buffer);
  EXPECT_EQ((*pool)->allocated_bytes(), 4096u);
}

TEST(StagingPoolTest, StagesThroughTheDevice) {
  auto dev = MakeSim();
  auto pool = StagingPool::Create(*dev, 65536, 2);
  ASSERT_TRUE(pool.ok());
  auto in = (*pool)->Acquire(DeadlineAfter(std::chrono::seconds(1)));
  auto out = (*pool)->Acquire(DeadlineAfter(std::chrono::seconds(1)));
  ASSERT_TRUE(in.ok() && out.ok());
  FillPattern(in->data(), in->size(), 77, 0, 0);
  auto a = dev->Allocate(65536);
  ASSERT_TRUE(a.ok());
  auto stream = dev->CreateStream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE((*stream)->CopyHostToDevice((*a)->address(), in->data(), 65536).ok());
  ASSERT_TRUE((*stream)->CopyDeviceToHost(out->data(), (*a)->address(), 65536).ok());
  ASSERT_TRUE(testing::Sync(**stream).ok());
  EXPECT_EQ(FirstPatternMismatch(out->data(), 65536, 77, 0, 0), -1);
}

TEST(StagingPoolTest, RefusesAnEmptyBound) {
  auto dev = MakeSim();
  EXPECT_EQ(StagingPool::Create(*dev, 0, 2).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(StagingPool::Create(*dev, 4096, 0).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvferry::device
