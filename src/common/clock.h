// Deadlines: every wait in kvferry has one.
#pragma once

#include <algorithm>
#include <chrono>

#include "kvferry/transport.h"

namespace kvferry {

inline Deadline DeadlineAfter(std::chrono::milliseconds ms) { return Clock::now() + ms; }

/// Milliseconds left until `deadline`, clamped to [0, cap_ms]; for poll(2) timeouts.
inline int PollTimeoutMs(Deadline deadline, int cap_ms) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, cap_ms));
}

inline bool Expired(Deadline deadline) { return Clock::now() >= deadline; }

}  // namespace kvferry
