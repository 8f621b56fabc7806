// A fake libcuda for tests without a GPU: the driver API functions the cuda device uses, on host
// memory, with controls a test reaches by dlsym. It checks kvferry's use of the API as kvferry
// understands it (offsets, fallbacks, event states); it proves nothing about the real driver.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "device/cuda/cuda_api.h"

using namespace kvferry::device::cu;  // NOLINT(google-build-using-namespace): a test library

// The opaque handle types, defined here (the real driver's are its own).
struct CUstream_st {};
struct CUevent_st {};

namespace {

struct FakeAllocation {
  std::size_t size;
  bool ipc_capable;
};

std::mutex mu;
std::map<CUdeviceptr, FakeAllocation> allocations;  // guarded by mu
bool next_ipc_capable = true;                       // guarded by mu
CUresult event_query_result = CUDA_SUCCESS;         // guarded by mu
int fake_context;                                   // its address is the context

const FakeAllocation* Find(CUdeviceptr p, CUdeviceptr* base) {
  auto it = allocations.upper_bound(p);
  if (it == allocations.begin()) return nullptr;
  --it;
  if (p - it->first >= it->second.size) return nullptr;
  *base = it->first;
  return &it->second;
}

}  // namespace

extern "C" {

// Controls for tests.
void fake_cuda_set_ipc_capable(int capable) {
  std::lock_guard<std::mutex> lock(mu);
  next_ipc_capable = capable != 0;
}
void fake_cuda_set_event_query_result(int result) {
  std::lock_guard<std::mutex> lock(mu);
  event_query_result = static_cast<CUresult>(result);
}

CUresult cuGetErrorString(CUresult, const char** s) {
  *s = "fake error";
  return CUDA_SUCCESS;
}
CUresult cuGetErrorName(CUresult, const char** s) {
  *s = "CUDA_ERROR_FAKE";
  return CUDA_SUCCESS;
}
CUresult cuInit(unsigned int) { return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int* v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetCount(int* n) {
  *n = 1;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_VALUE;
  *d = 0;
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice) {
  *c = reinterpret_cast<CUcontext>(&fake_context);
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext c) {
  return c == reinterpret_cast<CUcontext>(&fake_context) ? CUDA_SUCCESS
                                                         : CUDA_ERROR_INVALID_CONTEXT;
}
CUresult cuMemAlloc_v2(CUdeviceptr* p, std::size_t size) {
  void* m = std::malloc(size);
  if (m == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> lock(mu);
  *p = reinterpret_cast<CUdeviceptr>(m);
  allocations[*p] = {size, next_ipc_capable};
  return CUDA_SUCCESS;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  std::lock_guard<std::mutex> lock(mu);
  if (allocations.erase(p) != 1) return CUDA_ERROR_INVALID_VALUE;
  std::free(reinterpret_cast<void*>(p));
  return CUDA_SUCCESS;
}
CUresult cuMemHostAlloc(void** p, std::size_t size, unsigned int) {
  *p = std::malloc(size);
  return *p != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuMemFreeHost(void* p) {
  std::free(p);
  return CUDA_SUCCESS;
}
CUresult cuPointerGetAttribute(void* data, CUpointer_attribute attribute, CUdeviceptr p) {
  std::lock_guard<std::mutex> lock(mu);
  CUdeviceptr base = 0;
  const FakeAllocation* a = Find(p, &base);
  if (a == nullptr) return CUDA_ERROR_INVALID_VALUE;
  int value = 0;
  switch (attribute) {
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
      value = CU_MEMORYTYPE_DEVICE;
      break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
      value = 0;
      break;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
      value = a->ipc_capable ? 1 : 0;
      break;
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
  std::memcpy(data, &value, sizeof(value));
  return CUDA_SUCCESS;
}
CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, std::size_t* size, CUdeviceptr p) {
  std::lock_guard<std::mutex> lock(mu);
  const FakeAllocation* a = Find(p, base);
  if (a == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *size = a->size;
  return CUDA_SUCCESS;
}
// The handle holds the base address; the real driver refuses an in-process import, this fake maps
// it to the same memory.
CUresult cuIpcGetMemHandle(CUipcMemHandle* h, CUdeviceptr p) {
  std::lock_guard<std::mutex> lock(mu);
  if (allocations.count(p) != 1) return CUDA_ERROR_INVALID_VALUE;  // must be a base
  std::memset(h, 0, sizeof(*h));
  std::memcpy(h->reserved, &p, sizeof(p));
  return CUDA_SUCCESS;
}
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* p, CUipcMemHandle h, unsigned int) {
  std::memcpy(p, h.reserved, sizeof(*p));
  std::lock_guard<std::mutex> lock(mu);
  return allocations.count(*p) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuIpcCloseMemHandle(CUdeviceptr) { return CUDA_SUCCESS; }
CUresult cuStreamCreate(CUstream* s, unsigned int) {
  *s = new CUstream_st;
  return CUDA_SUCCESS;
}
CUresult cuStreamDestroy_v2(CUstream s) {
  delete s;
  return CUDA_SUCCESS;
}
// Copies run at once; only events model asynchrony (fake_cuda_set_event_query_result).
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, std::size_t n, CUstream) {
  std::memcpy(reinterpret_cast<void*>(dst), src, n);
  return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, std::size_t n, CUstream) {
  std::memcpy(dst, reinterpret_cast<const void*>(src), n);
  return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, std::size_t n, CUstream) {
  std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
  return CUDA_SUCCESS;
}
CUresult cuEventCreate(CUevent* e, unsigned int) {
  *e = new CUevent_st;
  return CUDA_SUCCESS;
}
CUresult cuEventDestroy_v2(CUevent e) {
  delete e;
  return CUDA_SUCCESS;
}
CUresult cuEventRecord(CUevent, CUstream) { return CUDA_SUCCESS; }
CUresult cuEventQuery(CUevent) {
  std::lock_guard<std::mutex> lock(mu);
  return event_query_result;
}

}  // extern "C"
