#include "common/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <memory>

namespace kvferry {

spdlog::logger& Log() {
  static const std::shared_ptr<spdlog::logger> logger = [] {
    auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    auto l = std::make_shared<spdlog::logger>("kvferry", std::move(sink));
    l->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [kvferry] [%l] [pid %P] %v");
    spdlog::level::level_enum level = spdlog::level::info;
    // Runs once, inside a function-local static initialiser; nothing in kvferry calls setenv.
    const char* env = std::getenv("KVFERRY_LOG_LEVEL");  // NOLINT(concurrency-mt-unsafe)
    if (env != nullptr && *env != '\0') level = spdlog::level::from_str(env);
    l->set_level(level);
    return l;
  }();
  return *logger;
}

}  // namespace kvferry
