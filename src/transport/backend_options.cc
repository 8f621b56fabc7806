#include "transport/backend_options.h"

#include <charconv>

namespace kvferry {

TransportOptionMap OwnOptions(const TransportOptionMap& all, std::string_view backend) {
  TransportOptionMap own;
  const std::string prefix = std::string(backend) + ".";
  for (const auto& [key, value] : all) {
    if (key.size() > prefix.size() && key.compare(0, prefix.size(), prefix) == 0) {
      own.emplace(key.substr(prefix.size()), value);
    }
  }
  return own;
}

std::string BackendOptionReader::FullKey(std::string_view key) const {
  return backend_ + "." + std::string(key);
}

const std::string* BackendOptionReader::Find(std::string_view key) {
  known_.emplace(key);
  auto it = own_.find(std::string(key));
  return it == own_.end() ? nullptr : &it->second;
}

Status BackendOptionReader::ReadString(std::string_view key, std::string* value) {
  if (const std::string* v = Find(key)) *value = *v;
  return Status::Ok();
}

Status BackendOptionReader::ReadUint(std::string_view key, std::uint64_t min, std::uint64_t max,
                                     std::uint64_t* value) {
  const std::string* v = Find(key);
  if (v == nullptr) return Status::Ok();
  std::uint64_t parsed = 0;
  const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), parsed);
  if (v->empty() || ec != std::errc() || end != v->data() + v->size() || parsed < min ||
      parsed > max) {
    return Status::InvalidArgument(FullKey(key) + ": expected an integer from " +
                                   std::to_string(min) + " to " + std::to_string(max) +
                                   ", found '" + *v + "'");
  }
  *value = parsed;
  return Status::Ok();
}

Status BackendOptionReader::ReadBool(std::string_view key, bool* value) {
  const std::string* v = Find(key);
  if (v == nullptr) return Status::Ok();
  if (*v == "true" || *v == "1") {
    *value = true;
  } else if (*v == "false" || *v == "0") {
    *value = false;
  } else {
    return Status::InvalidArgument(FullKey(key) + ": expected true, false, 1 or 0, found '" + *v +
                                   "'");
  }
  return Status::Ok();
}

Status BackendOptionReader::ReadMillis(std::string_view key, std::uint64_t min_ms,
                                       std::uint64_t max_ms, std::chrono::milliseconds* value) {
  auto ms = static_cast<std::uint64_t>(value->count() < 0 ? 0 : value->count());
  KVFERRY_RETURN_IF_ERROR(ReadUint(key, min_ms, max_ms, &ms));
  *value = std::chrono::milliseconds(static_cast<std::int64_t>(ms));
  return Status::Ok();
}

Status BackendOptionReader::RejectUnknown() const {
  for (const auto& [key, value] : own_) {
    if (known_.count(key) != 0) continue;
    std::string list;
    for (const std::string& k : known_) list += (list.empty() ? "" : ", ") + FullKey(k);
    return Status::InvalidArgument("unknown transport option " + FullKey(key) + " (= '" + value +
                                   "'); the " + backend_ + " backend knows " + list);
  }
  return Status::Ok();
}

}  // namespace kvferry
