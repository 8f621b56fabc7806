#include "device/acl/acl_runtime.h"

#include <dlfcn.h>

#include <cstdlib>

namespace kvferry::device {
namespace {

constexpr const char* kLibrary = "libascendcl.so";
constexpr const char* kToolkitLibrary =
    "/usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so";
constexpr const char* kWayOut =
    "install CANN and source its set_env.sh before starting the process (e.g. `source "
    "/usr/local/Ascend/ascend-toolkit/set_env.sh`, which puts libascendcl.so on LD_LIBRARY_PATH), "
    "or keep the KV cache in host memory (kv_buffer_device \"cpu\")";

std::string Env(const char* name) {
  const char* v = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read once per load
  return v == nullptr ? std::string() : std::string(v);
}

}  // namespace

std::vector<std::string> AclRuntime::DefaultLibraries() {
  if (std::string lib = Env("KVFERRY_ACL_LIBRARY"); !lib.empty()) return {lib};
  std::vector<std::string> out = {kLibrary};
  if (std::string home = Env("ASCEND_HOME_PATH"); !home.empty()) {
    out.push_back(home + "/lib64/" + kLibrary);
  }
  out.push_back(kToolkitLibrary);
  return out;
}

std::string AclRuntime::Describe(const char* call, acl::aclError r) const {
  const char* recent = aclGetRecentErrMsg != nullptr ? aclGetRecentErrMsg() : nullptr;
  return std::string(call) + " failed: aclError " + std::to_string(r) +
         (recent != nullptr && *recent != '\0' ? std::string(" (") + recent + ")" : "");
}

Result<std::shared_ptr<const AclRuntime>> AclRuntime::Load() { return Load(DefaultLibraries()); }

Result<std::shared_ptr<const AclRuntime>> AclRuntime::Load(
    const std::vector<std::string>& libraries) {
  std::shared_ptr<AclRuntime> rt(new AclRuntime());
  void* library = nullptr;
  std::string tried;
  for (const std::string& path : libraries) {
    library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (library != nullptr) {
      rt->path_ = path;
      break;
    }
    const char* err = dlerror();  // NOLINT(concurrency-mt-unsafe): glibc keeps it per thread
    tried += (tried.empty() ? "" : "; ") + path + ": " + (err ? err : "unknown error");
  }
  if (library == nullptr) {
    const std::string ld_path = Env("LD_LIBRARY_PATH");
    return Status::Unavailable(
        std::string("no NPU runtime: ") + kLibrary +
        " (Huawei CANN's ACL runtime) could not be loaded. Tried " + tried +
        " (a bare name is looked for in LD_LIBRARY_PATH, " +
        (ld_path.empty() ? std::string("which is empty") : "\"" + ld_path + "\"") +
        ", then /etc/ld.so.cache and the system library directories). To use NPU memory, " +
        kWayOut);
  }
  // dlsym returns void*; POSIX guarantees it converts to a function pointer.
#define KVFERRY_ACL_RESOLVE(sym, ret, params)                                                 \
  rt->sym = reinterpret_cast<acl::PFN_##sym>(dlsym(library, #sym));                           \
  if (rt->sym == nullptr) {                                                                   \
    return Status::Unavailable("no NPU runtime: " + rt->path_ +                               \
                               " lacks " #sym                                                 \
                               ": it is not CANN's libascendcl.so, or a release too old for " \
                               "kvferry; " +                                                  \
                               kWayOut);                                                      \
  }
  KVFERRY_ACL_FUNCTIONS(KVFERRY_ACL_RESOLVE)
#undef KVFERRY_ACL_RESOLVE
#define KVFERRY_ACL_RESOLVE_OPTIONAL(sym, ret, params) \
  rt->sym = reinterpret_cast<acl::PFN_##sym>(dlsym(library, #sym));
  KVFERRY_ACL_QUERY_FUNCTIONS(KVFERRY_ACL_RESOLVE_OPTIONAL)
  KVFERRY_ACL_IPC_FUNCTIONS(KVFERRY_ACL_RESOLVE_OPTIONAL)
#undef KVFERRY_ACL_RESOLVE_OPTIONAL
  // Exports need the page size (aclrtPointerGetAttributes) as well as the IPC calls.
#define KVFERRY_ACL_MISSING(sym, ret, params) \
  if (rt->sym == nullptr)                     \
    rt->missing_ipc_ += (rt->missing_ipc_.empty() ? "" : ", ") + std::string(#sym);
  KVFERRY_ACL_IPC_FUNCTIONS(KVFERRY_ACL_MISSING)
  if (rt->aclrtPointerGetAttributes == nullptr) {
    rt->missing_ipc_ +=
        (rt->missing_ipc_.empty() ? "" : ", ") + std::string("aclrtPointerGetAttributes");
  }
#undef KVFERRY_ACL_MISSING

  const acl::aclError init = rt->aclInit(nullptr);
  if (init != acl::ACL_SUCCESS && init != acl::ACL_ERROR_REPEAT_INITIALIZE) {
    return Status::Unavailable("no NPU runtime: " + rt->path_ + ": " +
                               rt->Describe("aclInit", init) +
                               "; check the driver (npu-smi info) and CANN's set_env.sh");
  }
  std::uint32_t count = 0;
  if (const acl::aclError r = rt->aclrtGetDeviceCount(&count); r != acl::ACL_SUCCESS) {
    return Status::Unavailable("no NPU device: " + rt->Describe("aclrtGetDeviceCount", r) +
                               " (is the NPU driver installed? npu-smi info)");
  }
  if (count == 0) {
    return Status::Unavailable("no NPU device: the ACL runtime (" + rt->path_ +
                               ") reports 0 devices (ASCEND_RT_VISIBLE_DEVICES applies)");
  }
  rt->device_count_ = static_cast<int>(count);
  return std::shared_ptr<const AclRuntime>(std::move(rt));
}

}  // namespace kvferry::device
