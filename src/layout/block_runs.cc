#include "layout/block_runs.h"

#include <algorithm>
#include <string>

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

std::int64_t RegionBytes(const CacheSpec& spec, int part) {
  if (!PartsInterleaved(spec)) return spec.PartBytes(part);
  return spec.num_blocks() * spec.BlockStride(0);
}

Status CheckRegionLayout(const CacheSpec& spec) {
  if (!PartsInterleaved(spec)) return Status::Ok();
  const std::int64_t sum = InterleavedOffset(spec, spec.num_parts());
  for (int p = 0; p < spec.num_parts(); ++p) {
    if (spec.BlockStride(p) != sum) {
      return Status::NotSupported(
          "part " + std::to_string(p) + " has block stride " + std::to_string(spec.BlockStride(p)) +
          " bytes; interleaved parts must each have the stride of one block of every part (" +
          std::to_string(sum) +
          " bytes, as in a (num_blocks, parts, ...) tensor), or no part may be strided");
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

}  // namespace kvferry
