// What the reference engine's files share: a request as the engine runs it, and the hash mixer
// that the prefix hashes and the KV values derive from.
#pragma once

#include <cstdint>
#include <vector>

#include "common/clock.h"
#include "engine/engine.h"

namespace kvferry::engine {

inline std::uint64_t Mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

struct Instance::Running {
  EngineRequest request;
  std::vector<std::uint64_t> hashes;
  // [group][block index]: every block of the prompt, group 0's prefix hits first; kNoBlock where
  // a sliding-window group holds none.
  std::vector<std::vector<std::int64_t>> blocks;
  std::int64_t prefix_hit = 0;
  // Decode: the prompt tokens the engine holds once the load is done (prefix hits and loaded).
  std::int64_t loaded_end = 0;
  Clock::time_point submitted = Clock::now();
  Clock::time_point scheduled{};
  EngineResult result;
  bool aborted = false;
};

// The model-wide heads [first, first + count) of `part` that `spec`'s TP rank holds, written from
// the definition (engine_kv.cc), not taken from CacheSpec.
struct HeldHeads {
  std::int64_t first = 0;
  std::int64_t count = 0;
};
HeldHeads HeadsHeldBy(const CacheSpec& spec, int part);

}  // namespace kvferry::engine
