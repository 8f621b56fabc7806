// Reading msgpack from untrusted peers: a bounded unpack and a typed, path-naming view of maps.
// Shared by the side-channel messages and the transport descriptors.
#pragma once

#include <cstdint>
#include <limits>
#include <msgpack.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::wire {

struct UnpackLimits {
  std::size_t max_array_elements = 65536;
  std::size_t max_map_entries = 64;
  std::size_t max_depth = 6;
};

/// Unpacks exactly one msgpack object that fills `bytes`. Before msgpack allocates, checks that
/// the declared array and map elements do not outnumber the input bytes and that nesting stays
/// within `limits.max_depth`, so memory use stays a small multiple of the input size. Malformed,
/// truncated or trailing bytes are InvalidArgument. Thread-safe.
Result<msgpack::object_handle> SafeUnpack(std::span<const std::uint8_t> bytes,
                                          const UnpackLimits& limits);

/// "a string", "a map", ... for error messages.
const char* ObjectTypeName(const msgpack::object& o);

// A map whose keys have been checked to be unique strings, with its path for error messages.
class MapView {
 public:
  static Result<MapView> Of(const msgpack::object& o, std::string path) {
    if (o.type != msgpack::type::MAP) {
      return Status::InvalidArgument(path + ": expected a map, found " + ObjectTypeName(o));
    }
    const msgpack::object_map& m = o.via.map;
    for (std::uint32_t i = 0; i < m.size; ++i) {
      const msgpack::object& k = m.ptr[i].key;
      if (k.type != msgpack::type::STR) {
        return Status::InvalidArgument(path + ": map key " + std::to_string(i) + " is " +
                                       ObjectTypeName(k) + ", expected a string");
      }
      const std::string_view key(k.via.str.ptr, k.via.str.size);
      for (std::uint32_t j = 0; j < i; ++j) {
        const msgpack::object& other = m.ptr[j].key;
        if (std::string_view(other.via.str.ptr, other.via.str.size) == key) {
          return Status::InvalidArgument(path + ": key '" + std::string(key.substr(0, 64)) +
                                         "' appears twice");
        }
      }
    }
    return MapView(&m, std::move(path));
  }

  const std::string& path() const { return path_; }
  std::string At(const char* key) const { return path_ + "." + key; }

  const msgpack::object* Find(const char* key) const {
    const std::string_view want(key);
    for (std::uint32_t i = 0; i < map_->size; ++i) {
      const msgpack::object& k = map_->ptr[i].key;
      if (std::string_view(k.via.str.ptr, k.via.str.size) == want) return &map_->ptr[i].val;
    }
    return nullptr;
  }

  Result<const msgpack::object*> Require(const char* key) const {
    const msgpack::object* v = Find(key);
    if (v == nullptr) return Status::InvalidArgument(At(key) + ": missing");
    return v;
  }

  Result<std::string> Str(const char* key, std::size_t max_bytes) const {
    KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* v, Require(key));
    return StrOf(*v, At(key), max_bytes);
  }

  std::optional<Result<std::string>> OptionalStr(const char* key, std::size_t max_bytes) const {
    const msgpack::object* v = Find(key);
    if (v == nullptr) return std::nullopt;
    return StrOf(*v, At(key), max_bytes);
  }

  Result<std::uint64_t> Uint(const char* key, std::uint64_t max) const {
    KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* v, Require(key));
    if (v->type != msgpack::type::POSITIVE_INTEGER) {
      return Status::InvalidArgument(At(key) + ": expected a non-negative integer, found " +
                                     ObjectTypeName(*v));
    }
    if (v->via.u64 > max) {
      return Status::InvalidArgument(At(key) + ": " + std::to_string(v->via.u64) +
                                     " exceeds the limit of " + std::to_string(max));
    }
    return v->via.u64;
  }

  Result<std::vector<std::uint8_t>> Bin(const char* key, std::size_t max_bytes) const {
    KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* v, Require(key));
    if (v->type != msgpack::type::BIN) {
      return Status::InvalidArgument(At(key) + ": expected binary, found " + ObjectTypeName(*v));
    }
    if (v->via.bin.size > max_bytes) {
      return Status::InvalidArgument(At(key) + ": " + std::to_string(v->via.bin.size) +
                                     " bytes exceed the limit of " + std::to_string(max_bytes));
    }
    const auto* p = reinterpret_cast<const std::uint8_t*>(v->via.bin.ptr);
    return std::vector<std::uint8_t>(p, p + v->via.bin.size);
  }

  Result<std::vector<std::string>> StrList(const char* key, std::size_t max_items,
                                           std::size_t max_bytes) const {
    KVFERRY_ASSIGN_OR_RETURN(const msgpack::object* v, Require(key));
    if (v->type != msgpack::type::ARRAY) {
      return Status::InvalidArgument(At(key) + ": expected an array, found " + ObjectTypeName(*v));
    }
    if (v->via.array.size > max_items) {
      return Status::InvalidArgument(At(key) + ": " + std::to_string(v->via.array.size) +
                                     " items exceed the limit of " + std::to_string(max_items));
    }
    std::vector<std::string> out;
    out.reserve(v->via.array.size);
    for (std::uint32_t i = 0; i < v->via.array.size; ++i) {
      KVFERRY_ASSIGN_OR_RETURN(
          std::string s,
          StrOf(v->via.array.ptr[i], At(key) + "[" + std::to_string(i) + "]", max_bytes));
      out.push_back(std::move(s));
    }
    return out;
  }

  static Result<std::string> StrOf(const msgpack::object& v, const std::string& path,
                                   std::size_t max_bytes) {
    if (v.type != msgpack::type::STR) {
      return Status::InvalidArgument(path + ": expected a string, found " + ObjectTypeName(v));
    }
    if (v.via.str.size > max_bytes) {
      return Status::InvalidArgument(path + ": " + std::to_string(v.via.str.size) +
                                     " bytes exceed the limit of " + std::to_string(max_bytes));
    }
    return std::string(v.via.str.ptr, v.via.str.size);
  }

 private:
  MapView(const msgpack::object_map* map, std::string path) : map_(map), path_(std::move(path)) {}

  const msgpack::object_map* map_;
  std::string path_;
};

/// The largest values of signed types, as bounds of unsigned msgpack integers.
inline constexpr std::uint64_t kMaxI32 = std::numeric_limits<std::int32_t>::max();
inline constexpr std::uint64_t kMaxI64 = std::numeric_limits<std::int64_t>::max();

/// The optional array under `key` of at most `max_items` non-negative int64 values; empty when
/// absent.
Result<std::vector<std::int64_t>> OptionalInts(const MapView& m, const char* key,
                                               std::uint32_t max_items);

/// An array of at most `max_items` block ids at `path`: each non-negative or -1 (kNoBlock, a
/// position where a KV cache group holds no block).
Result<std::vector<std::int64_t>> BlockIdsOf(const msgpack::object& v, const std::string& path,
                                             std::uint32_t max_items);

}  // namespace kvferry::wire
