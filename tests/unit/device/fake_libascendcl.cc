// A fake libascendcl for tests without an NPU: the ACL runtime functions the acl device uses, on
// host memory, with controls a test reaches by dlsym. It checks kvferry's use of the runtime as
// kvferry reads CANN's documentation (a current context on every calling thread, page-aligned
// exports, the whitelist an importer must be on, importers closing before the exporter, exports
// closed before the memory is freed, event states); it proves nothing about the real runtime.
//
// Device memory is a memfd mapped at a 64 KiB-aligned address (the fake's page size), so that a
// second process can import it: a key names the exporter's pid, the memfd's descriptor, the
// offset and the size, and the importer maps /proc/<pid>/fd/<fd>. The memfd's first 4 KiB hold
// the export's state (whitelist, importer count), shared by every process that maps it.
//
// Built twice: as is, and with KVFERRY_FAKE_ACL_OLD (a runtime older than CANN 8.2.RC1: no IPC
// calls, no aclrtMemGetAddressRange).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "device/acl/acl_api.h"

using namespace kvferry::device::acl;  // NOLINT(google-build-using-namespace): a test library

namespace {

constexpr aclError kParamInvalid = 107000;  // ACL_ERROR_RT_PARAM_INVALID
constexpr aclError kContextNull = 107002;   // ACL_ERROR_RT_CONTEXT_NULL
constexpr std::size_t kPage = 64 * 1024;    // the fake's device page size
constexpr std::size_t kHeaderBytes = 4096;  // the export state at the start of each memfd
constexpr std::uint32_t kMagic = 0x46414b45;
constexpr int kMaxPids = 512;

// The export state every process mapping the memfd sees.
struct Header {
  std::uint32_t magic;
  std::atomic<std::uint32_t> validation;       // 1: only whitelisted pids may import
  std::atomic<std::uint32_t> exporter_closed;  // 1: aclrtIpcMemClose by the exporter
  std::atomic<std::int32_t> importers;         // processes that imported and have not closed
  std::atomic<std::int32_t> npids;             // published after the pid is written
  std::int32_t pids[kMaxPids];
};
static_assert(sizeof(Header) <= kHeaderBytes);

struct Allocation {
  std::size_t requested;  // what aclrtMalloc was asked for
  std::size_t mapped;     // rounded up to kPage
  int fd;
  Header* header;
  std::string key;  // non-empty while exported
};

struct Import {
  void* data;
  std::size_t size;
  int fd;
  Header* header;
};

struct FakeStream {};
struct FakeEvent {};

std::mutex mu;
std::map<std::uintptr_t, Allocation> allocations;  // by data address; guarded by mu
std::map<std::string, Import> imports;             // by key; guarded by mu
std::map<std::uintptr_t, std::size_t> pinned;      // guarded by mu
// Never destroyed: a stream left running (its owner timed out waiting) stays known until the
// process ends, as with the real runtime, and the leak checker must find it reachable at exit.
auto& streams = *new std::set<FakeStream*>;             // guarded by mu
auto& events = *new std::set<FakeEvent*>;               // guarded by mu
int device_count = 1;                                   // guarded by mu
int init_calls = 0;                                     // guarded by mu
int init_result = -1;                                   // guarded by mu; -1: the default behaviour
int event_status = ACL_EVENT_RECORDED_STATUS_COMPLETE;  // guarded by mu
aclError event_error = ACL_SUCCESS;                     // guarded by mu
aclError sync_result = ACL_SUCCESS;                     // guarded by mu
std::atomic<int> violations{0};  // calls in an order CANN's documentation forbids
int contexts[8];                 // device i's default context is &contexts[i]
thread_local aclrtContext current = nullptr;

bool HasContext() { return current != nullptr; }

// The device range [p, p + n) lies in one allocation or import of this process.
bool IsDevice(const void* p, std::size_t n) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  auto it = allocations.upper_bound(a);
  if (it != allocations.begin()) {
    --it;
    if (a - it->first < it->second.mapped && n <= it->second.mapped - (a - it->first)) return true;
  }
  for (const auto& [key, imp] : imports) {
    const auto base = reinterpret_cast<std::uintptr_t>(imp.data);
    if (a >= base && a - base < imp.size && n <= imp.size - (a - base)) return true;
  }
  return false;
}

