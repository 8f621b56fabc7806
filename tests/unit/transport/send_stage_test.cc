// The tcp server's staging of device memory (src/transport/tcp/send_stage.h), driven as the server
// drives it: responses whose bodies mix host and sim-device entries, consumed in random amounts as
// partial sends would, every byte compared, the pinned memory bound checked at every step.
#include "transport/tcp/send_stage.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <vector>

#include "tests/unit/device/device_test_util.h"

namespace kvferry::tcp {
namespace {

using device::DeviceAddress;
using device::testing::Download;
using device::testing::PatternBytes;
using device::testing::Upload;

constexpr std::uint64_t kPool = std::uint64_t{24} << 20;

struct Fixture {
  std::unique_ptr<device::Device> dev;
  std::unique_ptr<device::DeviceAllocation> pool;
  std::vector<std::byte> device_bytes;  // what the pool holds
  std::vector<std::byte> host;          // host entries point in here
};

Fixture MakeFixture() {
  Fixture f;
  auto dev = device::OpenDevice("sim:0");
  EXPECT_TRUE(dev.ok()) << dev.status().ToString();
  f.dev = std::move(dev).value();
  auto pool = f.dev->Allocate(kPool);
  EXPECT_TRUE(pool.ok());
  f.pool = std::move(pool).value();
  f.device_bytes = PatternBytes(kPool, 11);
  auto stream = f.dev->CreateStream();
  EXPECT_TRUE(stream.ok());
  EXPECT_TRUE(Upload(**stream, f.pool->address(), f.device_bytes).ok());
  f.host = PatternBytes(std::uint64_t{4} << 20, 12);
  return f;
}

// A response as the server keeps it, plus the bytes its payload must be.
struct TestResponse {
  std::uint64_t serial;
  std::vector<iovec> body;
  std::vector<device::Device*> devices;
  std::vector<std::byte> expected;
  StagedBody view() const { return {serial, body, devices}; }
};

TestResponse RandomResponse(Fixture& f, std::uint64_t serial, std::mt19937_64& rng) {
  TestResponse r{serial, {}, {}, {}};
  const int entries = std::uniform_int_distribution<int>(1, 24)(rng);
  for (int e = 0; e < entries; ++e) {
    const bool on_device = std::uniform_int_distribution<int>(0, 3)(rng) != 0;
    // Mostly blocks of up to 128 KiB; one in eight up to 3 MiB, more than a buffer holds.
    const std::uint64_t max_len =
        std::uniform_int_distribution<int>(0, 7)(rng) == 0 ? 3u << 20 : 128u << 10;
    const std::uint64_t len = std::uniform_int_distribution<std::uint64_t>(1, max_len)(rng);
    if (on_device) {
      const std::uint64_t at = std::uniform_int_distribution<std::uint64_t>(0, kPool - len)(rng);
      // NOLINTNEXTLINE(performance-no-int-to-ptr): a device address carried as a pointer
      r.body.push_back({reinterpret_cast<void*>(f.pool->address() + at), len});
      r.devices.push_back(f.dev.get());
      r.expected.insert(r.expected.end(), f.device_bytes.begin() + static_cast<std::ptrdiff_t>(at),
                        f.device_bytes.begin() + static_cast<std::ptrdiff_t>(at + len));
    } else {
      const std::uint64_t hl = std::min<std::uint64_t>(len, f.host.size());
      const std::uint64_t at =
          std::uniform_int_distribution<std::uint64_t>(0, f.host.size() - hl)(rng);
      r.body.push_back({f.host.data() + at, hl});
      r.devices.push_back(nullptr);
      r.expected.insert(r.expected.end(), f.host.begin() + static_cast<std::ptrdiff_t>(at),
                        f.host.begin() + static_cast<std::ptrdiff_t>(at + hl));
    }
  }
  return r;
}

TEST(SendStageTest, SendsEveryByteOfMixedResponsesAndNeverHoldsMoreThanTwoBuffers) {
  Fixture f = MakeFixture();
  std::mt19937_64 rng(5);
  std::deque<TestResponse> out;
  for (std::uint64_t s = 1; s <= 16; ++s) out.push_back(RandomResponse(f, s, rng));
  SendStage stage;
  std::uint64_t device_chunks = 0;
  while (!out.empty()) {
    const TestResponse& r = out.front();
    std::vector<std::byte> sent;
    std::size_t entry = 0;
    std::uint64_t skip = 0;
    while (entry < r.body.size()) {
      std::span<const std::byte> avail;
      if (r.devices[entry] == nullptr) {
        avail = {static_cast<const std::byte*>(r.body[entry].iov_base) + skip,
                 r.body[entry].iov_len - skip};
      } else {
        const StagedBody next = out.size() > 1 ? out[1].view() : StagedBody{};
        auto bytes = stage.Bytes(r.view(), entry, skip, out.size() > 1 ? &next : nullptr);
        ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
        ASSERT_FALSE(bytes->empty());
        avail = *bytes;
        ++device_chunks;
      }
      ASSERT_LE(stage.pinned_bytes(), 2 * SendStage::kBytes);
      // A partial send: some of what is available, as a full socket would take.
      std::uint64_t n = avail.size();
      if (std::uniform_int_distribution<int>(0, 2)(rng) == 0) {
        n = std::uniform_int_distribution<std::uint64_t>(1, avail.size())(rng);
      }
      sent.insert(sent.end(), avail.begin(), avail.begin() + static_cast<std::ptrdiff_t>(n));
      // Advance through the entries the way the server's Flush does.
      while (n > 0) {
        const std::uint64_t rest = r.body[entry].iov_len - skip;
        if (n >= rest) {
          n -= rest;
          ++entry;
          skip = 0;
        } else {
          skip += n;
          n = 0;
        }
      }
    }
    ASSERT_EQ(sent.size(), r.expected.size()) << "response " << r.serial;
    ASSERT_TRUE(std::memcmp(sent.data(), r.expected.data(), sent.size()) == 0)
        << "response " << r.serial << " differs";
    out.pop_front();
  }
  EXPECT_GT(device_chunks, 16u);
  EXPECT_EQ(stage.pinned_bytes(), 2 * SendStage::kBytes);
}

TEST(SendStageTest, ACopyThatFailsIsAnErrorAndTheStageStartsAfresh) {
  Fixture f = MakeFixture();
  SendStage stage;
  // An address the device does not know (one past the pool): the copy is refused.
  TestResponse bad{1, {}, {f.dev.get()}, {}};
  // NOLINTNEXTLINE(performance-no-int-to-ptr): a device address carried as a pointer
  bad.body.push_back({reinterpret_cast<void*>(f.pool->address() + kPool + 4096), 4096});
  auto refused = stage.Bytes(bad.view(), 0, 0, nullptr);
  ASSERT_FALSE(refused.ok());

  TestResponse good{2, {}, {f.dev.get()}, {}};
  // NOLINTNEXTLINE(performance-no-int-to-ptr)
  good.body.push_back({reinterpret_cast<void*>(f.pool->address() + 8192), 65536});
  auto bytes = stage.Bytes(good.view(), 0, 0, nullptr);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  ASSERT_EQ(bytes->size(), 65536u);
  EXPECT_EQ(std::memcmp(bytes->data(), f.device_bytes.data() + 8192, 65536), 0);
}

TEST(SendStageTest, APrefetchThatFailsLeavesTheBytesInHandValid) {
  Fixture f = MakeFixture();
  SendStage stage;
  TestResponse r{1, {}, {f.dev.get(), f.dev.get()}, {}};
  // NOLINTNEXTLINE(performance-no-int-to-ptr)
  r.body.push_back({reinterpret_cast<void*>(f.pool->address()), SendStage::kBytes});
  // The second entry cannot be copied: the prefetch of it fails after the first is staged.
  // NOLINTNEXTLINE(performance-no-int-to-ptr)
  r.body.push_back({reinterpret_cast<void*>(f.pool->address() + kPool + 4096), 4096});
  auto first = stage.Bytes(r.view(), 0, 0, nullptr);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_EQ(first->size(), SendStage::kBytes);
  EXPECT_EQ(std::memcmp(first->data(), f.device_bytes.data(), SendStage::kBytes), 0);
  EXPECT_FALSE(stage.Bytes(r.view(), 1, 0, nullptr).ok());
}

}  // namespace
}  // namespace kvferry::tcp
