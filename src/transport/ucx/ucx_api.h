// UCX, loaded on first use: the ucx backend calls UCX only through Ucx(), and the library is
// opened (dlopen "libucp.so.0", found through the loader's usual path, so a site's own UCX build
// with CUDA or verbs is picked up by LD_LIBRARY_PATH) when a transport first creates the ucx
// backend. A process that never names ucx never loads UCX, and so never gets its signal handlers
// or memory hooks. The build needs UCX's headers only.
#pragma once

#include <ucp/api/ucp.h>

#include "kvferry/status.h"

namespace kvferry {

// Every UCX function the backend calls. ucp_init is an inline wrapper of ucp_init_version.
// clang-format off
#define KVFERRY_UCX_FUNCTIONS(X) \
  X(ucp_config_read) X(ucp_config_modify) X(ucp_config_release) X(ucp_init_version) X(ucp_cleanup) X(ucp_context_query) \
  X(ucp_worker_create) X(ucp_worker_destroy) X(ucp_worker_get_efd) X(ucp_worker_arm) \
  X(ucp_worker_progress) X(ucp_worker_get_address) X(ucp_worker_release_address) \
  X(ucp_ep_create) X(ucp_ep_close_nbx) X(ucp_ep_rkey_unpack) X(ucp_rkey_destroy) \
  X(ucp_rkey_pack) X(ucp_rkey_buffer_release) X(ucp_mem_map) X(ucp_mem_unmap) \
  X(ucp_get_nbx) X(ucp_request_cancel) X(ucp_request_free) X(ucs_status_string)
// clang-format on

struct UcxApi {
#define KVFERRY_UCX_FIELD(name) decltype(&::name) name = nullptr;
  KVFERRY_UCX_FUNCTIONS(KVFERRY_UCX_FIELD)
#undef KVFERRY_UCX_FIELD
};

/// Opens UCX the first time it is called and finds every function above; the same answer every
/// later time (never unloaded). Unavailable when libucp.so.0 is not found or lacks a function,
/// naming it. Thread-safe.
Result<const UcxApi*> LoadUcx();

/// The loaded functions. Only after LoadUcx succeeded (the backend's factory calls it first).
const UcxApi& Ucx();

}  // namespace kvferry