bool IsPinned(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  auto it = pinned.upper_bound(a);
  if (it == pinned.begin()) return false;
  --it;
  return a - it->first < it->second;
}

// Maps `len` bytes of `fd` at `offset` to a kPage-aligned address.
void* MapAligned(int fd, std::size_t len, off_t offset) {
  void* reserve = mmap(nullptr, len + kPage, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (reserve == MAP_FAILED) return nullptr;
  const auto r = reinterpret_cast<std::uintptr_t>(reserve);
  const std::uintptr_t aligned = (r + kPage - 1) / kPage * kPage;
  if (aligned > r) munmap(reserve, aligned - r);
  if (r + kPage > aligned) munmap(reinterpret_cast<void*>(aligned + len), r + kPage - aligned);
  void* p = mmap(reinterpret_cast<void*>(aligned), len, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_FIXED, fd, offset);
  return p == MAP_FAILED ? nullptr : p;
}

// Creates or destroys a handle of the kind `live` tracks (streams, events). Callers hold mu.
template <typename T>
aclError Make(std::set<T*>& live, void** out) {
  auto* h = new T;
  live.insert(h);
  *out = h;
  return ACL_SUCCESS;
}
template <typename T>
aclError Drop(std::set<T*>& live, void* p) {
  auto* h = static_cast<T*>(p);
  if (live.erase(h) != 1) return kParamInvalid;
  delete h;
  return ACL_SUCCESS;
}

Header* MapHeader(int fd) {
  void* h = mmap(nullptr, kHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return h == MAP_FAILED ? nullptr : static_cast<Header*>(h);
}

}  // namespace

extern "C" {

// Controls for tests.
void fake_acl_set_event(int status, int error) {
  std::lock_guard<std::mutex> lock(mu);
  event_status = status;
  event_error = error;
}
void fake_acl_set_sync_result(int result) {
  std::lock_guard<std::mutex> lock(mu);
  sync_result = result;
}
void fake_acl_set_init_result(int result) {
  std::lock_guard<std::mutex> lock(mu);
  init_result = result;
}
void fake_acl_set_device_count(int n) {
  std::lock_guard<std::mutex> lock(mu);
  device_count = n;
}
int fake_acl_violations() { return violations.load(); }
int fake_acl_live_streams() {
  std::lock_guard<std::mutex> lock(mu);
  return static_cast<int>(streams.size());
}
int fake_acl_live_exports() {
  std::lock_guard<std::mutex> lock(mu);
  int n = 0;
  for (const auto& [p, a] : allocations) n += a.key.empty() ? 0 : 1;
  return n;
}
int fake_acl_live_imports() {
  std::lock_guard<std::mutex> lock(mu);
  return static_cast<int>(imports.size());
}
// How many pids the whitelist of `key` (exported by this process) holds, or -1.
int fake_acl_whitelist_size(const char* key) {
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [p, a] : allocations) {
    if (a.key == key) return a.header->npids.load();
  }
  return -1;
}

aclError aclInit(const char*) {
  std::lock_guard<std::mutex> lock(mu);
  if (init_result >= 0) return init_result;
  // As the real runtime: once per process; torch_npu usually comes first.
  return init_calls++ == 0 ? ACL_SUCCESS : ACL_ERROR_REPEAT_INITIALIZE;
}
const char* aclGetRecentErrMsg() { return "fake ACL runtime error"; }

aclError aclrtSetDevice(std::int32_t id) {
  std::lock_guard<std::mutex> lock(mu);
  if (id < 0 || id >= device_count) return kParamInvalid;
  current = &contexts[id];
  return ACL_SUCCESS;
}
aclError aclrtGetDevice(std::int32_t* id) {
  if (!HasContext()) return kContextNull;
  *id = static_cast<std::int32_t>(static_cast<int*>(current) - contexts);
  return ACL_SUCCESS;
}
aclError aclrtGetDeviceCount(std::uint32_t* n) {
  std::lock_guard<std::mutex> lock(mu);
  *n = static_cast<std::uint32_t>(device_count);
  return ACL_SUCCESS;
}
aclError aclrtGetCurrentContext(aclrtContext* ctx) {
  if (!HasContext()) return kContextNull;
  *ctx = current;
  return ACL_SUCCESS;
}
aclError aclrtSetCurrentContext(aclrtContext ctx) {
  const auto* c = static_cast<int*>(ctx);
  if (c < contexts || c >= contexts + 8) return kParamInvalid;
  current = ctx;
  return ACL_SUCCESS;
}

aclError aclrtMalloc(void** p, std::size_t size, aclrtMemMallocPolicy) {
  if (!HasContext()) return kContextNull;
  if (size == 0) return kParamInvalid;
  const std::size_t mapped = (size + kPage - 1) / kPage * kPage;
  const int fd = memfd_create("fake-acl", MFD_CLOEXEC);
  if (fd < 0) return kParamInvalid;
  if (ftruncate(fd, static_cast<off_t>(kHeaderBytes + mapped)) != 0) {
    close(fd);
    return kParamInvalid;
  }
  Header* header = MapHeader(fd);
  void* data = MapAligned(fd, mapped, kHeaderBytes);
  if (header == nullptr || data == nullptr) {
    close(fd);
    return kParamInvalid;
  }
  header->magic = kMagic;
  std::lock_guard<std::mutex> lock(mu);
  allocations[reinterpret_cast<std::uintptr_t>(data)] = {size, mapped, fd, header, ""};
  *p = data;
  return ACL_SUCCESS;
}
aclError aclrtFree(void* p) {
  if (!HasContext()) return kContextNull;
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocations.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == allocations.end()) return kParamInvalid;
  if (!it->second.key.empty()) {  // CANN: close the export before freeing the memory
    ++violations;
    return kParamInvalid;
  }
  munmap(p, it->second.mapped);
  munmap(it->second.header, kHeaderBytes);
  close(it->second.fd);
  allocations.erase(it);
  return ACL_SUCCESS;
}
aclError aclrtMallocHost(void** p, std::size_t size) {
  if (!HasContext()) return kContextNull;
  *p = std::malloc(size);
  if (*p == nullptr) return kParamInvalid;
  std::lock_guard<std::mutex> lock(mu);
  pinned[reinterpret_cast<std::uintptr_t>(*p)] = size;
  return ACL_SUCCESS;
}
aclError aclrtFreeHost(void* p) {
  std::lock_guard<std::mutex> lock(mu);
  if (pinned.erase(reinterpret_cast<std::uintptr_t>(p)) != 1) return kParamInvalid;
  std::free(p);
  return ACL_SUCCESS;
}

