// kvferry: the command-line tool. See README.md for the commands.
#include <CLI/CLI.hpp>

#include "tools/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"kvferry: moves the KV cache of LLM requests from prefill to decode instances"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kvferry 0.1.0");
  int exit_code = 0;
  kvferry::cli::AddRanktableCommands(app, exit_code);
  kvferry::cli::AddPlanCommand(app, exit_code);
  kvferry::cli::AddBenchCommands(app, exit_code);
  kvferry::cli::AddServeCommand(app, exit_code);
  kvferry::cli::AddDrainCommand(app, exit_code);
  kvferry::cli::AddDemoCommands(app, exit_code);
  kvferry::cli::AddTopCommand(app, exit_code);
  CLI11_PARSE(app, argc, argv);
  return exit_code;
}
