#include "connector/layerwise_plan.h"

#include <algorithm>
#include <string>

namespace kvferry {
namespace {

// a / b rounded up, for a >= 0 and b > 0 (a peer's prompt may be near INT64_MAX: no a + b - 1).
std::int64_t CeilDiv(std::int64_t a, std::int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// The prompt tokens `p` announces written in layer `l` of group `g`.
std::int64_t Announced(const wire::Progress& p, int g, int l) {
  return static_cast<std::int64_t>(static_cast<std::uint32_t>(l) < p.LayersCur(g) ? p.tokens_cur
                                                                                  : p.tokens_all);
}

// The prompt block that a token group's local block 0 holds.
std::int64_t LocalOffset(const LayerwiseGroup& g, std::int64_t remote_blocks) {
  return g.first_block >= 0 ? g.first_block
                            : remote_blocks - static_cast<std::int64_t>(g.local_block_ids.size());
}

}  // namespace

bool LayerwiseCursor::Done() const {
  return prompt_tokens > 0 &&
         std::all_of(tokens_read.begin(), tokens_read.end(), [&](const auto& layers) {
           return std::all_of(layers.begin(), layers.end(),
                              [&](std::int64_t t) { return t >= prompt_tokens; });
         });
}

LayerwiseCursor AnnouncedCursor(const wire::Progress& p, std::span<const LayerwiseGroup> groups) {
  LayerwiseCursor c;
  c.prompt_tokens = static_cast<std::int64_t>(p.prompt_tokens);
  for (int g = 0; g < static_cast<int>(groups.size()) && g < p.groups(); ++g) {
    std::vector<std::int64_t>& layers = c.tokens_read.emplace_back();
    for (int l = 0; l < groups[static_cast<std::size_t>(g)].num_layers; ++l) {
      layers.push_back(Announced(p, g, l));
    }
  }
  return c;
}

Status CheckLayerwiseProgress(const wire::Progress& p, std::span<const LayerwiseGroup> groups,
                              std::span<const std::int64_t> remote_num_blocks,
                              const LayerwiseCursor& cursor) {
  const std::string what = "progress of transfer " + p.transfer_id + " from " + p.from.engine_id +
                           " rank " + std::to_string(p.from.tp_rank);
  if (p.state != wire::Progress::State::kRunning) return Status::Ok();
  const auto num_groups = static_cast<int>(groups.size());
  if (p.groups() != num_groups) {
    return Status::InvalidArgument(what + " describes " + std::to_string(p.groups()) +
                                   " KV cache group(s); this reader's cache has " +
                                   std::to_string(num_groups));
  }
  const auto prompt = static_cast<std::int64_t>(p.prompt_tokens);
  for (int g = 0; g < num_groups; ++g) {
    const LayerwiseGroup& group = groups[static_cast<std::size_t>(g)];
    const std::int64_t remote_blocks = CeilDiv(prompt, group.tokens_per_block);
    const std::int64_t offset = LocalOffset(group, remote_blocks);
    const auto local = static_cast<std::int64_t>(group.local_block_ids.size());
    if (prompt <= 0 || (group.end_token >= 0 && prompt != group.end_token) ||
        (!group.state && (offset < 0 || (group.progressive && group.first_block >= 0 &&
                                         local < remote_blocks - offset)))) {
      return Status::InvalidArgument(
          what + " gives a prompt of " + std::to_string(prompt) + " tokens, " +
          std::to_string(remote_blocks) + " blocks" +
          (num_groups > 1 ? " of KV cache group " + std::to_string(g) : std::string()) +
          "; this reader allocated " + std::to_string(local) + " for it" +
          (group.first_block >= 0 ? " from prompt block " + std::to_string(group.first_block)
                                  : std::string()) +
          (group.end_token >= 0 ? ", to load tokens up to " + std::to_string(group.end_token)
                                : std::string()));
    }
  }
  if (cursor.prompt_tokens != 0 && cursor.prompt_tokens != prompt) {
    return Status::InvalidArgument(what + " gives a prompt of " + std::to_string(prompt) +
                                   " tokens; an earlier one gave " +
                                   std::to_string(cursor.prompt_tokens));
  }
  auto group_name = [&](int g) {
    return num_groups > 1 ? "KV cache group " + std::to_string(g) + " of "
                          : std::string("a cache of ");
  };
  bool all_layers = true;
  for (int g = 0; g < num_groups; ++g) {
    const int n = groups[static_cast<std::size_t>(g)].num_layers;
    if (p.LayersCur(g) > static_cast<std::uint32_t>(n)) {
      return Status::InvalidArgument(what + " announces " + std::to_string(p.LayersCur(g)) +
                                     " layers written of " + group_name(g) + std::to_string(n) +
                                     " layers");
    }
    all_layers = all_layers && p.LayersCur(g) == static_cast<std::uint32_t>(n);
  }
  if (all_layers) {
    // Every layer written to tokens_cur is said as tokens_all: this one contradicts itself.
    return Status::InvalidArgument(what + " announces " + std::to_string(p.layers_cur) +
                                   " layers written of " + group_name(0) +
                                   std::to_string(groups[0].num_layers) +
                                   " layers, every layer of every group, as a partial write");
  }
  for (int g = 0; g < num_groups; ++g) {
    const LayerwiseGroup& group = groups[static_cast<std::size_t>(g)];
    const std::vector<std::int64_t>& ids = p.BlockIds(g);
    const std::string in_group = num_groups > 1 ? " of KV cache group " + std::to_string(g) : "";
    if (!group.state) {
      const std::int64_t tpb = group.tokens_per_block;
      const std::int64_t remote_blocks = CeilDiv(prompt, tpb);
      const std::int64_t offset = LocalOffset(group, remote_blocks);
      const std::int64_t needed =
          group.progressive ? CeilDiv(static_cast<std::int64_t>(p.tokens_cur), tpb) : 0;
      if (static_cast<std::int64_t>(ids.size()) < needed ||
          static_cast<std::int64_t>(ids.size()) > remote_blocks) {
        return Status::InvalidArgument(
            what + " names " + std::to_string(ids.size()) + " blocks" + in_group + " for " +
            std::to_string(p.tokens_cur) + " tokens written of " + std::to_string(prompt) +
            "; expected " + std::to_string(needed) + " to " + std::to_string(remote_blocks));
      }
      for (std::int64_t i = offset; group.progressive && i < needed; ++i) {
        if (ids[static_cast<std::size_t>(i)] == kNoBlock) {
          return Status::InvalidArgument(what + " names no block" + in_group + " at position " +
                                         std::to_string(i) + ", which holds tokens it announces");
        }
      }
    }
    const std::int64_t remote = static_cast<std::size_t>(g) < remote_num_blocks.size()
                                    ? remote_num_blocks[static_cast<std::size_t>(g)]
                                    : 0;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] == kNoBlock) continue;
      if (ids[i] < 0 || (remote > 0 && ids[i] >= remote)) {
        return Status::InvalidArgument(
            what + " names block " + std::to_string(ids[i]) + in_group + " at position " +
            std::to_string(i) + "; the prefill cache has " + std::to_string(remote) + " blocks");
      }
    }
    if (static_cast<std::size_t>(g) >= cursor.tokens_read.size()) continue;
    const std::vector<std::int64_t>& read = cursor.tokens_read[static_cast<std::size_t>(g)];
    for (std::size_t l = 0; l < read.size(); ++l) {
      const std::int64_t target = Announced(p, g, static_cast<int>(l));
      if (target < read[l]) {
        return Status::InvalidArgument(what + " announces layer " + std::to_string(l) + in_group +
                                       " written to token " + std::to_string(target) +
                                       ", but an earlier one announced " + std::to_string(read[l]));
      }
    }
  }
  return Status::Ok();
}

