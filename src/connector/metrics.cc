// Prometheus text exposition (format 0.0.4) of WorkerStats. Families are written whole, in a
// fixed order, so the output is stable for tests and diffs.
#include "kvferry/metrics.h"

#include <charconv>
#include <functional>
#include <map>

namespace kvferry {
namespace {

std::string Escape(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

using Labels = std::vector<std::pair<std::string, std::string>>;

std::string LabelText(const Labels& labels) {
  if (labels.empty()) return "";
  std::string out = "{";
  for (std::size_t i = 0; i < labels.size(); ++i) {
    if (i != 0) out += ",";
    out += labels[i].first + "=\"" + Escape(labels[i].second) + "\"";
  }
  return out + "}";
}

// The shortest text that reads back as exactly `v`.
std::string Number(double v) {
  char buf[64];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

std::string Number(std::uint64_t v) { return std::to_string(v); }

std::string Seconds(std::uint64_t us) { return Number(static_cast<double>(us) / 1e6); }

Labels WorkerLabels(const WorkerMetrics& w) {
  return {{"engine_id", w.engine_id},
          {"role", RoleName(w.role)},
          {"dp_rank", std::to_string(w.dp_rank)},
          {"tp_rank", std::to_string(w.tp_rank)}};
}

Labels With(Labels labels, const std::string& name, const std::string& value) {
  labels.emplace_back(name, value);
  return labels;
}

class Writer {
 public:
  explicit Writer(std::span<const WorkerMetrics> workers) : workers_(workers) {}

  // One family with one sample per worker: value(stats).
  void Simple(const std::string& name, const char* type, const std::string& help,
              const std::function<std::uint64_t(const WorkerStats&)>& value) {
    Header(name, type, help);
    for (const WorkerMetrics& w : workers_) {
      Line(name, WorkerLabels(w), Number(value(w.stats)));
    }
  }

  // One family with one sample per worker and label value: rows(stats) lists (value, sample).
  void Labelled(
      const std::string& name, const char* type, const std::string& help, const std::string& label,
      const std::function<std::vector<std::pair<std::string, std::uint64_t>>(const WorkerStats&)>&
          rows) {
    Header(name, type, help);
    for (const WorkerMetrics& w : workers_) {
      for (const auto& [value, sample] : rows(w.stats)) {
        Line(name, With(WorkerLabels(w), label, value), Number(sample));
      }
    }
  }

  void Histogram(const std::string& name, const std::string& help,
                 const std::function<const LatencyHistogram&(const WorkerStats&)>& get) {
    Header(name, "histogram", help);
    for (const WorkerMetrics& w : workers_) {
      const LatencyHistogram& h = get(w.stats);
      const Labels labels = WorkerLabels(w);
      for (std::size_t i = 0; i < LatencyHistogram::kExportBoundsUs.size(); ++i) {
        Line(name + "_bucket", With(labels, "le", Seconds(LatencyHistogram::kExportBoundsUs[i])),
             Number(h.CountAtOrBelowBound(i)));
      }
      Line(name + "_bucket", With(labels, "le", "+Inf"), Number(h.count()));
      Line(name + "_sum", labels, Seconds(h.sum_us()));
      Line(name + "_count", labels, Number(h.count()));
    }
    // The same distribution at the histogram's own resolution (within 1/64): what a 1-2.5-5
    // bucket grid cannot tell.
    const std::string summary = name + "_quantiles";
    Header(summary, "summary",
           help + ", quantiles since start from kvferry's log-linear histogram (within 1.6 %)");
    for (const WorkerMetrics& w : workers_) {
      const LatencyHistogram& h = get(w.stats);
      const Labels labels = WorkerLabels(w);
      for (const auto& [text, q] :
           {std::pair<const char*, double>{"0.5", 0.5}, {"0.9", 0.9}, {"0.99", 0.99}, {"1", 1.0}}) {
        Line(summary, With(labels, "quantile", text), Seconds(h.Quantile(q)));
      }
      Line(summary + "_sum", labels, Seconds(h.sum_us()));
      Line(summary + "_count", labels, Number(h.count()));
    }
  }

  void Extra(std::span<const ExtraMetric> extra) {
    // Families in order of first appearance, each written whole.
    std::vector<std::string> order;
    std::map<std::string, std::vector<const ExtraMetric*>> families;
    for (const ExtraMetric& m : extra) {
      auto [it, added] = families.try_emplace(m.name);
      if (added) order.push_back(m.name);
      it->second.push_back(&m);
    }
    for (const std::string& name : order) {
      const ExtraMetric& first = *families[name].front();
      Header(name, first.type == MetricType::kCounter ? "counter" : "gauge", first.help);
      for (const ExtraMetric* m : families[name]) Line(name, m->labels, Number(m->value));
    }
  }

  std::string Take() { return std::move(out_); }

 private:
  void Header(const std::string& name, const char* type, const std::string& help) {
    std::string h;
    for (char c : help) h += c == '\\' ? "\\\\" : c == '\n' ? "\\n" : std::string(1, c);
    out_ += "# HELP " + name + " " + h + "\n# TYPE " + name + " " + type + "\n";
  }
  void Line(const std::string& name, const Labels& labels, const std::string& value) {
    out_ += name + LabelText(labels) + " " + value + "\n";
  }

  std::span<const WorkerMetrics> workers_;
  std::string out_;
};

}  // namespace

std::string PrometheusText(std::span<const WorkerMetrics> workers,
                           std::span<const ExtraMetric> extra) {
  Writer w(workers);
  using S = const WorkerStats&;
  w.Labelled("kvferry_loads_total", "counter",
             "Loads (decode side) that ended, by outcome (done or failed)", "outcome", [](S s) {
               return std::vector<std::pair<std::string, std::uint64_t>>{
                   {"done", s.loads_done}, {"failed", s.loads_failed}};
             });
  w.Labelled("kvferry_load_failures_total", "counter",
             "Failed loads by status code (Timeout, PeerDisconnected, ...)", "code", [](S s) {
               return std::vector<std::pair<std::string, std::uint64_t>>(s.failures.begin(),
                                                                         s.failures.end());
             });
  w.Labelled("kvferry_load_failures_by_peer_total", "counter",
             "Failed loads by the prefill engine read from (its engine id; at most 256, then "
             "\"other\")",
             "peer", [](S s) {
               return std::vector<std::pair<std::string, std::uint64_t>>(s.failures_by_peer.begin(),
                                                                         s.failures_by_peer.end());
             });
  w.Simple("kvferry_loads_outstanding", "gauge", "Loads started and not yet reported finished",
           [](S s) { return s.loads_outstanding; });
  w.Simple("kvferry_bytes_read_total", "counter", "KV bytes the connector's loads read",
           [](S s) { return s.bytes_read; });
  w.Simple("kvferry_reads_total", "counter", "Byte ranges the connector's loads read",
           [](S s) { return s.reads; });
  w.Simple("kvferry_merged_runs_total", "counter",
           "Block runs read after merging contiguous blocks", [](S s) { return s.merged_runs; });
  w.Simple("kvferry_loads_reread_total", "counter",
           "Loads read a second time after a peer fault, through a new handshake (a prefill "
           "rank restarted on its endpoint)",
           [](S s) { return s.loads_reread; });
  w.Simple("kvferry_handshakes_total", "counter",
           "Handshakes completed with prefill ranks (metadata, descriptor, connect)",
           [](S s) { return s.handshakes; });
  w.Simple("kvferry_agents_evicted_total", "counter",
           "Cached prefill-rank handshakes dropped past max_agents",
           [](S s) { return s.agents_evicted; });
  w.Simple("kvferry_holds_outstanding", "gauge",
           "Prefill holds: requests whose blocks wait for their decode readers",
           [](S s) { return s.holds_outstanding; });
  w.Labelled("kvferry_holds_ended_total", "counter",
             "Prefill holds that ended, by why: every reader reported, an abort notice, or the "
             "lease expired",
             "reason", [](S s) {
               return std::vector<std::pair<std::string, std::uint64_t>>{
                   {"readers", s.holds_released_by_readers},
                   {"abort", s.holds_released_by_abort},
                   {"lease_expired", s.holds_expired}};
             });
  w.Labelled("kvferry_notices_received_total", "counter",
             "Side-channel messages this worker's listener answered, by type", "type", [](S s) {
               return std::vector<std::pair<std::string, std::uint64_t>>(s.notices_received.begin(),
                                                                         s.notices_received.end());
             });
  w.Simple("kvferry_early_notices", "gauge",
           "Finished or abort notices kept for requests not held yet",
           [](S s) { return s.early_notices; });
  w.Simple("kvferry_early_notices_refused_total", "counter",
           "Early notices refused past max_early_notices",
           [](S s) { return s.early_notices_refused; });
  w.Simple("kvferry_notices_dropped_total", "counter",
           "Best-effort notices (lease renewals, aborts) dropped past max_queued_notices",
           [](S s) { return s.notices_dropped; });
  w.Histogram("kvferry_transfer_latency_seconds",
              "Loads that ended done, from start to the last read",
              [](S s) -> const LatencyHistogram& { return s.transfer_latency; });
  w.Histogram("kvferry_handshake_latency_seconds",
              "Handshakes with prefill ranks, from metadata request to connected",
              [](S s) -> const LatencyHistogram& { return s.handshake_latency; });
  w.Simple("kvferry_transport_batches_submitted_total", "counter",
           "Read batches submitted to the data plane",
           [](S s) { return s.transport.batches_submitted; });
  w.Labelled("kvferry_transport_batches_ended_total", "counter",
             "Read batches that ended, by state (done, failed, cancelled)", "state", [](S s) {
               return std::vector<std::pair<std::string, std::uint64_t>>{
                   {"done", s.transport.batches_done},
                   {"failed", s.transport.batches_failed},
                   {"cancelled", s.transport.batches_cancelled}};
             });
  w.Simple("kvferry_transport_bytes_read_total", "counter", "Bytes the data plane read from peers",
           [](S s) { return s.transport.bytes_read; });
  w.Simple("kvferry_transport_bytes_served_total", "counter",
           "Bytes the data plane served to peers (prefill side, tcp)",
           [](S s) { return s.transport.bytes_served; });
  w.Simple("kvferry_transport_requests_refused_total", "counter",
           "Data-plane requests refused: reads outside registered memory, bad proof, bad frames",
           [](S s) { return s.transport.requests_refused; });
  w.Simple("kvferry_transport_staging_bytes", "gauge",
           "Pinned host memory the data plane holds to stage device memory",
           [](S s) { return s.transport.staging_bytes; });
  w.Labelled("kvferry_registered_bytes", "gauge",
             "Bytes of KV cache registered with the data plane, by memory kind (host, cuda:0, ...)",
             "memory", [](S s) {
               return std::vector<std::pair<std::string, std::uint64_t>>(
                   s.transport.registered_bytes.begin(), s.transport.registered_bytes.end());
             });
  w.Extra(extra);
  return w.Take();
}

}  // namespace kvferry
