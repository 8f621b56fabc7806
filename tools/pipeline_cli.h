// What kvferry demo and kvferry bench e2e share around the pipeline (pipeline.h): its
// command-line options, the prompts they send, and the connector's per-request figures they
// report.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "tools/pipeline.h"

namespace kvferry::cli {

/// The q-quantile (0..1) of `v`, nearest rank; 0 for none.
double Percentile(std::vector<double> v, double q);

// Per-request figures of the connector itself (not of the demo engine around it): transfer
// times and rates of the loads that read bytes, exact per request.
struct ConnectorFigures {
  int loads = 0;
  std::uint64_t bytes = 0;
  double ms_p50 = 0, ms_p90 = 0, ms_p99 = 0, ms_max = 0;
  double gbps_p50 = 0, gbps_p10 = 0;  // bytes / transfer time; p10: the slow tail
  std::uint64_t bytes_p50 = 0;        // per request
};
ConnectorFigures FiguresOf(const std::vector<RequestTiming>& timings);
nlohmann::json FiguresJson(const ConnectorFigures& f);
// The decode instances' transfer percentiles at the end of a run (transfer_p50_us, p90, p99,
// max: the slowest instance's), to add to a report.
nlohmann::json TransferPercentilesJson(const nlohmann::json& decode_end);

// Prompt lengths spread log-uniformly; a share of them start with one of a few common system
// prompts, so the decode side's prefix cache gets hits.
std::vector<std::vector<std::int32_t>> MakePrompts(int n, int min_len, int max_len, double shared,
                                                   std::uint32_t seed);

/// Adds the options of PipelineArgs (instances, transport, faults, model...) to `cmd`.
void AddPipelineOptions(CLI::App& cmd, PipelineArgs& p);

}  // namespace kvferry::cli