Result<std::vector<LayerGroupRead>> PlanLayerwiseReads(
    const wire::Progress& p, std::span<const LayerwiseGroup> groups,
    std::span<const std::int64_t> remote_num_blocks, LayerwiseCursor& cursor) {
  bool shaped = cursor.tokens_read.size() == groups.size();
  for (std::size_t g = 0; shaped && g < groups.size(); ++g) {
    shaped = cursor.tokens_read[g].size() == static_cast<std::size_t>(groups[g].num_layers);
  }
  if (!shaped) {
    cursor.tokens_read.clear();
    for (const LayerwiseGroup& g : groups) {
      cursor.tokens_read.emplace_back(static_cast<std::size_t>(g.num_layers), 0);
    }
  }
  KVFERRY_RETURN_IF_ERROR(CheckLayerwiseProgress(p, groups, remote_num_blocks, cursor));
  const auto prompt = static_cast<std::int64_t>(p.prompt_tokens);
  std::vector<LayerGroupRead> out;
  std::vector<std::vector<std::int64_t>> next = cursor.tokens_read;
  for (int g = 0; g < static_cast<int>(groups.size()); ++g) {
    const LayerwiseGroup& group = groups[static_cast<std::size_t>(g)];
    const std::vector<std::int64_t>& read = cursor.tokens_read[static_cast<std::size_t>(g)];
    const std::vector<std::int64_t>& ids = p.BlockIds(g);
    const std::int64_t tpb = group.tokens_per_block;
    const std::int64_t offset = group.state ? 0 : LocalOffset(group, CeilDiv(prompt, tpb));
    int l = 0;
    while (l < group.num_layers) {
      const std::int64_t target = Announced(p, g, l);
      const std::int64_t from = read[static_cast<std::size_t>(l)];
      int end = l + 1;
      while (end < group.num_layers && read[static_cast<std::size_t>(end)] == from &&
             Announced(p, g, end) == target) {
        ++end;
      }
      bool advanced = false;
      if (target > from && group.progressive) {
        LayerGroupRead r{g, l, end, {}, {}, false};
        const std::int64_t first_block = std::max(from / tpb, offset);
        const std::int64_t end_block = CeilDiv(target, tpb);
        for (std::int64_t b = first_block; b < end_block; ++b) {
          r.remote_ids.push_back(ids[static_cast<std::size_t>(b)]);
          r.local_ids.push_back(group.local_block_ids[static_cast<std::size_t>(b - offset)]);
        }
        if (!r.remote_ids.empty()) out.push_back(std::move(r));
        advanced = true;
      } else if (target > from && target == prompt) {
        out.push_back({g, l, end, {}, {}, true});  // a window or a state, final now
        advanced = true;
      }
      for (int k = l; advanced && k < end; ++k) {
        next[static_cast<std::size_t>(g)][static_cast<std::size_t>(k)] = target;
      }
      l = end;
    }
  }
  cursor.tokens_read = std::move(next);
  cursor.prompt_tokens = prompt;
  return out;
}

SilenceStep OnSilence(Clock::time_point now, Clock::time_point limit, Clock::time_point heard,
                      Clock::time_point polled, Clock::duration poll_every) {
  if (now >= limit) return polled >= limit - poll_every ? SilenceStep::kFail : SilenceStep::kPoll;
  return now >= heard + poll_every ? SilenceStep::kPoll : SilenceStep::kWait;
}

}  // namespace kvferry
