#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <string>
#include <string_view>
#include <vector>

#include "tools/commands.h"

namespace kvferry::cli {

std::string SelfExe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : "kvferry";
}

void AddModelOptions(CLI::App& cmd, ModelArgs& m) {
  cmd.add_option("--kind", m.kind, "Cache kind: mha|mla|sparse_mla")->capture_default_str();
  cmd.add_option("--layers", m.layers, "Attention layers")->capture_default_str();
  cmd.add_option("--kv-heads", m.kv_heads, "Model-wide KV heads (mha)")->capture_default_str();
  cmd.add_option("--head-dim", m.head_dim, "Head dim (mha)")->capture_default_str();
  cmd.add_option("--latent-dim", m.latent_dim, "Latent width (mla)")->capture_default_str();
  cmd.add_option("--rope-dim", m.rope_dim, "Rope width (mla)")->capture_default_str();
  cmd.add_option("--indexer-dim", m.indexer_dim, "Indexer width (sparse_mla)")
      ->capture_default_str();
  cmd.add_option("--tokens-per-block", m.tokens_per_block, "Tokens per block")
      ->capture_default_str();
  cmd.add_option("--num-blocks", m.num_blocks, "Blocks per TP rank")->capture_default_str();
  cmd.add_option("--dtype", m.dtype, "fp16|bf16|fp32|int8")->capture_default_str();
  cmd.add_option("--layout", m.layout, "token_major|head_major")->capture_default_str();
  cmd.add_option("--hybrid", m.hybrid,
                 "A hybrid model's KV cache groups: swa (gpt-oss-like: 12 full-attention and 12 "
                 "sliding-window layers of a 128-token window, alternating; --groups "
                 "full:12,swa@128:12), mamba (Qwen3-Next-like: of every four layers three "
                 "gated-delta-net state layers and one full attention; --groups "
                 "mamba:6,mamba:6,mamba:6,full:6)")
      ->check(CLI::IsMember({"swa", "mamba"}));
  cmd.add_option(
      "--groups", m.groups,
      "KV cache groups, comma-separated, each KIND[@WINDOW][:LAYERS] in vLLM's group "
      "order: full (the --kind geometry), mha (MHA of --kv-heads and --head-dim), swa@W "
      "(the same with a W-token sliding window), mamba (a gated-delta-net state: conv state "
      "and fp32 SSM state, one block per request); LAYERS defaults to --layers. Groups of one size "
      "interleave their layers, as vLLM's do");
}

Result<std::string> HybridSpec(const std::string& name) {
  if (name == "swa") return std::string("full:12,swa@128:12");
  if (name == "mamba") return std::string("mamba:6,mamba:6,mamba:6,full:6");
  return Status::InvalidArgument("unknown --hybrid '" + name + "'; expected swa or mamba");
}

namespace {

Result<std::int64_t> ParseCount(std::string_view text, std::string_view what,
                                std::string_view item) {
  std::int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v <= 0) {
    return Status::InvalidArgument("--groups item '" + std::string(item) +
                                   "': " + std::string(what) + " '" + std::string(text) +
                                   "' is not a positive number");
  }
  return v;
}

// One --groups item, KIND[@WINDOW][:LAYERS], on top of the uniform model `base`.
Result<CacheSpecOptions> ParseGroup(std::string_view item, const ModelArgs& m,
                                    const CacheSpecOptions& base) {
  std::string_view kind = item;
  std::int64_t layers = m.layers;
  std::int64_t window = 0;
  if (const auto colon = kind.find(':'); colon != std::string_view::npos) {
    KVFERRY_ASSIGN_OR_RETURN(layers, ParseCount(kind.substr(colon + 1), "layer count", item));
    kind = kind.substr(0, colon);
  }
  if (const auto at = kind.find('@'); at != std::string_view::npos) {
    KVFERRY_ASSIGN_OR_RETURN(window, ParseCount(kind.substr(at + 1), "window", item));
    kind = kind.substr(0, at);
  }
  CacheSpecOptions o = base;
  if (kind == "full") {
    if (window != 0) {
      return Status::InvalidArgument("--groups item '" + std::string(item) +
                                     "': full attention has no window; write swa@" +
                                     std::to_string(window));
    }
  } else if (kind == "swa" || kind == "mha") {
    if ((kind == "swa") != (window != 0)) {
      return Status::InvalidArgument("--groups item '" + std::string(item) +
                                     "': swa takes a window in tokens (swa@128), mha none");
    }
    LayerSpec layer;
    layer.kind = CacheKind::kMha;
    layer.parts = {{"k", m.kv_heads, m.head_dim}, {"v", m.kv_heads, m.head_dim}};
    o.layers.assign(1, layer);
    o.sliding_window = window;
  } else if (kind == "mamba") {
    if (window != 0) {
      return Status::InvalidArgument("--groups item '" + std::string(item) +
                                     "': a state group has no window");
    }
    // A gated delta net layer as Qwen3-Next's, scaled down (4 key heads, 8 value heads, head
    // dims 64, conv kernel 4): the conv state's Q, K and V channels in vLLM's DS layout
    // (channels outermost, kernel - 1 taps each), then the SSM state of the value heads, fp32.
    LayerSpec layer;
    layer.kind = CacheKind::kState;
    layer.parts = {{"conv_q", 4 * 64, 3},
                   {"conv_k", 4 * 64, 3},
                   {"conv_v", 8 * 64, 3},
                   {"ssm", 8, 64 * 64, DType::kFloat32}};
    o.layers.assign(1, layer);
    // One state per request: a pool of a sixteenth of the attention blocks' count.
    o.num_blocks = std::max<std::int64_t>(16, m.num_blocks / 16);
  } else {
    return Status::InvalidArgument("--groups item '" + std::string(item) + "': unknown kind '" +
                                   std::string(kind) +
                                   "'; expected full, mha, swa@WINDOW or mamba");
  }
  o.layers.assign(static_cast<std::size_t>(layers), o.layers.front());
  KVFERRY_RETURN_IF_ERROR(
      CacheSpec::Create(o).status().WithContext("--groups item '" + std::string(item) + "'"));
  return o;
}

}  // namespace

