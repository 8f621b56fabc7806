// The memory HostMemory allocates (include/kvferry/host_memory.h), as the shm backend sees it: a
// serving process publishes, for each host region inside such memory, which of its descriptors
// names the memfd and where in it the region starts; a same-host reader takes that descriptor
// with pidfd_getfd, checks it against the serving process's own mappings and maps it read-only
// (MapServedRegion). docs/transport.md, "shm", "Memory kvferry allocates".
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "kvferry/status.h"

namespace kvferry {

/// A range of HostMemory: the read-only descriptor of its memfd in this process and the offset
/// of the range's first byte in the memfd.
struct ServedSpan {
  int fd = -1;
  std::uint64_t offset = 0;
};

/// Where [addr, addr + length) lies wholly inside one HostMemory of this process that is alive;
/// nothing otherwise.
std::optional<ServedSpan> FindServedMemory(const std::byte* addr, std::uint64_t length);

/// A peer's region mapped read-only into this process; unmapped when destroyed.
class MappedRegion {
 public:
  MappedRegion(void* map, std::size_t map_length, const std::byte* first)
      : map_(map), map_length_(map_length), first_(first) {}
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;
  ~MappedRegion();
  /// The region's first byte.
  const std::byte* data() const { return first_; }

 private:
  void* map_;
  std::size_t map_length_;
  const std::byte* first_;
};

/// Maps the peer's region [addr, addr + length) (in the peer's address space), which its section
/// says is at `offset` of the memfd its descriptor `fd` names. `pidfd` holds the proven peer
/// process `pid`. Everything is checked before anything is mapped: the descriptor taken with
/// pidfd_getfd must be a memfd sealed against shrinking (so a read never faults on a truncated
/// file), open read-only, and the peer's /proc/PID/maps must map the whole range from that very
/// file (device and inode) at that offset. Mapped PROT_READ and MAP_SHARED: the reader sees the
/// peer's writes and cannot write. Unavailable, saying why, otherwise: the caller then reads the
/// region with process_vm_readv, as any memory.
Result<std::unique_ptr<MappedRegion>> MapServedRegion(int pidfd, pid_t pid, int fd,
                                                      std::uint64_t offset, std::uint64_t addr,
                                                      std::uint64_t length);

}  // namespace kvferry
