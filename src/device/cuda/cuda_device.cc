#include "device/cuda/cuda_device.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "common/hex.h"
#include "common/log.h"

namespace kvferry::device {
namespace {

// The driver and context every object of one device needs to make calls.
struct CudaCtx {
  std::shared_ptr<const CudaDriver> driver;
  cu::CUcontext ctx;
  Status MakeCurrent() const {
    const auto r = driver->cuCtxSetCurrent(ctx);
    return r == cu::CUDA_SUCCESS ? Status::Ok()
                                 : Status::Internal(driver->Describe("cuCtxSetCurrent", r));
  }
};

class CudaAllocation final : public DeviceAllocation {
 public:
  CudaAllocation(CudaCtx c, cu::CUdeviceptr p, std::uint64_t size)
      : c_(std::move(c)), p_(p), size_(size) {}
  ~CudaAllocation() override {
    if (c_.MakeCurrent().ok()) (void)c_.driver->cuMemFree_v2(p_);
  }
  DeviceAddress address() const override { return p_; }
  std::uint64_t size() const override { return size_; }

 private:
  CudaCtx c_;
  cu::CUdeviceptr p_;
  std::uint64_t size_;
};

class CudaImported final : public ImportedMemory {
 public:
  CudaImported(CudaCtx c, cu::CUdeviceptr p, std::uint64_t size)
      : c_(std::move(c)), p_(p), size_(size) {}
  ~CudaImported() override {
    if (c_.MakeCurrent().ok()) (void)c_.driver->cuIpcCloseMemHandle(p_);
  }
  DeviceAddress base() const override { return p_; }
  std::uint64_t size() const override { return size_; }

 private:
  CudaCtx c_;
  cu::CUdeviceptr p_;
  std::uint64_t size_;
};

class CudaPinned final : public PinnedBuffer {
 public:
  CudaPinned(CudaCtx c, void* p, std::uint64_t size) : c_(std::move(c)), p_(p), size_(size) {}
  ~CudaPinned() override {
    if (c_.MakeCurrent().ok()) (void)c_.driver->cuMemFreeHost(p_);
  }
  std::byte* data() const override { return static_cast<std::byte*>(p_); }
  std::uint64_t size() const override { return size_; }

 private:
  CudaCtx c_;
  void* p_;
  std::uint64_t size_;
};

class CudaEvent final : public Event {
 public:
  CudaEvent(CudaCtx c, cu::CUevent e) : c_(std::move(c)), e_(e) {}
  ~CudaEvent() override {
    if (c_.MakeCurrent().ok()) (void)c_.driver->cuEventDestroy_v2(e_);
  }
  EventPoll Poll() override {
    if (Status s = c_.MakeCurrent(); !s.ok()) return {EventState::kFailed, std::move(s)};
    const auto r = c_.driver->cuEventQuery(e_);
    if (r == cu::CUDA_SUCCESS) return {EventState::kComplete, Status::Ok()};
    if (r == cu::CUDA_ERROR_NOT_READY) return {EventState::kPending, Status::Ok()};
    return {EventState::kFailed, Status::Internal(c_.driver->Describe("cuEventQuery", r) +
                                                  ": a copy before the event failed")};
  }
  // cuEventSynchronize has no deadline: poll.
  Status Wait(Deadline deadline) override { return PollEventUntil(*this, deadline, "cuda event"); }

 private:
  CudaCtx c_;
  cu::CUevent e_;
};

// An event recorded on `stream` now, in context `c`.
Result<std::unique_ptr<Event>> RecordCudaEvent(const CudaCtx& c, cu::CUstream stream) {
  KVFERRY_RETURN_IF_ERROR(c.MakeCurrent());
  cu::CUevent e = nullptr;
  if (const auto r = c.driver->cuEventCreate(&e, cu::kEventDisableTiming); r != cu::CUDA_SUCCESS) {
    return Status::ResourceExhausted(c.driver->Describe("cuEventCreate", r));
  }
  auto event = std::make_unique<CudaEvent>(c, e);
  if (const auto r = c.driver->cuEventRecord(e, stream); r != cu::CUDA_SUCCESS) {
    return Status::InvalidArgument(c.driver->Describe("cuEventRecord", r) +
                                   ": expected a live stream of this device's primary context");
  }
  return std::unique_ptr<Event>(std::move(event));
}

class CudaStream final : public Stream {
 public:
  CudaStream(CudaCtx c, cu::CUstream s) : c_(std::move(c)), s_(s) {}
  // cuStreamDestroy returns at once; the driver finishes enqueued copies and then frees the stream.
  ~CudaStream() override {
    if (c_.MakeCurrent().ok()) (void)c_.driver->cuStreamDestroy_v2(s_);
  }
  Status CopyHostToDevice(DeviceAddress dst, const std::byte* src, std::uint64_t size) override {
    KVFERRY_RETURN_IF_ERROR(c_.MakeCurrent());
    return Check("cuMemcpyHtoDAsync", c_.driver->cuMemcpyHtoDAsync_v2(dst, src, size, s_));
  }
  Status CopyDeviceToHost(std::byte* dst, DeviceAddress src, std::uint64_t size) override {
    KVFERRY_RETURN_IF_ERROR(c_.MakeCurrent());
    return Check("cuMemcpyDtoHAsync", c_.driver->cuMemcpyDtoHAsync_v2(dst, src, size, s_));
  }
  Status CopyDeviceToDevice(DeviceAddress dst, DeviceAddress src, std::uint64_t size) override {
    KVFERRY_RETURN_IF_ERROR(c_.MakeCurrent());
    return Check("cuMemcpyDtoDAsync", c_.driver->cuMemcpyDtoDAsync_v2(dst, src, size, s_));
  }
  Result<std::unique_ptr<Event>> RecordEvent() override { return RecordCudaEvent(c_, s_); }
  std::uint64_t native_handle() const override { return reinterpret_cast<std::uint64_t>(s_); }

