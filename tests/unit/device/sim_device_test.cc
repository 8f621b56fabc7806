// The sim device: copies in every direction, scattered blocks, events and deadlines, IPC with a
// second process, and the property the sim exists for: host code touching its memory crashes.
#include "device/sim/sim_device.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <random>

#include "common/subprocess.h"
#include "tests/unit/device/device_test_util.h"

namespace kvferry::device {
namespace {

using testing::Download;
using testing::PatternBytes;
using testing::Sync;
using testing::Upload;

std::unique_ptr<SimDevice> MakeSim(SimOptions options = {}) {
  auto d = SimDevice::Create(options);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  return std::move(d).value();
}

TEST(SimDeviceTest, CopiesInEveryDirectionAreByteExact) {
  auto dev = MakeSim();
  auto a = dev->Allocate(1 << 20);
  auto b = dev->Allocate(1 << 20);
  ASSERT_TRUE(a.ok() && b.ok());
  auto stream = dev->CreateStream();
  ASSERT_TRUE(stream.ok());
  const auto bytes = PatternBytes(1 << 20, 7);
  ASSERT_TRUE(Upload(**stream, (*a)->address(), bytes).ok());  // h->d
  ASSERT_TRUE(
      (*stream)->CopyDeviceToDevice((*b)->address(), (*a)->address(), 1 << 20).ok());  // d->d
  auto back = Download(**stream, (*b)->address(), 1 << 20);                            // d->h
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, bytes);
  // An odd-sized, unaligned piece in the middle.
  auto piece = Download(**stream, (*b)->address() + 4097, 12345);
  ASSERT_TRUE(piece.ok());
  EXPECT_TRUE(std::equal(piece->begin(), piece->end(), bytes.begin() + 4097));
}

TEST(SimDeviceTest, RandomScatteredBlocksInEveryDirection) {
  auto dev = MakeSim();
  constexpr std::uint64_t kBlock = 64 * 1024;
  constexpr std::uint64_t kBlocks = 48;
  auto src = dev->Allocate(kBlock * kBlocks);
  auto dst = dev->Allocate(kBlock * kBlocks);
  ASSERT_TRUE(src.ok() && dst.ok());
  auto stream = dev->CreateStream();
  ASSERT_TRUE(stream.ok());
  std::mt19937_64 rng(1234);
  std::vector<std::uint64_t> order(kBlocks);
  for (std::uint64_t i = 0; i < kBlocks; ++i) order[i] = i;

  // host -> sim: host block i lands in device block order[i].
  std::shuffle(order.begin(), order.end(), rng);
  const auto host = PatternBytes(kBlock * kBlocks, 99);
  for (std::uint64_t i = 0; i < kBlocks; ++i) {
    ASSERT_TRUE((*stream)
                    ->CopyHostToDevice((*src)->address() + order[i] * kBlock,
                                       host.data() + i * kBlock, kBlock)
                    .ok());
  }
  // sim -> sim: device block j of src to block perm[j] of dst, random lengths within a block.
  std::vector<std::uint64_t> perm = order;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::uint64_t> lengths(kBlocks);
  for (auto& len : lengths) len = 1 + rng() % kBlock;
  for (std::uint64_t j = 0; j < kBlocks; ++j) {
    ASSERT_TRUE((*stream)
                    ->CopyDeviceToDevice((*dst)->address() + perm[j] * kBlock,
                                         (*src)->address() + j * kBlock, lengths[j])
                    .ok());
  }
  // sim -> host: scattered back into a host buffer in yet another order.
  std::vector<std::uint64_t> out_order = order;
  std::shuffle(out_order.begin(), out_order.end(), rng);
  std::vector<std::byte> out(kBlock * kBlocks, std::byte{0xee});
  for (std::uint64_t k = 0; k < kBlocks; ++k) {
    ASSERT_TRUE((*stream)
                    ->CopyDeviceToHost(out.data() + out_order[k] * kBlock,
                                       (*dst)->address() + k * kBlock, kBlock)
                    .ok());
  }
  ASSERT_TRUE(Sync(**stream).ok());

  // Expected: dst block perm[j] begins with lengths[j] bytes of src block j, which holds host
  // block i where order[i] == j.
  std::vector<std::uint64_t> host_of(kBlocks);
  for (std::uint64_t i = 0; i < kBlocks; ++i) host_of[order[i]] = i;
  for (std::uint64_t j = 0; j < kBlocks; ++j) {
    const std::uint64_t k = perm[j];
    const std::byte* got = out.data() + out_order[k] * kBlock;
    const std::byte* want = host.data() + host_of[j] * kBlock;
    ASSERT_EQ(std::memcmp(got, want, lengths[j]), 0) << "block " << j;
  }
}

TEST(SimDeviceTest, QueryNamesTheAllocationAndRefusesHostMemory) {
  auto dev = MakeSim(SimOptions{.index = 3});
  auto a = dev->Allocate(10000);
  ASSERT_TRUE(a.ok());
  auto info = dev->Query((*a)->address() + 1234);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->device, "sim:3");
  EXPECT_EQ(info->device_index, 3);
  EXPECT_EQ(info->alloc_base, (*a)->address());
  EXPECT_EQ(info->alloc_size, 10000u);
  EXPECT_EQ(dev->Query((*a)->address() + 10000).status().code(), StatusCode::kNotFound);
  std::vector<std::byte> host(16);
  EXPECT_EQ(dev->Query(reinterpret_cast<DeviceAddress>(host.data())).status().code(),
            StatusCode::kNotFound);
  // Another sim device does not know this one's memory.
  auto other = MakeSim();
  EXPECT_EQ(other->Query((*a)->address()).status().code(), StatusCode::kNotFound);
}

