#include "device/acl/acl_device.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>

#include "common/clock.h"
#include "common/hex.h"
#include "common/log.h"
#include "device/acl/acl_ipc.h"
#include "device/acl/acl_permit.h"

namespace kvferry::device {

struct AclImport;

// What every object of one device needs: the runtime, the default context, and the tables.
struct AclShared {
  std::shared_ptr<const AclRuntime> rt;
  int index = 0;
  std::string name;
  acl::aclrtContext ctx = nullptr;
  AclExportTable exports;

  Mutex mu;
  std::map<DeviceAddress, std::uint64_t> allocations GUARDED_BY(mu);  // Allocate's: base -> size
  std::map<std::string, std::weak_ptr<AclImport>> imports GUARDED_BY(mu);  // by key

  // aclrtSetCurrentContext: per thread, cheap; every call into the runtime is preceded by it.
  Status MakeCurrent() const {
    const acl::aclError r = rt->aclrtSetCurrentContext(ctx);
    return r == acl::ACL_SUCCESS
               ? Status::Ok()
               : Status::Internal(name + ": " + rt->Describe("aclrtSetCurrentContext", r));
  }
  // Closes export keys (the exporter's aclrtIpcMemClose), before their memory is freed.
  void CloseKeys(const std::vector<std::string>& keys) const {
    if (keys.empty() || !MakeCurrent().ok()) return;
    for (const std::string& key : keys) {
      if (const acl::aclError r = rt->aclrtIpcMemClose(key.c_str()); r != acl::ACL_SUCCESS) {
        Log().warn("{}: closing an IPC export: {} (a reader may still have it open)", name,
                   rt->Describe("aclrtIpcMemClose", r));
      }
    }
  }
};

// One import of a key in this process, shared by the ImportedMemory objects that map it.
struct AclImport {
  AclImport(std::shared_ptr<AclShared> s, std::string k, void* p)
      : shared(std::move(s)), key(std::move(k)), ptr(p) {}
  ~AclImport() {
    if (!shared->MakeCurrent().ok()) return;
    if (const acl::aclError r = shared->rt->aclrtIpcMemClose(key.c_str()); r != acl::ACL_SUCCESS) {
      Log().warn("{}: closing an IPC import: {}", shared->name,
                 shared->rt->Describe("aclrtIpcMemClose", r));
    }
  }
  AclImport(const AclImport&) = delete;
  AclImport& operator=(const AclImport&) = delete;

  std::shared_ptr<AclShared> shared;
  std::string key;
  void* ptr;
};

namespace {

constexpr std::uint64_t kAllocationGranule = std::uint64_t{2} << 20;  // a huge page
constexpr std::int32_t kStreamDrainMs = 10000;  // what a stream's destructor waits for its copies
constexpr auto kPermitWait = std::chrono::seconds(5);

// A device address as the runtime's void*: never dereferenced here.
void* Ptr(DeviceAddress a) {
  return reinterpret_cast<void*>(a);  // NOLINT(performance-no-int-to-ptr)
}
DeviceAddress Addr(const void* p) { return reinterpret_cast<DeviceAddress>(p); }

class AclAllocation final : public DeviceAllocation {
 public:
  AclAllocation(std::shared_ptr<AclShared> s, DeviceAddress p, std::uint64_t size,
                std::uint64_t allocated)
      : s_(std::move(s)), p_(p), size_(size), allocated_(allocated) {}
  // Every importer must have closed its import before this (the caller's contract); the export
  // keys of the allocation are closed here, then the memory is freed.
  ~AclAllocation() override {
    s_->CloseKeys(s_->exports.TakeOverlapping(p_, allocated_));
    {
      MutexLock lock(s_->mu);
      s_->allocations.erase(p_);
    }
    if (s_->MakeCurrent().ok()) (void)s_->rt->aclrtFree(Ptr(p_));
  }
  DeviceAddress address() const override { return p_; }
  std::uint64_t size() const override { return size_; }

 private:
  std::shared_ptr<AclShared> s_;
  DeviceAddress p_;
  std::uint64_t size_;
  std::uint64_t allocated_;
};

class AclImported final : public ImportedMemory {
 public:
  AclImported(std::shared_ptr<AclImport> import, std::uint64_t size)
      : import_(std::move(import)), size_(size) {}
  DeviceAddress base() const override { return Addr(import_->ptr); }
  std::uint64_t size() const override { return size_; }

