// The transport options shared by serve, demo and bench: backends and their options come from
// the transport's backend registry, never from a list here.
#include "tools/commands.h"

namespace kvferry::cli {

std::string TransportChoices() {
  std::string choices = "auto";
  for (const std::string& name : TransportBackendNames()) choices += "|" + name;
  return choices + ", or a comma-separated preference order (shm,tcp; docs/transport.md)";
}

void AddTransportOptOption(CLI::App& cmd, std::vector<std::string>& key_values) {
  cmd.add_option("--transport-opt", key_values,
                 "Backend option KEY=VALUE, repeatable (tcp.connections=4; docs/transport.md)")
      ->take_all()
      ->allow_extra_args(false);
}

Result<TransportOptionMap> ParseTransportOpts(const std::vector<std::string>& key_values,
                                              const std::string& backend) {
  TransportOptions options;
  options.backend = backend;
  for (const std::string& kv : key_values) {
    KVFERRY_RETURN_IF_ERROR(AddTransportOption(kv, &options.backend_options));
  }
  KVFERRY_RETURN_IF_ERROR(CheckTransportOptions(options));
  return options.backend_options;
}

std::vector<std::string> TransportOptArgv(const std::vector<std::string>& key_values) {
  std::vector<std::string> argv;
  for (const std::string& kv : key_values) {
    argv.emplace_back("--transport-opt");
    argv.push_back(kv);
  }
  return argv;
}

}  // namespace kvferry::cli
