// The wire form of a worker's KV cache groups (docs/protocol.md, "CacheSpec" and "Groups"): one
// CacheSpec map per group, group 0 under "cache" as every version-1 peer reads it, the others
// under "more_groups", which a peer that predates groups never reads (the groups' hash then
// differs from its group 0's, and it refuses the metadata).
#pragma once

#include <cstdint>

#include "kvferry/cache_spec.h"
#include "kvferry/status.h"
#include "wire/msgpack_reader.h"
#include "wire/msgpack_writer.h"

namespace kvferry::wire {

/// One group's geometry as a map.
void PackCacheSpec(Packer& pk, const CacheSpec& spec);
/// The map under `key` of `parent`, validated as CacheSpec::Create validates a local spec.
Result<CacheSpec> DecodeCacheSpec(const MapView& parent, const char* key);

/// How many keys PackCacheGroups writes into the enclosing map: 1 ("cache") or 2.
std::uint32_t CacheGroupsKeys(const CacheGroups& groups);
/// Writes "cache" (group 0) and, for several groups, "more_groups" (an array of the others).
void PackCacheGroups(Packer& pk, const CacheGroups& groups);
/// Reads them back from `m`; at most kMaxCacheGroups groups, each validated, one TP placement.
Result<CacheGroups> DecodeCacheGroups(const MapView& m);

}  // namespace kvferry::wire
