// The registered addresses of a cache (CacheAddresses): one base per layer and part, each checked
// against the spec (null, alignment, wrap-around) and against every other part, so that no two
// blocks share a byte.
#include <algorithm>
#include <string>
#include <utility>

#include "kvferry/cache_spec.h"
#include "layout/part_label.h"

namespace kvferry {
namespace {

std::string ToHexAddress(std::uint64_t value) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  do {
    out.insert(out.begin(), kDigits[value & 0xf]);
    value >>= 4;
  } while (value != 0);
  return out;
}

// Whether some block of part `pa` at base `a` shares a byte with some block of part `pb` at base
// `b` (a <= b). Equal strides: block i of A and block j of B intersect iff
// -bytes_b < (b - a) + k * stride < bytes_a for k = j - i in [-(n - 1), n - 1]; the k that can
// satisfy it form one interval, intersected with that range. Different strides: the extents must
// not intersect at all (a conservative rule no vLLM layout needs to relax).
bool BlocksIntersect(const CacheSpec& spec, std::uint64_t a, int pa, std::uint64_t b, int pb) {
  const std::int64_t stride = spec.BlockStride(pa);
  if (stride != spec.BlockStride(pb)) return true;  // callers pass intersecting extents only
  const auto d = static_cast<std::int64_t>(b - a);  // < extent, so it fits
  const std::int64_t bytes_a = spec.BlockBytes(pa);
  const std::int64_t bytes_b = spec.BlockBytes(pb);
  auto floor_div = [](std::int64_t x, std::int64_t y) {
    return x / y - ((x % y != 0) && ((x < 0) != (y < 0)) ? 1 : 0);
  };
  // Smallest k with d + k * stride > -bytes_b, largest k with d + k * stride < bytes_a.
  const std::int64_t k_min = floor_div(-bytes_b - d, stride) + 1;
  const std::int64_t k_max = floor_div(bytes_a - d - 1, stride);
  const std::int64_t n = spec.num_blocks();
  return std::max(k_min, -(n - 1)) <= std::min(k_max, n - 1);
}

}  // namespace

Result<CacheAddresses> CacheAddresses::Create(const CacheSpec& spec,
                                              std::vector<std::vector<std::uint64_t>> bases) {
  if (bases.size() != static_cast<std::size_t>(spec.num_layers())) {
    return Status::InvalidArgument("expected base addresses for " +
                                   std::to_string(spec.num_layers()) + " layers, found " +
                                   std::to_string(bases.size()));
  }
  struct Region {
    std::uint64_t begin;
    std::uint64_t end;
    int layer;
    int part;
  };
  std::vector<Region> regions;
  const auto align = static_cast<std::uint64_t>(spec.RequiredAlignment());
  for (std::size_t l = 0; l < bases.size(); ++l) {
    if (bases[l].size() != static_cast<std::size_t>(spec.num_parts())) {
      return Status::InvalidArgument(
          "layer " + std::to_string(l) + " has " + std::to_string(bases[l].size()) +
          " base addresses, expected " + std::to_string(spec.num_parts()) + " (one per part)");
    }
    for (int p = 0; p < spec.num_parts(); ++p) {
      const std::uint64_t base = bases[l][static_cast<std::size_t>(p)];
      const std::string label =
          PartLabel(static_cast<int>(l), p, spec.parts()[static_cast<std::size_t>(p)]);
      if (base == 0) return Status::InvalidArgument(label + " has a null base address");
      if (base % align != 0) {
        return Status::InvalidArgument(label + " base address 0x" + ToHexAddress(base) +
                                       " is not aligned to " + std::to_string(align) +
                                       " bytes, as dtype " + DTypeName(spec.dtype()) + " requires");
      }
      const auto len = static_cast<std::uint64_t>(spec.PartBytes(p));
      if (base + len < base) {
        return Status::InvalidArgument(label + " region wraps around the address space");
      }
      regions.push_back({base, base + len, static_cast<int>(l), p});
    }
  }
  std::sort(regions.begin(), regions.end(),
            [](const Region& a, const Region& b) { return a.begin < b.begin; });
  // Every pair whose extents intersect must keep its blocks apart: interleaved parts are fine,
  // shared bytes are not. Sorted by start, so the inner loop stops at the first region that
  // begins past the current one's end.
  for (std::size_t i = 0; i < regions.size(); ++i) {
    for (std::size_t j = i + 1; j < regions.size() && regions[j].begin < regions[i].end; ++j) {
      const Region& a = regions[i];
      const Region& b = regions[j];
      if (BlocksIntersect(spec, a.begin, a.part, b.begin, b.part)) {
        return Status::InvalidArgument("layer " + std::to_string(b.layer) + " part " +
                                       std::to_string(b.part) + " overlaps layer " +
                                       std::to_string(a.layer) + " part " + std::to_string(a.part) +
                                       ": every block of every part needs its own memory");
      }
    }
  }
  return CacheAddresses(std::move(bases));
}

}  // namespace kvferry
