// Fields that more than one backend's descriptor section carries, with one encoder and one
// decoder each, so that the sections follow one rule (docs/transport.md, "The descriptor"): the
// process fields that name the serving process, and region lists (the ucx section's packed
// rkeys, the shm section's IPC handles).
#pragma once

#include <cstdint>
#include <functional>
#include <msgpack.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"
#include "transport/peer_process.h"
#include "wire/msgpack_reader.h"

namespace kvferry {

/// The fields of a section that names the process serving it, four map entries: "boot_id",
/// "pidns", "pid" (of `host`) and "start" (the process's start time), so that a same-host reader
/// can prove the very process that wrote them (PeerProcess::Prove).
void PackProcessFields(msgpack::packer<msgpack::sbuffer>& pk, const HostIdentity& host,
                       std::uint64_t start_time);
/// Reads those fields of `m`; a pid that is not in 1..2^31-1 is InvalidArgument naming the field.
Status ReadProcessFields(const wire::MapView& m, HostIdentity* host, std::uint64_t* start_time);

/// One entry of a region list: a region of the descriptor and the bytes its backend publishes
/// for it (a packed rkey, an encoded IPC handle).
struct RegionBlob {
  std::uint32_t region = 0;
  std::vector<std::uint8_t> bytes;

  friend bool operator==(const RegionBlob&, const RegionBlob&) = default;
};

/// Packs `list` as an array of [region id (uint), bytes (bin)].
void PackRegionList(msgpack::packer<msgpack::sbuffer>& pk, const std::vector<RegionBlob>& list);
/// Reads such an array, never trusting it; `path` names it in errors and `what` names its bytes
/// ("packed rkey"). The one rule for every section: each entry is [region id (uint <= 2^32-1),
/// bytes (bin of 1 to `max_bytes`)]; an entry with no bytes, and a region that an earlier entry
/// named, are refused. InvalidArgument naming the entry otherwise.
Result<std::vector<RegionBlob>> ReadRegionList(const msgpack::object& list, const std::string& path,
                                               std::size_t max_bytes, std::string_view what);

/// The rule under ReadRegionList, for any list keyed by region: `list` must be an array of arrays
/// of `arity` items whose first is a region id (uint <= 2^32-1) and that `shaped` accepts, each
/// region named once; `take` gets each entry's items and region. InvalidArgument naming the entry
/// otherwise: "expected [region id, `rest`]", or "... listed twice; expected one `what` per
/// region".
Status ReadRegionEntries(
    const msgpack::object& list, const std::string& path, std::uint32_t arity,
    const std::function<bool(const msgpack::object* items)>& shaped, std::string_view rest,
    std::string_view what,
    const std::function<void(std::uint32_t region, const msgpack::object* items)>& take);

}  // namespace kvferry
