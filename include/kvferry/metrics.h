// kvferry: the connector's metrics as a snapshot an embedding engine exports its own way, and as
// Prometheus text (what `kvferry serve --metrics-port` serves). docs/observability.md names every
// metric, its type, labels and meaning.
#pragma once

#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvferry/connector.h"

namespace kvferry {

enum class MetricType : std::uint8_t { kCounter, kGauge };

/// A sample an embedder adds to the exposition (for example its own request counters). Samples
/// with the same name form one family and must share its help text and type.
struct ExtraMetric {
  std::string name;  ///< [a-zA-Z_:][a-zA-Z0-9_:]*; counters end in _total
  std::string help;
  MetricType type = MetricType::kGauge;
  std::vector<std::pair<std::string, std::string>> labels;  ///< names [a-zA-Z_][a-zA-Z0-9_]*
  double value = 0;
};

/// The Prometheus text exposition format (version 0.0.4) of `workers` followed by `extra`:
/// every family once, with its HELP and TYPE lines, every worker series labelled engine_id,
/// role, dp_rank, tp_rank; latency histograms as Prometheus histograms in seconds (cumulative
/// `le` buckets, the last +Inf, then _sum and _count) and as summaries (quantiles 0.5, 0.9,
/// 0.99, 1). Label values are escaped. Pure: safe from any thread.
std::string PrometheusText(std::span<const WorkerMetrics> workers,
                           std::span<const ExtraMetric> extra = {});

/// The content type to serve PrometheusText with.
inline constexpr const char* kPrometheusContentType = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace kvferry
