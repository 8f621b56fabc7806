// The part of Huawei CANN's ACL runtime (libascendcl.so) that kvferry uses, declared here so the
// build needs no CANN: the library is opened at run time (acl_runtime.h), and a process that never
// names an NPU never loads it.
//
// Written from the public headers include/external/acl/acl_rt.h and acl_base_rt.h (and
// error_codes/rt_error_codes.h) of github.com/hicann/runtime at commit 681ef7610df1 (2026-08-22,
// ACL version 1.17.0 in acl_rt.h); the header was read, not copied. 64-bit Linux, C linkage,
// ACL_FUNC_VISIBILITY empty. tests/unit/device/acl_header_check_test.cc checks every declaration
// here against acl_rt.h (scripts/acl_header_check.sh; docs/device.md, "The acl header check").
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvferry::device::acl {

// Types and values keep acl_rt.h's names, so the header check and readers can match them one to
// one. acl_rt.h's enums are plain C enums of int size; ours are distinct enum types of the same
// size and values.
// NOLINTBEGIN(readability-identifier-naming)
using aclError = int;
using aclrtStream = void*;
using aclrtEvent = void*;
using aclrtContext = void*;

inline constexpr aclError ACL_SUCCESS = 0;
inline constexpr aclError ACL_ERROR_REPEAT_INITIALIZE = 100002;  // acl_base_rt.h
// NOLINTEND(readability-identifier-naming)
/// ACL_ERROR_RT_STREAM_SYNC_TIMEOUT (a macro in error_codes/rt_error_codes.h, hence not its name):
/// aclrtSynchronizeStreamWithTimeout ran out of time.
inline constexpr aclError kStreamSyncTimeout = 507046;
// NOLINTBEGIN(readability-identifier-naming)

enum aclrtMemMallocPolicy : int {
  ACL_MEM_MALLOC_HUGE_FIRST = 0,
  ACL_MEM_MALLOC_HUGE_ONLY = 1,
  ACL_MEM_MALLOC_NORMAL_ONLY = 2,
};

enum aclrtMemcpyKind : int {
  ACL_MEMCPY_HOST_TO_HOST = 0,
  ACL_MEMCPY_HOST_TO_DEVICE = 1,
  ACL_MEMCPY_DEVICE_TO_HOST = 2,
  ACL_MEMCPY_DEVICE_TO_DEVICE = 3,
};

// What aclrtQueryEventStatus reports. (The deprecated aclrtQueryEvent's aclrtEventStatus numbers
// the two states the other way round: kvferry never uses it.)
enum aclrtEventRecordedStatus : int {
  ACL_EVENT_RECORDED_STATUS_NOT_READY = 0,
  ACL_EVENT_RECORDED_STATUS_COMPLETE = 1,
};

enum aclrtMemLocationType : int {
  ACL_MEM_LOCATION_TYPE_HOST = 0,
  ACL_MEM_LOCATION_TYPE_DEVICE = 1,
  ACL_MEM_LOCATION_TYPE_UNREGISTERED = 2,
};

struct aclrtMemLocation {
  std::uint32_t id;
  aclrtMemLocationType type;
};

struct aclrtPtrAttributes {
  aclrtMemLocation location;
  std::uint32_t pageSize;
  std::uint32_t rsv[4];
};
// NOLINTEND(readability-identifier-naming)

/// aclrtIpcMemGetExportKey's key: a NUL-terminated string in a buffer of this many bytes.
inline constexpr std::size_t kIpcKeyLength = 65;
inline constexpr std::uint64_t kIpcMemExportFlagDefault =
    0x0;  // ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT
inline constexpr std::uint64_t kIpcMemImportFlagDefault =
    0x0;  // ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT

// Every runtime function kvferry needs: X(symbol, return type, parameter list). All of them are in
// CANN releases long before 8.2.RC1; a library that lacks one is not an ACL runtime kvferry can
// use.
#define KVFERRY_ACL_FUNCTIONS(X)                                                  \
  X(aclInit, aclError, (const char*))                                             \
  X(aclGetRecentErrMsg, const char*, ())                                          \
  X(aclrtSetDevice, aclError, (std::int32_t))                                     \
  X(aclrtGetDevice, aclError, (std::int32_t*))                                    \
  X(aclrtGetDeviceCount, aclError, (std::uint32_t*))                              \
  X(aclrtGetCurrentContext, aclError, (aclrtContext*))                            \
  X(aclrtSetCurrentContext, aclError, (aclrtContext))                             \
  X(aclrtMalloc, aclError, (void**, std::size_t, aclrtMemMallocPolicy))           \
  X(aclrtFree, aclError, (void*))                                                 \
  X(aclrtMallocHost, aclError, (void**, std::size_t))                             \
  X(aclrtFreeHost, aclError, (void*))                                             \
  X(aclrtMemcpyAsync, aclError,                                                   \
    (void*, std::size_t, const void*, std::size_t, aclrtMemcpyKind, aclrtStream)) \
  X(aclrtCreateStream, aclError, (aclrtStream*))                                  \
  X(aclrtDestroyStream, aclError, (aclrtStream))                                  \
  X(aclrtSynchronizeStreamWithTimeout, aclError, (aclrtStream, std::int32_t))     \
  X(aclrtCreateEvent, aclError, (aclrtEvent*))                                    \
  X(aclrtDestroyEvent, aclError, (aclrtEvent))                                    \
  X(aclrtRecordEvent, aclError, (aclrtEvent, aclrtStream))                        \
  X(aclrtQueryEventStatus, aclError, (aclrtEvent, aclrtEventRecordedStatus*))

// Functions kvferry uses where the runtime has them (null members of AclRuntime otherwise):
// - aclrtPointerGetAttributes (in CANN 8.1 and newer): memory location and page size, for Query
//   and for the page-aligned range IPC exports;
// - aclrtMemGetAddressRange (documented from CANN 9.0.0): the allocation that holds an address,
//   which Query needs for memory kvferry did not allocate (torch_npu's);
// - the IPC calls (CANN 8.2.RC1 and newer): same-host device-to-device reads. Without them, reads
//   of another process's NPU memory stage through host memory (tcp on loopback).
#define KVFERRY_ACL_QUERY_FUNCTIONS(X)                                       \
  X(aclrtPointerGetAttributes, aclError, (const void*, aclrtPtrAttributes*)) \
  X(aclrtMemGetAddressRange, aclError, (void*, void**, std::size_t*))
#define KVFERRY_ACL_IPC_FUNCTIONS(X)                                                            \
  X(aclrtIpcMemGetExportKey, aclError, (void*, std::size_t, char*, std::size_t, std::uint64_t)) \
  X(aclrtIpcMemSetImportPid, aclError, (const char*, std::int32_t*, std::size_t))               \
  X(aclrtIpcMemImportByKey, aclError, (void**, const char*, std::uint64_t))                     \
  X(aclrtIpcMemClose, aclError, (const char*))                                                  \
  X(aclrtDeviceGetBareTgid, aclError, (std::int32_t*))

// PFN_<symbol>: a pointer to that function. `params` is a parenthesised list already.
// NOLINTNEXTLINE(bugprone-macro-parentheses)
#define KVFERRY_ACL_PFN(name, ret, params) using PFN_##name = ret(*) params;
KVFERRY_ACL_FUNCTIONS(KVFERRY_ACL_PFN)
KVFERRY_ACL_QUERY_FUNCTIONS(KVFERRY_ACL_PFN)
KVFERRY_ACL_IPC_FUNCTIONS(KVFERRY_ACL_PFN)
#undef KVFERRY_ACL_PFN

}  // namespace kvferry::device::acl
