// Latency bounds in tests are contracts measured on an unloaded optimised build. Sanitizers slow
// every step by several times, so under them the same bounds are scaled by kTimingSlack.
#pragma once

namespace kvferry::testing {

#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
inline constexpr int kTimingSlack = 5;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
inline constexpr int kTimingSlack = 5;
#else
inline constexpr int kTimingSlack = 1;
#endif
#else
inline constexpr int kTimingSlack = 1;
#endif

}  // namespace kvferry::testing
