// kvferry plan: shows, for a model shape, TP sizes and block id lists, which prefill ranks every
// decode rank reads, which bytes of each block, how many readers every prefill rank waits for,
// and the merged block runs. What the connector will do, without moving a byte.
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "common/digest.h"
#include "kvferry/cache_spec.h"
#include "layout/block_runs.h"
#include "layout/tp_map.h"
#include "tools/commands.h"

namespace kvferry::cli {
namespace {

struct PlanArgs {
  ModelArgs model;
  int prefill_tp = 1;
  int decode_tp = 1;
  std::vector<std::int64_t> remote_blocks;
  std::vector<std::int64_t> local_blocks;
};

Result<CacheSpec> BuildSpec(const PlanArgs& a, int tp_size, int tp_rank) {
  KVFERRY_ASSIGN_OR_RETURN(CacheSpecOptions o, BuildModel(a.model));
  o.tp_size = tp_size;
  o.tp_rank = tp_rank;
  return CacheSpec::Create(std::move(o));
}

Status RunPlan(const PlanArgs& a) {
  KVFERRY_ASSIGN_OR_RETURN(CacheSpec decode0, BuildSpec(a, a.decode_tp, 0));
  std::cout << "cache: " << decode0.CanonicalText() << "\n";
  std::cout << "compatibility hash: " << ToHex(decode0.Hash()) << "\n";
  std::cout << "prefill TP " << a.prefill_tp << " -> decode TP " << a.decode_tp << "\n";
  for (int q = 0; q < a.prefill_tp; ++q) {
    KVFERRY_ASSIGN_OR_RETURN(int readers, ExpectedReaders(decode0, a.prefill_tp, a.decode_tp, q));
    std::cout << "  prefill rank " << q << " frees after " << readers << " reader"
              << (readers == 1 ? "" : "s") << "\n";
  }
  std::vector<std::int64_t> local = a.local_blocks;
  if (local.empty()) local = a.remote_blocks;
  KVFERRY_ASSIGN_OR_RETURN(std::span<const std::int64_t> remote,
                           TailOfRemote(a.remote_blocks, local));
  KVFERRY_ASSIGN_OR_RETURN(std::vector<BlockRun> runs,
                           MergeBlockRuns(remote, local, a.model.num_blocks, a.model.num_blocks));
  std::cout << "blocks: " << local.size() << " in " << runs.size() << " run"
            << (runs.size() == 1 ? "" : "s");
  for (const BlockRun& r : runs) {
    std::cout << " [" << r.remote_start << "->" << r.local_start << " x" << r.count << "]";
  }
  std::cout << "\n";
  for (int r = 0; r < a.decode_tp; ++r) {
    KVFERRY_ASSIGN_OR_RETURN(CacheSpec local_spec, BuildSpec(a, a.decode_tp, r));
    KVFERRY_ASSIGN_OR_RETURN(std::vector<TpSource> sources,
                             PlanTpSources(local_spec, a.prefill_tp, a.decode_tp, r));
    for (const TpSource& s : sources) {
      KVFERRY_ASSIGN_OR_RETURN(CacheSpec remote_spec, BuildSpec(a, a.prefill_tp, s.prefill_rank));
      std::vector<PartBlockBytes> bytes;
      bytes.reserve(static_cast<std::size_t>(local_spec.num_parts()));
      for (int p = 0; p < local_spec.num_parts(); ++p) {
        bytes.push_back({remote_spec.BlockBytes(p), local_spec.BlockBytes(p)});
      }
      const std::vector<ByteRange> ranges = RunByteRanges(runs, local_spec.num_layers(), bytes, s);
      std::int64_t total = 0;
      std::int64_t pieces = 0;
      for (const ByteRange& br : ranges) {
        total += br.length * br.count;
        pieces += br.count;
      }
      std::cout << "  decode rank " << r << " reads prefill rank " << s.prefill_rank << ": ";
      for (std::size_t p = 0; p < s.part_slices.size(); ++p) {
        const BlockSlice& sl = s.part_slices[p];
        std::cout << (p ? ", " : "") << local_spec.parts()[p].name << " bytes [" << sl.remote_offset
                  << ", +" << sl.length << ") -> [" << sl.local_offset << ", +" << sl.length << ")";
        if (sl.count > 1) {
          // A token-major head slice: one piece per token slot.
          std::cout << " x" << sl.count << " (steps " << sl.remote_step << " -> " << sl.local_step
                    << ")";
        }
      }
      std::cout << "; " << ranges.size() << " reads";
      if (pieces != static_cast<std::int64_t>(ranges.size()))
        std::cout << " of " << pieces << " pieces";
      std::cout << ", " << total << " bytes\n";
    }
  }
  return Status::Ok();
}

}  // namespace

void AddPlanCommand(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* plan = app.add_subcommand(
      "plan", "Show the reads, TP mapping and reader counts for a model shape and block lists");
  AddModelOptions(*plan, args->model);
  plan->add_option("--prefill-tp", args->prefill_tp, "Prefill TP size")->capture_default_str();
  plan->add_option("--decode-tp", args->decode_tp, "Decode TP size")->capture_default_str();
  plan->add_option("--remote-blocks", args->remote_blocks, "Prefill block ids")
      ->delimiter(',')
      ->required();
  plan->add_option("--local-blocks", args->local_blocks,
                   "Decode block ids (default: same as remote)")
      ->delimiter(',');
  plan->callback([args, &exit_code] {
    Status s = RunPlan(*args);
    if (!s.ok()) {
      std::cerr << "kvferry plan: " << s.ToString() << "\n";
      exit_code = 1;
    }
  });
}

}  // namespace kvferry::cli