aclError aclrtPointerGetAttributes(const void* p, aclrtPtrAttributes* attrs) {
  std::lock_guard<std::mutex> lock(mu);
  std::memset(attrs, 0, sizeof(*attrs));
  if (IsDevice(p, 1)) {
    attrs->location = {0, ACL_MEM_LOCATION_TYPE_DEVICE};
    attrs->pageSize = kPage;
  } else if (IsPinned(p)) {
    attrs->location = {0, ACL_MEM_LOCATION_TYPE_HOST};
    attrs->pageSize = 4096;
  } else {
    attrs->location = {0, ACL_MEM_LOCATION_TYPE_UNREGISTERED};
  }
  return ACL_SUCCESS;
}

// Copies run at once; only events model asynchrony (fake_acl_set_event).
aclError aclrtMemcpyAsync(void* dst, std::size_t dest_max, const void* src, std::size_t count,
                          aclrtMemcpyKind kind, aclrtStream stream) {
  if (!HasContext()) return kContextNull;
  std::lock_guard<std::mutex> lock(mu);
  if (stream != nullptr && streams.count(static_cast<FakeStream*>(stream)) == 0) {
    return kParamInvalid;
  }
  if (count == 0 || count > dest_max) return kParamInvalid;
  const bool ok =
      (kind == ACL_MEMCPY_HOST_TO_DEVICE && IsDevice(dst, count) && !IsDevice(src, 1)) ||
      (kind == ACL_MEMCPY_DEVICE_TO_HOST && IsDevice(src, count) && !IsDevice(dst, 1)) ||
      (kind == ACL_MEMCPY_DEVICE_TO_DEVICE && IsDevice(dst, count) && IsDevice(src, count));
  if (!ok) return kParamInvalid;
  std::memmove(dst, src, count);
  return ACL_SUCCESS;
}

