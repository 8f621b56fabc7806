#include "device/sim/sim_device.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/errno_text.h"
#include "common/hex.h"
#include "device/sim/sim_table.h"

namespace kvferry::device {
namespace {

std::uint64_t PageRound(std::uint64_t size) {
  const auto page = static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
  return (size + page - 1) / page * page;
}

// What the sim puts in IpcHandle::opaque (native byte order, same host only).
struct SimIpcBytes {
  std::int32_t pid;
  std::int32_t fd;
  std::uint64_t st_dev;
  std::uint64_t st_ino;
};

class SimAllocation final : public DeviceAllocation, public ImportedMemory {
 public:
  SimAllocation(std::shared_ptr<SimTable> table, DeviceAddress base, std::uint64_t size)
      : table_(std::move(table)), base_(base), size_(size) {}
  ~SimAllocation() override { table_->Erase(base_); }
  DeviceAddress address() const override { return base_; }
  DeviceAddress base() const override { return base_; }
  std::uint64_t size() const override { return size_; }

 private:
  std::shared_ptr<SimTable> table_;
  DeviceAddress base_;
  std::uint64_t size_;
};

class SimPinned final : public PinnedBuffer {
 public:
  SimPinned(std::shared_ptr<SimTable> table, std::byte* data, std::uint64_t size,
            std::uint64_t mapped)
      : table_(std::move(table)), data_(data), size_(size), mapped_(mapped) {
    table_->PinnedAdded(size_);
  }
  ~SimPinned() override {
    munmap(data_, mapped_);
    table_->PinnedFreed(size_);
  }
  std::byte* data() const override { return data_; }
  std::uint64_t size() const override { return size_; }

