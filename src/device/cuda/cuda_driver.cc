#include "device/cuda/cuda_driver.h"

#include <dlfcn.h>

namespace kvferry::device {

CudaDriver::~CudaDriver() {
  if (library_ != nullptr) dlclose(library_);
}

std::string CudaDriver::Describe(const char* call, cu::CUresult r) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (cuGetErrorName == nullptr || cuGetErrorName(r, &name) != cu::CUDA_SUCCESS) name = nullptr;
  if (cuGetErrorString == nullptr || cuGetErrorString(r, &text) != cu::CUDA_SUCCESS) text = nullptr;
  return std::string(call) + " failed: " + (name ? name : "CUresult") + " " +
         std::to_string(static_cast<int>(r)) + (text ? std::string(" (") + text + ")" : "");
}

Result<std::shared_ptr<const CudaDriver>> CudaDriver::Load(std::string_view library) {
  const std::string path(library);
  std::shared_ptr<CudaDriver> d(new CudaDriver());
  d->library_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (d->library_ == nullptr) {
    const char* err = dlerror();  // NOLINT(concurrency-mt-unsafe): glibc keeps it per thread
    return Status::Unavailable("no CUDA driver: dlopen(" + path +
                               ") failed: " + (err ? err : "unknown error") +
                               "; install the NVIDIA driver, or use the sim device");
  }
  // dlsym returns void*; POSIX guarantees it converts to a function pointer.
#define KVFERRY_CUDA_RESOLVE(sym, ret, params)                                              \
  d->sym = reinterpret_cast<cu::PFN_##sym>(dlsym(d->library_, #sym));                       \
  if (d->sym == nullptr) {                                                                  \
    return Status::Unavailable("no CUDA driver: " + path +                                  \
                               " lacks " #sym                                               \
                               "; the driver is too old for kvferry (CUDA 11.3 or newer)"); \
  }
  KVFERRY_CUDA_FUNCTIONS(KVFERRY_CUDA_RESOLVE)
#undef KVFERRY_CUDA_RESOLVE

  const cu::CUresult init = d->cuInit(0);
  if (init == cu::CUDA_ERROR_STUB_LIBRARY) {
    return Status::Unavailable("no CUDA driver: " + path +
                               " is the toolkit's stub library, not a driver (" +
                               d->Describe("cuInit", init) + ")");
  }
  if (init == cu::CUDA_ERROR_NO_DEVICE) {
    return Status::Unavailable("no CUDA device: " + d->Describe("cuInit", init));
  }
  if (init != cu::CUDA_SUCCESS) {
    return Status::Unavailable("no CUDA driver: " + d->Describe("cuInit", init));
  }
  if (const auto r = d->cuDriverGetVersion(&d->version_); r != cu::CUDA_SUCCESS) {
    return Status::Unavailable("no CUDA driver: " + d->Describe("cuDriverGetVersion", r));
  }
  if (const auto r = d->cuDeviceGetCount(&d->device_count_); r != cu::CUDA_SUCCESS) {
    return Status::Unavailable("no CUDA device: " + d->Describe("cuDeviceGetCount", r));
  }
  if (d->device_count_ <= 0) {
    return Status::Unavailable("no CUDA device: the driver (version " +
                               std::to_string(d->version_) + ") reports 0 devices");
  }
  return std::shared_ptr<const CudaDriver>(std::move(d));
}

}  // namespace kvferry::device
