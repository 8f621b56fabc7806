// Checks src/device/cuda/cuda_api.h against NVIDIA's cuda.h: every function pointer type, enum
// value and struct size kvferry relies on. The checks are static_asserts, so a mismatch fails the
// build of this test. Built everywhere; where CMake found no cuda.h the test SKIPs with the reason.
#include <gtest/gtest.h>

#if KVFERRY_HAVE_CUDA_H
#include <cuda.h>
#include <dlfcn.h>
#endif

#include <type_traits>

#include "device/cuda/cuda_api.h"

#if KVFERRY_HAVE_CUDA_H
namespace {

namespace cu = kvferry::device::cu;

// Maps a type of cuda_api.h to the cuda.h type it stands for; other types map to themselves.
template <typename T>
struct ToCudaH {
  using type = T;
};
template <>
struct ToCudaH<cu::CUresult> {
  using type = ::CUresult;
};
template <>
struct ToCudaH<cu::CUpointer_attribute> {
  using type = ::CUpointer_attribute;
};
template <>
struct ToCudaH<cu::CUipcMemHandle> {
  using type = ::CUipcMemHandle;
};
template <typename T>
struct ToCudaH<T*> {
  using type = typename ToCudaH<T>::type*;
};
template <typename T>
struct ToCudaH<const T> {
  using type = const typename ToCudaH<T>::type;
};
template <typename R, typename... A>
struct ToCudaH<R (*)(A...)> {
  using type = typename ToCudaH<R>::type (*)(typename ToCudaH<A>::type...);
};

// Every function: our pointer type, translated, is exactly the type of cuda.h's declaration of
// the exported symbol (cuda.h's macros map e.g. cuMemAlloc to cuMemAlloc_v2).
#define KVFERRY_CHECK_SIGNATURE(name, ret, params)                                \
  static_assert(std::is_same_v<ToCudaH<cu::PFN_##name>::type, decltype(&::name)>, \
                #name ": cuda_api.h's signature differs from cuda.h's");
KVFERRY_CUDA_FUNCTIONS(KVFERRY_CHECK_SIGNATURE)
#undef KVFERRY_CHECK_SIGNATURE

// Types passed by value or through pointers.
static_assert(std::is_same_v<cu::CUdeviceptr, ::CUdeviceptr>);
static_assert(std::is_same_v<cu::CUdevice, ::CUdevice>);
static_assert(std::is_same_v<cu::CUcontext, ::CUcontext>);
static_assert(std::is_same_v<cu::CUstream, ::CUstream>);
static_assert(std::is_same_v<cu::CUevent, ::CUevent>);
static_assert(sizeof(cu::CUresult) == sizeof(::CUresult));
static_assert(sizeof(cu::CUpointer_attribute) == sizeof(::CUpointer_attribute));
static_assert(sizeof(cu::CUipcMemHandle) == sizeof(::CUipcMemHandle));
static_assert(alignof(cu::CUipcMemHandle) == alignof(::CUipcMemHandle));
static_assert(cu::kIpcHandleSize == CU_IPC_HANDLE_SIZE);

// Every value.
#define KVFERRY_CHECK_VALUE(ours, theirs) \
  static_assert(static_cast<long long>(ours) == static_cast<long long>(theirs), #ours);
KVFERRY_CHECK_VALUE(cu::CUDA_SUCCESS, ::CUDA_SUCCESS)
KVFERRY_CHECK_VALUE(cu::CUDA_ERROR_INVALID_VALUE, ::CUDA_ERROR_INVALID_VALUE)
KVFERRY_CHECK_VALUE(cu::CUDA_ERROR_NOT_INITIALIZED, ::CUDA_ERROR_NOT_INITIALIZED)
KVFERRY_CHECK_VALUE(cu::CUDA_ERROR_STUB_LIBRARY, ::CUDA_ERROR_STUB_LIBRARY)
KVFERRY_CHECK_VALUE(cu::CUDA_ERROR_NO_DEVICE, ::CUDA_ERROR_NO_DEVICE)
KVFERRY_CHECK_VALUE(cu::CUDA_ERROR_INVALID_CONTEXT, ::CUDA_ERROR_INVALID_CONTEXT)
KVFERRY_CHECK_VALUE(cu::CUDA_ERROR_NOT_READY, ::CUDA_ERROR_NOT_READY)
KVFERRY_CHECK_VALUE(cu::CUDA_ERROR_NOT_SUPPORTED, ::CUDA_ERROR_NOT_SUPPORTED)
KVFERRY_CHECK_VALUE(cu::CU_POINTER_ATTRIBUTE_CONTEXT, ::CU_POINTER_ATTRIBUTE_CONTEXT)
KVFERRY_CHECK_VALUE(cu::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ::CU_POINTER_ATTRIBUTE_MEMORY_TYPE)
KVFERRY_CHECK_VALUE(cu::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
KVFERRY_CHECK_VALUE(cu::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                    ::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE)
KVFERRY_CHECK_VALUE(cu::CU_MEMORYTYPE_HOST, ::CU_MEMORYTYPE_HOST)
KVFERRY_CHECK_VALUE(cu::CU_MEMORYTYPE_DEVICE, ::CU_MEMORYTYPE_DEVICE)
KVFERRY_CHECK_VALUE(cu::CU_MEMORYTYPE_ARRAY, ::CU_MEMORYTYPE_ARRAY)
KVFERRY_CHECK_VALUE(cu::CU_MEMORYTYPE_UNIFIED, ::CU_MEMORYTYPE_UNIFIED)
KVFERRY_CHECK_VALUE(cu::kIpcMemLazyEnablePeerAccess, ::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
KVFERRY_CHECK_VALUE(cu::kStreamNonBlocking, ::CU_STREAM_NON_BLOCKING)
KVFERRY_CHECK_VALUE(cu::kEventDisableTiming, ::CU_EVENT_DISABLE_TIMING)
KVFERRY_CHECK_VALUE(cu::kMemHostAllocPortable, CU_MEMHOSTALLOC_PORTABLE)
#undef KVFERRY_CHECK_VALUE

}  // namespace
#endif

TEST(CudaHeaderCheckTest, DeclarationsMatchCudaH) {
#if KVFERRY_HAVE_CUDA_H
  // The static_asserts above passed, or this file would not have compiled. At run time: every
  // symbol the loader resolves is exported by the toolkit's libcuda stub (same names as a driver).
  const char* stub = KVFERRY_CUDA_STUB_LIB;
  void* lib = dlopen(stub, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    GTEST_SKIP() << "cuda.h matched (compile-time checks passed) but the stub " << stub
                 << " did not load: " << dlerror();
  }
  int missing = 0;
#define KVFERRY_CHECK_EXPORTED(name, ret, params)          \
  if (dlsym(lib, #name) == nullptr) {                      \
    ++missing;                                             \
    ADD_FAILURE() << #name " is not exported by " << stub; \
  }
  KVFERRY_CUDA_FUNCTIONS(KVFERRY_CHECK_EXPORTED)
#undef KVFERRY_CHECK_EXPORTED
  dlclose(lib);
  EXPECT_EQ(missing, 0);
#else
  GTEST_SKIP() << "SKIPPED: no cuda.h found when CMake configured (looked in "
               << KVFERRY_CUDA_INCLUDE_HINT
               << "): src/device/cuda/cuda_api.h was NOT checked against NVIDIA's header. Install "
                  "the CUDA toolkit (or set -DKVFERRY_CUDA_INCLUDE_DIR) and reconfigure.";
#endif
}