aclError aclrtCreateStream(aclrtStream* s) {
  if (!HasContext()) return kContextNull;
  std::lock_guard<std::mutex> lock(mu);
  return Make(streams, s);
}
aclError aclrtDestroyStream(aclrtStream s) {
  std::lock_guard<std::mutex> lock(mu);
  return Drop(streams, s);
}
aclError aclrtSynchronizeStreamWithTimeout(aclrtStream s, std::int32_t) {
  if (!HasContext()) return kContextNull;
  std::lock_guard<std::mutex> lock(mu);
  if (streams.count(static_cast<FakeStream*>(s)) == 0) return kParamInvalid;
  return sync_result;
}
aclError aclrtCreateEvent(aclrtEvent* e) {
  if (!HasContext()) return kContextNull;
  std::lock_guard<std::mutex> lock(mu);
  return Make(events, e);
}
aclError aclrtDestroyEvent(aclrtEvent e) {
  std::lock_guard<std::mutex> lock(mu);
  return Drop(events, e);
}
aclError aclrtRecordEvent(aclrtEvent e, aclrtStream s) {
  if (!HasContext()) return kContextNull;
  std::lock_guard<std::mutex> lock(mu);
  if (events.count(static_cast<FakeEvent*>(e)) == 0) return kParamInvalid;
  if (s != nullptr && streams.count(static_cast<FakeStream*>(s)) == 0) return kParamInvalid;
  return ACL_SUCCESS;
}
aclError aclrtQueryEventStatus(aclrtEvent e, aclrtEventRecordedStatus* status) {
  std::lock_guard<std::mutex> lock(mu);
  if (events.count(static_cast<FakeEvent*>(e)) == 0) return kParamInvalid;
  if (event_error != ACL_SUCCESS) return event_error;
  *status = static_cast<aclrtEventRecordedStatus>(event_status);
  return ACL_SUCCESS;
}

#ifndef KVFERRY_FAKE_ACL_OLD
aclError aclrtMemGetAddressRange(void* p, void** base, std::size_t* size) {
  std::lock_guard<std::mutex> lock(mu);
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  auto it = allocations.upper_bound(a);
  if (it != allocations.begin()) {
    --it;
    if (a - it->first < it->second.requested) {
      *base = reinterpret_cast<void*>(it->first);
      *size = it->second.requested;
      return ACL_SUCCESS;
    }
  }
  return kParamInvalid;
}

aclError aclrtDeviceGetBareTgid(std::int32_t* pid) {
  *pid = static_cast<std::int32_t>(getpid());
  return ACL_SUCCESS;
}

