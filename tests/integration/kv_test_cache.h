// A KV cache in ordinary memory whose every element is a known function of its model-level
// coordinates, so the decode side can check every byte it received. Which model heads a rank
// holds comes from tests/head_placement.h, not from the library's SplitHeads: a wrong placement in
// the library then makes the transfer plans move the wrong heads, and the check fails.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "kvferry/cache_spec.h"
#include "tests/head_placement.h"

namespace kvferry::testing {

/// Value of element (layer, part, block on the prefill side, token, model-wide head, dim).
inline std::int32_t KvValue(int layer, int part, std::int64_t block, std::int64_t token,
                            std::int64_t head, std::int64_t dim) {
  std::uint64_t x =
      (static_cast<std::uint64_t>(layer) << 56) ^ (static_cast<std::uint64_t>(part) << 52) ^
      (static_cast<std::uint64_t>(block) << 32) ^ (static_cast<std::uint64_t>(token) << 20) ^
      (static_cast<std::uint64_t>(head) << 10) ^ static_cast<std::uint64_t>(dim);
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return static_cast<std::int32_t>(x);
}

/// One TP rank's cache (dtype int32).
class TestCache {
 public:
  explicit TestCache(const CacheSpec& spec) : spec_(spec) {
    // The spec sizes blocks from its own head count; the oracle must agree, or the element
    // indices below would leave the block.
    for (int p = 0; p < spec.num_parts(); ++p) {
      const std::int64_t want = OracleLocalHeads(spec, p).count * spec.tokens_per_block() *
                                spec.parts()[static_cast<std::size_t>(p)].head_dim * 4;
      if (spec.BlockBytes(p) != want) {
        std::cerr << "TestCache: part " << p << " of TP rank " << spec.tp_rank() << " of "
                  << spec.tp_size() << " has blocks of " << spec.BlockBytes(p)
                  << " bytes; the head placement oracle expects " << want << "\n";
        std::abort();
      }
    }
    for (int l = 0; l < spec.num_layers(); ++l) {
      for (int p = 0; p < spec.num_parts(); ++p) {
        parts_.emplace_back(static_cast<std::size_t>(spec.PartBytes(p) / 4), 0);
      }
    }
  }
  const CacheSpec& spec() const { return spec_; }

  std::vector<std::vector<std::uint64_t>> Bases() {
    std::vector<std::vector<std::uint64_t>> out(static_cast<std::size_t>(spec_.num_layers()));
    for (int l = 0; l < spec_.num_layers(); ++l) {
      for (int p = 0; p < spec_.num_parts(); ++p) {
        out[static_cast<std::size_t>(l)].push_back(
            reinterpret_cast<std::uint64_t>(Part(l, p).data()));
      }
    }
    return out;
  }

  /// Writes what the prefill side computed for `block` (as block `as_block` of the model).
  void Fill(std::int64_t block, std::int64_t as_block) {
    ForEach(block, [&](int l, int p, std::int64_t t, std::int64_t h, std::int64_t d,
                       std::int32_t& v) { v = KvValue(l, p, as_block, t, h, d); });
  }
  void FillAll() {
    for (std::int64_t b = 0; b < spec_.num_blocks(); ++b) Fill(b, b);
  }
  /// Layer `layer` only of Fill(block, as_block): a layer-wise prefill writes one layer at a time.
  void FillLayer(std::int64_t block, std::int64_t as_block, int layer) {
    ForEach(block,
            [&](int l, int p, std::int64_t t, std::int64_t h, std::int64_t d, std::int32_t& v) {
              if (l == layer) v = KvValue(l, p, as_block, t, h, d);
            });
  }
  /// Number of elements of local `block` that differ from remote block `remote_block`'s values.
  std::int64_t Mismatches(std::int64_t block, std::int64_t remote_block) {
    std::int64_t bad = 0;
    ForEach(block,
            [&](int l, int p, std::int64_t t, std::int64_t h, std::int64_t d, std::int32_t& v) {
              if (v != KvValue(l, p, remote_block, t, h, d)) ++bad;
            });
    return bad;
  }

 private:
  std::vector<std::int32_t>& Part(int l, int p) {
    return parts_[static_cast<std::size_t>(l * spec_.num_parts() + p)];
  }
  template <typename Fn>
  void ForEach(std::int64_t block, Fn fn) {
    for (int l = 0; l < spec_.num_layers(); ++l) {
      for (int p = 0; p < spec_.num_parts(); ++p) {
        const OracleHeads local = OracleLocalHeads(spec_, p);
        const std::int64_t heads = local.count;
        const std::int64_t first = local.first;
        const std::int64_t dim = spec_.parts()[static_cast<std::size_t>(p)].head_dim;
        const std::int64_t tokens = spec_.tokens_per_block();
        std::int32_t* base = Part(l, p).data() + block * (spec_.BlockBytes(p) / 4);
        for (std::int64_t t = 0; t < tokens; ++t) {
          for (std::int64_t h = 0; h < heads; ++h) {
            for (std::int64_t d = 0; d < dim; ++d) {
              const std::int64_t idx = spec_.layout() == BlockLayout::kTokenMajor
                                           ? (t * heads + h) * dim + d
                                           : (h * tokens + t) * dim + d;
              fn(l, p, t, first + h, d, base[idx]);
            }
          }
        }
      }
    }
  }

  CacheSpec spec_;
  std::vector<std::vector<std::int32_t>> parts_;
};

/// The cache shapes the connector tests use, by name: "mha", "mha_head_major", "mla".
inline Result<CacheSpec> TestSpec(const std::string& kind, int tp_size, int tp_rank,
                                  std::int64_t blocks = 64) {
  if (kind == "mla") return CacheSpec::Mla(2, 16, 4, blocks, 4, DType::kInt32, tp_size, tp_rank);
  const BlockLayout layout =
      kind == "mha_head_major" ? BlockLayout::kHeadMajor : BlockLayout::kTokenMajor;
  return CacheSpec::Mha(2, 4, 8, blocks, 4, DType::kInt32, tp_size, tp_rank, layout);
}

}  // namespace kvferry::testing
