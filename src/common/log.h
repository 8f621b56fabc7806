// Logging: one spdlog logger named "kvferry", level from KVFERRY_LOG_LEVEL (trace, debug, info,
// warn, error, off; default info). Log once, where an error is decided.
#pragma once

#include <spdlog/spdlog.h>

namespace kvferry {

/// The process-wide logger. Created on first use; thread-safe.
spdlog::logger& Log();

}  // namespace kvferry
