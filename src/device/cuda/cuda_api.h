// The part of NVIDIA's CUDA driver API that kvferry uses, declared here so the build needs no CUDA
// toolkit: libcuda.so.1 is loaded at run time (cuda_driver.h). Types, values and signatures follow
// cuda.h (CUDA 12/13, 64-bit Linux, CUDAAPI empty); tests/unit/device/cuda_header_check_test.cc
// checks every one of them against cuda.h where a toolkit is installed.
#pragma once

#include <cstddef>

// Opaque handles: the same global struct names as cuda.h, so the pointer types are identical.
struct CUctx_st;
struct CUstream_st;
struct CUevent_st;

namespace kvferry::device::cu {

// Distinct enum types (cuda.h's are unscoped enums of the same size and values). The names are
// cuda.h's, so the header check and readers can match them one to one.
// NOLINTBEGIN(readability-identifier-naming)
enum CUresult : int {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_STUB_LIBRARY = 34,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_NOT_SUPPORTED = 801,
};

enum CUpointer_attribute : int {
  CU_POINTER_ATTRIBUTE_CONTEXT = 1,
  CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
  CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
  CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10,
};

// Values of CU_POINTER_ATTRIBUTE_MEMORY_TYPE (cuda.h's CUmemorytype).
enum CUmemorytype : int {
  CU_MEMORYTYPE_HOST = 1,
  CU_MEMORYTYPE_DEVICE = 2,
  CU_MEMORYTYPE_ARRAY = 3,
  CU_MEMORYTYPE_UNIFIED = 4,
};
// NOLINTEND(readability-identifier-naming)

using CUdeviceptr = unsigned long long;
using CUdevice = int;
using CUcontext = CUctx_st*;
using CUstream = CUstream_st*;
using CUevent = CUevent_st*;

inline constexpr std::size_t kIpcHandleSize = 64;  // CU_IPC_HANDLE_SIZE
struct CUipcMemHandle {
  char reserved[kIpcHandleSize];
};

inline constexpr unsigned int kIpcMemLazyEnablePeerAccess =
    0x1;                                                    // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
inline constexpr unsigned int kStreamNonBlocking = 0x1;     // CU_STREAM_NON_BLOCKING
inline constexpr unsigned int kEventDisableTiming = 0x2;    // CU_EVENT_DISABLE_TIMING
inline constexpr unsigned int kMemHostAllocPortable = 0x1;  // CU_MEMHOSTALLOC_PORTABLE

// Every driver function kvferry calls: X(exported symbol, return type, parameter list). The
// symbol is the versioned name libcuda exports for the default (legacy stream) API, which is what
// cuda.h's macros (cuMemAlloc -> cuMemAlloc_v2, ...) resolve to without per-thread streams.
#define KVFERRY_CUDA_FUNCTIONS(X)                                                      \
  X(cuGetErrorString, CUresult, (CUresult, const char**))                              \
  X(cuGetErrorName, CUresult, (CUresult, const char**))                                \
  X(cuInit, CUresult, (unsigned int))                                                  \
  X(cuDriverGetVersion, CUresult, (int*))                                              \
  X(cuDeviceGetCount, CUresult, (int*))                                                \
  X(cuDeviceGet, CUresult, (CUdevice*, int))                                           \
  X(cuDevicePrimaryCtxRetain, CUresult, (CUcontext*, CUdevice))                        \
  X(cuDevicePrimaryCtxRelease_v2, CUresult, (CUdevice))                                \
  X(cuCtxSetCurrent, CUresult, (CUcontext))                                            \
  X(cuMemAlloc_v2, CUresult, (CUdeviceptr*, std::size_t))                              \
  X(cuMemFree_v2, CUresult, (CUdeviceptr))                                             \
  X(cuMemHostAlloc, CUresult, (void**, std::size_t, unsigned int))                     \
  X(cuMemFreeHost, CUresult, (void*))                                                  \
  X(cuPointerGetAttribute, CUresult, (void*, CUpointer_attribute, CUdeviceptr))        \
  X(cuMemGetAddressRange_v2, CUresult, (CUdeviceptr*, std::size_t*, CUdeviceptr))      \
  X(cuIpcGetMemHandle, CUresult, (CUipcMemHandle*, CUdeviceptr))                       \
  X(cuIpcOpenMemHandle_v2, CUresult, (CUdeviceptr*, CUipcMemHandle, unsigned int))     \
  X(cuIpcCloseMemHandle, CUresult, (CUdeviceptr))                                      \
  X(cuStreamCreate, CUresult, (CUstream*, unsigned int))                               \
  X(cuStreamDestroy_v2, CUresult, (CUstream))                                          \
  X(cuMemcpyHtoDAsync_v2, CUresult, (CUdeviceptr, const void*, std::size_t, CUstream)) \
  X(cuMemcpyDtoHAsync_v2, CUresult, (void*, CUdeviceptr, std::size_t, CUstream))       \
  X(cuMemcpyDtoDAsync_v2, CUresult, (CUdeviceptr, CUdeviceptr, std::size_t, CUstream)) \
  X(cuEventCreate, CUresult, (CUevent*, unsigned int))                                 \
  X(cuEventDestroy_v2, CUresult, (CUevent))                                            \
  X(cuEventRecord, CUresult, (CUevent, CUstream))                                      \
  X(cuEventQuery, CUresult, (CUevent))

// PFN_<symbol>: a pointer to that function. `params` is a parenthesised list already.
// NOLINTNEXTLINE(bugprone-macro-parentheses)
#define KVFERRY_CUDA_PFN(name, ret, params) using PFN_##name = ret(*) params;
KVFERRY_CUDA_FUNCTIONS(KVFERRY_CUDA_PFN)
#undef KVFERRY_CUDA_PFN

}  // namespace kvferry::device::cu