TEST(SimDeviceTest, CopiesCheckTheirRanges) {
  auto dev = MakeSim();
  auto a = dev->Allocate(4096);
  ASSERT_TRUE(a.ok());
  auto stream = dev->CreateStream();
  ASSERT_TRUE(stream.ok());
  std::vector<std::byte> host(8192);
  // Past the end of the allocation.
  Status s = (*stream)->CopyHostToDevice((*a)->address() + 1, host.data(), 4096);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("past the end"), std::string_view::npos) << s.ToString();
  // Not device memory at all.
  s = (*stream)->CopyDeviceToHost(host.data(), reinterpret_cast<DeviceAddress>(host.data()), 16);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  // A device address passed as the host side: the bug class the sim exists to catch.
  s = (*stream)->CopyHostToDevice((*a)->address(),
                                  reinterpret_cast<const std::byte*>((*a)->address()), 16);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("expected host memory"), std::string_view::npos) << s.ToString();
  // A freed allocation is unknown from then on.
  const DeviceAddress freed = (*a)->address();
  a->reset();
  EXPECT_EQ((*stream)->CopyHostToDevice(freed, host.data(), 16).code(),
            StatusCode::kInvalidArgument);
}

// The reason the sim exists: code that treats device memory as host memory must crash in tests.
TEST(SimDeviceDeathTest, HostLoadFromDeviceAddressFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto dev = MakeSim();
  auto a = dev->Allocate(4096);
  ASSERT_TRUE(a.ok());
  auto stream = dev->CreateStream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE(Upload(**stream, (*a)->address(), PatternBytes(4096, 5)).ok());
  const DeviceAddress addr = (*a)->address();
  // The kernel's SIGSEGV, not a sanitizer's report of it: ASan installs its own handler.
  EXPECT_EXIT(
      {
        std::signal(SIGSEGV, SIG_DFL);
        std::uint64_t word = 0;
        std::memcpy(&word, reinterpret_cast<const void*>(addr), sizeof(word));
        std::fprintf(stderr, "read %llu from device memory\n",
                     static_cast<unsigned long long>(word));
        std::_Exit(0);
      },
      ::testing::KilledBySignal(SIGSEGV), "");
  EXPECT_EXIT(
      {
        std::signal(SIGSEGV, SIG_DFL);
        std::memset(reinterpret_cast<void*>(addr), 1, 64);
        std::_Exit(0);
      },
      ::testing::KilledBySignal(SIGSEGV), "");
  // The device's own copies still see the bytes.
  auto back = Download(**stream, addr, 4096);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, PatternBytes(4096, 5));
}

TEST(SimDeviceTest, EventsCompleteInOrderAndWaitsHonourDeadlines) {
  auto dev = MakeSim(SimOptions{.copy_latency = std::chrono::milliseconds(2000)});
  auto a = dev->Allocate(4096);
  ASSERT_TRUE(a.ok());
  auto stream = dev->CreateStream();
  ASSERT_TRUE(stream.ok());
  auto empty = (*stream)->RecordEvent();  // nothing before it
  ASSERT_TRUE(empty.ok());
  ASSERT_TRUE((*empty)->Wait(DeadlineAfter(std::chrono::seconds(10))).ok());
  EXPECT_EQ((*empty)->Poll().state, EventState::kComplete);

  const auto bytes = PatternBytes(4096, 11);
  const auto start = Clock::now();
  ASSERT_TRUE((*stream)->CopyHostToDevice((*a)->address(), bytes.data(), bytes.size()).ok());
  auto after_copy = (*stream)->RecordEvent();
  ASSERT_TRUE(after_copy.ok());
  // The copy takes at least 2 s: the event cannot have completed yet, and a short wait times
  // out.
  EXPECT_EQ((*after_copy)->Poll().state, EventState::kPending);
  const Status timed_out = (*after_copy)->Wait(DeadlineAfter(std::chrono::milliseconds(20)));
  EXPECT_EQ(timed_out.code(), StatusCode::kTimeout) << timed_out.ToString();
  // Waiting again with room succeeds, no earlier than the simulated latency.
  ASSERT_TRUE((*after_copy)->Wait(DeadlineAfter(std::chrono::seconds(30))).ok());
  EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(2000));
  EXPECT_EQ((*after_copy)->Poll().state, EventState::kComplete);
}

