// libascendcl.so (Huawei CANN's ACL runtime) opened at run time: the build needs no CANN, and
// where there is none, loading is Unavailable "no NPU runtime ..." with what was tried and what to
// do (docs/device.md, "The acl device").
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "device/acl/acl_api.h"
#include "kvferry/status.h"

namespace kvferry::device {

/// The runtime's entry points, resolved with dlsym. Immutable after Load; thread-safe (the runtime
/// itself is). The library is opened with RTLD_NODELETE and never closed: the runtime keeps
/// threads and global state that torch_npu shares, which must outlive every kvferry object.
class AclRuntime {
 public:
  /// Where Load() looks, in order: only $KVFERRY_ACL_LIBRARY when it is set (a path or a name);
  /// else "libascendcl.so" through the loader's path (LD_LIBRARY_PATH, which CANN's set_env.sh
  /// sets, /etc/ld.so.cache, the system directories), then $ASCEND_HOME_PATH/lib64/libascendcl.so
  /// when ASCEND_HOME_PATH is set, then /usr/local/Ascend/ascend-toolkit/latest/lib64/.
  static std::vector<std::string> DefaultLibraries();

  /// Loads the first of `libraries` that opens, resolves every function of acl_api.h (the
  /// optional ones where present), calls aclInit(nullptr) (ACL_ERROR_REPEAT_INITIALIZE is
  /// success: torch_npu initialises first; kvferry never calls aclFinalize) and counts devices.
  /// Unavailable "no NPU runtime: ..." when none opens (naming each path tried, its error, and the
  /// way out), the library lacks a required function, or aclInit fails; Unavailable "no NPU
  /// device: ..." when the runtime sees no device.
  static Result<std::shared_ptr<const AclRuntime>> Load();
  static Result<std::shared_ptr<const AclRuntime>> Load(const std::vector<std::string>& libraries);

  AclRuntime(const AclRuntime&) = delete;
  AclRuntime& operator=(const AclRuntime&) = delete;

  const std::string& path() const { return path_; }
  int device_count() const { return device_count_; }

  /// Whether the same-host IPC calls are all there (CANN 8.2.RC1 and newer), and if not, which
  /// are missing ("aclrtIpcMemGetExportKey, ..."), for the messages of the staging fallback.
  bool has_ipc() const { return missing_ipc_.empty(); }
  const std::string& missing_ipc() const { return missing_ipc_; }

  /// "<call> failed: aclError <n> (<the runtime's recent message for this thread>)".
  std::string Describe(const char* call, acl::aclError r) const;

#define KVFERRY_ACL_MEMBER(name, ret, params) acl::PFN_##name name = nullptr;
  KVFERRY_ACL_FUNCTIONS(KVFERRY_ACL_MEMBER)
  KVFERRY_ACL_QUERY_FUNCTIONS(KVFERRY_ACL_MEMBER)
  KVFERRY_ACL_IPC_FUNCTIONS(KVFERRY_ACL_MEMBER)
#undef KVFERRY_ACL_MEMBER

 private:
  AclRuntime() = default;

  std::string path_;
  int device_count_ = 0;
  std::string missing_ipc_;
};

}  // namespace kvferry::device
