// The KV the reference engine computes and verifies: every element a function of the token
// prefix, layer, part and model-wide head, so the decode side can check every byte it received.
// With device memory, blocks are copied up after computing and down before verifying.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "engine/engine.h"
#include "engine/engine_internal.h"

namespace kvferry::engine {
// The model-wide heads of `part` that `spec`'s TP rank holds, written from the definition rather
// than taken from CacheSpec::FirstLocalHead / SplitHeads: the verifier checks what the transfer
// plans (built on those) moved, so it must not share their mistakes. An MHA part's heads are dealt
// out in equal runs of consecutive heads (head h on rank h / (heads / tp)); with fewer heads than
// ranks each head is on tp / heads consecutive ranks. MLA parts are whole on every rank.
HeldHeads HeadsHeldBy(const CacheSpec& spec, int part) {
  const std::int64_t heads = spec.parts()[static_cast<std::size_t>(part)].num_heads;
  if (spec.kind() != CacheKind::kMha && spec.kind() != CacheKind::kState) return {0, heads};
  const std::int64_t tp = spec.tp_size();
  const std::int64_t rank = spec.tp_rank();
  HeldHeads out{-1, 0};
  for (std::int64_t h = 0; h < heads; ++h) {
    const bool held = tp <= heads ? h / (heads / tp) == rank
                                  : h * (tp / heads) <= rank && rank < (h + 1) * (tp / heads);
    if (!held) continue;
    if (out.first < 0) out.first = h;
    ++out.count;
  }
  if (out.first < 0) out.first = 0;
  return out;
}

namespace {

// The block indexes [first, end) of a group's `num_blocks` blocks of a request that hold prompt
// tokens [first_token, end_token) of its `prompt`; a state group's one block holds them all.
struct BlockSpan {
  std::int64_t first = 0;
  std::int64_t end = 0;
};
BlockSpan BlocksOf(const CacheSpec& spec, std::int64_t num_blocks, std::int64_t first_token,
                   std::int64_t end_token, std::int64_t prompt) {
  const std::int64_t tpb = spec.is_state() ? prompt + 1 : spec.tokens_per_block();
  return {first_token / tpb, std::min<std::int64_t>((end_token + tpb - 1) / tpb, num_blocks)};
}

}  // namespace

// The value of element d of a row whose seed is `seed`.
inline std::uint64_t RowValue(std::uint64_t seed, std::int64_t d) {
  return seed + static_cast<std::uint64_t>(d) * 0x9e3779b97f4a7c15ull;
}

// Writes a row: element d is the low `esize` bytes of RowValue(seed, d), little-endian as the
// host stores them. One loop per element size, so each store is a plain store, not a call.
template <typename T>
void FillRowAs(std::uint8_t* out, std::uint64_t seed, std::int64_t dim) {
  for (std::int64_t d = 0; d < dim; ++d) {
    const auto v = static_cast<T>(RowValue(seed, d));
    std::memcpy(out + d * static_cast<std::int64_t>(sizeof(T)), &v, sizeof(T));
  }
}

void FillRow(std::uint8_t* out, std::uint64_t seed, std::int64_t dim, std::int64_t esize) {
  switch (esize) {
    case 1:
      return FillRowAs<std::uint8_t>(out, seed, dim);
    case 2:
      return FillRowAs<std::uint16_t>(out, seed, dim);
    case 4:
      return FillRowAs<std::uint32_t>(out, seed, dim);
    case 8:
      return FillRowAs<std::uint64_t>(out, seed, dim);
    default:
      for (std::int64_t d = 0; d < dim; ++d) {
        const std::uint64_t v = RowValue(seed, d);
        std::memcpy(out + d * esize, &v, static_cast<std::size_t>(esize));
      }
  }
}

// Visits every (rank, group, layer, part, block, token slot, head) row of prompt tokens
// [tokens.first, tokens.end) of a request, in each group (kNoBlock skipped): `dim` elements of
// `esize` bytes whose values derive from the token prefix at that slot, the group, the layer, the
// part and the model-wide head. A state group has one row per layer, part and head: the state as
// of token tokens.end - 1, in the request's state block. `fn` returns false to stop.
template <typename Fn>
bool Instance::ForEachRow(const Running& r, Tokens tokens, Layers layers, Fn&& fn) {
  const auto prompt = static_cast<std::int64_t>(r.hashes.size());
  for (std::size_t rank = 0; rank < caches_.size(); ++rank) {
    for (int g = 0; g < caches_[rank].size(); ++g) {
      const CacheSpec& spec = caches_[rank][g];
      const GroupMemory& mem = memory_[rank][static_cast<std::size_t>(g)];
      const std::int64_t tpb = spec.is_state() ? prompt + 1 : spec.tokens_per_block();
      const std::vector<std::int64_t>& blocks = r.blocks[static_cast<std::size_t>(g)];
      KvRow row;
      row.rank = rank;
      row.group = g;
      const std::int64_t window_first =
          spec.sliding_window() > 0 ? prompt - spec.sliding_window() : 0;
      const BlockSpan span = BlocksOf(spec, std::ssize(blocks), tokens.first, tokens.end, prompt);
      for (std::int64_t bi = span.first; bi < span.end; ++bi) {
        row.block_index = bi;
        const std::int64_t block = blocks[static_cast<std::size_t>(bi)];
        if (block == kNoBlock || (spec.is_state() && tokens.end <= 0)) continue;
        for (int l = layers.first; l < std::min(layers.end, spec.num_layers()); ++l) {
          for (int p = 0; p < spec.num_parts(); ++p) {
            row.layer = l;
            row.part = p;
            row.esize = DTypeSize(spec.PartDType(p));
            std::uint8_t* base =
                mem.host[static_cast<std::size_t>(l) * static_cast<std::size_t>(spec.num_parts()) +
                         static_cast<std::size_t>(p)] +
                block * spec.BlockStride(p);
            const HeldHeads held = HeadsHeldBy(spec, p);
            const std::int64_t heads = held.count;
            const std::int64_t first_head = held.first;
            row.dim = spec.parts()[static_cast<std::size_t>(p)].head_dim;
            // A state block has one slot: the state after the range's last token.
            const std::int64_t slots = spec.is_state() ? 1 : tpb;
            for (std::int64_t slot = 0; slot < slots; ++slot) {
              const std::int64_t t = spec.is_state() ? tokens.end - 1 : bi * tpb + slot;
              row.slot = slot;
              row.past_prompt = t >= prompt;
              row.in_range = t >= tokens.first && t < tokens.end;
              row.before_window = t < window_first;
              // The unfilled tail of the last block gets values too, from a fixed token.
              const std::uint64_t token =
                  row.past_prompt ? 0 : r.hashes[static_cast<std::size_t>(t)];
              for (std::int64_t h = 0; h < heads; ++h) {
                row.head = first_head + h;
                row.seed =
                    // The group's model-wide layer: a pipeline stage's bytes are its own layers'.
                    Mix(token ^ (static_cast<std::uint64_t>(spec.first_layer() + l) << 48) ^
                        (static_cast<std::uint64_t>(g) << 44) ^
                        (static_cast<std::uint64_t>(p) << 40) ^
                        static_cast<std::uint64_t>(row.head));
                const std::int64_t idx = spec.layout() == BlockLayout::kTokenMajor
                                             ? (slot * heads + h) * row.dim
                                             : (h * slots + slot) * row.dim;
                row.data = base + idx * row.esize;
                if (!fn(row)) return false;
              }
            }
          }
        }
      }
    }
  }
  return true;
}

// Writes the KV of the blocks holding `tokens` on every rank.
Status Instance::Compute(const Running& r, Tokens tokens) {
  ForEachRow(r, tokens, Layers::All(), [](const KvRow& row) {
    if (row.in_range) FillRow(row.data, row.seed, row.dim, row.esize);
    return true;
  });
  return device_ == nullptr ? Status::Ok() : CopyBlocks(r, tokens, /*up=*/true);
}

Status Instance::ComputeLayerwise(const Running& r) {
  // With state groups, the prompt less its last token (the decode side computes that one).
  const std::int64_t prompt = scheduler_->PrefillTokens(
      r.request.params, static_cast<std::int64_t>(r.request.prompt.size()));
  const std::int64_t chunk =
      config_.prefill_chunk_tokens > 0 ? config_.prefill_chunk_tokens : prompt;
  // Pipeline stages may hold different numbers of layers (vLLM's split): layer l of the step is
  // each stage's own layer l, where it has one. KV cache groups interleave: step l computes
  // layer l of every group that has one (gpt-oss: a full-attention layer, then a sliding-window
  // one).
  int layers = 0;
  for (const CacheGroups& caches : caches_) {
    for (const CacheSpec& g : caches.specs()) layers = std::max(layers, g.num_layers());
  }
  for (std::int64_t begin = 0; begin < prompt; begin += chunk) {
    const std::int64_t end = std::min(prompt, begin + chunk);
    // What vLLM's scheduler side does each step, then its workers' start of the step.
    scheduler_->RequestScheduledAllGroups(r.request.request_id, r.request.params, r.blocks, begin,
                                          end - begin, prompt);
    const ConnectorMetadata meta = scheduler_->BuildConnectorMeta();
    for (auto& w : workers_) w->StartLoadKv(meta);
    // Layer l is computed in [start + l * per_layer, start + (l + 1) * per_layer), on a fixed
    // schedule, so a late wake-up is not added to every later layer. Its KV bytes are made at the
    // start of that window (the window stretches when making them takes longer) and announced when
    // its first half, the attention, ends: vLLM calls save_kv_layer from the attention op, before
    // the layer's MLP, which takes the second half.
    const auto per_layer = config_.compute_per_token * (end - begin) / layers;
    const Clock::time_point start = Clock::now();
    std::uint64_t stream = 0;
    for (int l = 0; l < layers; ++l) {
      ForEachRow(r, {begin, end}, Layers{l, l + 1}, [](const KvRow& row) {
        if (row.in_range) FillRow(row.data, row.seed, row.dim, row.esize);
        return true;
      });
      std::this_thread::sleep_until(start + per_layer * l + per_layer / 2);
      if (device_ != nullptr) {
        // The layer goes up on the engine's stream; the connector announces it once the stream
        // has done it, and the engine computes the next layer meanwhile.
        KVFERRY_RETURN_IF_ERROR(EnqueueCopies(r, {begin, end}, /*up=*/true, {l, l + 1}));
        stream = stream_->native_handle();
      }
      // Attention layers only: a state layer (Mamba) calls no save_kv_layer in vLLM.
      KVFERRY_RETURN_IF_ERROR(SaveLayer(l, /*state=*/false, stream));
      std::this_thread::sleep_until(start + per_layer * (l + 1));  // the MLP
    }
    // The end of the step's forward pass (vLLM's wait_for_save, where kvferry's adapter saves
    // the state layers): each state group's layers, now holding the state as of `end`.
    for (int l = 0; l < layers; ++l) KVFERRY_RETURN_IF_ERROR(SaveLayer(l, /*state=*/true, stream));
  }
  if (device_ == nullptr) return Status::Ok();
  // vLLM's wait_for_save: the step's device work is done before the request finishes.
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<device::Event> done, stream_->RecordEvent());
  return done->Wait(DeadlineAfter(std::chrono::seconds(30)))
      .WithContext("copying KV blocks to " + device_->name());
}

