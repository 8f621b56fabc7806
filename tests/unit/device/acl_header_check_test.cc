// Checks src/device/acl/acl_api.h against CANN's acl/acl_rt.h: every function pointer type, enum
// value, flag and struct layout kvferry relies on. The checks are static_asserts, so a mismatch
// fails the compilation of this file. A developer check: scripts/acl_header_check.sh compiles it
// against a header fetched from github.com/hicann/runtime (docs/device.md, "The acl header
// check"); CMake builds it against an installed CANN where it finds one, and otherwise the test
// SKIPs with the reason.
#include <gtest/gtest.h>

#if KVFERRY_HAVE_ACL_RT_H
#include <acl/acl_rt.h>
#include <dlfcn.h>

#include <iostream>
#endif

#include <cstddef>
#include <type_traits>

#include "device/acl/acl_api.h"

#if KVFERRY_HAVE_ACL_RT_H
namespace {

namespace acl = kvferry::device::acl;

// Maps a type of acl_api.h to the acl_rt.h type it stands for; other types map to themselves.
template <typename T>
struct ToAclH {
  using type = T;
};
template <>
struct ToAclH<acl::aclrtMemMallocPolicy> {
  using type = ::aclrtMemMallocPolicy;
};
template <>
struct ToAclH<acl::aclrtMemcpyKind> {
  using type = ::aclrtMemcpyKind;
};
template <>
struct ToAclH<acl::aclrtEventRecordedStatus> {
  using type = ::aclrtEventRecordedStatus;
};
template <>
struct ToAclH<acl::aclrtPtrAttributes> {
  using type = ::aclrtPtrAttributes;
};
template <typename T>
struct ToAclH<T*> {
  using type = typename ToAclH<T>::type*;
};
template <typename T>
struct ToAclH<const T> {
  using type = const typename ToAclH<T>::type;
};
template <typename R, typename... A>
struct ToAclH<R (*)(A...)> {
  using type = typename ToAclH<R>::type (*)(typename ToAclH<A>::type...);
};

// Every function: our pointer type, translated, is exactly the type of acl_rt.h's declaration.
#define KVFERRY_CHECK_SIGNATURE(name, ret, params)                                \
  static_assert(std::is_same_v<ToAclH<acl::PFN_##name>::type, decltype(&::name)>, \
                #name ": acl_api.h's signature differs from acl_rt.h's");
KVFERRY_ACL_FUNCTIONS(KVFERRY_CHECK_SIGNATURE)
KVFERRY_ACL_QUERY_FUNCTIONS(KVFERRY_CHECK_SIGNATURE)
KVFERRY_ACL_IPC_FUNCTIONS(KVFERRY_CHECK_SIGNATURE)
#undef KVFERRY_CHECK_SIGNATURE

// Types passed by value or through pointers, and the layout of the structs the runtime fills.
static_assert(std::is_same_v<acl::aclError, ::aclError>);
static_assert(std::is_same_v<acl::aclrtStream, ::aclrtStream>);
static_assert(std::is_same_v<acl::aclrtEvent, ::aclrtEvent>);
static_assert(std::is_same_v<acl::aclrtContext, ::aclrtContext>);
static_assert(sizeof(acl::aclrtMemMallocPolicy) == sizeof(::aclrtMemMallocPolicy));
static_assert(sizeof(acl::aclrtMemcpyKind) == sizeof(::aclrtMemcpyKind));
static_assert(sizeof(acl::aclrtEventRecordedStatus) == sizeof(::aclrtEventRecordedStatus));
static_assert(sizeof(acl::aclrtMemLocationType) == sizeof(::aclrtMemLocationType));
static_assert(sizeof(acl::aclrtMemLocation) == sizeof(::aclrtMemLocation));
static_assert(offsetof(acl::aclrtMemLocation, id) == offsetof(::aclrtMemLocation, id));
static_assert(offsetof(acl::aclrtMemLocation, type) == offsetof(::aclrtMemLocation, type));
static_assert(sizeof(acl::aclrtPtrAttributes) == sizeof(::aclrtPtrAttributes));
static_assert(alignof(acl::aclrtPtrAttributes) == alignof(::aclrtPtrAttributes));
static_assert(offsetof(acl::aclrtPtrAttributes, location) ==
              offsetof(::aclrtPtrAttributes, location));
static_assert(offsetof(acl::aclrtPtrAttributes, pageSize) ==
              offsetof(::aclrtPtrAttributes, pageSize));
static_assert(std::is_same_v<decltype(acl::aclrtPtrAttributes::pageSize),
                             decltype(::aclrtPtrAttributes::pageSize)>);
static_assert(
    std::is_same_v<decltype(acl::aclrtMemLocation::id), decltype(::aclrtMemLocation::id)>);

// Every value.
#define KVFERRY_CHECK_VALUE(ours, theirs) \
  static_assert(static_cast<long long>(ours) == static_cast<long long>(theirs), #ours);
KVFERRY_CHECK_VALUE(acl::ACL_SUCCESS, ::ACL_SUCCESS)
KVFERRY_CHECK_VALUE(acl::ACL_ERROR_REPEAT_INITIALIZE, ::ACL_ERROR_REPEAT_INITIALIZE)
KVFERRY_CHECK_VALUE(acl::kStreamSyncTimeout, ACL_ERROR_RT_STREAM_SYNC_TIMEOUT)
KVFERRY_CHECK_VALUE(acl::ACL_MEM_MALLOC_HUGE_FIRST, ::ACL_MEM_MALLOC_HUGE_FIRST)
KVFERRY_CHECK_VALUE(acl::ACL_MEM_MALLOC_HUGE_ONLY, ::ACL_MEM_MALLOC_HUGE_ONLY)
KVFERRY_CHECK_VALUE(acl::ACL_MEM_MALLOC_NORMAL_ONLY, ::ACL_MEM_MALLOC_NORMAL_ONLY)
KVFERRY_CHECK_VALUE(acl::ACL_MEMCPY_HOST_TO_HOST, ::ACL_MEMCPY_HOST_TO_HOST)
KVFERRY_CHECK_VALUE(acl::ACL_MEMCPY_HOST_TO_DEVICE, ::ACL_MEMCPY_HOST_TO_DEVICE)
KVFERRY_CHECK_VALUE(acl::ACL_MEMCPY_DEVICE_TO_HOST, ::ACL_MEMCPY_DEVICE_TO_HOST)
KVFERRY_CHECK_VALUE(acl::ACL_MEMCPY_DEVICE_TO_DEVICE, ::ACL_MEMCPY_DEVICE_TO_DEVICE)
KVFERRY_CHECK_VALUE(acl::ACL_EVENT_RECORDED_STATUS_NOT_READY, ::ACL_EVENT_RECORDED_STATUS_NOT_READY)
KVFERRY_CHECK_VALUE(acl::ACL_EVENT_RECORDED_STATUS_COMPLETE, ::ACL_EVENT_RECORDED_STATUS_COMPLETE)
KVFERRY_CHECK_VALUE(acl::ACL_MEM_LOCATION_TYPE_HOST, ::ACL_MEM_LOCATION_TYPE_HOST)
KVFERRY_CHECK_VALUE(acl::ACL_MEM_LOCATION_TYPE_DEVICE, ::ACL_MEM_LOCATION_TYPE_DEVICE)
KVFERRY_CHECK_VALUE(acl::ACL_MEM_LOCATION_TYPE_UNREGISTERED, ::ACL_MEM_LOCATION_TYPE_UNREGISTERED)
KVFERRY_CHECK_VALUE(acl::kIpcMemExportFlagDefault, ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT)
KVFERRY_CHECK_VALUE(acl::kIpcMemImportFlagDefault, ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT)
#undef KVFERRY_CHECK_VALUE
// The deprecated aclrtQueryEvent numbers its states the other way round: kvferry must not
// confuse the two enums (acl_api.h declares only aclrtQueryEventStatus's).
static_assert(static_cast<int>(::ACL_EVENT_STATUS_COMPLETE) !=
              static_cast<int>(::ACL_EVENT_RECORDED_STATUS_COMPLETE));

}  // namespace
#endif

TEST(AclHeaderCheckTest, DeclarationsMatchAclRtH) {
#if KVFERRY_HAVE_ACL_RT_H
  // The static_asserts above passed, or this file would not have compiled. At run time, where an
  // installed runtime loads: every required symbol is exported (the optional ones may be absent
  // from older releases; they are listed).
  void* lib = dlopen("libascendcl.so", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    GTEST_SKIP() << "acl_rt.h matched (the compile-time checks passed) but libascendcl.so did "
                    "not load, so its exports were not checked: "
                 << dlerror();
  }
  int missing = 0;
#define KVFERRY_CHECK_EXPORTED(name, ret, params)                \
  if (dlsym(lib, #name) == nullptr) {                            \
    ++missing;                                                   \
    ADD_FAILURE() << #name " is not exported by libascendcl.so"; \
  }
  KVFERRY_ACL_FUNCTIONS(KVFERRY_CHECK_EXPORTED)
#undef KVFERRY_CHECK_EXPORTED
#define KVFERRY_NOTE_OPTIONAL(name, ret, params) \
  if (dlsym(lib, #name) == nullptr) std::cout << "optional " #name " is absent\n";
  KVFERRY_ACL_QUERY_FUNCTIONS(KVFERRY_NOTE_OPTIONAL)
  KVFERRY_ACL_IPC_FUNCTIONS(KVFERRY_NOTE_OPTIONAL)
#undef KVFERRY_NOTE_OPTIONAL
  dlclose(lib);
  EXPECT_EQ(missing, 0);
#else
  GTEST_SKIP() << "SKIPPED: no acl/acl_rt.h found when CMake configured (looked in "
               << KVFERRY_ACL_INCLUDE_HINT
               << "): src/device/acl/acl_api.h was NOT checked against CANN's header here. Run "
                  "scripts/acl_header_check.sh (it fetches the public header), or install CANN "
                  "(or set -DKVFERRY_ACL_INCLUDE_DIR) and reconfigure.";
#endif
}
