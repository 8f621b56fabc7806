#include "transport/shm/served_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "common/errno_text.h"
#include "common/mutex.h"
#include "kvferry/host_memory.h"

namespace kvferry {

struct HostMemory::Mapping {
  std::byte* data = nullptr;
  std::size_t size = 0;        // as asked
  std::size_t map_length = 0;  // whole pages
  int read_only_fd = -1;       // what readers take; -1 when it could not be opened
  ~Mapping();
};

namespace {

std::size_t PageSize() { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }

// The live HostMemory of this process, by first byte.
struct Registry {
  Mutex mu;
  std::map<const std::byte*, const HostMemory::Mapping*> by_start GUARDED_BY(mu);
};

Registry& Served() {
  static Registry* r = new Registry();  // never destroyed: HostMemory may outlive statics
  return *r;
}

Status NotMapped(pid_t pid, std::uint64_t addr, const std::string& why) {
  return Status::Unavailable("the peer's served memory at " + std::to_string(addr) +
                             " in process " + std::to_string(pid) + " is not mapped: " + why +
                             "; it is read with process_vm_readv instead");
}

// One line of /proc/PID/maps.
struct MapsLine {
  std::uint64_t start = 0;
  std::uint64_t end = 0;
  std::uint64_t file_offset = 0;
  unsigned dev_major = 0;
  unsigned dev_minor = 0;
  std::uint64_t inode = 0;
};

bool ParseMapsLine(const std::string& line, MapsLine* out) {
  std::istringstream in(line);
  std::string perms;
  char dash = 0;
  char colon = 0;
  in >> std::hex >> out->start >> dash >> out->end >> perms >> out->file_offset >> out->dev_major >>
      colon >> out->dev_minor >> std::dec >> out->inode;
  return !in.fail() && dash == '-' && colon == ':';
}

}  // namespace

HostMemory::Mapping::~Mapping() {
  {
    MutexLock lock(Served().mu);
    Served().by_start.erase(data);
  }
  if (data != nullptr) munmap(data, map_length);
  if (read_only_fd >= 0) close(read_only_fd);
}

Result<HostMemory> HostMemory::Allocate(std::size_t bytes, bool huge_pages) {
  if (bytes == 0) return Status::InvalidArgument("HostMemory::Allocate: expected > 0 bytes, got 0");
  const std::size_t page = PageSize();
  if (bytes > SIZE_MAX - page) {
    return Status::InvalidArgument("HostMemory::Allocate: " + std::to_string(bytes) +
                                   " bytes is more than an address space holds");
  }
  auto m = std::make_unique<Mapping>();
  m->size = bytes;
  m->map_length = (bytes + page - 1) / page * page;
  const int fd = memfd_create("kvferry-served", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return Status::ResourceExhausted("memfd_create failed: " + ErrnoText(errno) +
                                     "; cannot allocate " + std::to_string(bytes) + " bytes");
  }
  auto fail = [&](const char* what) {
    const int err = errno;
    close(fd);
    return Status::ResourceExhausted(std::string(what) + " of a " + std::to_string(bytes) +
                                     "-byte memfd failed: " + ErrnoText(err));
  };
  if (ftruncate(fd, static_cast<off_t>(m->map_length)) != 0) return fail("ftruncate");
  // Sealed against shrinking, so a reader's mapping can never fault on a truncated file.
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return fail("sealing");
  }
  void* p = mmap(nullptr, m->map_length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return fail("mmap");
  m->data = static_cast<std::byte*>(p);
  // Best effort: shmem takes huge pages only where shmem_enabled allows them.
  if (huge_pages) (void)madvise(p, m->map_length, MADV_HUGEPAGE);
  // The descriptor readers take: read-only, so no reader can map it writable. Without /proc the
  // memory is still usable; readers then use process_vm_readv.
  const std::string self = "/proc/self/fd/" + std::to_string(fd);
  m->read_only_fd = open(self.c_str(), O_RDONLY | O_CLOEXEC);
  close(fd);
  if (m->read_only_fd >= 0) {
    MutexLock lock(Served().mu);
    Served().by_start[m->data] = m.get();
  }
  return HostMemory(std::move(m));
}

HostMemory::HostMemory(std::unique_ptr<Mapping> m) : mapping_(std::move(m)) {}
HostMemory::HostMemory() = default;
HostMemory::HostMemory(HostMemory&&) noexcept = default;
HostMemory& HostMemory::operator=(HostMemory&&) noexcept = default;
HostMemory::~HostMemory() = default;
std::byte* HostMemory::data() const { return mapping_ ? mapping_->data : nullptr; }
std::size_t HostMemory::size() const { return mapping_ ? mapping_->size : 0; }

std::optional<ServedSpan> FindServedMemory(const std::byte* addr, std::uint64_t length) {
  MutexLock lock(Served().mu);
  auto& by_start = Served().by_start;
  auto it = by_start.upper_bound(addr);
  if (it == by_start.begin()) return std::nullopt;
  const HostMemory::Mapping& m = *std::prev(it)->second;
  const auto offset = static_cast<std::uint64_t>(addr - m.data);
  if (offset > m.map_length || length > m.map_length - offset) return std::nullopt;
  return ServedSpan{m.read_only_fd, offset};
}

MappedRegion::~MappedRegion() { munmap(map_, map_length_); }

Result<std::unique_ptr<MappedRegion>> MapServedRegion(int pidfd, pid_t pid, int fd,
                                                      std::uint64_t offset, std::uint64_t addr,
                                                      std::uint64_t length) {
  if (length == 0) return NotMapped(pid, addr, "the region is empty");
  const int local = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, fd, 0));
  if (local < 0) return NotMapped(pid, addr, "pidfd_getfd failed: " + ErrnoText(errno));
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{local};
  struct stat st {};
  if (fstat(local, &st) != 0 || !S_ISREG(st.st_mode)) {
    return NotMapped(pid, addr, "its descriptor " + std::to_string(fd) + " is not a file");
  }
  const int seals = fcntl(local, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return NotMapped(
        pid, addr,
        "its descriptor " + std::to_string(fd) + " is not a memfd sealed against shrinking");
  }
  if ((fcntl(local, F_GETFL) & O_ACCMODE) != O_RDONLY) {
    return NotMapped(pid, addr, "its descriptor " + std::to_string(fd) + " is not read-only");
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (offset > size || length > size - offset || addr > UINT64_MAX - length) {
    return NotMapped(pid, addr,
                     "the memfd holds " + std::to_string(size) +
                         " bytes, fewer than the region's " + std::to_string(length) +
                         " at offset " + std::to_string(offset));
  }
  // The peer's own mappings must map [addr, addr + length) from this very file at `offset`, so a
  // wrong descriptor or offset is never read as the region.
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  if (!maps) return NotMapped(pid, addr, "its /proc/PID/maps cannot be read");
  std::uint64_t covered = addr;  // the range is checked up to here
  std::string line;
  while (covered < addr + length && std::getline(maps, line)) {
    MapsLine l;
    if (!ParseMapsLine(line, &l) || l.end <= covered) continue;
    const bool same_file = l.start <= covered && l.inode == st.st_ino &&
                           l.dev_major == major(st.st_dev) && l.dev_minor == minor(st.st_dev) &&
                           l.file_offset + (covered - l.start) == offset + (covered - addr);
    if (!same_file) {
      return NotMapped(pid, addr,
                       "the process maps it from another file or offset than its section says");
    }
    covered = l.end;
  }
  if (covered < addr + length) {
    return NotMapped(pid, addr, "the process does not map all of it");
  }
  const std::uint64_t page = PageSize();
  const std::uint64_t first = offset / page * page;
  const std::uint64_t map_length = offset + length - first;
  void* p = mmap(nullptr, map_length, PROT_READ, MAP_SHARED, local, static_cast<off_t>(first));
  if (p == MAP_FAILED) return NotMapped(pid, addr, "mmap failed: " + ErrnoText(errno));
  return std::make_unique<MappedRegion>(p, map_length,
                                        static_cast<const std::byte*>(p) + (offset - first));
}

}  // namespace kvferry
