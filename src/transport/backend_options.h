// Reads one backend's string options ("connections" = "4" for the key tcp.connections) over the
// defaults its own options struct holds, with errors that name the full key.
#pragma once

#include <chrono>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>

#include "kvferry/status.h"
#include "kvferry/transport.h"

namespace kvferry {

/// The keys of `all` that start with "<backend>.", without that prefix.
TransportOptionMap OwnOptions(const TransportOptionMap& all, std::string_view backend);

/// Not thread-safe; one per parse. Each Read leaves `*value` alone when the key is absent.
class BackendOptionReader {
 public:
  BackendOptionReader(std::string_view backend, const TransportOptionMap& own)
      : backend_(backend), own_(own) {}

  Status ReadString(std::string_view key, std::string* value);
  /// An unsigned decimal integer in [min, max].
  Status ReadUint(std::string_view key, std::uint64_t min, std::uint64_t max, std::uint64_t* value);
  /// "true"/"false"/"1"/"0".
  Status ReadBool(std::string_view key, bool* value);
  /// Milliseconds, an unsigned decimal integer in [min_ms, max_ms].
  Status ReadMillis(std::string_view key, std::uint64_t min_ms, std::uint64_t max_ms,
                    std::chrono::milliseconds* value);
  /// InvalidArgument naming the first key of `own` that no Read asked for, listing the known
  /// ones; OK when none is left.
  Status RejectUnknown() const;

  /// "<backend>.<key>".
  std::string FullKey(std::string_view key) const;

 private:
  const std::string* Find(std::string_view key);

  std::string backend_;
  const TransportOptionMap& own_;
  std::set<std::string, std::less<>> known_;
};

}  // namespace kvferry
