// The backends of this build. Adding one: its folder src/transport/<name>/ and one line below
// (docs/transport.md, "Writing a backend").
#include "transport/shm/shm_backend.h"
#include "transport/tcp/tcp_backend.h"
#include "transport/ucx/ucx_backend.h"

namespace kvferry {

const std::vector<BackendFactory>& RegisteredBackends() {
  // In the order `auto` tries them: the cheapest path first.
  static const std::vector<BackendFactory> backends = {
      ShmBackend::Factory(),
      tcp::TcpBackend::Factory(),
      // Only when named: in_auto is false.
      UcxBackend::Factory(),
  };
  return backends;
}

const BackendFactory* FindBackend(std::string_view name) {
  for (const BackendFactory& f : RegisteredBackends()) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

std::vector<std::string> TransportBackendNames() {
  std::vector<std::string> names;
  for (const BackendFactory& f : RegisteredBackends()) names.push_back(f.name);
  return names;
}

}  // namespace kvferry
