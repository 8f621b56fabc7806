// HostMemory and the shm backend's mapping of it (include/kvferry/host_memory.h,
// src/transport/shm/served_memory.h; issue 30 item 6). The reader here is this very process,
// through a pidfd on itself: MapServedRegion's checks do not depend on who reads.
#include "transport/shm/served_memory.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "kvferry/host_memory.h"
#include "transport/shm/shm_section.h"

namespace kvferry {
namespace {

using ::testing::HasSubstr;

struct SelfPidfd {
  SelfPidfd() : fd(static_cast<int>(syscall(SYS_pidfd_open, getpid(), 0))) {}
  ~SelfPidfd() {
    if (fd >= 0) close(fd);
  }
  int fd;
};

std::uint64_t Addr(const std::byte* p) { return reinterpret_cast<std::uint64_t>(p); }

TEST(HostMemoryTest, IsZeroedPageAlignedAndFoundWhileItLives) {
  EXPECT_EQ(HostMemory::Allocate(0).status().code(), StatusCode::kInvalidArgument);
  const std::byte* start = nullptr;
  {
    Result<HostMemory> m = HostMemory::Allocate(3 * 4096 + 100);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    start = m->data();
    EXPECT_EQ(m->size(), 3u * 4096 + 100);
    EXPECT_EQ(Addr(m->data()) % 4096, 0u);
    for (std::size_t i = 0; i < m->size(); ++i) ASSERT_EQ(m->data()[i], std::byte{0}) << i;
    std::optional<ServedSpan> whole = FindServedMemory(m->data(), m->size());
    ASSERT_TRUE(whole.has_value());
    EXPECT_EQ(whole->offset, 0u);
    EXPECT_GE(whole->fd, 0);
    std::optional<ServedSpan> inner = FindServedMemory(m->data() + 5000, 100);
    ASSERT_TRUE(inner.has_value());
    EXPECT_EQ(inner->offset, 5000u);
    // Past its pages, and memory it does not hold: not served.
    EXPECT_FALSE(FindServedMemory(m->data() + 4096, 4 * 4096).has_value());
    std::byte other[16];
    EXPECT_FALSE(FindServedMemory(other, sizeof(other)).has_value());
    // Moved, it is still the same memory.
    HostMemory moved = std::move(*m);
    EXPECT_EQ(moved.data(), start);
    EXPECT_TRUE(FindServedMemory(start, 4096).has_value());
  }
  EXPECT_FALSE(FindServedMemory(start, 4096).has_value()) << "found after it was freed";
}

TEST(MapServedRegionTest, MapsTheRegionReadOnlyAndSeesItsOwnersWrites) {
  Result<HostMemory> m = HostMemory::Allocate(64u << 10);
  ASSERT_TRUE(m.ok());
  SelfPidfd self;
  ASSERT_GE(self.fd, 0);
  const std::uint64_t offset = 12288 + 10;  // not page-aligned: the mapping starts a page below
  const std::uint64_t length = 20000;
  std::optional<ServedSpan> span = FindServedMemory(m->data() + offset, length);
  ASSERT_TRUE(span.has_value());
  Result<std::unique_ptr<MappedRegion>> mapped =
      MapServedRegion(self.fd, getpid(), span->fd, span->offset, Addr(m->data() + offset), length);
  ASSERT_TRUE(mapped.ok()) << mapped.status().ToString();
  ASSERT_NE((*mapped)->data(), m->data() + offset) << "expected a mapping of its own";
  std::memset(m->data() + offset, 0x5a, length);
  EXPECT_EQ((*mapped)->data()[0], std::byte{0x5a});
  EXPECT_EQ((*mapped)->data()[length - 1], std::byte{0x5a});
  // The descriptor a reader gets is read-only: the kernel refuses a writable shared mapping.
  const int taken = static_cast<int>(syscall(SYS_pidfd_getfd, self.fd, span->fd, 0));
  ASSERT_GE(taken, 0);
  EXPECT_EQ(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, taken, 0), MAP_FAILED);
  EXPECT_EQ(errno, EACCES);
  close(taken);
}

TEST(MapServedRegionTest, ADescriptorOrOffsetThatIsNotTheRegionsIsNeverMapped) {
  Result<HostMemory> m = HostMemory::Allocate(64u << 10);
  Result<HostMemory> other = HostMemory::Allocate(64u << 10);
  ASSERT_TRUE(m.ok() && other.ok());
  SelfPidfd self;
  const std::optional<ServedSpan> span = FindServedMemory(m->data(), 4096);
  const std::optional<ServedSpan> other_span = FindServedMemory(other->data(), 4096);
  ASSERT_TRUE(span && other_span);
  const std::uint64_t at = Addr(m->data());
  // Another memfd, another offset, a range past the mapping, a file that is not a sealed memfd,
  // a descriptor that does not exist, anonymous memory claimed as a memfd.
  Result<std::unique_ptr<MappedRegion>> r =
      MapServedRegion(self.fd, getpid(), other_span->fd, 0, at, 4096);
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("another file or offset"));
  r = MapServedRegion(self.fd, getpid(), span->fd, 4096, at, 4096);
  EXPECT_THAT(r.status().message(), HasSubstr("another file or offset"));
  r = MapServedRegion(self.fd, getpid(), span->fd, 0, at, 128u << 10);
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  const int unsealed = memfd_create("not-kvferry", MFD_CLOEXEC);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(ftruncate(unsealed, 65536), 0);
  r = MapServedRegion(self.fd, getpid(), unsealed, 0, at, 4096);
  EXPECT_THAT(r.status().message(), HasSubstr("not a memfd sealed against shrinking"));
  close(unsealed);
  r = MapServedRegion(self.fd, getpid(), 1 << 20, 0, at, 4096);
  EXPECT_THAT(r.status().message(), HasSubstr("pidfd_getfd failed"));
  std::vector<std::byte> anonymous(8192);
  r = MapServedRegion(self.fd, getpid(), span->fd, 0, Addr(anonymous.data()), 4096);
  EXPECT_THAT(r.status().message(), HasSubstr("another file or offset"));
}

