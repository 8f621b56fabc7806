#include "transport/descriptor.h"

#include <algorithm>
#include <charconv>
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

std::span<const std::uint8_t> PeerDescriptor::Section(const std::string& name) const {
  auto it = sections.find(name);
  if (it == sections.end()) return {};
  return it->second;
}

bool IsValidMemoryKindType(std::string_view type) {
  if (type.empty() || type.size() > 16) return false;
  for (char c : type) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'))) return false;
  }
  return true;
}

std::string MemoryKind::ToString() const {
  if (is_host()) return type;
  return type + ":" + std::to_string(device);
}

Result<MemoryKind> ParseMemoryKind(std::string_view text) {
  MemoryKind kind;
  const std::size_t colon = text.find(':');
  kind.type = std::string(text.substr(0, colon));
  bool ok = IsValidMemoryKindType(kind.type);
  if (ok && colon != std::string_view::npos) {
    const std::string_view digits = text.substr(colon + 1);
    const auto [end, ec] =
        std::from_chars(digits.data(), digits.data() + digits.size(), kind.device);
    ok = !digits.empty() && ec == std::errc() && end == digits.data() + digits.size() &&
         !kind.is_host();
  }
  if (!ok) {
    return Status::InvalidArgument("memory kind '" + std::string(text) +
                                   "': expected host or <type>:<device> (cuda:0), with a type of "
                                   "1 to 16 lower-case letters and digits");
  }
  return kind;
}

std::vector<std::uint8_t> EncodeDescriptor(const PeerDescriptor& d) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(3);
  pk.pack(std::string("v"));
  pk.pack_uint32(kDescriptorVersion);
  pk.pack(std::string("regions"));
  pk.pack_array(static_cast<std::uint32_t>(d.regions.size()));
  for (const RemoteRegion& r : d.regions) {
    pk.pack_array(5);
    pk.pack_uint32(r.id);
    pk.pack_uint64(r.addr);
    pk.pack_uint64(r.length);
    pk.pack(r.kind.type);
    pk.pack_uint32(r.kind.device);
  }
  pk.pack(std::string("backends"));
  pk.pack_map(static_cast<std::uint32_t>(d.sections.size()));
  for (const auto& [name, bytes] : d.sections) {
    pk.pack(name);
    pk.pack_bin(static_cast<std::uint32_t>(bytes.size()));
    pk.pack_bin_body(reinterpret_cast<const char*>(bytes.data()),
                     static_cast<std::uint32_t>(bytes.size()));
  }
  const auto* p = reinterpret_cast<const std::uint8_t*>(buffer.data());
  return {p, p + buffer.size()};
}

namespace {

Result<RemoteRegion> DecodeRegion(const msgpack::object& r, const std::string& at) {
  if (r.type != msgpack::type::ARRAY || r.via.array.size != 5) {
    return Status::InvalidArgument(at + ": expected [id, address, length, kind, device]");
  }
  const msgpack::object* f = r.via.array.ptr;
  for (std::uint32_t k : {0u, 1u, 2u, 4u}) {
    if (f[k].type != msgpack::type::POSITIVE_INTEGER) {
      return Status::InvalidArgument(at +
                                     ": expected non-negative integers for id, address, "
                                     "length and device");
    }
  }
  if (f[3].type != msgpack::type::STR) {
    return Status::InvalidArgument(at + ": expected the memory kind as a string, found " +
                                   wire::ObjectTypeName(f[3]));
  }
  RemoteRegion region;
  region.addr = f[1].via.u64;
  region.length = f[2].via.u64;
  if (f[0].via.u64 > std::numeric_limits<RegionId>::max()) {
    return Status::InvalidArgument(at + ": region id exceeds 32 bits");
  }
  region.id = static_cast<RegionId>(f[0].via.u64);
  if (region.length == 0 || region.addr + region.length < region.addr) {
    return Status::InvalidArgument(at + ": expected a non-empty range inside the address space");
  }
  region.kind.type.assign(f[3].via.str.ptr, std::min<std::size_t>(f[3].via.str.size, 64));
  if (!IsValidMemoryKindType(region.kind.type)) {
    return Status::InvalidArgument(at + ": memory kind '" + region.kind.type +
                                   "' is not 1 to 16 lower-case letters and digits");
  }
  if (f[4].via.u64 > std::numeric_limits<std::uint32_t>::max() ||
      (region.kind.is_host() && f[4].via.u64 != 0)) {
    return Status::InvalidArgument(at + ": device " + std::to_string(f[4].via.u64) +
                                   " is out of range for memory kind " + region.kind.type);
  }
  region.kind.device = static_cast<std::uint32_t>(f[4].via.u64);
  return region;
}

}  // namespace

Result<PeerDescriptor> DecodeDescriptor(std::span<const std::uint8_t> bytes) {
  if (bytes.size() > (8u << 20)) {
    return Status::InvalidArgument("transport descriptor of " + std::to_string(bytes.size()) +
                                   " bytes exceeds the limit of 8 MiB");
  }
  KVFERRY_ASSIGN_OR_RETURN(msgpack::object_handle handle,
                           wire::SafeUnpack(bytes, {kMaxDescriptorRegions, 16, 4}));
  KVFERRY_ASSIGN_OR_RETURN(wire::MapView m, wire::MapView::Of(handle.get(), "descriptor"));
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t version, m.Uint("v", 255));
  if (version != kDescriptorVersion) {
    return Status::NotSupported("transport descriptor version " + std::to_string(version) +
                                " is not supported; this build reads version " +
                                std::to_string(kDescriptorVersion) +
                                ": run the same kvferry build on both sides");
  }
  PeerDescriptor d;
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* regions, m.Require("regions"));
  if (regions->type != msgpack::type::ARRAY) {
    return Status::InvalidArgument(m.At("regions") + ": expected an array, found " +
                                   wire::ObjectTypeName(*regions));
  }
  std::set<RegionId> seen;
  for (std::uint32_t i = 0; i < regions->via.array.size; ++i) {
    const std::string at = m.At("regions") + "[" + std::to_string(i) + "]";
    KVFERRY_ASSIGN_OR_RETURN(RemoteRegion region, DecodeRegion(regions->via.array.ptr[i], at));
    if (!seen.insert(region.id).second) {
      return Status::InvalidArgument(at + ": region id " + std::to_string(region.id) +
                                     " appears twice");
    }
    d.regions.push_back(std::move(region));
  }
  KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* backends, m.Require("backends"));
  KVFERRY_ASSIGN_OR_RETURN(wire::MapView bm, wire::MapView::Of(*backends, m.At("backends")));
  if (backends->via.map.size > kMaxDescriptorSections) {
    return Status::InvalidArgument(
        m.At("backends") + ": " + std::to_string(backends->via.map.size) +
        " sections exceed the limit of " + std::to_string(kMaxDescriptorSections));
  }
  for (std::uint32_t i = 0; i < backends->via.map.size; ++i) {
    const msgpack::object& key = backends->via.map.ptr[i].key;
    const std::string name(key.via.str.ptr, std::min<std::size_t>(key.via.str.size, 64));
    if (!IsValidMemoryKindType(name)) {
      return Status::InvalidArgument(m.At("backends") + ": backend name '" + name +
                                     "' is not 1 to 16 lower-case letters and digits");
    }
    KVFERRY_ASSIGN_OR_RETURN(d.sections[name], bm.Bin(name.c_str(), kMaxSectionBytes));
  }
  return d;
}

RemoteRegionTable IndexRegions(const std::vector<RemoteRegion>& regions) {
  RemoteRegionTable table;
  for (const RemoteRegion& r : regions) table.emplace(r.id, r);
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