Status Instance::SaveLayer(int layer, bool state, std::uint64_t stream) {
  for (std::size_t w = 0; w < workers_.size(); ++w) {
    // The worker's layer index runs over its groups' layers, group after group.
    int flat = 0;
    for (const CacheSpec& g : caches_[w].specs()) {
      if (layer < g.num_layers() && g.is_state() == state) {
        KVFERRY_RETURN_IF_ERROR(workers_[w]->SaveKvLayer(flat + layer, stream));
      }
      flat += g.num_layers();
    }
  }
  return Status::Ok();
}

Status Instance::CopyBlocks(const Running& r, Tokens tokens, bool up) {
  KVFERRY_RETURN_IF_ERROR(EnqueueCopies(r, tokens, up, Layers::All()));
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<device::Event> done, stream_->RecordEvent());
  return done->Wait(DeadlineAfter(std::chrono::seconds(30)))
      .WithContext(std::string("copying KV blocks ") + (up ? "to " : "from ") + device_->name());
}

Status Instance::EnqueueCopies(const Running& r, Tokens tokens, bool up, Layers layers) {
  for (std::size_t rank = 0; rank < caches_.size(); ++rank) {
    for (int g = 0; g < caches_[rank].size(); ++g) {
      const CacheSpec& spec = caches_[rank][g];
      const GroupMemory& mem = memory_[rank][static_cast<std::size_t>(g)];
      const std::vector<std::int64_t>& blocks = r.blocks[static_cast<std::size_t>(g)];
      const BlockSpan span =
          BlocksOf(spec, std::ssize(blocks), tokens.first, tokens.end, std::ssize(r.hashes));
      for (std::int64_t bi = span.first; bi < span.end; ++bi) {
        const std::int64_t block = blocks[static_cast<std::size_t>(bi)];
        if (block == kNoBlock) continue;
        for (int l = layers.first; l < std::min(layers.end, spec.num_layers()); ++l) {
          for (int p = 0; p < spec.num_parts(); ++p) {
            const auto i =
                static_cast<std::size_t>(l) * static_cast<std::size_t>(spec.num_parts()) +
                static_cast<std::size_t>(p);
            const auto offset = static_cast<std::uint64_t>(block * spec.BlockStride(p));
            const auto bytes = static_cast<std::uint64_t>(spec.BlockBytes(p));
            auto* host = reinterpret_cast<std::byte*>(mem.host[i]) + offset;
            const device::DeviceAddress dev = mem.device[i] + offset;
            KVFERRY_RETURN_IF_ERROR(up ? stream_->CopyHostToDevice(dev, host, bytes)
                                       : stream_->CopyDeviceToHost(host, dev, bytes));
          }
        }
      }
    }
  }
  return Status::Ok();
}