TEST(ShmSectionServedTest, RoundTripsAndRefusesMalformedEntries) {
  ShmSection s;
  s.host = {"boot", 7, 42};
  s.proof = {1, 8, 9};
  s.served = {{0, 5, 0}, {3, 5, 8u << 20}, {4, 2147483647, ~std::uint64_t{0}}};
  Result<ShmSection> back = DecodeShmSection(EncodeShmSection(s));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, s);
  s.served = {{3, 5, 0}, {3, 6, 0}};
  back = DecodeShmSection(EncodeShmSection(s));
  EXPECT_EQ(back.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(back.status().message(), HasSubstr("listed twice"));
  // A negative descriptor and an entry of the wrong shape.
  for (const int shape : {0, 1}) {
    msgpack::sbuffer buffer;
    msgpack::packer<msgpack::sbuffer> pk(buffer);
    pk.pack_map(8);
    pk.pack(std::string("v"));
    pk.pack_uint32(kShmSectionVersion);
    PackProcessFields(pk, s.host, 1);
    pk.pack(std::string("nonce_at"));
    pk.pack_uint64(8);
    pk.pack(std::string("nonce"));
    pk.pack_uint64(9);
    pk.pack(std::string("memfd"));
    pk.pack_array(1);
    if (shape == 0) {
      pk.pack_array(3);
      pk.pack_uint32(1);
      pk.pack_int32(-1);
      pk.pack_uint64(0);
    } else {
      pk.pack_array(2);
      pk.pack_uint32(1);
      pk.pack_uint32(5);
    }
    const auto* p = reinterpret_cast<const std::uint8_t*>(buffer.data());
    back = DecodeShmSection(std::vector<std::uint8_t>(p, p + buffer.size()));
    EXPECT_EQ(back.status().code(), StatusCode::kInvalidArgument) << shape;
    EXPECT_THAT(back.status().message(), HasSubstr("descriptor (0 to 2^31-1)")) << shape;
  }
}

}  // namespace
}  // namespace kvferry
