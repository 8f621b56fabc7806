#include "transport/shm/huge_pages.h"

#include <sys/mman.h>

#include <cerrno>
#include <fstream>
#include <sstream>

#include "common/errno_text.h"

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1; older headers lack it, older kernels say EINVAL
#endif

namespace kvferry {
namespace {

constexpr std::uintptr_t kHugePage = 2u << 20;

}  // namespace

Result<HugePages> ParseHugePages(const std::string& text) {
  if (text == "off") return HugePages::kOff;
  if (text == "advise") return HugePages::kAdvise;
  if (text == "collapse") return HugePages::kCollapse;
  return Status::InvalidArgument("'" + text +
                                 "' is not a huge-pages mode; expected off, advise "
                                 "or collapse");
}

Status BackWithHugePages(void* addr, std::size_t length, HugePages how) {
  if (how == HugePages::kOff) return Status::Ok();
  const auto begin = reinterpret_cast<std::uintptr_t>(addr);
  const std::uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
  const std::uintptr_t last = (begin + length) & ~(kHugePage - 1);
  if (last <= first) return Status::Ok();
  auto* p = reinterpret_cast<void*>(first);
  const std::size_t n = last - first;
  if (madvise(p, n, MADV_HUGEPAGE) != 0) {
    return Status::Unavailable("madvise(MADV_HUGEPAGE) of " + std::to_string(n) +
                               " bytes failed: " + ErrnoText(errno) +
                               " (a kernel without transparent huge pages, or memory that is not "
                               "anonymous)");
  }
  if (how == HugePages::kCollapse && madvise(p, n, MADV_COLLAPSE) != 0) {
    return Status::Unavailable(
        "madvise(MADV_COLLAPSE) of " + std::to_string(n) + " bytes failed: " + ErrnoText(errno) +
        " (Linux before 6.1 has no MADV_COLLAPSE; pinned or file-backed pages and a short memory "
        "refuse it); the region stays advised, so khugepaged may still collapse it over time");
  }
  return Status::Ok();
}

void ForEachSmapsField(const void* addr, std::size_t length,
                       const std::function<void(const std::string&)>& field) {
  std::ifstream smaps("/proc/self/smaps");
  const auto begin = reinterpret_cast<std::uintptr_t>(addr);
  const std::uintptr_t end = begin + length;
  bool inside = false;
  std::string line;
  while (std::getline(smaps, line)) {
    std::uintptr_t lo = 0;
    std::uintptr_t hi = 0;
    char dash = 0;
    std::istringstream head(line);
    // A mapping's first line: "lo-hi perms ...", both hexadecimal.
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      if (lo >= end) break;  // mappings are listed by address: none further overlaps
      inside = hi > begin;
    } else if (inside) {
      field(line);
    }
  }
}

std::uint64_t HugePageBytes(const void* addr, std::size_t length) {
  std::uint64_t total = 0;
  ForEachSmapsField(addr, length, [&](const std::string& line) {
    if (line.rfind("AnonHugePages:", 0) != 0) return;
    std::istringstream value(line.substr(14));
    std::uint64_t kib = 0;
    value >> kib;
    total += kib << 10;
  });
  return total;
}

}  // namespace kvferry
