// Writing msgpack: the few helpers every encoder here needs (side-channel messages, connector
// metadata), so strings and id lists are packed one way.
#pragma once

#include <cstdint>
#include <msgpack.hpp>
#include <string_view>
#include <vector>

namespace kvferry::wire {

using Packer = msgpack::packer<msgpack::sbuffer>;

inline void PackStr(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<std::uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<std::uint32_t>(s.size()));
}

inline void PackIds(Packer& pk, const std::vector<std::int64_t>& ids) {
  pk.pack_array(static_cast<std::uint32_t>(ids.size()));
  for (std::int64_t id : ids) pk.pack_int64(id);
}

}  // namespace kvferry::wire
