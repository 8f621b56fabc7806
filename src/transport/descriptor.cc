#include "transport/descriptor.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <limits>
#include <set>

#include "wire/msgpack_reader.h"

namespace kvferry {

const RemoteRegion* PeerDescriptor::FindRegion(RegionId id) const {
  for (const RemoteRegion& r : regions) {
    if (r.id == id) return &r;
  }
  return nullptr;
}

std::vector<std::uint8_t> EncodeDescriptor(const PeerDescriptor& d) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(5 + (d.shm ? 1 : 0) + (d.tcp ? 1 : 0));
  pk.pack(std::string("v"));
  pk.pack_uint32(1);
  pk.pack(std::string("boot_id"));
  pk.pack(d.host.boot_id);
  pk.pack(std::string("pidns"));
  pk.pack_uint64(d.host.pid_namespace);
  pk.pack(std::string("pid"));
  pk.pack_int64(d.host.pid);
  if (d.shm) {
    pk.pack(std::string("shm"));
    pk.pack_map(3);
    pk.pack(std::string("start"));
    pk.pack_uint64(d.shm->start_time);
    pk.pack(std::string("nonce_at"));
    pk.pack_uint64(d.shm->nonce_addr);
    pk.pack(std::string("nonce"));
    pk.pack_uint64(d.shm->nonce);
  }
  if (d.tcp) {
    pk.pack(std::string("tcp"));
    pk.pack_map(3);
    pk.pack(std::string("host"));
    pk.pack(d.tcp->host);
    pk.pack(std::string("port"));
    pk.pack_uint16(d.tcp->port);
    pk.pack(std::string("instance"));
    pk.pack_uint64(d.tcp->instance);
  }
  pk.pack(std::string("regions"));
  pk.pack_array(static_cast<std::uint32_t>(d.regions.size()));
  for (const RemoteRegion& r : d.regions) {
    pk.pack_array(3);
    pk.pack_uint32(r.id);
    pk.pack_uint64(r.addr);
    pk.pack_uint64(r.length);
  }
  const auto* p = reinterpret_cast<const std::uint8_t*>(buffer.data());
  return {p, p + buffer.size()};
}