 private:
  std::shared_ptr<SimTable> table_;
  std::byte* data_;
  std::uint64_t size_;
  std::uint64_t mapped_;
};

}  // namespace

SimMapping::~SimMapping() {
  if (backing != nullptr) munmap(backing, mapped_size);
  // A sim device address is the reservation's host address by design (device.h).
  if (base != 0)
    munmap(reinterpret_cast<void*>(base), mapped_size);  // NOLINT(performance-no-int-to-ptr)
  if (fd >= 0) close(fd);
}

Result<std::shared_ptr<SimMapping>> MapSimMemory(int fd, std::uint64_t size) {
  auto m = std::make_shared<SimMapping>();
  m->fd = fd;
  m->size = size;
  m->mapped_size = PageRound(size);
  void* reserve =
      mmap(nullptr, m->mapped_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserve == MAP_FAILED) {
    return Status::ResourceExhausted("sim device: reserving " + std::to_string(size) +
                                     " bytes of address space failed: " + ErrnoText(errno));
  }
  m->base = reinterpret_cast<DeviceAddress>(reserve);
  // Populated: device memory is resident, as a GPU's is; a page fault inside a timed copy would
  // charge the sim's copies for the host's paging, not for moving bytes.
  void* backing =
      mmap(nullptr, m->mapped_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (backing == MAP_FAILED) {
    return Status::ResourceExhausted("sim device: mapping a memfd of " + std::to_string(size) +
                                     " bytes failed: " + ErrnoText(errno));
  }
  m->backing = static_cast<std::byte*>(backing);
  return m;
}

void SimTable::Insert(std::shared_ptr<SimMapping> mapping) {
  MutexLock lock(mu_);
  by_base_[mapping->base] = std::move(mapping);
}

void SimTable::Erase(DeviceAddress base) {
  std::shared_ptr<SimMapping> last;  // unmapped outside the lock
  MutexLock lock(mu_);
  auto it = by_base_.find(base);
  if (it == by_base_.end()) return;
  last = std::move(it->second);
  by_base_.erase(it);
}

void SimTable::PinnedAdded(std::uint64_t bytes) {
  MutexLock lock(mu_);
  pinned_ += bytes;
  pinned_peak_ = std::max(pinned_peak_, pinned_);
}

void SimTable::PinnedFreed(std::uint64_t bytes) {
  MutexLock lock(mu_);
  pinned_ -= bytes;
}

std::uint64_t SimTable::pinned_bytes() const {
  MutexLock lock(mu_);
  return pinned_;
}

std::uint64_t SimTable::pinned_peak_bytes() const {
  MutexLock lock(mu_);
  return pinned_peak_;
}

void SimTable::ResetPinnedPeak() {
  MutexLock lock(mu_);
  pinned_peak_ = pinned_;
}

void SimTable::AddStream(std::uint64_t handle, Stream* stream) {
  MutexLock lock(mu_);
  streams_[handle] = stream;
}

void SimTable::RemoveStream(std::uint64_t handle) {
  MutexLock lock(mu_);
  streams_.erase(handle);
}

Result<std::unique_ptr<Event>> SimTable::RecordOn(std::uint64_t handle) {
  MutexLock lock(mu_);
  auto it = streams_.find(handle);
  if (it == streams_.end()) {
    return Status::InvalidArgument(device_name_ + ": no live stream has native handle " +
                                   std::to_string(handle) +
                                   "; expected the native_handle() of one of its streams");
  }
  return it->second->RecordEvent();
}

std::shared_ptr<SimMapping> SimTable::Find(DeviceAddress address) const {
  MutexLock lock(mu_);
  auto it = by_base_.upper_bound(address);
  if (it == by_base_.begin()) return nullptr;
  --it;
  if (address - it->first >= it->second->size) return nullptr;
  return it->second;
}

Result<SimRange> SimTable::Resolve(DeviceAddress address, std::uint64_t size,
                                   const char* what) const {
  auto m = Find(address);
  if (m == nullptr) {
    return Status::InvalidArgument(std::string(what) + ": expected an address of " + device_name_ +
                                   " memory; found " + Hex(address) +
                                   ", which no allocation or import of this device holds");
  }
  const std::uint64_t offset = address - m->base;
  if (size > m->size - offset) {
    return Status::InvalidArgument(std::string(what) + ": " + std::to_string(size) + " bytes at " +
                                   Hex(address) + " run past the end of the " + device_name_ +
                                   " allocation [" + Hex(m->base) + ", +" +
                                   std::to_string(m->size) + ")");
  }
  std::byte* backing = m->backing + offset;
  return SimRange{std::move(m), backing};
}

SimDevice::SimDevice(SimOptions options, std::shared_ptr<SimTable> table)
    : options_(options), name_("sim:" + std::to_string(options.index)), table_(std::move(table)) {}

SimDevice::~SimDevice() = default;

Result<std::unique_ptr<SimDevice>> SimDevice::Create(SimOptions options) {
  if (options.index < 0 || options.bytes_per_second < 0 || options.copy_latency.count() < 0) {
    return Status::InvalidArgument(
        "sim device: expected index >= 0, latency >= 0 and bandwidth "
        ">= 0 (0: unlimited)");
  }
  auto table = std::make_shared<SimTable>("sim:" + std::to_string(options.index));
  return std::unique_ptr<SimDevice>(new SimDevice(options, std::move(table)));
}

Result<PointerInfo> SimDevice::Query(DeviceAddress address) const {
  auto m = table_->Find(address);
  if (m == nullptr) {
    return Status::NotFound(name_ + ": " + Hex(address) +
                            " is not memory of this device (host memory, or another device's)");
  }
  return PointerInfo{name_, options_.index, m->base, m->size};
}

Result<std::unique_ptr<DeviceAllocation>> SimDevice::Allocate(std::uint64_t size) {
  if (size == 0) return Status::InvalidArgument(name_ + ": expected an allocation size > 0");
  const int fd = memfd_create("kvferry-sim", MFD_CLOEXEC);
  if (fd < 0) {
    return Status::ResourceExhausted(name_ + ": memfd_create failed: " + ErrnoText(errno));
  }
  if (ftruncate(fd, static_cast<off_t>(PageRound(size))) != 0) {
    const int err = errno;
    close(fd);
    return Status::ResourceExhausted(name_ + ": sizing a memfd to " + std::to_string(size) +
                                     " bytes failed: " + ErrnoText(err));
  }
  KVFERRY_ASSIGN_OR_RETURN(auto mapping, MapSimMemory(fd, size));
  const DeviceAddress base = mapping->base;
  table_->Insert(std::move(mapping));
  return std::unique_ptr<DeviceAllocation>(new SimAllocation(table_, base, size));
}

Result<std::unique_ptr<PinnedBuffer>> SimDevice::AllocatePinned(std::uint64_t size) {
  if (size == 0) return Status::InvalidArgument(name_ + ": expected a pinned buffer size > 0");
  const std::uint64_t mapped = PageRound(size);
  // Populated: pinned memory is resident (page-locked), and so is this model of it.
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) {
    return Status::ResourceExhausted(name_ + ": allocating " + std::to_string(size) +
                                     " bytes of staging memory failed: " + ErrnoText(errno));
  }
  return std::unique_ptr<PinnedBuffer>(
      new SimPinned(table_, static_cast<std::byte*>(p), size, mapped));
}

Result<IpcHandle> SimDevice::ExportIpc(DeviceAddress address) {
  auto m = table_->Find(address);
  if (m == nullptr) {
    return Status::InvalidArgument(name_ + ": cannot export " + Hex(address) +
                                   ": no allocation of this device holds it");
  }
  struct stat st {};
  if (fstat(m->fd, &st) != 0) {
    return Status::Internal(name_ + ": fstat of an allocation's memfd failed: " + ErrnoText(errno));
  }
  const SimIpcBytes bytes{static_cast<std::int32_t>(getpid()), m->fd,
                          static_cast<std::uint64_t>(st.st_dev),
                          static_cast<std::uint64_t>(st.st_ino)};
  IpcHandle h;
  h.kind = "sim";
  h.device_index = options_.index;
  h.alloc_size = m->size;
  h.offset = address - m->base;
  const auto* p = reinterpret_cast<const std::uint8_t*>(&bytes);
  h.opaque.assign(p, p + sizeof(bytes));
  return h;
}

Result<std::unique_ptr<ImportedMemory>> SimDevice::ImportIpc(const IpcHandle& handle) {
  SimIpcBytes bytes{};
  if (handle.kind != "sim" || handle.opaque.size() != sizeof(bytes)) {
    return Status::InvalidArgument(name_ + ": expected a sim IPC handle; found kind \"" +
                                   handle.kind + "\" with " + std::to_string(handle.opaque.size()) +
                                   " opaque bytes");
  }
  std::memcpy(&bytes, handle.opaque.data(), sizeof(bytes));
  const std::string path = "/proc/" + std::to_string(bytes.pid) + "/fd/" + std::to_string(bytes.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    return Status::Unavailable(name_ + ": opening the exported allocation at " + path +
                               " failed: " + ErrnoText(errno) +
                               "; the exporter must be alive, on this host, and run as this user");
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<std::uint64_t>(st.st_ino) != bytes.st_ino ||
      static_cast<std::uint64_t>(st.st_dev) != bytes.st_dev ||
      static_cast<std::uint64_t>(st.st_size) < handle.alloc_size) {
    close(fd);
    return Status::Unavailable(name_ + ": " + path +
                               " is no longer the exported allocation (freed, or the exporter "
                               "restarted); export it again");
  }
  KVFERRY_ASSIGN_OR_RETURN(auto mapping, MapSimMemory(fd, handle.alloc_size));
  const DeviceAddress base = mapping->base;
  table_->Insert(std::move(mapping));
  return std::unique_ptr<ImportedMemory>(new SimAllocation(table_, base, handle.alloc_size));
}

Result<std::unique_ptr<Stream>> SimDevice::CreateStream() {
  return CreateSimStream(table_, options_);
}

Result<std::unique_ptr<Event>> SimDevice::RecordEventOn(std::uint64_t native_stream) {
  return table_->RecordOn(native_stream);
}

std::uint64_t SimDevice::pinned_bytes() const { return table_->pinned_bytes(); }
std::uint64_t SimDevice::pinned_peak_bytes() const { return table_->pinned_peak_bytes(); }
void SimDevice::ResetPinnedPeak() { table_->ResetPinnedPeak(); }

}  // namespace kvferry::device
