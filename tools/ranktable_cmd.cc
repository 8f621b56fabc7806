// kvferry ranktable check | gen
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "kvferry/rank_table.h"
#include "tools/commands.h"

namespace kvferry::cli {
namespace {

struct CheckArgs {
  std::string file;
  std::string role;
  std::string server_id;
  std::string visible_devices;
  int tp_rank = -1;
};

struct GenArgs {
  std::vector<std::string> hosts;
  std::vector<std::string> device_ips;
  int devices_per_host = 0;
  int prefill = 0;
  int decode = 0;
  bool super_pod = false;
  std::string output;
};

void PrintSummary(const RankTable& table) {
  for (Role role : {Role::kPrefill, Role::kDecode}) {
    std::map<std::string, int> per_server;
    for (const DeviceEntry& e : table.List(role)) ++per_server[e.server_id];
    std::cout << RoleName(role) << ": " << table.List(role).size() << " devices";
    for (const auto& [server, count] : per_server) std::cout << ", " << server << " x" << count;
    std::cout << "\n";
  }
}

int RunCheck(const CheckArgs& args) {
  Result<RankTable> table = RankTable::Load(args.file);
  if (!table.ok()) {
    std::cerr << "kvferry ranktable check: " << table.status().ToString() << "\n";
    return 1;
  }
  std::cout << args.file << ": valid rank table, version " << table->version() << "\n";
  PrintSummary(*table);
  if (args.role.empty()) return 0;
  Result<Role> role = ParseRole(args.role);
  if (!role.ok()) {
    std::cerr << "kvferry ranktable check: " << role.status().ToString() << "\n";
    return 2;
  }
  Result<DeviceEntry> entry = table->SelectLocal(
      *role, args.server_id, ParseVisibleDevices(args.visible_devices), std::max(args.tp_rank, 0));
  if (!entry.ok()) {
    std::cerr << "kvferry ranktable check: " << entry.status().ToString() << "\n";
    return 1;
  }
  std::cout << "selected: server_id " << entry->server_id << ", device_id " << entry->device_id
            << ", device_ip " << entry->device_ip << ", cluster_id " << entry->cluster_id << "\n";
  return 0;
}

int RunGen(const GenArgs& args) {
  RankTableGenOptions options;
  options.hosts = args.hosts;
  options.device_ips = args.device_ips;
  options.devices_per_host = args.devices_per_host;
  options.prefill_count = args.prefill;
  options.decode_count = args.decode;
  options.super_pod = args.super_pod;
  Result<RankTable> table = GenerateRankTable(options);
  if (!table.ok()) {
    std::cerr << "kvferry ranktable gen: " << table.status().ToString() << "\n";
    return 1;
  }
  const std::string json = table->ToJson();
  if (args.output.empty() || args.output == "-") {
    std::cout << json;
    return 0;
  }
  std::ofstream out(args.output, std::ios::binary | std::ios::trunc);
  out << json;
  out.close();
  if (!out) {
    std::cerr << "kvferry ranktable gen: cannot write " << args.output << "\n";
    return 1;
  }
  std::cerr << "wrote " << args.output << "\n";
  return 0;
}

}  // namespace

void AddRanktableCommands(CLI::App& app, int& exit_code) {
  CLI::App* rt = app.add_subcommand("ranktable", "Check or generate a global rank table");
  rt->require_subcommand(1);

  auto check_args = std::make_shared<CheckArgs>();
  CLI::App* check = rt->add_subcommand("check",
                                       "Validate a rank table file; optionally select "
                                       "the entry a worker would use");
  check->add_option("file", check_args->file, "Rank table JSON file")->required();
  check->add_option("--role", check_args->role, "prefill|decode (kv_producer|kv_consumer)");
  check->add_option("--server-id", check_args->server_id, "Host address to select entries for");
  check->add_option("--visible-devices", check_args->visible_devices,
                    "Comma-separated device ids (like ASCEND_RT_VISIBLE_DEVICES)");
  check->add_option("--tp-rank", check_args->tp_rank, "TP rank to select");
  check->callback([check_args, &exit_code] { exit_code = RunCheck(*check_args); });

  auto gen_args = std::make_shared<GenArgs>();
  CLI::App* gen = rt->add_subcommand("gen",
                                     "Write a rank table in the reference generator's "
                                     "format");
  gen->add_option("--hosts", gen_args->hosts, "Host addresses (server_id), in order")
      ->required()
      ->delimiter(',');
  gen->add_option("--device-ips", gen_args->device_ips,
                  "Data-plane address per host (default: the host address)")
      ->delimiter(',');
  gen->add_option("--devices-per-host", gen_args->devices_per_host, "Devices on every host")
      ->required();
  gen->add_option("--prefill", gen_args->prefill, "Number of prefill devices (taken first)")
      ->required();
  gen->add_option("--decode", gen_args->decode, "Number of decode devices (taken next)")
      ->required();
  gen->add_flag("--super-pod", gen_args->super_pod,
                "Write the A3 fields super_pod_id and "
                "super_device_id");
  gen->add_option("-o,--output", gen_args->output, "Output file (default: stdout)");
  gen->callback([gen_args, &exit_code] { exit_code = RunGen(*gen_args); });
}

}  // namespace kvferry::cli
