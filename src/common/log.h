// Logging: one spdlog logger named "kvferry", level from KVFERRY_LOG_LEVEL (trace, debug, info,
// warn, error, off; default info). Log once, where an error is decided.
#pragma once

#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdint>

namespace kvferry {

/// The process-wide logger. Created on first use; thread-safe.
spdlog::logger& Log();

/// Counts events of one kind and says whether this one should be logged: the first ten, then
/// every thousandth, so a flood of bad input cannot flood the log. Thread-safe.
class RateLimitedCounter {
 public:
  /// Counts one event; returns its number (1-based) if it should be logged, else 0.
  std::uint64_t Hit() {
    const std::uint64_t n = count_.fetch_add(1, std::memory_order_relaxed) + 1;
    return (n <= 10 || n % 1000 == 0) ? n : 0;
  }
  std::uint64_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::uint64_t> count_{0};
};

}  // namespace kvferry
