// The reference engine's blocks: its pools (one per KV cache group), a request's blocks in every
// group (a sliding window's outside the window given back or never allocated), and the decode
// side's prefix cache of a uniform model.
#include <algorithm>
#include <vector>

#include "engine/engine.h"
#include "engine/engine_internal.h"

namespace kvferry::engine {

std::vector<std::uint64_t> PrefixHashes(const std::vector<std::int32_t>& prompt) {
  std::vector<std::uint64_t> out(prompt.size());
  std::uint64_t h = 0x6b76666572727931ull;
  for (std::size_t i = 0; i < prompt.size(); ++i) {
    h = Mix(h ^ static_cast<std::uint32_t>(prompt[i]));
    out[i] = h;
  }
  return out;
}

BlockAllocator::BlockAllocator(std::int64_t num_blocks)
    : total_(num_blocks), refs_(static_cast<std::size_t>(num_blocks), 0) {
  for (std::int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

Result<std::vector<std::int64_t>> BlockAllocator::Allocate(std::size_t n) {
  if (n > free_.size()) {
    return Status::ResourceExhausted("need " + std::to_string(n) + " blocks, " +
                                     std::to_string(free_.size()) + " free");
  }
  std::vector<std::int64_t> out(free_.end() - static_cast<std::ptrdiff_t>(n), free_.end());
  free_.resize(free_.size() - n);
  std::reverse(out.begin(), out.end());
  for (std::int64_t b : out) refs_[static_cast<std::size_t>(b)] = 1;
  return out;
}

void BlockAllocator::Ref(std::int64_t block) { ++refs_[static_cast<std::size_t>(block)]; }

bool BlockAllocator::Unref(std::int64_t block) {
  if (--refs_[static_cast<std::size_t>(block)] == 0) {
    free_.push_back(block);
    return true;
  }
  return false;
}

void Instance::FreeBlocks(const std::vector<std::vector<std::int64_t>>& blocks) {
  for (std::size_t g = 0; g < blocks.size(); ++g) {
    for (std::int64_t b : blocks[g]) {
      if (b != kNoBlock) allocators_[g]->Unref(b);
    }
  }
}

Result<std::vector<std::int64_t>> Instance::AllocateEvicting(std::size_t n) {
  // Evict cached prefix blocks, least recently used first, until n blocks are free.
  BlockAllocator& allocator = *allocators_[0];
  auto it = lru_.begin();
  while (static_cast<std::size_t>(allocator.free_blocks()) < n && it != lru_.end()) {
    const std::uint64_t key = *it;
    const std::int64_t block = prefix_.at(key);
    if (allocator.refs(block) == 1) {  // only the cache holds it
      allocator.Unref(block);
      prefix_.erase(key);
      lru_pos_.erase(key);
      it = lru_.erase(it);
    } else {
      ++it;
    }
  }
  return allocator.Allocate(n);
}

bool Instance::AllocateGroups(Running& r, std::int64_t prompt, bool window_only) {
  r.blocks.clear();
  for (int g = 0; g < num_groups(); ++g) {
    const CacheSpecOptions& o = group_options(g);
    // A state group: one block, the request's state.
    const bool state = o.layers.front().kind == CacheKind::kState;
    const std::int64_t total = state ? 1 : (prompt + o.tokens_per_block - 1) / o.tokens_per_block;
    // The decode side's window: from the block holding the prompt's last `sliding_window` tokens
    // (the load reads them from that block's start).
    const std::int64_t first =
        window_only && o.sliding_window > 0
            ? std::max<std::int64_t>(prompt - o.sliding_window, 0) / o.tokens_per_block
            : 0;
    Result<std::vector<std::int64_t>> fresh =
        allocators_[static_cast<std::size_t>(g)]->Allocate(static_cast<std::size_t>(total - first));
    if (!fresh.ok()) {
      FreeBlocks(r.blocks);  // the groups allocated so far
      r.blocks.clear();
      return false;
    }
    std::vector<std::int64_t> blocks(static_cast<std::size_t>(first), kNoBlock);
    blocks.insert(blocks.end(), fresh->begin(), fresh->end());
    r.blocks.push_back(std::move(blocks));
  }
  return true;
}

void Instance::FreeOutsideWindow(Running& r) {
  const auto prompt = static_cast<std::int64_t>(r.request.prompt.size());
  for (int g = 0; g < num_groups(); ++g) {
    const CacheSpecOptions& o = group_options(g);
    if (o.sliding_window == 0) continue;
    // Blocks whose last token is before the prompt's last `sliding_window` tokens.
    const std::int64_t keep_from =
        std::max<std::int64_t>(prompt - o.sliding_window, 0) / o.tokens_per_block;
    std::vector<std::int64_t>& blocks = r.blocks[static_cast<std::size_t>(g)];
    for (std::int64_t bi = 0; bi < keep_from; ++bi) {
      std::int64_t& b = blocks[static_cast<std::size_t>(bi)];
      allocators_[static_cast<std::size_t>(g)]->Unref(b);
      b = kNoBlock;
    }
  }
}

void Instance::AddToPrefixCache(const Running& r) {
  const std::int64_t tpb = config_.model.tokens_per_block;
  const auto full = static_cast<std::int64_t>(r.hashes.size()) / tpb;
  for (std::int64_t bi = 0; bi < full; ++bi) {
    const std::uint64_t key = r.hashes[static_cast<std::size_t>((bi + 1) * tpb - 1)];
    const std::int64_t block = r.blocks[0][static_cast<std::size_t>(bi)];
    auto found = prefix_.find(key);
    if (found != prefix_.end()) {
      lru_.splice(lru_.end(), lru_, lru_pos_.at(key));  // touched
      continue;
    }
    allocators_[0]->Ref(block);  // the cache's own reference
    prefix_[key] = block;
    lru_.push_back(key);
    lru_pos_[key] = std::prev(lru_.end());
  }
}

}  // namespace kvferry::engine
