// Sub-commands of the kvferry CLI. Each Add* registers its commands on `app`; the command's
// callback stores its process exit status in `exit_code` (0 success, 1 failure, 2 bad usage).
#pragma once

#include <CLI/CLI.hpp>
#include <optional>

#include "kvferry/cache_spec.h"
#include "kvferry/transport.h"

namespace kvferry::cli {

/// The model shape options shared by serve, demo and bench e2e.
struct ModelArgs {
  std::string kind = "mha";
  int layers = 8;
  std::int64_t kv_heads = 8;
  std::int64_t head_dim = 64;
  std::int64_t latent_dim = 512;
  std::int64_t rope_dim = 64;
  std::int64_t indexer_dim = 128;
  std::int64_t tokens_per_block = 16;
  std::int64_t num_blocks = 2048;
  std::string dtype = "bf16";
  std::string layout = "token_major";
  /// A hybrid model's KV cache groups (docs/connector.md, "KV cache groups"): "swa" (gpt-oss-like,
  /// HybridSpec), or a --groups spec; empty: one group of --kind.
  std::string hybrid;
  std::string groups;
};
void AddModelOptions(CLI::App& cmd, ModelArgs& model);
/// The CacheSpecOptions of group 0 of the model (TP fields left at 1/0; each rank sets its own).
Result<CacheSpecOptions> BuildModel(const ModelArgs& model);
/// Every KV cache group of the model: --groups (or --hybrid's), else the one group BuildModel
/// makes.
Result<std::vector<CacheSpecOptions>> BuildGroups(const ModelArgs& model);
/// The items of a --groups spec, split at its commas.
std::vector<std::string> GroupItems(std::string_view spec);
/// The --groups spec of the model, --hybrid's resolved; empty for a uniform model.
std::string GroupsSpec(const ModelArgs& model);
/// The model vLLM runs without its hybrid KV cache manager: every sliding window full attention
/// (vLLM's unify_hybrid_kv_cache_specs); nullopt for a model with no window.
std::optional<ModelArgs> FullAttentionFallback(const ModelArgs& model);
/// The most bytes one request of `prompt` tokens should read across `decode_tp` decode ranks:
/// every block of a full-attention group, a sliding window's tokens and one block more, a
/// state group's one block.
Result<std::uint64_t> BoundBytesPerRequest(const ModelArgs& model, int decode_tp,
                                           std::int64_t prompt);
/// "mha 8 layers", or a hybrid's groups ("groups full:12,swa@128:12 (hybrid swa)").
std::string ModelText(const ModelArgs& model);
/// The --groups spec `--hybrid NAME` stands for, or an empty string and InvalidArgument.
Result<std::string> HybridSpec(const std::string& name);
/// This executable's path, for starting child kvferry processes (bench peer, serve).
std::string SelfExe();
/// Arguments that pass `model` on to a child `kvferry serve`.
std::vector<std::string> ModelArgv(const ModelArgs& model);

/// The --transport choices from the backend registry: "auto|shm|tcp".
std::string TransportChoices();
/// Adds --transport-opt KEY=VALUE (repeatable; keys in docs/transport.md, "Options") to `cmd`.
void AddTransportOptOption(CLI::App& cmd, std::vector<std::string>& key_values);
/// The map the collected --transport-opt values give, checked against every backend's options
/// with `backend` and the defaults of TransportOptions.
Result<TransportOptionMap> ParseTransportOpts(const std::vector<std::string>& key_values,
                                              const std::string& backend);
/// Arguments that pass `key_values` on to a child kvferry process.
std::vector<std::string> TransportOptArgv(const std::vector<std::string>& key_values);

void AddRanktableCommands(CLI::App& app, int& exit_code);
void AddPlanCommand(CLI::App& app, int& exit_code);
void AddBenchCommands(CLI::App& app, int& exit_code);
/// `kvferry bench control`, registered by AddBenchCommands on its `bench` command.
void AddBenchControlCommand(CLI::App& bench, int& exit_code);
void AddServeCommand(CLI::App& app, int& exit_code);
/// `kvferry drain ENDPOINT`: the control message "drain" to a running `kvferry serve`.
void AddDrainCommand(CLI::App& app, int& exit_code);
/// `kvferry demo`, and `kvferry bench e2e` on the `bench` command (AddBenchE2eCommand), which
/// AddBenchCommands must have added.
void AddDemoCommands(CLI::App& app, int& exit_code);
/// `kvferry bench e2e`.
void AddBenchE2eCommand(CLI::App& bench, int& exit_code);
void AddTopCommand(CLI::App& app, int& exit_code);

}  // namespace kvferry::cli
