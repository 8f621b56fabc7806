// kvferry: host memory for caches that same-host peers read (docs/transport.md, "shm", "Memory
// kvferry allocates").
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kvferry/status.h"

namespace kvferry {

/// Zeroed, page-aligned host memory backed by a sealed memfd (its size can never change), for a
/// cache that peers read. Register it as any host memory. A same-host shm reader then maps it
/// read-only once (through a read-only descriptor of the memfd, so the kernel refuses it any
/// writable mapping) and copies with memcpy; memory kvferry did not allocate is read with
/// process_vm_readv, which walks this process's page table at every read (4 KiB at a time over
/// ordinary pages). Over tcp and ucx it is ordinary memory.
///
/// A reader keeps the pages it mapped until it drops the peer, even after this object is gone, so
/// the memory is returned to the system once this process and every reader have let it go.
/// Move-only; unmapped when destroyed. Thread-safe to read and write as ordinary memory.
class HostMemory {
 public:
  /// `bytes` (> 0; rounded up to whole pages) of memory. `huge_pages` advises transparent huge
  /// pages (effective only where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows them).
  /// InvalidArgument for 0 bytes; ResourceExhausted when memfd_create, ftruncate or mmap fails,
  /// naming the error.
  static Result<HostMemory> Allocate(std::size_t bytes, bool huge_pages = false);

  HostMemory();
  HostMemory(HostMemory&&) noexcept;
  HostMemory& operator=(HostMemory&&) noexcept;
  ~HostMemory();

  std::byte* data() const;
  /// As asked, not rounded.
  std::size_t size() const;

  struct Mapping;  // the mapping and its memfd, registered while it lives (src/transport/shm)

 private:
  explicit HostMemory(std::unique_ptr<Mapping> m);
  std::unique_ptr<Mapping> mapping_;
};

}  // namespace kvferry
