// Transparent huge pages for memory that shm readers read (shm.huge_pages). process_vm_readv pins
// every page it copies; over 4 KiB pages the kernel walks a page table entry per 4 KiB
// (follow_page_pte: a fifth of the samples of a 64 KiB shm read here), over a 2 MiB huge page one
// entry per 2 MiB, and shm reads about twice as fast (docs/performance.md, "shm and huge pages").
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "kvferry/status.h"

namespace kvferry {

/// What a serving shm backend does to a host region when it is registered.
enum class HugePages {
  kOff,       ///< nothing
  kAdvise,    ///< madvise(MADV_HUGEPAGE): pages faulted in later, and khugepaged, use huge pages
  kCollapse,  ///< also madvise(MADV_COLLAPSE): the pages already there become huge pages now
};

/// "off", "advise", "collapse"; InvalidArgument listing them otherwise.
Result<HugePages> ParseHugePages(const std::string& text);

/// Applies `how` to the 2 MiB-aligned part of [addr, addr + length) (the rest is left as it is;
/// nothing for a region smaller than 2 MiB). The memory's contents do not change. Unavailable
/// with the kernel's reason when it refuses (no THP in this kernel, MADV_COLLAPSE before Linux
/// 6.1, memory that cannot be collapsed, such as pinned or file-backed pages).
Status BackWithHugePages(void* addr, std::size_t length, HugePages how);

/// Calls `field` with each field line ("AnonHugePages:   2048 kB", "VmFlags: rd wr ...") of the
/// mappings in /proc/self/smaps that overlap [addr, addr + length); nothing when it cannot be read.
void ForEachSmapsField(const void* addr, std::size_t length,
                       const std::function<void(const std::string&)>& field);

/// Bytes of [addr, addr + length) that are backed by huge pages now (the AnonHugePages of the
/// mappings it overlaps, counted whole), from /proc/self/smaps; 0 when it cannot be read.
std::uint64_t HugePageBytes(const void* addr, std::size_t length);

}  // namespace kvferry
