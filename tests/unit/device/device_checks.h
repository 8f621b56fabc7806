// The checks every real device passes the same way (cuda_gpu_test on a GPU, acl_npu_test on an
// NPU and on the fake libascendcl): each takes an open device and fails the calling test.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>

#include "common/subprocess.h"
#include "device/device.h"
#include "tests/unit/device/device_test_util.h"

namespace kvferry::device::testing {

// 8 MiB up, across and back down, byte for byte.
inline void CheckCopiesInEveryDirection(Device& dev) {
  constexpr std::uint64_t kSize = 8 << 20;
  auto a = dev.Allocate(kSize);
  auto b = dev.Allocate(kSize);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString();
  auto stream = dev.CreateStream();
  ASSERT_TRUE(stream.ok()) << stream.status().ToString();
  const auto bytes = PatternBytes(kSize, 7);
  ASSERT_TRUE(Upload(**stream, (*a)->address(), bytes).ok());
  ASSERT_TRUE((*stream)->CopyDeviceToDevice((*b)->address(), (*a)->address(), kSize).ok());
  auto back = Download(**stream, (*b)->address(), kSize);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, bytes);
}

// 64 blocks of 64 KiB in shuffled order from one pinned buffer up and back into another.
inline void CheckScatteredBlocksThroughPinnedStaging(Device& dev) {
  constexpr std::uint64_t kBlock = 64 * 1024;
  constexpr std::uint64_t kBlocks = 64;
  auto a = dev.Allocate(kBlock * kBlocks);
  ASSERT_TRUE(a.ok());
  auto in_buffer = dev.AllocatePinned(kBlock * kBlocks);
  auto out_buffer = dev.AllocatePinned(kBlock * kBlocks);
  ASSERT_TRUE(in_buffer.ok() && out_buffer.ok()) << in_buffer.status().ToString();
  PinnedBuffer* in = in_buffer->get();
  PinnedBuffer* out = out_buffer->get();
  FillPattern(in->data(), in->size(), 5, 0, 0);
  std::vector<std::uint64_t> order(kBlocks);
  for (std::uint64_t i = 0; i < kBlocks; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937_64(9));
  auto stream = dev.CreateStream();
  ASSERT_TRUE(stream.ok());
  for (std::uint64_t i = 0; i < kBlocks; ++i) {
    ASSERT_TRUE(
        (*stream)
            ->CopyHostToDevice((*a)->address() + order[i] * kBlock, in->data() + i * kBlock, kBlock)
            .ok());
  }
  for (std::uint64_t i = 0; i < kBlocks; ++i) {
    ASSERT_TRUE((*stream)
                    ->CopyDeviceToHost(out->data() + i * kBlock,
                                       (*a)->address() + order[i] * kBlock, kBlock)
                    .ok());
  }
  ASSERT_TRUE(Sync(**stream).ok());
  EXPECT_EQ(std::memcmp(in->data(), out->data(), kBlock * kBlocks), 0);
}

inline void CheckQueryOfAnInnerPointer(Device& dev) {
  auto a = dev.Allocate(1 << 20);
  ASSERT_TRUE(a.ok());
  auto info = dev.Query((*a)->address() + 4096);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->alloc_base, (*a)->address());
  EXPECT_GE(info->alloc_size, 1u << 20);
  std::vector<std::byte> host(64);
  EXPECT_EQ(dev.Query(reinterpret_cast<DeviceAddress>(host.data())).status().code(),
            StatusCode::kNotFound);
}

// RecordEventOn with a stream the engine made (here one of the device's own, by its native
// handle): the event completes once the copies queued on it have.
inline void CheckEventOnANativeStream(Device& dev) {
  constexpr std::uint64_t kSize = 16 << 20;
  auto a = dev.Allocate(kSize);
  ASSERT_TRUE(a.ok());
  auto stream = dev.CreateStream();
  ASSERT_TRUE(stream.ok());
  const auto bytes = PatternBytes(kSize, 3);
  ASSERT_TRUE((*stream)->CopyHostToDevice((*a)->address(), bytes.data(), kSize).ok());
  auto event = dev.RecordEventOn((*stream)->native_handle());
  ASSERT_TRUE(event.ok()) << event.status().ToString();
  ASSERT_TRUE((*event)->Wait(DeadlineAfter(std::chrono::seconds(10))).ok());
  auto back = Download(**stream, (*a)->address(), kSize);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, bytes);
}

#ifdef KVFERRY_DEVICE_IPC_PEER_PATH
// Another process (device_ipc_peer) imports the handle of a sub-range, as PyTorch's allocators
// hand out, checks the bytes from the offset on and writes new ones, which this process reads
// back.
inline void CheckTwoProcessIpc(Device& dev) {
  constexpr std::uint64_t kSize = 4 << 20;
  auto a = dev.Allocate(kSize);
  ASSERT_TRUE(a.ok());
  auto stream = dev.CreateStream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE(Upload(**stream, (*a)->address(), PatternBytes(kSize, 41)).ok());
  constexpr std::uint64_t kOffset = 65536 + 512;
  auto handle = dev.ExportIpc((*a)->address() + kOffset);
  ASSERT_TRUE(handle.ok()) << handle.status().ToString();
  ASSERT_EQ(handle->offset, kOffset);
  ASSERT_EQ(handle->alloc_size, kSize);  // the peer checks the bytes up to the end of it
  auto peer = Subprocess::Spawn(
      {DeviceIpcPeerPath(), "import", dev.name(), ToHex(handle->Encode()), "41", "42"});
  ASSERT_TRUE(peer.ok());
  auto line = peer->ReadLine(std::chrono::seconds(60));
  ASSERT_TRUE(line.ok()) << line.status().ToString();
  ASSERT_EQ(*line, "ok");
  auto code = peer->CloseAndWait(std::chrono::seconds(30));  // it closes its import first
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  auto back = Download(**stream, (*a)->address(), kSize);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(FirstPatternMismatch(back->data(), kOffset, 41, 0, 0), -1);
  EXPECT_EQ(FirstPatternMismatch(back->data() + kOffset, kSize - kOffset, 42, 0, kOffset), -1);
}
#endif

}  // namespace kvferry::device::testing