std::vector<std::string> GroupItems(std::string_view spec) {
  std::vector<std::string> out;
  while (!spec.empty()) {
    const auto comma = spec.find(',');
    out.emplace_back(spec.substr(0, comma));
    spec = comma == std::string_view::npos ? std::string_view() : spec.substr(comma + 1);
  }
  return out;
}

Result<std::vector<CacheSpecOptions>> BuildGroups(const ModelArgs& m) {
  KVFERRY_ASSIGN_OR_RETURN(CacheSpecOptions base, BuildModel(m));
  std::string spec = m.groups;
  if (!m.hybrid.empty()) {
    if (!m.groups.empty()) {
      return Status::InvalidArgument("--hybrid " + m.hybrid + " and --groups " + m.groups +
                                     ": give one of them");
    }
    KVFERRY_ASSIGN_OR_RETURN(spec, HybridSpec(m.hybrid));
  }
  if (spec.empty()) return std::vector<CacheSpecOptions>{base};
  std::vector<CacheSpecOptions> out;
  bool attention = false;
  for (const std::string& item : GroupItems(spec)) {
    KVFERRY_ASSIGN_OR_RETURN(CacheSpecOptions g, ParseGroup(item, m, base));
    attention = attention || g.layers.front().kind != CacheKind::kState;
    out.push_back(std::move(g));
  }
  if (out.size() > static_cast<std::size_t>(kMaxCacheGroups)) {
    return Status::InvalidArgument("--groups names " + std::to_string(out.size()) +
                                   " KV cache groups; at most " + std::to_string(kMaxCacheGroups));
  }
  if (!attention) {
    return Status::InvalidArgument("--groups " + spec +
                                   ": every group is a state group; a hybrid model has attention "
                                   "layers too (add full, mha or swa@W)");
  }
  return out;
}

Result<CacheSpecOptions> BuildModel(const ModelArgs& m) {
  KVFERRY_ASSIGN_OR_RETURN(CacheKind kind, ParseCacheKind(m.kind));
  KVFERRY_ASSIGN_OR_RETURN(DType dtype, ParseDType(m.dtype));
  KVFERRY_ASSIGN_OR_RETURN(BlockLayout layout, ParseBlockLayout(m.layout));
  if (m.layers < 1) return Status::InvalidArgument("--layers must be positive");
  if (kind == CacheKind::kState) {
    return Status::InvalidArgument(
        "--kind " + m.kind +
        ": a state cache is a group of a hybrid model beside attention "
        "layers; give it with --groups (e.g. mamba:6,mamba:6,mamba:6,full:6) or --hybrid mamba");
  }
  LayerSpec layer;
  layer.kind = kind;
  if (kind == CacheKind::kMha) {
    layer.parts = {{"k", m.kv_heads, m.head_dim}, {"v", m.kv_heads, m.head_dim}};
  } else if (kind == CacheKind::kMla) {
    layer.parts = {{"latent", 1, m.latent_dim}, {"rope", 1, m.rope_dim}};
  } else {
    layer.parts = {
        {"latent", 1, m.latent_dim}, {"rope", 1, m.rope_dim}, {"indexer", 1, m.indexer_dim}};
  }
  CacheSpecOptions o;
  o.layers.assign(static_cast<std::size_t>(m.layers), layer);
  o.num_blocks = m.num_blocks;
  o.tokens_per_block = m.tokens_per_block;
  o.dtype = dtype;
  o.layout = layout;
  // Validate now (TP 1), so that a bad shape is reported before any process starts.
  KVFERRY_RETURN_IF_ERROR(CacheSpec::Create(o).status());
  return o;
}

std::string GroupsSpec(const ModelArgs& m) {
  if (m.hybrid.empty()) return m.groups;
  Result<std::string> spec = HybridSpec(m.hybrid);
  return spec.ok() ? *spec : std::string();
}

std::string ModelText(const ModelArgs& m) {
  const std::string spec = GroupsSpec(m);
  if (spec.empty()) return m.kind + " " + std::to_string(m.layers) + " layers";
  return "KV cache groups " + spec + (m.hybrid.empty() ? "" : " (hybrid " + m.hybrid + ")");
}

std::vector<std::string> ModelArgv(const ModelArgs& m) {
  return {"--kind",
          m.kind,
          "--layers",
          std::to_string(m.layers),
          "--kv-heads",
          std::to_string(m.kv_heads),
          "--head-dim",
          std::to_string(m.head_dim),
          "--latent-dim",
          std::to_string(m.latent_dim),
          "--rope-dim",
          std::to_string(m.rope_dim),
          "--indexer-dim",
          std::to_string(m.indexer_dim),
          "--tokens-per-block",
          std::to_string(m.tokens_per_block),
          "--num-blocks",
          std::to_string(m.num_blocks),
          "--dtype",
          m.dtype,
          "--layout",
          m.layout,
          "--groups",
          GroupsSpec(m)};
}

}  // namespace kvferry::cli
