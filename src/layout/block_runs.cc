#include "layout/block_runs.h"

#include <algorithm>
#include <optional>
#include <string>

#include "common/checked_math.h"

namespace kvferry {

Result<std::span<const std::int64_t>> TailOfRemote(std::span<const std::int64_t> remote_ids,
                                                   std::span<const std::int64_t> local_ids) {
  if (local_ids.size() > remote_ids.size()) {
    return Status::InvalidArgument("the decode side allocated " + std::to_string(local_ids.size()) +
                                   " blocks but the prefill side sent only " +
                                   std::to_string(remote_ids.size()) +
                                   "; expected at most as many local blocks as remote ones");
  }
  return remote_ids.subspan(remote_ids.size() - local_ids.size());
}

Result<std::vector<BlockRun>> MergeBlockRuns(std::span<const std::int64_t> remote_ids,
                                             std::span<const std::int64_t> local_ids,
                                             std::int64_t remote_num_blocks,
                                             std::int64_t local_num_blocks) {
  if (remote_ids.size() != local_ids.size()) {
    return Status::InvalidArgument("expected as many remote as local block ids, found " +
                                   std::to_string(remote_ids.size()) + " and " +
                                   std::to_string(local_ids.size()));
  }
  std::vector<bool> seen(static_cast<std::size_t>(std::max<std::int64_t>(local_num_blocks, 0)));
  for (std::size_t i = 0; i < remote_ids.size(); ++i) {
    if (remote_ids[i] < 0 || remote_ids[i] >= remote_num_blocks) {
      return Status::InvalidArgument("remote block id " + std::to_string(remote_ids[i]) +
                                     " at index " + std::to_string(i) + " is outside [0, " +
                                     std::to_string(remote_num_blocks) + ")");
    }
    if (local_ids[i] < 0 || local_ids[i] >= local_num_blocks) {
      return Status::InvalidArgument("local block id " + std::to_string(local_ids[i]) +
                                     " at index " + std::to_string(i) + " is outside [0, " +
                                     std::to_string(local_num_blocks) + ")");
    }
    const auto slot = static_cast<std::size_t>(local_ids[i]);
    if (seen[slot]) {
      return Status::InvalidArgument("local block id " + std::to_string(local_ids[i]) +
                                     " appears twice; each local block can receive one block");
    }
    seen[slot] = true;
  }
  std::vector<BlockRun> runs;
  for (std::size_t i = 0; i < remote_ids.size(); ++i) {
    if (!runs.empty()) {
      BlockRun& last = runs.back();
      if (remote_ids[i] == last.remote_start + last.count &&
          local_ids[i] == last.local_start + last.count) {
        ++last.count;
        continue;
      }
    }
    runs.push_back({remote_ids[i], local_ids[i], 1});
  }
  return runs;
}

std::vector<PartBlockGeometry> PartBlockGeometryOf(const CacheSpec& remote,
                                                   const CacheSpec& local) {
  std::vector<PartBlockGeometry> out;
  out.reserve(static_cast<std::size_t>(local.num_parts()));
  for (int p = 0; p < local.num_parts(); ++p) {
    out.push_back(
        {remote.BlockBytes(p), local.BlockBytes(p), remote.BlockStride(p), local.BlockStride(p)});
  }
  return out;
}

bool PartsInterleaved(const CacheSpec& spec) {
  for (int p = 0; p < spec.num_parts(); ++p) {
    if (spec.BlockStride(p) != spec.BlockBytes(p)) return true;
  }
  return false;
}

namespace {

// Offset of part `part`'s first block from part 0's in an interleaved layer.
std::int64_t InterleavedOffset(const CacheSpec& spec, int part) {
  std::int64_t offset = 0;
  for (int q = 0; q < part; ++q) offset += spec.BlockBytes(q);
  return offset;
}

}  // namespace

PartRegion RegionOfPart(const CacheSpec& spec, int layer, int part) {
  const std::int64_t first = static_cast<std::int64_t>(layer) * spec.num_parts();
  if (!PartsInterleaved(spec)) return {first + part, 0};
  return {first, InterleavedOffset(spec, part)};
}

PartRegion RegionOfPart(const CacheGroups& caches, int group, int layer, int part) {
  std::int64_t first = 0;
  for (int g = 0; g < group; ++g) {
    const CacheSpec& s = caches[g];
    // Every group takes layers * parts ids, interleaved or not (an interleaved layer's region has
    // the id of its part 0, RegionOfPart above), so ids never collide across groups. Before,
    // an interleaved group counted one id per layer, colliding with the next group's ids: such
    // caches failed to register, so no working peer numbered them otherwise.
    first += static_cast<std::int64_t>(s.num_layers()) * s.num_parts();
  }
  PartRegion r = RegionOfPart(caches[group], layer, part);
  r.id += first;
  return r;
}

std::int64_t RegionBytes(const CacheSpec& spec, int part) {
  if (!PartsInterleaved(spec)) return spec.PartBytes(part);
  return spec.num_blocks() * spec.BlockStride(0);
}

Status CheckRegionLayout(const CacheSpec& spec) {
  if (!PartsInterleaved(spec)) return Status::Ok();
  // A page may end in padding (vLLM's MambaSpec.page_size_padded), never start or gap with it.
  const std::int64_t sum = InterleavedOffset(spec, spec.num_parts());
  for (int p = 0; p < spec.num_parts(); ++p) {
    if (spec.BlockStride(p) != spec.BlockStride(0) || spec.BlockStride(p) < sum) {
      return Status::NotSupported(
          "part " + std::to_string(p) + " has block stride " + std::to_string(spec.BlockStride(p)) +
          " bytes; interleaved parts must each have the stride of one block of every part (" +
          std::to_string(sum) +
          " bytes, as in a (num_blocks, parts, ...) tensor, or more where the page ends in "
          "padding, one stride for every part), or no part may be strided");
    }
  }
  return Status::Ok();
}

Status CheckRegionBases(const CacheSpec& spec,
                        const std::vector<std::vector<std::uint64_t>>& bases) {
  KVFERRY_RETURN_IF_ERROR(CheckRegionLayout(spec));
  if (!PartsInterleaved(spec)) return Status::Ok();
  for (std::size_t l = 0; l < bases.size(); ++l) {
    for (int p = 1; p < spec.num_parts() && p < static_cast<int>(bases[l].size()); ++p) {
      const std::uint64_t want =
          bases[l][0] + static_cast<std::uint64_t>(InterleavedOffset(spec, p));
      if (bases[l][static_cast<std::size_t>(p)] != want) {
        return Status::NotSupported(
            "layer " + std::to_string(l) + " part " + std::to_string(p) + " starts " +
            std::to_string(
                static_cast<std::int64_t>(bases[l][static_cast<std::size_t>(p)] - bases[l][0])) +
            " bytes after part 0, but interleaved parts must follow each other inside every "
            "block (" +
            std::to_string(InterleavedOffset(spec, p)) +
            " bytes after part 0, as in a (num_blocks, parts, ...) tensor)");
      }
    }
  }
  return Status::Ok();
}

std::vector<ByteRange> RunByteRanges(std::span<const BlockRun> runs, int num_layers,
                                     std::span<const PartBlockBytes> block_bytes,
                                     const TpSource& source) {
  std::vector<PartBlockGeometry> packed;
  packed.reserve(block_bytes.size());
  for (const PartBlockBytes& b : block_bytes)
    packed.push_back({b.remote, b.local, b.remote, b.local});
  return RunByteRanges(runs, num_layers, packed, source);
}

std::vector<ByteRange> RunByteRanges(std::span<const BlockRun> runs, int num_layers,
                                     std::span<const PartBlockGeometry> blocks,
                                     const TpSource& source) {
  return RunByteRanges(runs, 0, num_layers, blocks, source);
}

std::vector<ByteRange> RunByteRanges(std::span<const BlockRun> runs, int first_layer, int end_layer,
                                     std::span<const PartBlockGeometry> blocks,
                                     const TpSource& source) {
  std::vector<ByteRange> out;
  for (int layer = first_layer; layer < end_layer; ++layer) {
    for (std::size_t p = 0; p < blocks.size(); ++p) {
      const BlockSlice& slice = source.part_slices[p];
      const PartBlockGeometry& bb = blocks[p];
      const bool packed = bb.remote_stride == bb.remote && bb.local_stride == bb.local;
      const int part = static_cast<int>(p);
      for (const BlockRun& run : runs) {
        if (slice.whole_block && packed) {
          out.push_back({layer, part, run.remote_start * bb.remote, run.local_start * bb.local,
                         run.count * bb.remote, 1, 0, 0});
          continue;
        }
        for (std::int64_t b = 0; b < run.count; ++b) {
          out.push_back({layer, part,
                         (run.remote_start + b) * bb.remote_stride + slice.remote_offset,
                         (run.local_start + b) * bb.local_stride + slice.local_offset, slice.length,
                         slice.count, slice.remote_step, slice.local_step});
        }
      }
    }
  }
  return out;
}

namespace {

Status CheckTokenBlocks(const char* side, const TokenBlocks& b, std::int64_t first_token,
                        std::int64_t end_token) {
  if (b.tokens_per_block <= 0) {
    return Status::InvalidArgument(std::string(side) + " blocks hold " +
                                   std::to_string(b.tokens_per_block) +
                                   " tokens; expected a positive count");
  }
  const auto held = static_cast<std::int64_t>(b.ids.size());
  // A peer's block size may be anything its cache's byte counts allow: no product may overflow.
  const std::optional<std::int64_t> span = CheckedMul(held, b.tokens_per_block);
  const std::optional<std::int64_t> end = span ? CheckedAdd(b.first_token, *span) : std::nullopt;
  if (!end) {
    return Status::InvalidArgument(
        std::string(side) + " blocks of " + std::to_string(b.tokens_per_block) + " tokens, " +
        std::to_string(held) + " of them, hold more tokens than a load can count");
  }
  if (b.first_token > first_token || *end < end_token) {
    return Status::InvalidArgument(
        std::string(side) + " blocks hold tokens [" + std::to_string(b.first_token) + ", " +
        std::to_string(*end) + ") (" + std::to_string(held) + " blocks of " +
        std::to_string(b.tokens_per_block) + "), which do not cover tokens [" +
        std::to_string(first_token) + ", " + std::to_string(end_token) + ") of the load");
  }
  // Blocks the load reads must exist; the others may be kNoBlock (a sliding window's freed ones).
  const std::int64_t first_read = (first_token - b.first_token) / b.tokens_per_block;
  const std::int64_t end_read = end_token == first_token
                                    ? first_read
                                    : (end_token - 1 - b.first_token) / b.tokens_per_block + 1;
  for (std::size_t i = 0; i < b.ids.size(); ++i) {
    const auto at = static_cast<std::int64_t>(i);
    const bool read = at >= first_read && at < end_read;
    if (!read && b.ids[i] == kNoBlock) continue;
    if (read && b.ids[i] == kNoBlock) {
      return Status::InvalidArgument(
          std::string(side) + " side has no block (-1) at index " + std::to_string(i) +
          ", tokens [" + std::to_string(b.first_token + at * b.tokens_per_block) + ", +" +
          std::to_string(b.tokens_per_block) + "), which the load reads (tokens [" +
          std::to_string(first_token) + ", " + std::to_string(end_token) +
          ")): the engine freed a block the decode side needs");
    }
    if (b.ids[i] < 0 || b.ids[i] >= b.num_blocks) {
      return Status::InvalidArgument(std::string(side) + " block id " + std::to_string(b.ids[i]) +
                                     " at index " + std::to_string(i) + " is outside [0, " +
                                     std::to_string(b.num_blocks) + ")");
    }
  }
  return Status::Ok();
}

}  // namespace

std::vector<std::int64_t> CacheBlocksOfIds(std::span<const std::int64_t> ids,
                                           std::int64_t blocks_per_id) {
  std::vector<std::int64_t> out;
  out.reserve(ids.size() * static_cast<std::size_t>(blocks_per_id));
  for (std::int64_t id : ids) {
    // Ids past any cache stay past it (they are checked against the cache after this).
    const std::int64_t first =
        id < 0 ? -1 : (id > (std::int64_t{1} << 40) ? std::int64_t{1} << 50 : id * blocks_per_id);
    for (std::int64_t k = 0; k < blocks_per_id; ++k) out.push_back(first < 0 ? -1 : first + k);
  }
  return out;
}

Result<std::vector<TokenRun>> PairTokenRuns(const TokenBlocks& remote, const TokenBlocks& local,
                                            std::int64_t first_token, std::int64_t num_tokens) {
  if (first_token < 0 || num_tokens < 0) {
    return Status::InvalidArgument("a load of tokens [" + std::to_string(first_token) + ", +" +
                                   std::to_string(num_tokens) +
                                   "); expected a first token and a count of at least 0");
  }
  const std::int64_t end_token = first_token + num_tokens;
  KVFERRY_RETURN_IF_ERROR(CheckTokenBlocks("remote", remote, first_token, end_token));
  KVFERRY_RETURN_IF_ERROR(CheckTokenBlocks("local", local, first_token, end_token));
  // Every local block that receives tokens receives them from this load alone.
  std::vector<bool> seen(static_cast<std::size_t>(std::max<std::int64_t>(local.num_blocks, 0)));
  const std::int64_t first_local = (first_token - local.first_token) / local.tokens_per_block;
  const std::int64_t end_local =
      num_tokens == 0 ? first_local
                      : (end_token - 1 - local.first_token) / local.tokens_per_block + 1;
  for (std::int64_t i = first_local; i < end_local; ++i) {
    const auto slot = static_cast<std::size_t>(local.ids[static_cast<std::size_t>(i)]);
    if (seen[slot]) {
      return Status::InvalidArgument("local block id " + std::to_string(slot) +
                                     " appears twice; each local block can receive one block");
    }
    seen[slot] = true;
  }
  std::vector<TokenRun> runs;
  for (std::int64_t t = first_token; t < end_token;) {
    const std::int64_t r = t - remote.first_token;
    const std::int64_t l = t - local.first_token;
    const std::int64_t r_slot = r % remote.tokens_per_block;
    const std::int64_t l_slot = l % local.tokens_per_block;
    const std::int64_t n = std::min(
        {remote.tokens_per_block - r_slot, local.tokens_per_block - l_slot, end_token - t});
    runs.push_back({remote.ids[static_cast<std::size_t>(r / remote.tokens_per_block)], r_slot,
                    local.ids[static_cast<std::size_t>(l / local.tokens_per_block)], l_slot, n});
    t += n;
  }
  return runs;
}

std::vector<ByteRange> TokenRunByteRanges(std::span<const TokenRun> runs, int first_layer,
                                          int end_layer, const CacheSpec& remote,
                                          const CacheSpec& local, const TpSource& source) {
  std::vector<ByteRange> out;
  auto add = [&out](const ByteRange& r) {
    if (!out.empty()) {
      ByteRange& last = out.back();
      if (last.layer == r.layer && last.part == r.part && last.count == 1 && r.count == 1 &&
          last.remote_offset + last.length == r.remote_offset &&
          last.local_offset + last.length == r.local_offset) {
        last.length += r.length;
        return;
      }
    }
    out.push_back(r);
  };
  const std::int64_t esize = DTypeSize(local.dtype());
  const bool token_major = local.layout() == BlockLayout::kTokenMajor;
  for (int layer = first_layer; layer < end_layer; ++layer) {
    for (int p = 0; p < local.num_parts(); ++p) {
      const std::int64_t row = local.parts()[static_cast<std::size_t>(p)].head_dim * esize;
      const std::int64_t remote_heads = remote.LocalHeads(p);
      const std::int64_t local_heads = local.LocalHeads(p);
      const std::int64_t heads = source.heads > 0 ? source.heads : local_heads;
      const std::int64_t remote_head = source.heads > 0 ? source.remote_first_head : 0;
      const std::int64_t local_head = source.heads > 0 ? source.local_first_head : 0;
      for (const TokenRun& run : runs) {
        const std::int64_t remote_block = run.remote_block * remote.BlockStride(p);
        const std::int64_t local_block = run.local_block * local.BlockStride(p);
        if (token_major) {
          // [token][head][dim]: the heads of a token are one piece, a token row apart.
          const std::int64_t remote_row = remote_heads * row;
          const std::int64_t local_row = local_heads * row;
          const std::int64_t from = remote_block + run.remote_slot * remote_row + remote_head * row;
          const std::int64_t to = local_block + run.local_slot * local_row + local_head * row;
          if (heads == remote_heads && heads == local_heads) {
            add({layer, p, from, to, run.count * local_row, 1, 0, 0});
          } else {
            add({layer, p, from, to, heads * row, run.count, remote_row, local_row});
          }
          continue;
        }
        // [head][token][dim]: a head's tokens are one piece, a block's tokens of a head apart.
        const std::int64_t remote_step = remote.tokens_per_block() * row;
        const std::int64_t local_step = local.tokens_per_block() * row;
        const std::int64_t from = remote_block + remote_head * remote_step + run.remote_slot * row;
        const std::int64_t to = local_block + local_head * local_step + run.local_slot * row;
        if (heads == 1) {
          add({layer, p, from, to, run.count * row, 1, 0, 0});
        } else {
          add({layer, p, from, to, run.count * row, heads, remote_step, local_step});
        }
      }
    }
  }
  return out;
}

}  // namespace kvferry