// The key: "fake:<pid>:<fd>:<offset>:<size>"; the range must be whole pages of one allocation.
aclError aclrtIpcMemGetExportKey(void* p, std::size_t size, char* key, std::size_t len,
                                 std::uint64_t flags) {
  if (!HasContext()) return kContextNull;
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (len != kIpcKeyLength || a % kPage != 0 || size % kPage != 0 || size == 0) {
    return kParamInvalid;
  }
  std::lock_guard<std::mutex> lock(mu);
  auto it = allocations.upper_bound(a);
  if (it == allocations.begin()) return kParamInvalid;
  --it;
  Allocation& alloc = it->second;
  const std::size_t offset = a - it->first;
  if (offset >= alloc.mapped || size > alloc.mapped - offset || !alloc.key.empty()) {
    return kParamInvalid;
  }
  std::snprintf(key, len, "fake:%d:%d:%zu:%zu", static_cast<int>(getpid()), alloc.fd, offset, size);
  alloc.key = key;
  alloc.header->validation = (flags & 0x1) == 0 ? 1 : 0;
  alloc.header->exporter_closed = 0;
  alloc.header->npids = 0;
  return ACL_SUCCESS;
}

aclError aclrtIpcMemSetImportPid(const char* key, std::int32_t* pid, std::size_t num) {
  if (!HasContext()) return kContextNull;  // the runtime needs the current context
  std::lock_guard<std::mutex> lock(mu);
  for (auto& [p, alloc] : allocations) {
    if (alloc.key != key) continue;
    Header* h = alloc.header;
    const std::int32_t n = h->npids.load();
    if (n + static_cast<std::int64_t>(num) > kMaxPids) return kParamInvalid;
    for (std::size_t i = 0; i < num; ++i) h->pids[n + static_cast<std::int32_t>(i)] = pid[i];
    h->npids.store(n + static_cast<std::int32_t>(num));  // publishes the pids written above
    return ACL_SUCCESS;
  }
  return kParamInvalid;
}

aclError aclrtIpcMemImportByKey(void** p, const char* key, std::uint64_t) {
  if (!HasContext()) return kContextNull;
  int pid = 0;
  int fd = 0;
  std::size_t offset = 0;
  std::size_t size = 0;
  if (std::sscanf(key, "fake:%d:%d:%zu:%zu", &pid, &fd, &offset, &size) != 4) return kParamInvalid;
  std::lock_guard<std::mutex> lock(mu);
  if (imports.count(key) != 0) return kParamInvalid;  // once per process
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int local = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (local < 0) return kParamInvalid;
  Header* h = MapHeader(local);
  if (h == nullptr || h->magic != kMagic || h->exporter_closed.load() != 0) {
    if (h != nullptr) munmap(h, kHeaderBytes);
    close(local);
    return kParamInvalid;
  }
  bool admitted = h->validation.load() == 0;
  const std::int32_t n = h->npids.load();
  for (std::int32_t i = 0; i < n && !admitted; ++i) admitted = h->pids[i] == getpid();
  void* data =
      admitted ? MapAligned(local, size, static_cast<off_t>(kHeaderBytes + offset)) : nullptr;
  if (data == nullptr) {
    munmap(h, kHeaderBytes);
    close(local);
    return kParamInvalid;
  }
  ++h->importers;
  imports[key] = {data, size, local, h};
  *p = data;
  return ACL_SUCCESS;
}

aclError aclrtIpcMemClose(const char* key) {
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = imports.find(key); it != imports.end()) {  // an importer closes its import
    --it->second.header->importers;
    munmap(it->second.data, it->second.size);
    munmap(it->second.header, kHeaderBytes);
    close(it->second.fd);
    imports.erase(it);
    return ACL_SUCCESS;
  }
  for (auto& [p, alloc] : allocations) {  // the exporter closes its export
    if (alloc.key != key) continue;
    if (alloc.header->importers.load() > 0) {  // CANN: every importer closes first
      ++violations;
      return kParamInvalid;
    }
    alloc.header->exporter_closed = 1;
    alloc.key.clear();
    return ACL_SUCCESS;
  }
  return kParamInvalid;
}
#endif  // KVFERRY_FAKE_ACL_OLD

}  // extern "C"
