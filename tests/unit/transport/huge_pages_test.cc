// shm.huge_pages (src/transport/shm/huge_pages.h): what each mode does to a region's pages, and a
// serving transport applying it to the host regions it registers. Skips, saying so, only on a
// kernel without transparent huge pages or (collapse) before Linux 6.1; this project's machines
// have both, THP in madvise mode.
#include "transport/shm/huge_pages.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include "kvferry/transport.h"
#include "transport/shm/shm_options.h"

namespace kvferry {
namespace {

using ::testing::HasSubstr;

constexpr std::size_t kBytes = 16u << 20;

bool KernelHasThp() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode;
  std::getline(f, mode);
  return !mode.empty() && mode.find("[never]") == std::string::npos;
}

// The VmFlags of the mapping that holds `addr`.
std::string VmFlags(const void* addr) {
  std::string flags;
  ForEachSmapsField(addr, 1, [&](const std::string& line) {
    if (line.rfind("VmFlags:", 0) == 0) flags = line;
  });
  return flags;
}

// Whether madvise(MADV_COLLAPSE) exists here (Linux 6.1+): EINVAL on 2 MiB of fresh memory says no.
bool KernelHasCollapse() {
  void* p = mmap(nullptr, 4u << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return false;
  auto* aligned = reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(p) + (2u << 20) - 1) &
                                          ~std::uintptr_t{(2u << 20) - 1});
  std::memset(aligned, 1, 2u << 20);
  const bool ok = madvise(aligned, 2u << 20, 25 /* MADV_COLLAPSE */) == 0 || errno != EINVAL;
  munmap(p, 4u << 20);
  return ok;
}

// 16 MiB of anonymous memory faulted in as 4 KiB pages, with a pattern.
class Pages {
 public:
  Pages() {
    void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<unsigned char*>(p);
    if (data_ == nullptr) return;
    // MAP_POPULATE faulted them in as 4 KiB pages (THP in madvise mode); NOHUGEPAGE keeps them so
    // under THP "always" too, until BackWithHugePages advises the range.
    (void)madvise(data_, kBytes, MADV_NOHUGEPAGE);
    for (std::size_t i = 0; i < kBytes; ++i) data_[i] = static_cast<unsigned char>(i * 7 + 3);
  }
  ~Pages() {
    if (data_ != nullptr) munmap(data_, kBytes);
  }
  Pages(const Pages&) = delete;
  Pages& operator=(const Pages&) = delete;
  unsigned char* data() const { return data_; }
  bool Intact() const {
    for (std::size_t i = 0; i < kBytes; ++i) {
      if (data_[i] != static_cast<unsigned char>(i * 7 + 3)) return false;
    }
    return true;
  }

 private:
  unsigned char* data_ = nullptr;
};

TEST(HugePagesTest, ModesParseAndOthersAreRefused) {
  EXPECT_EQ(*ParseHugePages("off"), HugePages::kOff);
  EXPECT_EQ(*ParseHugePages("advise"), HugePages::kAdvise);
  EXPECT_EQ(*ParseHugePages("collapse"), HugePages::kCollapse);
  EXPECT_THAT(ParseHugePages("always").status().message(), HasSubstr("off, advise or collapse"));
  TransportOptions o;
  EXPECT_EQ(ParseShmOptions(o, {})->huge_pages, HugePages::kOff);
  EXPECT_EQ(ParseShmOptions(o, {{"huge_pages", "collapse"}})->huge_pages, HugePages::kCollapse);
  o.backend_options = {{"shm.huge_pages", "sometimes"}};
  const Status bad = CheckTransportOptions(o);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("shm.huge_pages"));
}

TEST(HugePagesTest, EachModeDoesWhatItSaysAndKeepsTheBytes) {
  if (!KernelHasThp()) GTEST_SKIP() << "SKIPPED LOUDLY: this kernel has no transparent huge pages";
  for (HugePages how : {HugePages::kOff, HugePages::kAdvise, HugePages::kCollapse}) {
    if (how == HugePages::kCollapse && !KernelHasCollapse()) {
      GTEST_SKIP() << "SKIPPED LOUDLY: this kernel has no MADV_COLLAPSE (Linux 6.1+)";
    }
    Pages pages;
    ASSERT_NE(pages.data(), nullptr);
    ASSERT_EQ(HugePageBytes(pages.data(), kBytes), 0u) << "the test's pages are already huge";
    // An unaligned start and end: only the aligned 2 MiB pages inside are touched.
    const Status s = BackWithHugePages(pages.data() + 4096, kBytes - 8192, how);
    ASSERT_TRUE(s.ok()) << s.ToString();
    const std::string flags = VmFlags(pages.data() + (4u << 20));
    const std::uint64_t huge = HugePageBytes(pages.data(), kBytes);
    switch (how) {
      case HugePages::kOff:
        EXPECT_EQ(huge, 0u);
        EXPECT_THAT(flags, ::testing::Not(HasSubstr(" hg")));
        break;
      case HugePages::kAdvise:
        EXPECT_THAT(flags, HasSubstr(" hg")) << "MADV_HUGEPAGE was not applied";
        break;
      case HugePages::kCollapse:
        // 7 of the 8 2 MiB pages lie inside the unaligned range; all but the first and last
        // partial ones are collapsed.
        EXPECT_GE(huge, 6u * (2u << 20)) << "MADV_COLLAPSE left the pages small";
        EXPECT_LE(huge, kBytes - (2u << 20));
        break;
    }
    EXPECT_TRUE(pages.Intact()) << "the bytes changed";
  }
}

// A serving transport gives its host regions the mode; a transport that only reads does not.
TEST(HugePagesTest, AServingTransportCollapsesTheRegionsItRegisters) {
  if (!KernelHasThp() || !KernelHasCollapse()) {
    GTEST_SKIP() << "SKIPPED LOUDLY: this kernel has no transparent huge pages or no "
                    "MADV_COLLAPSE (Linux 6.1+)";
  }
  for (bool serve : {true, false}) {
    TransportOptions o;
    o.backend = "shm";
    o.serve = serve;
    o.backend_options = {{"shm.huge_pages", "collapse"}};
    Result<std::unique_ptr<Transport>> t = CreateTransport(o);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    Pages pages;
    ASSERT_NE(pages.data(), nullptr);
    ASSERT_TRUE((*t)->RegisterMemory(1, pages.data(), kBytes).ok());
    const std::uint64_t huge = HugePageBytes(pages.data(), kBytes);
    if (serve) {
      EXPECT_GE(huge, 6u * (2u << 20)) << "a serving transport left its region in small pages";
    } else {
      EXPECT_EQ(huge, 0u) << "a reading transport changed its local memory's pages";
    }
    EXPECT_TRUE(pages.Intact());
    ASSERT_TRUE((*t)->DeregisterMemory(1).ok());
  }
}

}  // namespace
}  // namespace kvferry