 private:
  std::shared_ptr<AclImport> import_;
  std::uint64_t size_;
};

class AclPinned final : public PinnedBuffer {
 public:
  AclPinned(std::shared_ptr<AclShared> s, void* p, std::uint64_t size)
      : s_(std::move(s)), p_(p), size_(size) {}
  ~AclPinned() override {
    if (s_->MakeCurrent().ok()) (void)s_->rt->aclrtFreeHost(p_);
  }
  std::byte* data() const override { return static_cast<std::byte*>(p_); }
  std::uint64_t size() const override { return size_; }

 private:
  std::shared_ptr<AclShared> s_;
  void* p_;
  std::uint64_t size_;
};

class AclEvent final : public Event {
 public:
  AclEvent(std::shared_ptr<AclShared> s, acl::aclrtEvent e) : s_(std::move(s)), e_(e) {}
  ~AclEvent() override {
    if (s_->MakeCurrent().ok()) (void)s_->rt->aclrtDestroyEvent(e_);
  }
  EventPoll Poll() override {
    if (Status s = s_->MakeCurrent(); !s.ok()) return {EventState::kFailed, std::move(s)};
    auto status = acl::ACL_EVENT_RECORDED_STATUS_NOT_READY;
    const acl::aclError r = s_->rt->aclrtQueryEventStatus(e_, &status);
    if (r != acl::ACL_SUCCESS) {
      return {EventState::kFailed, Status::Internal(s_->rt->Describe("aclrtQueryEventStatus", r) +
                                                    ": a copy before the event failed")};
    }
    if (status == acl::ACL_EVENT_RECORDED_STATUS_COMPLETE) return {EventState::kComplete, {}};
    if (status == acl::ACL_EVENT_RECORDED_STATUS_NOT_READY) return {EventState::kPending, {}};
    return {EventState::kFailed,
            Status::Internal("aclrtQueryEventStatus: expected status 0 (not ready) or 1 "
                             "(complete); found " +
                             std::to_string(static_cast<int>(status)))};
  }
  // ACL's event wait (aclrtSynchronizeEvent) has no deadline: poll.
  Status Wait(Deadline deadline) override { return PollEventUntil(*this, deadline, "npu event"); }

 private:
  std::shared_ptr<AclShared> s_;
  acl::aclrtEvent e_;
};

// An event recorded now on `stream` of the device `s`.
Result<std::unique_ptr<Event>> RecordAclEvent(const std::shared_ptr<AclShared>& s,
                                              acl::aclrtStream stream) {
  KVFERRY_RETURN_IF_ERROR(s->MakeCurrent());
  acl::aclrtEvent e = nullptr;
  if (const acl::aclError r = s->rt->aclrtCreateEvent(&e); r != acl::ACL_SUCCESS) {
    return Status::ResourceExhausted(s->name + ": " + s->rt->Describe("aclrtCreateEvent", r));
  }
  auto event = std::make_unique<AclEvent>(s, e);
  if (const acl::aclError r = s->rt->aclrtRecordEvent(e, stream); r != acl::ACL_SUCCESS) {
    return Status::InvalidArgument(s->name + ": " + s->rt->Describe("aclrtRecordEvent", r) +
                                   ": expected a live stream of this device's default context");
  }
  return std::unique_ptr<Event>(std::move(event));
}

class AclStream final : public Stream {
 public:
  AclStream(std::shared_ptr<AclShared> s, acl::aclrtStream st) : s_(std::move(s)), st_(st) {}
  ~AclStream() override {
    if (!s_->MakeCurrent().ok()) return;
    const acl::aclError r = s_->rt->aclrtSynchronizeStreamWithTimeout(st_, kStreamDrainMs);
    if (r == acl::kStreamSyncTimeout) {
      Log().warn(
          "{}: a stream still ran copies {} ms after its owner let it go; it is left "
          "undestroyed (aclrtDestroyStream would wait without a deadline)",
          s_->name, kStreamDrainMs);
      return;
    }
    (void)s_->rt->aclrtDestroyStream(st_);
  }
  Status CopyHostToDevice(DeviceAddress dst, const std::byte* src, std::uint64_t size) override {
    return Copy(Ptr(dst), src, size, acl::ACL_MEMCPY_HOST_TO_DEVICE);
  }
  Status CopyDeviceToHost(std::byte* dst, DeviceAddress src, std::uint64_t size) override {
    return Copy(dst, Ptr(src), size, acl::ACL_MEMCPY_DEVICE_TO_HOST);
  }
  Status CopyDeviceToDevice(DeviceAddress dst, DeviceAddress src, std::uint64_t size) override {
    return Copy(Ptr(dst), Ptr(src), size, acl::ACL_MEMCPY_DEVICE_TO_DEVICE);
  }
  Result<std::unique_ptr<Event>> RecordEvent() override { return RecordAclEvent(s_, st_); }
  std::uint64_t native_handle() const override { return Addr(st_); }

