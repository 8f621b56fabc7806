#include "transport/section_fields.h"

#include <limits>
#include <set>
#include <string>

namespace kvferry {

void PackProcessFields(msgpack::packer<msgpack::sbuffer>& pk, const HostIdentity& host,
                       std::uint64_t start_time) {
  pk.pack(std::string("boot_id"));
  pk.pack(host.boot_id);
  pk.pack(std::string("pidns"));
  pk.pack_uint64(host.pid_namespace);
  pk.pack(std::string("pid"));
  pk.pack_int64(host.pid);
  pk.pack(std::string("start"));
  pk.pack_uint64(start_time);
}

Status ReadProcessFields(const wire::MapView& m, HostIdentity* host, std::uint64_t* start_time) {
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  KVFERRY_ASSIGN_OR_RETURN(host->boot_id, m.Str("boot_id", 64));
  KVFERRY_ASSIGN_OR_RETURN(host->pid_namespace, m.Uint("pidns", kMax));
  if (const msgpack::object* pid = m.Find("pid");
      pid != nullptr && pid->type == msgpack::type::NEGATIVE_INTEGER) {
    return Status::InvalidArgument(m.At("pid") +
                                   ": expected the serving process's pid (> 0), found " +
                                   std::to_string(pid->via.i64));
  }
  KVFERRY_ASSIGN_OR_RETURN(std::uint64_t pid,
                           m.Uint("pid", std::numeric_limits<std::int32_t>::max()));
  if (pid == 0) {
    // Pid 0 names no process a reader could prove.
    return Status::InvalidArgument(m.At("pid") +
                                   ": expected the serving process's pid (> 0), found 0");
  }
  host->pid = static_cast<std::int64_t>(pid);
  KVFERRY_ASSIGN_OR_RETURN(*start_time, m.Uint("start", kMax));
  return Status::Ok();
}

void PackRegionList(msgpack::packer<msgpack::sbuffer>& pk, const std::vector<RegionBlob>& list) {
  pk.pack_array(static_cast<std::uint32_t>(list.size()));
  for (const RegionBlob& e : list) {
    pk.pack_array(2);
    pk.pack_uint32(e.region);
    pk.pack_bin(static_cast<std::uint32_t>(e.bytes.size()));
    pk.pack_bin_body(reinterpret_cast<const char*>(e.bytes.data()),
                     static_cast<std::uint32_t>(e.bytes.size()));
  }
}

Status ReadRegionEntries(
    const msgpack::object& list, const std::string& path, std::uint32_t arity,
    const std::function<bool(const msgpack::object* items)>& shaped, std::string_view rest,
    std::string_view what,
    const std::function<void(std::uint32_t region, const msgpack::object* items)>& take) {
  if (list.type != msgpack::type::ARRAY) {
    return Status::InvalidArgument(path + ": expected an array, found " +
                                   wire::ObjectTypeName(list));
  }
  std::set<std::uint32_t> seen;
  for (std::uint32_t i = 0; i < list.via.array.size; ++i) {
    const msgpack::object& e = list.via.array.ptr[i];
    const std::string at = path + "[" + std::to_string(i) + "]";
    const bool well_formed =
        e.type == msgpack::type::ARRAY && e.via.array.size == arity &&
        e.via.array.ptr[0].type == msgpack::type::POSITIVE_INTEGER &&
        e.via.array.ptr[0].via.u64 <= std::numeric_limits<std::uint32_t>::max() &&
        shaped(e.via.array.ptr);
    if (!well_formed) {
      return Status::InvalidArgument(at + ": expected [region id, " + std::string(rest) + "]");
    }
    const auto region = static_cast<std::uint32_t>(e.via.array.ptr[0].via.u64);
    if (!seen.insert(region).second) {
      return Status::InvalidArgument(at + ": region " + std::to_string(region) +
                                     " is listed twice; expected one " + std::string(what) +
                                     " per region");
    }
    take(region, e.via.array.ptr);
  }
  return Status::Ok();
}

Result<std::vector<RegionBlob>> ReadRegionList(const msgpack::object& list, const std::string& path,
                                               std::size_t max_bytes, std::string_view what) {
  std::vector<RegionBlob> out;
  KVFERRY_RETURN_IF_ERROR(ReadRegionEntries(
      list, path, 2,
      [&](const msgpack::object* items) {
        return items[1].type == msgpack::type::BIN && items[1].via.bin.size >= 1 &&
               items[1].via.bin.size <= max_bytes;
      },
      std::string(what) + " (1 to " + std::to_string(max_bytes) + " bytes)", what,
      [&](std::uint32_t region, const msgpack::object* items) {
        const msgpack::object_bin& bin = items[1].via.bin;
        const auto* b = reinterpret_cast<const std::uint8_t*>(bin.ptr);
        out.push_back({region, {b, b + bin.size}});
      }));
  return out;
}

}  // namespace kvferry
