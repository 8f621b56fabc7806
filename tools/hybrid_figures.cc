// What kvferry bench e2e reports for a hybrid model: the bytes a request should move at most
// (every full-attention token, a sliding window's last tokens and one block), and the model
// vLLM falls back to without its hybrid KV cache manager (every window promoted to full
// attention), whose bytes the same run measures.
#include <string>
#include <string_view>

#include "tools/commands.h"

namespace kvferry::cli {

std::optional<ModelArgs> FullAttentionFallback(const ModelArgs& m) {
  std::string spec = GroupsSpec(m);
  if (spec.empty()) return std::nullopt;
  std::string out;
  bool windowed = false;
  for (std::string item : GroupItems(spec)) {
    if (item.rfind("swa@", 0) == 0) {
      // vLLM's unify_hybrid_kv_cache_specs: a sliding window becomes full attention.
      const auto colon = item.find(':');
      item = "mha" + (colon == std::string::npos ? std::string() : item.substr(colon));
      windowed = true;
    }
    out += (out.empty() ? "" : ",") + item;
  }
  if (!windowed) return std::nullopt;
  ModelArgs fallback = m;
  fallback.hybrid.clear();
  fallback.groups = out;
  return fallback;
}

Result<std::uint64_t> BoundBytesPerRequest(const ModelArgs& m, int decode_tp, std::int64_t prompt) {
  KVFERRY_ASSIGN_OR_RETURN(std::vector<CacheSpecOptions> groups, BuildGroups(m));
  std::uint64_t total = 0;
  for (CacheSpecOptions& o : groups) {
    const std::int64_t tpb = o.tokens_per_block;
    const std::int64_t all = (prompt + tpb - 1) / tpb * tpb;
    // A window's reads start at the start of the block holding its first token.
    const std::int64_t tokens = o.sliding_window > 0 ? std::min(all, o.sliding_window + tpb) : all;
    for (int r = 0; r < decode_tp; ++r) {
      o.tp_size = decode_tp;
      o.tp_rank = r;
      KVFERRY_ASSIGN_OR_RETURN(CacheSpec spec, CacheSpec::Create(o));
      for (int p = 0; p < spec.num_parts(); ++p) {
        // A state group moves one block, the request's state.
        const std::int64_t bytes =
            spec.is_state() ? spec.BlockBytes(p) : spec.BlockBytes(p) / tpb * tokens;
        total += static_cast<std::uint64_t>(bytes) * static_cast<std::uint64_t>(spec.num_layers());
      }
    }
  }
  return total;
}

}  // namespace kvferry::cli
