#include "transport/shm/shm_backend.h"

#include <openssl/rand.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <sstream>

#include "common/clock.h"
#include "common/errno_text.h"
#include "common/log.h"
#include "common/mutex.h"
#include "transport/shm/served_memory.h"
#include "transport/shm/shm_ipc.h"
#include "transport/shm/shm_peer.h"

namespace kvferry {
namespace {

// This process's instance nonce. A function-local static: initialised once (thread-safe), at an
// address that stays mapped for the life of the process, so peers may read it at any time.
const std::uint64_t& InstanceNonce() {
  static const std::uint64_t nonce = [] {
    std::uint64_t v = 0;
    if (RAND_bytes(reinterpret_cast<unsigned char*>(&v), sizeof(v)) != 1 || v == 0) {
      std::random_device rd;
      v = (static_cast<std::uint64_t>(rd()) << 32) | rd() | 1u;
    }
    return v;
  }();
  return nonce;
}

// What /proc/sys/kernel/yama/ptrace_scope says, for error messages.
std::string YamaScopeText() {
  std::ifstream file("/proc/sys/kernel/yama/ptrace_scope");
  int scope = -1;
  if (!(file >> scope)) return "this host has no Yama";
  return "this host has kernel.yama.ptrace_scope=" + std::to_string(scope);
}

}  // namespace

ShmBackend::ShmBackend(HostIdentity self, ShmProof proof, int threads, bool permitted_any_tracer,
                       RegionRegistry* regions, HugePages huge_pages)
    : self_(std::move(self)),
      proof_(proof),
      permitted_any_tracer_(permitted_any_tracer),
      regions_(regions),
      pool_(std::make_shared<WorkQueue>(threads, "kvferry-shm")),
      threads_(threads),
      huge_pages_(huge_pages) {}

BackendFactory ShmBackend::Factory() {
  BackendFactory f;
  f.name = "shm";
  f.check = [](const TransportOptions& options, const TransportOptionMap& own) {
    return ParseShmOptions(options, own).status();
  };
  f.create = [](const BackendContext& ctx) -> Result<std::unique_ptr<Backend>> {
    KVFERRY_ASSIGN_OR_RETURN(ShmOptions o, ParseShmOptions(ctx.options, ctx.own_options));
    KVFERRY_ASSIGN_OR_RETURN(HostIdentity self, LocalHostIdentity());
    KVFERRY_ASSIGN_OR_RETURN(ShmProof proof, LocalProof());
    const bool permit = ctx.options.serve && o.permit_any_tracer;
    if (permit) PermitAnyTracer();
    const HugePages huge = ctx.options.serve ? o.huge_pages : HugePages::kOff;
    return std::unique_ptr<Backend>(
        std::make_unique<ShmBackend>(std::move(self), proof, o.threads, permit, ctx.regions, huge));
  };
  return f;
}

void ShmBackend::RegionAdded(const RegionInfo& region) {
  // Under 2 MiB no huge page fits inside: nothing to do, nothing to log.
  if (huge_pages_ == HugePages::kOff || !region.kind.is_host() || region.length < (2u << 20)) {
    return;
  }
  const auto start = Clock::now();
  const Status s = BackWithHugePages(region.addr, region.length, huge_pages_);
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  if (!s.ok()) {
    Log().warn("shm: region {} ({} bytes) keeps its pages: {}", region.id, region.length,
               s.ToString());
    return;
  }
  Log().info("shm: region {} ({} bytes): huge pages {} in {} ms, {} bytes huge now", region.id,
             region.length, huge_pages_ == HugePages::kCollapse ? "collapsed" : "advised", ms,
             HugePageBytes(region.addr, region.length));
}

std::vector<std::uint8_t> ShmBackend::DescriptorSection() {
  ShmSection section{self_, proof_, {}, {}};
  // Device regions: exported for same-host readers (shm_ipc.h).
  if (regions_ != nullptr) {
    const std::vector<RegionInfo> regions = regions_->List();
    section.ipc = ExportDeviceRegions(regions);
    // Host regions in memory kvferry allocated: a same-host reader maps them (served_memory.h).
    for (const RegionInfo& r : regions) {
      if (!r.kind.is_host()) continue;
      if (const std::optional<ServedSpan> span = FindServedMemory(r.addr, r.length)) {
        section.served.push_back({r.id, span->fd, span->offset});
      }
    }
  }
  return EncodeShmSection(section);
}

Status ShmBackend::CanReach(const PeerView& peer) {
  if (peer.section.empty()) {
    return Status::Unavailable(
        "the peer's descriptor has no shm section (host identity, start time and instance "
        "nonce), so it cannot be read over shm");
  }
  Result<ShmSection> s = DecodeShmSection(peer.section);
  if (!s.ok()) return s.status();
  if (s->host.boot_id != self_.boot_id || s->host.pid_namespace != self_.pid_namespace) {
    return Status::Unavailable(
        "shm needs the peer on this kernel and PID namespace; the peer has boot id " +
        s->host.boot_id + " and PID namespace " + std::to_string(s->host.pid_namespace) +
        ", this process " + self_.boot_id + " and " + std::to_string(self_.pid_namespace));
  }
  for (const RemoteRegion& r : peer.regions) {
    // Kinds this build has no device for are refused per read (CanRead), not here.
    if (r.kind.is_host() || !device::KnownDeviceType(r.kind.type)) continue;
    const bool offered = std::any_of(s->ipc.begin(), s->ipc.end(),
                                     [&](const ShmIpcRegion& e) { return e.region == r.id; });
    if (!offered) {
      return Status::Unavailable("the peer's region " + std::to_string(r.id) + " is " +
                                 r.kind.ToString() +
                                 " memory it did not export for IPC (not exportable), so shm "
                                 "cannot read it");
    }
  }
  return Status::Ok();
}

Result<ShmProof> ShmBackend::LocalProof() {
  ShmProof proof;
  KVFERRY_ASSIGN_OR_RETURN(proof.start_time, ProcessStartTime(getpid()));
  const std::uint64_t& nonce = InstanceNonce();
  proof.nonce_addr = reinterpret_cast<std::uint64_t>(&nonce);
  proof.nonce = nonce;
  return proof;
}

void ShmBackend::PermitAnyTracer() {
  // Without Yama this has no effect and fails with EINVAL; nothing to report then.
  if (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0) {
    Log().info(
        "shm.permit_any_tracer: prctl(PR_SET_PTRACER_ANY) done; under Yama every process may "
        "now ptrace this one (not only read its memory)");
  }
}

std::string ShmBackend::RefusedReadText(pid_t pid) {
  return "the kernel refused process_vm_readv on process " + std::to_string(pid) + " (EPERM; " +
         YamaScopeText() +
         "): shm needs the same user (or CAP_SYS_PTRACE) and, under Yama ptrace_scope=1, a "
         "reader that descends from the serving process or a serving process that permits "
         "tracers: set the transport option shm.permit_any_tracer=true there (kvferry serve "
         "--shm-permit-any-tracer), "
         "which lets every process ptrace it, or run `sysctl kernel.yama.ptrace_scope=0`; "
         "otherwise use the tcp transport";
}

Result<std::unique_ptr<BackendPeer>> ShmBackend::Connect(const PeerView& peer,
                                                         Deadline /*deadline*/) {
  KVFERRY_RETURN_IF_ERROR(CanReach(peer));
  KVFERRY_ASSIGN_OR_RETURN(const ShmSection section, DecodeShmSection(peer.section));
  // Before the first read of a region: prove that the process is the one that wrote the
  // descriptor (the peer-process proof, then shm's nonce), so a reused pid is never read as the
  // peer.
  KVFERRY_ASSIGN_OR_RETURN(PeerProcess process,
                           PeerProcess::Prove(self_, section.host, section.proof.start_time));
  const pid_t pid = process.pid();
  const int pidfd = process.pidfd();
  auto state = std::make_shared<ShmPeerState>(std::move(process));
  KVFERRY_RETURN_IF_ERROR(ProveShmInstance(*state, section.proof));
  // Probe one byte of a host region, so that unmapped memory is found now, not mid-transfer.
  const auto host_region = std::find_if(peer.regions.begin(), peer.regions.end(),
                                        [](const RemoteRegion& r) { return r.kind.is_host(); });
  if (host_region != peer.regions.end()) {
    std::byte probe{};
    iovec local{&probe, 1};
    // An address in the peer's address space, never dereferenced here.
    iovec remote{reinterpret_cast<void*>(host_region->addr),  // NOLINT(performance-no-int-to-ptr)
                 1};
    if (process_vm_readv(pid, &local, 1, &remote, 1, 0) != 1) {
      const int err = errno;
      if (err == EPERM) return Status::Unavailable(RefusedReadText(pid));
      return Status::Unavailable("process_vm_readv of the peer's region " +
                                 std::to_string(host_region->id) + " in process " +
                                 std::to_string(pid) + " failed (" + ErrnoText(err) +
                                 "); use the tcp transport");
    }
  }
  // Device regions: each allocation's handle opened once (shm_ipc.h).
  const RemoteRegionTable table = IndexRegions(peer.regions);
  KVFERRY_ASSIGN_OR_RETURN(auto imported, ImportPeerRegions(section.ipc, table));
  // Host regions the peer allocated with HostMemory: mapped read-only once, then read with memcpy;
  // any that does not map is read with process_vm_readv (served_memory.h).
  std::map<RegionId, std::unique_ptr<const MappedRegion>> mapped;
  std::uint64_t mapped_bytes = 0;
  for (const ShmServedRegion& served : section.served) {
    auto it = table.find(served.region);
    if (it == table.end() || !it->second.kind.is_host()) continue;
    Result<std::unique_ptr<MappedRegion>> m =
        MapServedRegion(pidfd, pid, served.fd, served.offset, it->second.addr, it->second.length);
    if (!m.ok()) {
      Log().info("shm: region {}: {}", served.region, m.status().message());
      continue;
    }
    mapped[served.region] = std::move(*m);
    mapped_bytes += it->second.length;
  }
  if (!section.served.empty()) {
    Log().debug("shm: process {}: {} of its regions ({} bytes) mapped read-only", pid,
                mapped.size(), mapped_bytes);
  }
  return MakeShmPeer(std::move(state), table, pool_, threads_, std::move(imported),
                     std::move(mapped), staging_bytes_);
}

}  // namespace kvferry