Result<PeerDescriptor> DecodeDescriptor(std::span<const std::uint8_t> bytes) {
  if (bytes.size() > (8u << 20)) {
    return Status::InvalidArgument("transport descriptor of " + std::to_string(bytes.size()) +
                                   " bytes exceeds the limit of 8 MiB");
  }
  KVFERRY_ASSIGN_OR_RETURN(msgpack::object_handle handle,
                           wire::SafeUnpack(bytes, {kMaxDescriptorRegions, 16, 4}));
  KVFERRY_ASSIGN_OR_RETURN(wire::MapView m, wire::MapView::Of(handle.get(), "descriptor"));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t version, m.Uint("v", 255));
  if (version != 1) {
    return Status::NotSupported("transport descriptor version " + std::to_string(version) +
                                " is not supported; this build reads version 1");
  }
  PeerDescriptor d;
  KVFERRY_ASSIGN_OR_RETURN(d.host.boot_id, m.Str("boot_id", 64));
  KVFERRY_ASSIGN_OR_RETURN(d.host.pid_namespace,
                           m.Uint("pidns", std::numeric_limits<std::uint64_t>::max()));
  if (const msgpack::object* pid = m.Find("pid");
      pid != nullptr && pid->type == msgpack::type::NEGATIVE_INTEGER) {
    return Status::InvalidArgument(m.At("pid") +
                                   ": expected the serving process's pid (> 0), found " +
                                   std::to_string(pid->via.i64));
  }
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t pid,
                           m.Uint("pid", std::numeric_limits<std::int32_t>::max()));
  if (pid == 0) {
    // Pid 0 names no process a reader could prove; refuse it before any backend sees it.
    return Status::InvalidArgument(m.At("pid") +
                                   ": expected the serving process's pid (> 0), found 0");
  }
  d.host.pid = static_cast<std::int64_t>(pid);
  if (const msgpack::object* shm = m.Find("shm")) {
    KVFERRY_ASSIGN_OR_RETURN(wire::MapView sm, wire::MapView::Of(*shm, m.At("shm")));
    ShmProof proof;
    constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
    KVFERRY_ASSIGN_OR_RETURN(proof.start_time, sm.Uint("start", kMax));
    KVFERRY_ASSIGN_OR_RETURN(proof.nonce_addr, sm.Uint("nonce_at", kMax));
    KVFERRY_ASSIGN_OR_RETURN(proof.nonce, sm.Uint("nonce", kMax));
    if (proof.nonce_addr == 0) {
      return Status::InvalidArgument(m.At("shm") +
                                     ": expected a non-zero address of the instance nonce");
    }
    d.shm = proof;
  }
  if (const msgpack::object* tcp = m.Find("tcp")) {
    KVFERRY_ASSIGN_OR_RETURN(wire::MapView tm, wire::MapView::Of(*tcp, m.At("tcp")));
    TcpEndpoint ep;
    KVFERRY_ASSIGN_OR_RETURN(ep.host, tm.Str("host", 255));
    KVFERRY_ASSIGN_OR_RETURN(std::uint64_t port, tm.Uint("port", 65535));
    if (ep.host.empty() || port == 0) {
      return Status::InvalidArgument(m.At("tcp") + ": expected a host and a non-zero port");
    }
    ep.port = static_cast<std::uint16_t>(port);
    KVFERRY_ASSIGN_OR_RETURN(ep.instance,
                             tm.Uint("instance", std::numeric_limits<std::uint64_t>::max()));
    d.tcp = ep;
  }
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* regions, m.Require("regions"));
  if (regions->type != msgpack::type::ARRAY) {
    return Status::InvalidArgument(m.At("regions") + ": expected an array, found " +
                                   wire::ObjectTypeName(*regions));
  }
  std::set<RegionId> seen;
  for (std::uint32_t i = 0; i < regions->via.array.size; ++i) {
    const msgpack::object& r = regions->via.array.ptr[i];
    const std::string at = m.At("regions") + "[" + std::to_string(i) + "]";
    if (r.type != msgpack::type::ARRAY || r.via.array.size != 3) {
      return Status::InvalidArgument(at + ": expected [id, address, length]");
    }
    for (std::uint32_t k = 0; k < 3; ++k) {
      if (r.via.array.ptr[k].type != msgpack::type::POSITIVE_INTEGER) {
        return Status::InvalidArgument(at + ": expected non-negative integers");
      }
    }
    RemoteRegion region{0, r.via.array.ptr[1].via.u64, r.via.array.ptr[2].via.u64};
    if (r.via.array.ptr[0].via.u64 > std::numeric_limits<RegionId>::max()) {
      return Status::InvalidArgument(at + ": region id exceeds 32 bits");
    }
    region.id = static_cast<RegionId>(r.via.array.ptr[0].via.u64);
    if (region.length == 0 || region.addr + region.length < region.addr) {
      return Status::InvalidArgument(at + ": expected a non-empty range inside the address space");
    }
    if (!seen.insert(region.id).second) {
      return Status::InvalidArgument(at + ": region id " + std::to_string(region.id) +
                                     " appears twice");
    }
    d.regions.push_back(region);
  }
  return d;
}

Result<HostIdentity> LocalHostIdentity() {
  HostIdentity id;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  if (!(boot >> id.boot_id)) {
    return Status::Unavailable("cannot read /proc/sys/kernel/random/boot_id: is /proc mounted?");
  }
  struct stat st {};
  if (stat("/proc/self/ns/pid", &st) != 0) {
    return Status::Unavailable("cannot stat /proc/self/ns/pid: is /proc mounted?");
  }
  id.pid_namespace = st.st_ino;
  id.pid = getpid();
  return id;
}

RemoteRegionTable IndexRegions(const PeerDescriptor& peer) {
  RemoteRegionTable table;
  for (const RemoteRegion& r : peer.regions) table.emplace(r.id, r);
  return table;
}

Status CheckRemoteRange(const RemoteRegionTable& regions, RegionId id, std::uint64_t offset,
                        std::uint64_t length) {
  auto it = regions.find(id);
  if (it == regions.end()) {
    return Status::InvalidArgument("the peer has no region " + std::to_string(id) +
                                   "; it registered " + std::to_string(regions.size()) +
                                   " regions");
  }
  const RemoteRegion* r = &it->second;
  if (length == 0 || offset > r->length || length > r->length - offset) {
    return Status::InvalidArgument("read of " + std::to_string(length) + " bytes at offset " +
                                   std::to_string(offset) + " is outside the peer's region " +
                                   std::to_string(id) + " of " + std::to_string(r->length) +
                                   " bytes");
  }
  return Status::Ok();
}

}  // namespace kvferry
