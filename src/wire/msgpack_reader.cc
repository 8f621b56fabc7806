#include "wire/msgpack_reader.h"

#include <exception>
#include <string>

namespace kvferry::wire {
namespace {

// First pass over untrusted bytes, before msgpack allocates anything: every declared array or map
// element needs at least one byte of input, so the declared elements may not outnumber the bytes.
// msgpack allocates an array's storage when it reads the header, so without this pass a few bytes
// could make it allocate gigabytes. Also bounds the nesting depth.
class BoundsCheck : public msgpack::null_visitor {
 public:
  BoundsCheck(std::size_t input_bytes, std::size_t max_depth)
      : budget_(input_bytes), max_depth_(max_depth) {}

  bool start_array(std::uint32_t n) { return Enter(n); }
  bool end_array() { return Leave(); }
  bool start_map(std::uint32_t n) {
    // A map entry is a key and a value: two elements.
    return Enter(static_cast<std::uint64_t>(n) * 2);
  }
  bool end_map() { return Leave(); }

  const char* failure() const { return failure_; }

 private:
  bool Enter(std::uint64_t elements) {
    if (++depth_ > max_depth_) {
      failure_ = "nesting deeper than the protocol allows";
      return false;
    }
    if (elements > budget_) {
      failure_ = "a list or map declares more elements than the message has bytes";
      return false;
    }
    budget_ -= elements;
    return true;
  }
  bool Leave() {
    --depth_;
    return true;
  }

  std::uint64_t budget_;
  std::size_t max_depth_;
  std::size_t depth_ = 0;
  const char* failure_ = nullptr;
};

}  // namespace

const char* ObjectTypeName(const msgpack::object& o) {
  switch (o.type) {
    case msgpack::type::NIL:
      return "nil";
    case msgpack::type::BOOLEAN:
      return "a boolean";
    case msgpack::type::POSITIVE_INTEGER:
      return "a non-negative integer";
    case msgpack::type::NEGATIVE_INTEGER:
      return "a negative integer";
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64:
      return "a float";
    case msgpack::type::STR:
      return "a string";
    case msgpack::type::BIN:
      return "binary";
    case msgpack::type::ARRAY:
      return "an array";
    case msgpack::type::MAP:
      return "a map";
    case msgpack::type::EXT:
      return "an extension";
  }
  return "an unknown type";
}

Result<msgpack::object_handle> SafeUnpack(std::span<const std::uint8_t> bytes,
                                          const UnpackLimits& limits) {
  if (bytes.empty()) return Status::InvalidArgument("empty message: expected a msgpack map");
  const char* data = reinterpret_cast<const char*>(bytes.data());
  // msgpack-c reports malformed input by throwing; this is the one place kvferry lets a library
  // exception reach its code, and it ends here as a Status.
  try {
    BoundsCheck bounds(bytes.size(), limits.max_depth);
    std::size_t off = 0;
    if (!msgpack::parse(data, bytes.size(), off, bounds)) {
      return Status::InvalidArgument(
          std::string("malformed msgpack: ") +
          (bounds.failure() != nullptr ? bounds.failure() : "truncated or invalid encoding"));
    }
    if (off != bytes.size()) {
      return Status::InvalidArgument(std::to_string(bytes.size() - off) +
                                     " trailing bytes after the message: expected exactly one "
                                     "msgpack map");
    }
    off = 0;
    const msgpack::unpack_limit unpack_limits(limits.max_array_elements, limits.max_map_entries,
                                              bytes.size(), bytes.size(), 0, limits.max_depth);
    return msgpack::unpack(data, bytes.size(), off, nullptr, nullptr, unpack_limits);
  } catch (const std::exception& e) {
    return Status::InvalidArgument(std::string("malformed msgpack: ") + e.what());
  }
}

// An optional array of at most `max_items` non-negative int64 values; empty when absent.
Result<std::vector<std::int64_t>> OptionalInts(const MapView& m, const char* key,
                                               std::uint32_t max_items) {
  std::vector<std::int64_t> out;
  const msgpack::object* v = m.Find(key);
  if (v == nullptr) return out;
  if (v->type != msgpack::type::ARRAY || v->via.array.size > max_items) {
    return Status::InvalidArgument(m.At(key) + ": expected an array of at most " +
                                   std::to_string(max_items) + " integers");
  }
  for (std::uint32_t i = 0; i < v->via.array.size; ++i) {
    const msgpack::object& item = v->via.array.ptr[i];
    if (item.type != msgpack::type::POSITIVE_INTEGER || item.via.u64 > kMaxI64) {
      return Status::InvalidArgument(m.At(key) + "[" + std::to_string(i) +
                                     "]: expected a non-negative int64, found " +
                                     ObjectTypeName(item));
    }
    out.push_back(static_cast<std::int64_t>(item.via.u64));
  }
  return out;
}

Result<std::vector<std::int64_t>> BlockIdsOf(const msgpack::object& v, const std::string& path,
                                             std::uint32_t max_items) {
  if (v.type != msgpack::type::ARRAY || v.via.array.size > max_items) {
    return Status::InvalidArgument(path + ": expected an array of at most " +
                                   std::to_string(max_items) + " block ids, found " +
                                   ObjectTypeName(v));
  }
  std::vector<std::int64_t> out;
  out.reserve(v.via.array.size);
  for (std::uint32_t i = 0; i < v.via.array.size; ++i) {
    const msgpack::object& e = v.via.array.ptr[i];
    if (e.type == msgpack::type::NEGATIVE_INTEGER && e.via.i64 == -1) {
      out.push_back(-1);  // kNoBlock: a group's position without a block (a sliding window's)
      continue;
    }
    if (e.type != msgpack::type::POSITIVE_INTEGER || e.via.u64 > kMaxI64) {
      return Status::InvalidArgument(
          path + "[" + std::to_string(i) +
          "]: expected a non-negative block id or -1 (no block), found " + ObjectTypeName(e));
    }
    out.push_back(static_cast<std::int64_t>(e.via.u64));
  }
  return out;
}

}  // namespace kvferry::wire
