#include "transport/shm/shm_options.h"

#include <algorithm>
#include <string>
#include <vector>

#include "transport/backend_options.h"

namespace kvferry {

Result<ShmOptions> ParseShmOptions(const TransportOptions& /*options*/,
                                   const TransportOptionMap& own) {
  ShmOptions o;
  BackendOptionReader r("shm", own);
  auto threads = static_cast<std::uint64_t>(o.threads);
  KVFERRY_RETURN_IF_ERROR(r.ReadUint("threads", 1, 256, &threads));
  o.threads = static_cast<int>(threads);
  KVFERRY_RETURN_IF_ERROR(r.ReadBool("permit_any_tracer", &o.permit_any_tracer));
  std::string huge = "off";
  KVFERRY_RETURN_IF_ERROR(r.ReadString("huge_pages", &huge));
  Result<HugePages> mode = ParseHugePages(huge);
  if (!mode.ok()) return mode.status().WithContext("shm.huge_pages");
  o.huge_pages = *mode;
  KVFERRY_RETURN_IF_ERROR(r.RejectUnknown());
  return o;
}

bool ServingPermitsAnyTracer(const TransportOptions& options) {
  if (!options.serve) return false;
  Result<std::vector<std::string>> selected = SelectedTransportBackends(options.backend);
  if (!selected.ok() || std::find(selected->begin(), selected->end(), "shm") == selected->end()) {
    return false;
  }
  Result<ShmOptions> o = ParseShmOptions(options, OwnOptions(options.backend_options, "shm"));
  return o.ok() && o->permit_any_tracer;
}

}  // namespace kvferry
