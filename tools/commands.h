// Sub-commands of the kvferry CLI. Each Add* registers its commands on `app`; the command's
// callback stores its process exit status in `exit_code` (0 success, 1 failure, 2 bad usage).
#pragma once

#include <CLI/CLI.hpp>

namespace kvferry::cli {

void AddRanktableCommands(CLI::App& app, int& exit_code);
void AddPlanCommand(CLI::App& app, int& exit_code);
void AddBenchCommands(CLI::App& app, int& exit_code);

}  // namespace kvferry::cli