 private:
  Status Check(const char* call, cu::CUresult r) const {
    if (r == cu::CUDA_SUCCESS) return Status::Ok();
    return Status::InvalidArgument(c_.driver->Describe(call, r) +
                                   ": check that both ranges lie in live memory of this device");
  }
  CudaCtx c_;
  cu::CUstream s_;
};

}  // namespace

CudaDevice::CudaDevice(std::shared_ptr<const CudaDriver> driver, int index, cu::CUdevice dev,
                       cu::CUcontext ctx)
    : driver_(std::move(driver)),
      index_(index),
      name_("cuda:" + std::to_string(index)),
      dev_(dev),
      ctx_(ctx) {}

CudaDevice::~CudaDevice() { (void)driver_->cuDevicePrimaryCtxRelease_v2(dev_); }

Result<std::unique_ptr<CudaDevice>> CudaDevice::Open(int index) {
  KVFERRY_ASSIGN_OR_RETURN(auto driver, CudaDriver::Load());
  return Open(index, std::move(driver));
}

Result<std::unique_ptr<CudaDevice>> CudaDevice::Open(int index,
                                                     std::shared_ptr<const CudaDriver> driver) {
  if (index < 0 || index >= driver->device_count()) {
    return Status::InvalidArgument("cuda:" + std::to_string(index) + ": expected an index below " +
                                   std::to_string(driver->device_count()) +
                                   " (the devices the driver sees; CUDA_VISIBLE_DEVICES applies)");
  }
  cu::CUdevice dev = 0;
  if (const auto r = driver->cuDeviceGet(&dev, index); r != cu::CUDA_SUCCESS) {
    return Status::Unavailable("no CUDA device: " + driver->Describe("cuDeviceGet", r));
  }
  cu::CUcontext ctx = nullptr;
  if (const auto r = driver->cuDevicePrimaryCtxRetain(&ctx, dev); r != cu::CUDA_SUCCESS) {
    return Status::Unavailable("cuda:" + std::to_string(index) + ": " +
                               driver->Describe("cuDevicePrimaryCtxRetain", r));
  }
  return std::unique_ptr<CudaDevice>(new CudaDevice(std::move(driver), index, dev, ctx));
}

Status CudaDevice::MakeCurrent() const { return CudaCtx{driver_, ctx_}.MakeCurrent(); }

Result<PointerInfo> CudaDevice::Query(DeviceAddress address) const {
  KVFERRY_RETURN_IF_ERROR(MakeCurrent());
  int memory_type = 0;
  int ordinal = -1;
  if (driver_->cuPointerGetAttribute(&memory_type, cu::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address) !=
          cu::CUDA_SUCCESS ||
      memory_type != cu::CU_MEMORYTYPE_DEVICE ||
      driver_->cuPointerGetAttribute(&ordinal, cu::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, address) !=
          cu::CUDA_SUCCESS ||
      ordinal != index_) {
    return Status::NotFound(name_ + ": " + Hex(address) +
                            " is not device memory of this GPU (host, managed, or another GPU's)");
  }
  cu::CUdeviceptr base = 0;
  std::size_t size = 0;
  if (const auto r = driver_->cuMemGetAddressRange_v2(&base, &size, address);
      r != cu::CUDA_SUCCESS) {
    return Status::NotFound(name_ + ": " + driver_->Describe("cuMemGetAddressRange", r));
  }
  return PointerInfo{name_, index_, base, size};
}

Result<std::unique_ptr<DeviceAllocation>> CudaDevice::Allocate(std::uint64_t size) {
  if (size == 0) return Status::InvalidArgument(name_ + ": expected an allocation size > 0");
  KVFERRY_RETURN_IF_ERROR(MakeCurrent());
  cu::CUdeviceptr p = 0;
  if (const auto r = driver_->cuMemAlloc_v2(&p, size); r != cu::CUDA_SUCCESS) {
    return Status::ResourceExhausted(name_ + ": " + driver_->Describe("cuMemAlloc", r));
  }
  return std::unique_ptr<DeviceAllocation>(new CudaAllocation(CudaCtx{driver_, ctx_}, p, size));
}

Result<std::unique_ptr<PinnedBuffer>> CudaDevice::AllocatePinned(std::uint64_t size) {
  if (size == 0) return Status::InvalidArgument(name_ + ": expected a pinned buffer size > 0");
  KVFERRY_RETURN_IF_ERROR(MakeCurrent());
  void* p = nullptr;
  if (const auto r = driver_->cuMemHostAlloc(&p, size, cu::kMemHostAllocPortable);
      r != cu::CUDA_SUCCESS) {
    return Status::ResourceExhausted(name_ + ": " + driver_->Describe("cuMemHostAlloc", r));
  }
  return std::unique_ptr<PinnedBuffer>(new CudaPinned(CudaCtx{driver_, ctx_}, p, size));
}

Result<IpcHandle> CudaDevice::ExportIpc(DeviceAddress address) {
  KVFERRY_ASSIGN_OR_RETURN(PointerInfo info, Query(address));
  int capable = 0;
  const auto r = driver_->cuPointerGetAttribute(
      &capable, cu::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, info.alloc_base);
  if (r != cu::CUDA_SUCCESS || capable == 0) {
    Status s = Status::NotSupported(
        name_ + ": the allocation at " + Hex(info.alloc_base) +
        " cannot be exported with cuIpcGetMemHandle (made by cuMemCreate/VMM, e.g. PyTorch's "
        "expandable segments); copies from it go through host staging");
    if (!export_fallback_logged_.exchange(true)) Log().warn("{}", s.message());
    return s;
  }
  cu::CUipcMemHandle raw{};
  if (const auto g = driver_->cuIpcGetMemHandle(&raw, info.alloc_base); g != cu::CUDA_SUCCESS) {
    Status s = Status::NotSupported(name_ + ": " + driver_->Describe("cuIpcGetMemHandle", g) +
                                    "; copies from this allocation go through host staging");
    if (!export_fallback_logged_.exchange(true)) Log().warn("{}", s.message());
    return s;
  }
  IpcHandle h;
  h.kind = "cuda";
  h.device_index = index_;
  h.alloc_size = info.alloc_size;
  h.offset = address - info.alloc_base;
  h.opaque.resize(sizeof(raw));
  std::memcpy(h.opaque.data(), &raw, sizeof(raw));
  return h;
}

Result<std::unique_ptr<ImportedMemory>> CudaDevice::ImportIpc(const IpcHandle& handle) {
  cu::CUipcMemHandle raw{};
  if (handle.kind != "cuda" || handle.opaque.size() != sizeof(raw)) {
    return Status::InvalidArgument(
        name_ + ": expected a cuda IPC handle of 64 bytes; found kind \"" + handle.kind +
        "\" with " + std::to_string(handle.opaque.size()) + " bytes");
  }
  std::memcpy(&raw, handle.opaque.data(), sizeof(raw));
  KVFERRY_RETURN_IF_ERROR(MakeCurrent());
  cu::CUdeviceptr p = 0;
  if (const auto r = driver_->cuIpcOpenMemHandle_v2(&p, raw, cu::kIpcMemLazyEnablePeerAccess);
      r != cu::CUDA_SUCCESS) {
    return Status::Unavailable(name_ + ": " + driver_->Describe("cuIpcOpenMemHandle", r) +
                               "; the exporter must be alive, on this host, in another process");
  }
  return std::unique_ptr<ImportedMemory>(
      new CudaImported(CudaCtx{driver_, ctx_}, p, handle.alloc_size));
}

Result<std::unique_ptr<Stream>> CudaDevice::CreateStream() {
  KVFERRY_RETURN_IF_ERROR(MakeCurrent());
  cu::CUstream s = nullptr;
  if (const auto r = driver_->cuStreamCreate(&s, cu::kStreamNonBlocking); r != cu::CUDA_SUCCESS) {
    return Status::ResourceExhausted(name_ + ": " + driver_->Describe("cuStreamCreate", r));
  }
  return std::unique_ptr<Stream>(new CudaStream(CudaCtx{driver_, ctx_}, s));
}

Result<std::unique_ptr<Event>> CudaDevice::RecordEventOn(std::uint64_t native_stream) {
  return RecordCudaEvent(CudaCtx{driver_, ctx_},
                         reinterpret_cast<cu::CUstream>(native_stream));  // NOLINT
}

}  // namespace kvferry::device