 private:
  // A copy of 0 bytes is nothing to do (ACL refuses a count of 0).
  Status Copy(void* dst, const void* src, std::uint64_t size, acl::aclrtMemcpyKind kind) {
    if (size == 0) return Status::Ok();
    KVFERRY_RETURN_IF_ERROR(s_->MakeCurrent());
    const acl::aclError r = s_->rt->aclrtMemcpyAsync(dst, size, src, size, kind, st_);
    if (r == acl::ACL_SUCCESS) return Status::Ok();
    return Status::InvalidArgument(s_->name + ": " + s_->rt->Describe("aclrtMemcpyAsync", r) +
                                   " (kind " + std::to_string(static_cast<int>(kind)) + ", " +
                                   std::to_string(size) +
                                   " bytes): check that both ranges lie in live memory of this "
                                   "device or host memory");
  }
  std::shared_ptr<AclShared> s_;
  acl::aclrtStream st_;
};

}  // namespace

AclDevice::AclDevice(std::shared_ptr<AclShared> shared) : s_(std::move(shared)) {}

AclDevice::~AclDevice() {
  {
    MutexLock lock(server_mu_);
    server_.reset();  // no reader is admitted any more
  }
  s_->CloseKeys(s_->exports.TakeAll());
}

const std::string& AclDevice::name() const { return s_->name; }
int AclDevice::index() const { return s_->index; }

Result<std::unique_ptr<AclDevice>> AclDevice::Open(int index) {
  KVFERRY_ASSIGN_OR_RETURN(auto runtime, AclRuntime::Load());
  return Open(index, std::move(runtime));
}

Result<std::unique_ptr<AclDevice>> AclDevice::Open(int index,
                                                   std::shared_ptr<const AclRuntime> runtime) {
  const std::string name = "npu:" + std::to_string(index);
  if (index < 0 || index >= runtime->device_count()) {
    return Status::InvalidArgument(name + ": expected an index below " +
                                   std::to_string(runtime->device_count()) +
                                   " (the devices the ACL runtime sees; ASCEND_RT_VISIBLE_DEVICES "
                                   "applies)");
  }
  // aclrtSetDevice makes (or joins) the device's default context on this thread; the thread's
  // previous context, if it had one, is made current again afterwards.
  acl::aclrtContext previous = nullptr;
  if (runtime->aclrtGetCurrentContext(&previous) != acl::ACL_SUCCESS) previous = nullptr;
  if (const acl::aclError r = runtime->aclrtSetDevice(index); r != acl::ACL_SUCCESS) {
    return Status::Unavailable(name + ": " + runtime->Describe("aclrtSetDevice", r));
  }
  std::int32_t current = -1;
  if (const acl::aclError r = runtime->aclrtGetDevice(&current);
      r != acl::ACL_SUCCESS || current != index) {
    return Status::Internal(
        name + ": after aclrtSetDevice(" + std::to_string(index) +
        "), aclrtGetDevice gives device " + std::to_string(current) +
        (r == acl::ACL_SUCCESS ? "" : " (" + runtime->Describe("aclrtGetDevice", r) + ")"));
  }
  auto s = std::make_shared<AclShared>();
  if (const acl::aclError r = runtime->aclrtGetCurrentContext(&s->ctx);
      r != acl::ACL_SUCCESS || s->ctx == nullptr) {
    return Status::Internal(name + ": " + runtime->Describe("aclrtGetCurrentContext", r));
  }
  if (previous != nullptr && previous != s->ctx) (void)runtime->aclrtSetCurrentContext(previous);
  s->rt = std::move(runtime);
  s->index = index;
  s->name = name;
  return std::unique_ptr<AclDevice>(new AclDevice(std::move(s)));
}

Result<PointerInfo> AclDevice::Query(DeviceAddress address) const {
  {
    MutexLock lock(s_->mu);
    auto it = s_->allocations.upper_bound(address);
    if (it != s_->allocations.begin()) {
      --it;
      if (address - it->first < it->second)
        return PointerInfo{s_->name, s_->index, it->first, it->second};
    }
  }
  const AclRuntime& rt = *s_->rt;
  if (rt.aclrtPointerGetAttributes == nullptr || rt.aclrtMemGetAddressRange == nullptr) {
    return Status::NotFound(
        s_->name + ": " + Hex(address) +
        " is not memory this device allocated, and this CANN's libascendcl.so lacks " +
        (rt.aclrtPointerGetAttributes == nullptr ? "aclrtPointerGetAttributes"
                                                 : "aclrtMemGetAddressRange") +
        ", so the allocation that holds it cannot be found: use a CANN that has it "
        "(aclrtMemGetAddressRange is documented from CANN 9.0.0), or keep the KV cache in host "
        "memory (kv_buffer_device \"cpu\")");
  }
  KVFERRY_RETURN_IF_ERROR(s_->MakeCurrent());
  acl::aclrtPtrAttributes attrs{};
  if (rt.aclrtPointerGetAttributes(Ptr(address), &attrs) != acl::ACL_SUCCESS ||
      attrs.location.type != acl::ACL_MEM_LOCATION_TYPE_DEVICE ||
      attrs.location.id != static_cast<std::uint32_t>(s_->index)) {
    return Status::NotFound(s_->name + ": " + Hex(address) +
                            " is not device memory of this NPU (host memory, or another NPU's)");
  }
  void* base = nullptr;
  std::size_t size = 0;
  if (const acl::aclError r = rt.aclrtMemGetAddressRange(Ptr(address), &base, &size);
      r != acl::ACL_SUCCESS) {
    return Status::NotFound(s_->name + ": " + rt.Describe("aclrtMemGetAddressRange", r));
  }
  return PointerInfo{s_->name, s_->index, Addr(base), size};
}

Result<std::unique_ptr<DeviceAllocation>> AclDevice::Allocate(std::uint64_t size) {
  if (size == 0) return Status::InvalidArgument(s_->name + ": expected an allocation size > 0");
  const std::uint64_t allocated =
      (size + kAllocationGranule - 1) / kAllocationGranule * kAllocationGranule;
  KVFERRY_RETURN_IF_ERROR(s_->MakeCurrent());
  void* p = nullptr;
  if (const acl::aclError r = s_->rt->aclrtMalloc(&p, allocated, acl::ACL_MEM_MALLOC_HUGE_FIRST);
      r != acl::ACL_SUCCESS) {
    return Status::ResourceExhausted(s_->name + ": " + s_->rt->Describe("aclrtMalloc", r));
  }
  {
    MutexLock lock(s_->mu);
    s_->allocations[Addr(p)] = allocated;
  }
  return std::unique_ptr<DeviceAllocation>(new AclAllocation(s_, Addr(p), size, allocated));
}

Result<std::unique_ptr<PinnedBuffer>> AclDevice::AllocatePinned(std::uint64_t size) {
  if (size == 0) return Status::InvalidArgument(s_->name + ": expected a pinned buffer size > 0");
  KVFERRY_RETURN_IF_ERROR(s_->MakeCurrent());
  void* p = nullptr;
  if (const acl::aclError r = s_->rt->aclrtMallocHost(&p, size); r != acl::ACL_SUCCESS) {
    return Status::ResourceExhausted(s_->name + ": " + s_->rt->Describe("aclrtMallocHost", r));
  }
  return std::unique_ptr<PinnedBuffer>(new AclPinned(s_, p, size));
}

Result<std::string> AclDevice::ExportKey(DeviceAddress start, std::uint64_t size) {
  MutexLock lock(export_mu_);
  if (std::optional<std::string> key = s_->exports.Find(start, size)) return *key;
  // An export at an overlapping range is of memory freed since (torch_npu's, which kvferry does
  // not see freed): its key is stale.
  s_->CloseKeys(s_->exports.TakeOverlapping(start, size));
  KVFERRY_RETURN_IF_ERROR(s_->MakeCurrent());
  char key[acl::kIpcKeyLength] = {};
  if (const acl::aclError r = s_->rt->aclrtIpcMemGetExportKey(Ptr(start), size, key, sizeof(key),
                                                              acl::kIpcMemExportFlagDefault);
      r != acl::ACL_SUCCESS) {
    return Status::NotSupported(s_->name + ": " + s_->rt->Describe("aclrtIpcMemGetExportKey", r) +
                                " for [" + Hex(start) + ", +" + std::to_string(size) +
                                "); copies from this allocation go through host staging");
  }
  const std::size_t len = strnlen(key, sizeof(key));
  if (len == 0 || len == sizeof(key)) {
    return Status::NotSupported(s_->name +
                                ": aclrtIpcMemGetExportKey returned a key that is not "
                                "a string of 1 to 64 characters; copies go through host staging");
  }
  s_->exports.Add(start, size, std::string(key, len));
  return std::string(key, len);
}

Result<std::string> AclDevice::PermitSocket() {
  MutexLock lock(server_mu_);
  if (!server_) {
    std::int32_t tgid = 0;
    const bool host_pidns = s_->rt->aclrtDeviceGetBareTgid(&tgid) == acl::ACL_SUCCESS &&
                            tgid == static_cast<std::int32_t>(::getpid());
    std::weak_ptr<AclShared> weak = s_;
    KVFERRY_ASSIGN_OR_RETURN(
        server_, AclPermitServer::Start(
                     [weak](const std::string& key, std::int32_t pid) -> Status {
                       std::shared_ptr<AclShared> s = weak.lock();
                       if (!s) return Status::Unavailable("the exporting device is closing");
                       KVFERRY_ASSIGN_OR_RETURN(bool fresh, s->exports.Reserve(key, pid));
                       if (!fresh) return Status::Ok();
                       Status current = s->MakeCurrent();
                       std::int32_t pids[1] = {pid};
                       const acl::aclError r =
                           current.ok() ? s->rt->aclrtIpcMemSetImportPid(key.c_str(), pids, 1)
                                        : acl::ACL_SUCCESS;
                       if (current.ok() && r == acl::ACL_SUCCESS) return Status::Ok();
                       s->exports.Unreserve(key, pid);
                       if (!current.ok()) return current;
                       return Status::Unavailable(s->name + ": " +
                                                  s->rt->Describe("aclrtIpcMemSetImportPid", r));
                     },
                     host_pidns));
  }
  return server_->name();
}

Result<IpcHandle> AclDevice::ExportIpc(DeviceAddress address) {
  const AclRuntime& rt = *s_->rt;
  const auto fallback = [&](Status s) {
    if (!export_fallback_logged_.exchange(true)) Log().warn("{}", s.message());
    return s;
  };
  if (!rt.has_ipc()) {
    return fallback(Status::NotSupported(
        s_->name + ": this CANN's libascendcl.so (" + rt.path() + ") lacks " + rt.missing_ipc() +
        " (same-host NPU IPC needs CANN 8.2.RC1 or newer): same-host reads of NPU memory stage "
        "through host memory (tcp on loopback)"));
  }
  KVFERRY_ASSIGN_OR_RETURN(PointerInfo info, Query(address));
  KVFERRY_RETURN_IF_ERROR(s_->MakeCurrent());
  acl::aclrtPtrAttributes attrs{};
  if (const acl::aclError r = rt.aclrtPointerGetAttributes(Ptr(info.alloc_base), &attrs);
      r != acl::ACL_SUCCESS) {
    return fallback(Status::NotSupported(s_->name + ": " +
                                         rt.Describe("aclrtPointerGetAttributes", r) +
                                         "; copies from this allocation go through host staging"));
  }
  const std::uint64_t page = attrs.pageSize;
  if (page == 0 || (page & (page - 1)) != 0) {
    return fallback(Status::NotSupported(
        s_->name + ": aclrtPointerGetAttributes gives a page size of " + std::to_string(page) +
        " bytes, not a power of two; copies from this allocation go through host staging"));
  }
  // IPC exports whole pages (CANN refuses a range that is not page-aligned).
  const DeviceAddress start = info.alloc_base / page * page;
  const DeviceAddress end = (info.alloc_base + info.alloc_size + page - 1) / page * page;
  Result<std::string> key = ExportKey(start, end - start);
  if (!key.ok()) return fallback(key.status());
  KVFERRY_ASSIGN_OR_RETURN(std::string socket, PermitSocket());
  IpcHandle h;
  h.kind = "npu";
  h.device_index = s_->index;
  h.alloc_size = end - start;
  h.offset = address - start;
  h.opaque = AclExportRef{*key, static_cast<std::int32_t>(::getpid()), socket}.Encode();
  return h;
}

Result<std::unique_ptr<ImportedMemory>> AclDevice::ImportIpc(const IpcHandle& handle) {
  if (handle.kind != "npu") {
    return Status::InvalidArgument(s_->name + ": expected an npu IPC handle; found kind \"" +
                                   handle.kind + "\"");
  }
  KVFERRY_ASSIGN_OR_RETURN(AclExportRef ref, AclExportRef::Decode(handle.opaque));
  const AclRuntime& rt = *s_->rt;
  if (!rt.has_ipc()) {
    return Status::Unavailable(s_->name +
                               ": cannot import another process's NPU memory: this "
                               "CANN's libascendcl.so (" +
                               rt.path() + ") lacks " + rt.missing_ipc() +
                               " (same-host NPU IPC needs CANN 8.2.RC1 or newer); reads of that "
                               "process stage through host memory");
  }
  MutexLock serial(import_mu_);
  {
    MutexLock lock(s_->mu);
    auto it = s_->imports.find(ref.key);
    if (it != s_->imports.end()) {
      if (std::shared_ptr<AclImport> live = it->second.lock()) {
        return std::unique_ptr<ImportedMemory>(new AclImported(std::move(live), handle.alloc_size));
      }
      s_->imports.erase(it);
    }
  }
  KVFERRY_RETURN_IF_ERROR(s_->MakeCurrent());
  std::int32_t tgid = 0;
  if (const acl::aclError r = rt.aclrtDeviceGetBareTgid(&tgid); r != acl::ACL_SUCCESS) {
    return Status::Unavailable(s_->name + ": " + rt.Describe("aclrtDeviceGetBareTgid", r));
  }
  if (Status permit =
          RequestImportPermit(ref.permit_socket, ref.key, tgid, DeadlineAfter(kPermitWait));
      !permit.ok()) {
    return Status::Unavailable(s_->name + ": the exporter (pid " +
                               std::to_string(ref.exporter_pid) +
                               ") did not admit this process (bare tgid " + std::to_string(tgid) +
                               "): " + permit.ToString());
  }
  KVFERRY_RETURN_IF_ERROR(s_->MakeCurrent());
  void* p = nullptr;
  if (const acl::aclError r =
          rt.aclrtIpcMemImportByKey(&p, ref.key.c_str(), acl::kIpcMemImportFlagDefault);
      r != acl::ACL_SUCCESS) {
    return Status::Unavailable(s_->name + ": " + rt.Describe("aclrtIpcMemImportByKey", r) +
                               "; the exporter (pid " + std::to_string(ref.exporter_pid) +
                               ") must be alive, on this host, with the allocation still there");
  }
  auto import = std::make_shared<AclImport>(s_, ref.key, p);
  {
    MutexLock lock(s_->mu);
    s_->imports[ref.key] = import;
  }
  return std::unique_ptr<ImportedMemory>(new AclImported(std::move(import), handle.alloc_size));
}

Result<std::unique_ptr<Stream>> AclDevice::CreateStream() {
  KVFERRY_RETURN_IF_ERROR(s_->MakeCurrent());
  acl::aclrtStream st = nullptr;
  if (const acl::aclError r = s_->rt->aclrtCreateStream(&st); r != acl::ACL_SUCCESS) {
    return Status::ResourceExhausted(s_->name + ": " + s_->rt->Describe("aclrtCreateStream", r));
  }
  return std::unique_ptr<Stream>(new AclStream(s_, st));
}

Result<std::unique_ptr<Event>> AclDevice::RecordEventOn(std::uint64_t native_stream) {
  return RecordAclEvent(s_, Ptr(native_stream));
}

}  // namespace kvferry::device