TEST(SimDeviceTest, BandwidthLimitSlowsCopies) {
  auto dev = MakeSim(SimOptions{.bytes_per_second = 64.0 * 1024 * 1024});
  auto a = dev->Allocate(16 << 20);
  ASSERT_TRUE(a.ok());
  auto stream = dev->CreateStream();
  ASSERT_TRUE(stream.ok());
  const auto bytes = PatternBytes(16 << 20, 3);
  const auto start = Clock::now();
  ASSERT_TRUE(Upload(**stream, (*a)->address(), bytes).ok());
  EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(250));  // 16 MiB at 64 MiB/s
}

TEST(SimDeviceTest, StreamDestructorFinishesQueuedCopies) {
  auto dev = MakeSim();
  auto a = dev->Allocate(1 << 20);
  ASSERT_TRUE(a.ok());
  const auto bytes = PatternBytes(1 << 20, 21);
  {
    auto stream = dev->CreateStream();
    ASSERT_TRUE(stream.ok());
    for (int i = 0; i < 16; ++i) {
      ASSERT_TRUE(
          (*stream)
              ->CopyHostToDevice((*a)->address() + i * 65536, bytes.data() + i * 65536, 65536)
              .ok());
    }
  }
  auto stream = dev->CreateStream();
  ASSERT_TRUE(stream.ok());
  auto back = Download(**stream, (*a)->address(), 1 << 20);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, bytes);
}

TEST(IpcHandleTest, EncodesAndRefusesMalformedInput) {
  IpcHandle h{"sim", 2, 8192, 100, {1, 2, 3}};
  const auto bytes = h.Encode();
  auto back = IpcHandle::Decode(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->kind, "sim");
  EXPECT_EQ(back->device_index, 2);
  EXPECT_EQ(back->alloc_size, 8192u);
  EXPECT_EQ(back->offset, 100u);
  EXPECT_EQ(back->opaque, h.opaque);
  for (std::size_t n = 0; n < bytes.size(); ++n) {  // every truncation
    EXPECT_FALSE(IpcHandle::Decode(std::span(bytes.data(), n)).ok()) << n;
  }
  auto longer = bytes;
  longer.push_back(0);
  EXPECT_FALSE(IpcHandle::Decode(longer).ok());
  IpcHandle outside = h;
  outside.offset = 8192;  // not inside the allocation
  EXPECT_EQ(IpcHandle::Decode(outside.Encode()).status().code(), StatusCode::kInvalidArgument);
}

TEST(SimIpcTest, SecondProcessReadsAndWritesTheExportedAllocation) {
  auto dev = MakeSim();
  constexpr std::uint64_t kSize = 3 * 65536 + 100;
  auto a = dev->Allocate(kSize);
  ASSERT_TRUE(a.ok());
  auto stream = dev->CreateStream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE(Upload(**stream, (*a)->address(), PatternBytes(kSize, 41)).ok());
  // Export an address inside the allocation: the handle carries the base and the offset.
  constexpr std::uint64_t kOffset = 65536 + 7;
  auto handle = dev->ExportIpc((*a)->address() + kOffset);
  ASSERT_TRUE(handle.ok()) << handle.status().ToString();
  EXPECT_EQ(handle->offset, kOffset);
  EXPECT_EQ(handle->alloc_size, kSize);

  auto peer = Subprocess::Spawn({testing::DeviceIpcPeerPath(), "import", "sim:0",
                                 testing::ToHex(handle->Encode()), "41", "42"});
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  auto line = peer->ReadLine(std::chrono::seconds(20));
  ASSERT_TRUE(line.ok()) << line.status().ToString();
  ASSERT_EQ(*line, "ok");
  auto code = peer->CloseAndWait(std::chrono::seconds(10));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);

  // The peer wrote the pattern of 42 from the offset on; the bytes before it are untouched.
  auto back = Download(**stream, (*a)->address(), kSize);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(FirstPatternMismatch(back->data(), kOffset, 41, 0, 0), -1);
  EXPECT_EQ(FirstPatternMismatch(back->data() + kOffset, kSize - kOffset, 42, 0, kOffset), -1);
}

TEST(SimIpcTest, ImportOfAFreedAllocationIsUnavailable) {
  auto dev = MakeSim();
  auto a = dev->Allocate(4096);
  ASSERT_TRUE(a.ok());
  auto handle = dev->ExportIpc((*a)->address());
  ASSERT_TRUE(handle.ok());
  // Same process, same device: importing a live handle works (the /proc path is our own).
  {
    auto imported = dev->ImportIpc(*handle);
    ASSERT_TRUE(imported.ok()) << imported.status().ToString();
    EXPECT_NE((*imported)->base(), (*a)->address());
  }
  a->reset();
  auto gone = dev->ImportIpc(*handle);
  EXPECT_EQ(gone.status().code(), StatusCode::kUnavailable) << gone.status().ToString();
  IpcHandle wrong_kind = *handle;
  wrong_kind.kind = "cuda";
  EXPECT_EQ(dev->ImportIpc(wrong_kind).status().code(), StatusCode::kInvalidArgument);
}

TEST(SimIpcTest, ExportOfHostMemoryIsRefused) {
  auto dev = MakeSim();
  std::vector<std::byte> host(64);
  EXPECT_EQ(dev->ExportIpc(reinterpret_cast<DeviceAddress>(host.data())).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvferry::device
