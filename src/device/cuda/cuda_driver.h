// libcuda.so.1 loaded at run time: the build needs no CUDA toolkit and the binary runs where no
// driver exists (then loading is Unavailable "no CUDA driver ...").
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "device/cuda/cuda_api.h"
#include "kvferry/status.h"

namespace kvferry::device {

/// The driver's entry points, resolved with dlsym. Immutable after Load; thread-safe (the driver
/// itself is). Keeps the library loaded while it lives.
class CudaDriver {
 public:
  /// Loads `library`, resolves every function of cuda_api.h, calls cuInit(0) and counts devices.
  /// Unavailable "no CUDA driver ..." when the library cannot be loaded, lacks a symbol, is the
  /// toolkit's stub, or cuInit fails; Unavailable "no CUDA device" when the count is 0.
  static Result<std::shared_ptr<const CudaDriver>> Load(std::string_view library = "libcuda.so.1");
  ~CudaDriver();
  CudaDriver(const CudaDriver&) = delete;
  CudaDriver& operator=(const CudaDriver&) = delete;

  int device_count() const { return device_count_; }
  int version() const { return version_; }

  /// "<call> failed: CUDA_ERROR_X (<text>)" for a failed call's result.
  std::string Describe(const char* call, cu::CUresult r) const;

#define KVFERRY_CUDA_MEMBER(name, ret, params) cu::PFN_##name name = nullptr;
  KVFERRY_CUDA_FUNCTIONS(KVFERRY_CUDA_MEMBER)
#undef KVFERRY_CUDA_MEMBER

 private:
  CudaDriver() = default;
  void* library_ = nullptr;
  int device_count_ = 0;
  int version_ = 0;
};

}  // namespace kvferry::device
