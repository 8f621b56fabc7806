// The cuda device: one GPU through the driver API loaded at run time (docs/device.md).
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "device/cuda/cuda_driver.h"
#include "device/device.h"

namespace kvferry::device {

/// Uses the device's primary context (the one the CUDA runtime and PyTorch use), made current on
/// the calling thread by every method. Thread-safe.
class CudaDevice final : public Device {
 public:
  /// Loads the driver (CudaDriver::Load) and retains device `index`'s primary context.
  /// Unavailable "no CUDA driver ..." / "no CUDA device ..." where there is none; InvalidArgument
  /// for an index past the device count.
  static Result<std::unique_ptr<CudaDevice>> Open(int index);
  static Result<std::unique_ptr<CudaDevice>> Open(int index,
                                                  std::shared_ptr<const CudaDriver> driver);
  ~CudaDevice() override;

  const std::string& name() const override { return name_; }
  std::string_view kind() const override { return "cuda"; }
  int index() const override { return index_; }

  /// cuPointerGetAttribute (device ordinal, memory type) and cuMemGetAddressRange. NotFound for
  /// memory that is not device memory of this GPU.
  Result<PointerInfo> Query(DeviceAddress address) const override;
  /// cuMemAlloc.
  Result<std::unique_ptr<DeviceAllocation>> Allocate(std::uint64_t size) override;
  /// cuMemHostAlloc(CU_MEMHOSTALLOC_PORTABLE).
  Result<std::unique_ptr<PinnedBuffer>> AllocatePinned(std::uint64_t size) override;
  /// cuIpcGetMemHandle of the allocation base, plus the offset. NotSupported for allocations that
  /// legacy CUDA IPC cannot export (cuMemCreate/VMM, PyTorch expandable segments): the caller
  /// stages through host memory; logged once per device.
  Result<IpcHandle> ExportIpc(DeviceAddress address) override;
  /// cuIpcOpenMemHandle(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS). The driver refuses a handle exported
  /// by this same process (Unavailable).
  Result<std::unique_ptr<ImportedMemory>> ImportIpc(const IpcHandle& handle) override;
  /// cuStreamCreate(CU_STREAM_NON_BLOCKING).
  Result<std::unique_ptr<Stream>> CreateStream() override;
  /// cuEventRecord on the CUstream `native_stream` (which must belong to this device's primary
  /// context: torch's streams do).
  Result<std::unique_ptr<Event>> RecordEventOn(std::uint64_t native_stream) override;

 private:
  CudaDevice(std::shared_ptr<const CudaDriver> driver, int index, cu::CUdevice dev,
             cu::CUcontext ctx);
  Status MakeCurrent() const;

  std::shared_ptr<const CudaDriver> driver_;
  const int index_;
  const std::string name_;
  const cu::CUdevice dev_;
  const cu::CUcontext ctx_;
  std::atomic<bool> export_fallback_logged_{false};
};

}  // namespace kvferry::device
