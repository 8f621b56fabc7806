#include "transport/ucx/ucx_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <string>

namespace kvferry {
namespace {

struct Loaded {
  UcxApi api;
  Status status;
};

Loaded Load() {
  Loaded out;
  void* lib = dlopen("libucp.so.0", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    out.status = Status::Unavailable(
        std::string("the ucx backend cannot load UCX (libucp.so.0): ") +
        (why != nullptr ? why : "not found") +
        "; install UCX (Debian: libucx0) or put its lib directory on LD_LIBRARY_PATH");
    return out;
  }
  // dlsym on the handle also searches libucp's dependencies (libucs for ucs_status_string).
#define KVFERRY_UCX_LOAD(name)                                              \
  out.api.name = reinterpret_cast<decltype(&::name)>(dlsym(lib, #name));    \
  if (out.api.name == nullptr) {                                            \
    out.status = Status::Unavailable("the UCX at libucp.so.0 has no " #name \
                                     "; kvferry needs UCX 1.13 or later");  \
    return out;                                                             \
  }
  KVFERRY_UCX_FUNCTIONS(KVFERRY_UCX_LOAD)
#undef KVFERRY_UCX_LOAD
  return out;
}

const Loaded& Once() {
  static const Loaded loaded = Load();  // thread-safe initialisation
  return loaded;
}

}  // namespace

Result<const UcxApi*> LoadUcx() {
  const Loaded& l = Once();
  if (!l.status.ok()) return l.status;
  return &l.api;
}

const UcxApi& Ucx() {
  const Loaded& l = Once();
  if (!l.status.ok()) std::abort();  // a caller skipped LoadUcx: a bug, not a runtime condition
  return l.api;
}

}  // namespace kvferry
