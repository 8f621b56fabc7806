#include "connector/layerwise_plan.h"

#include <algorithm>
#include <string>

namespace kvferry {

bool LayerwiseCursor::Done() const {
  return prompt_tokens > 0 && std::all_of(tokens_read.begin(), tokens_read.end(),
                                          [&](std::int64_t t) { return t >= prompt_tokens; });
}

Status CheckLayerwiseProgress(const wire::Progress& p, std::size_t local_blocks,
                              std::int64_t tokens_per_block, int num_layers,
                              const LayerwiseCursor& cursor, std::int64_t remote_num_blocks) {
  const std::string what = "progress of transfer " + p.transfer_id + " from " + p.from.engine_id +
                           " rank " + std::to_string(p.from.tp_rank);
  if (p.state != wire::Progress::State::kRunning) return Status::Ok();
  const auto prompt = static_cast<std::int64_t>(p.prompt_tokens);
  const std::int64_t remote_blocks = (prompt + tokens_per_block - 1) / tokens_per_block;
  if (prompt <= 0 || remote_blocks < static_cast<std::int64_t>(local_blocks)) {
    return Status::InvalidArgument(what + " gives a prompt of " + std::to_string(prompt) +
                                   " tokens, " + std::to_string(remote_blocks) +
                                   " blocks; this reader allocated " +
                                   std::to_string(local_blocks) + " for it");
  }
  if (cursor.prompt_tokens != 0 && cursor.prompt_tokens != prompt) {
    return Status::InvalidArgument(what + " gives a prompt of " + std::to_string(prompt) +
                                   " tokens; an earlier one gave " +
                                   std::to_string(cursor.prompt_tokens));
  }
  if (p.layers_cur >= static_cast<std::uint32_t>(num_layers)) {
    return Status::InvalidArgument(what + " announces " + std::to_string(p.layers_cur) +
                                   " layers written of a cache of " + std::to_string(num_layers));
  }
  const auto needed =
      static_cast<std::int64_t>((p.tokens_cur + static_cast<std::uint64_t>(tokens_per_block - 1)) /
                                static_cast<std::uint64_t>(tokens_per_block));
  if (static_cast<std::int64_t>(p.block_ids.size()) < needed ||
      static_cast<std::int64_t>(p.block_ids.size()) > remote_blocks) {
    return Status::InvalidArgument(what + " names " + std::to_string(p.block_ids.size()) +
                                   " blocks for " + std::to_string(p.tokens_cur) +
                                   " tokens written of " + std::to_string(prompt) + "; expected " +
                                   std::to_string(needed) + " to " + std::to_string(remote_blocks));
  }
  for (std::size_t i = 0; remote_num_blocks > 0 && i < p.block_ids.size(); ++i) {
    if (p.block_ids[i] >= remote_num_blocks) {
      return Status::InvalidArgument(what + " names block " + std::to_string(p.block_ids[i]) +
                                     " at position " + std::to_string(i) +
                                     "; the prefill cache has " +
                                     std::to_string(remote_num_blocks) + " blocks");
    }
  }
  for (std::size_t l = 0; l < cursor.tokens_read.size(); ++l) {
    const std::uint64_t target = l < p.layers_cur ? p.tokens_cur : p.tokens_all;
    if (static_cast<std::int64_t>(target) < cursor.tokens_read[l]) {
      return Status::InvalidArgument(what + " announces layer " + std::to_string(l) +
                                     " written to token " + std::to_string(target) +
                                     ", but an earlier one announced " +
                                     std::to_string(cursor.tokens_read[l]));
    }
  }
  return Status::Ok();
}

Result<std::vector<LayerGroupRead>> PlanLayerwiseReads(
    const wire::Progress& p, std::span<const std::int64_t> local_block_ids,
    std::int64_t tokens_per_block, int num_layers, std::int64_t remote_num_blocks,
    LayerwiseCursor& cursor) {
  if (cursor.tokens_read.size() != static_cast<std::size_t>(num_layers)) {
    cursor.tokens_read.assign(static_cast<std::size_t>(num_layers), 0);
  }
  KVFERRY_RETURN_IF_ERROR(CheckLayerwiseProgress(p, local_block_ids.size(), tokens_per_block,
                                                 num_layers, cursor, remote_num_blocks));
  const auto prompt = static_cast<std::int64_t>(p.prompt_tokens);
  const std::int64_t remote_blocks = (prompt + tokens_per_block - 1) / tokens_per_block;
  // The tail rule: local block i holds the prompt's block (remote_blocks - local + i).
  const std::int64_t offset = remote_blocks - static_cast<std::int64_t>(local_block_ids.size());
  std::vector<LayerGroupRead> out;
  std::vector<std::int64_t> next = cursor.tokens_read;
  int l = 0;
  while (l < num_layers) {
    const auto target = static_cast<std::int64_t>(
        static_cast<std::uint32_t>(l) < p.layers_cur ? p.tokens_cur : p.tokens_all);
    const std::int64_t from = cursor.tokens_read[static_cast<std::size_t>(l)];
    int end = l + 1;
    while (end < num_layers && cursor.tokens_read[static_cast<std::size_t>(end)] == from &&
           static_cast<std::int64_t>(static_cast<std::uint32_t>(end) < p.layers_cur
                                         ? p.tokens_cur
                                         : p.tokens_all) == target) {
      ++end;
    }
    if (target > from) {
      LayerGroupRead g{l, end, {}, {}};
      const std::int64_t first_block = std::max(from / tokens_per_block, offset);
      const std::int64_t end_block = (target + tokens_per_block - 1) / tokens_per_block;
      for (std::int64_t b = first_block; b < end_block; ++b) {
        g.remote_ids.push_back(p.block_ids[static_cast<std::size_t>(b)]);
        g.local_ids.push_back(local_block_ids[static_cast<std::size_t>(b - offset)]);
      }
      if (!g.remote_ids.empty()) out.push_back(std::move(g));
      for (int k = l; k < end; ++k) next[static_cast<std::size_t>(k)] = target;
    }
    l = end;
  }
  cursor.tokens_read = std::move(next);
  cursor.prompt_tokens = prompt;
  return out;
}

}  // namespace kvferry
