#include <unistd.h>

#include <string>
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
}

Result<CacheSpecOptions> BuildModel(const ModelArgs& m) {
  KVFERRY_ASSIGN_OR_RETURN(CacheKind kind, ParseCacheKind(m.kind));
  KVFERRY_ASSIGN_OR_RETURN(DType dtype, ParseDType(m.dtype));
  KVFERRY_ASSIGN_OR_RETURN(BlockLayout layout, ParseBlockLayout(m.layout));
  if (m.layers < 1) return Status::InvalidArgument("--layers must be positive");
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
          m.layout};
}

}  // namespace kvferry::cli