// Checks the blocks holding `tokens` on every rank against what Compute wrote (a sliding
// window's tokens from the window on); returns the bytes checked and sets *status at the first
// difference.
std::uint64_t Instance::Verify(const Running& r, Tokens tokens, Status* status) {
  std::uint64_t bytes = 0;
  if (device_ != nullptr) {
    // What the device holds is what is checked: copied down over the host mirror first.
    if (Status s = CopyBlocks(r, tokens, /*up=*/false); !s.ok()) {
      *status = s;
      return 0;
    }
  }
  std::vector<std::uint8_t> expect;
  ForEachRow(r, tokens, Layers::All(), [&](const KvRow& row) {
    // Slots past the prompt are never read; the decode side attends to a window's tokens only.
    if (!row.in_range || row.past_prompt || row.before_window) return true;
    const auto row_bytes = static_cast<std::size_t>(row.dim * row.esize);
    if (expect.size() < row_bytes) expect.resize(row_bytes);
    FillRow(expect.data(), row.seed, row.dim, row.esize);
    if (std::memcmp(row.data, expect.data(), row_bytes) != 0) {
      *status = Status::Internal("request " + r.request.request_id + ": KV byte mismatch at rank " +
                                 std::to_string(row.rank) + " group " + std::to_string(row.group) +
                                 " layer " + std::to_string(row.layer) + " part " +
                                 std::to_string(row.part) + " block index " +
                                 std::to_string(row.block_index) + " token " +
                                 std::to_string(row.slot) + " head " + std::to_string(row.head));
      return false;
    }
    bytes += static_cast<std::uint64_t>(row.dim * row.esize);
    return true;
  });
  return bytes;
}

}  // namespace kvferry::engine
