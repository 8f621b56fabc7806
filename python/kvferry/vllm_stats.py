"""kvferry's figures in vLLM's connector-metrics contract.

vLLM (``vllm/distributed/kv_transfer/kv_connector/v1/metrics.py``) moves a connector's figures
from every worker to the engine core and on to its loggers and ``/metrics``:

  * each worker step, the model runner calls ``get_kv_connector_stats()`` (the connector's
    figures since the previous call, or None) and ships the object in its KVConnectorOutput;
  * ``KVOutputAggregator`` folds the workers' objects into one with ``aggregate(other)``; the
    object crosses processes, so its ``data`` must be plain values (vLLM's own stats keep lists);
  * the scheduler hands ``stats.data`` to its stat loggers, which rebuild an object with the
    connector class's ``build_kv_connector_stats(data=...)`` and log ``reduce()``, and the
    Prometheus logger passes ``data`` to the object that ``build_prom_metrics`` returned
    (``observe(transfer_stats_data, engine_idx)``).

So ``KvferryConnectorStats.data`` holds only lists (one entry per load, or per worker interval
for counts), ``aggregate`` concatenates them, and every method accepts whatever a peer process or
an older kvferry may have produced without raising: an engine step must never fail on figures.
"""

from __future__ import annotations

from typing import Any, Optional

try:  # pragma: no cover - depends on the vLLM version
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore
        KVConnectorPromMetrics as _PromBase,
        KVConnectorStats as _StatsBase,
    )
except Exception:  # vLLM absent (or too old to have connector metrics): standalone
    _PromBase = object
    _StatsBase = object

# data's keys, each a list:
#   transfer_duration  seconds, one per load that ended done (start to its last read)
#   bytes_transferred  bytes, one per load that ended done
#   failed_loads       status code names ("Timeout", "PeerDisconnected", ...), one per failed load
#   handshakes         handshakes with prefill ranks, one count per worker interval
#   reads              byte ranges read, one count per worker interval
_KEYS = ("transfer_duration", "bytes_transferred", "failed_loads", "handshakes", "reads")


def _list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else []


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    return float(value)


class KvferryConnectorStats(_StatsBase):  # type: ignore[misc, valid-type]
    """kvferry's figures for one interval, from one worker or aggregated over workers."""

    def __init__(self, data: Optional[dict] = None):
        self.data: dict[str, list] = {k: _list((data or {}).get(k)) for k in _KEYS}

    def reset(self) -> None:
        self.data = {k: [] for k in _KEYS}

    def aggregate(self, other: Any) -> "KvferryConnectorStats":
        """Adds `other`'s figures (another KvferryConnectorStats, or its data as a dict) to
        these and returns self, as vLLM's aggregator expects."""
        data = other if isinstance(other, dict) else getattr(other, "data", None)
        if isinstance(data, dict):
            for key in _KEYS:
                self.data[key].extend(_list(data.get(key)))
        return self

    @property
    def num_successful_transfers(self) -> int:
        return len(self.data["transfer_duration"])

    def reduce(self) -> dict[str, Any]:
        """The interval in a few figures, for vLLM's log line."""
        durations = [_number(d) for d in self.data["transfer_duration"]]
        total = sum(_number(b) for b in self.data["bytes_transferred"])
        out: dict[str, Any] = {
            "Num successful transfers": len(durations),
            "Num failed transfers": len(self.data["failed_loads"]),
            "Avg xfer time (ms)": round(1e3 * sum(durations) / len(durations), 3)
            if durations else 0.0,
            "P90 xfer time (ms)": round(1e3 * _quantile(durations, 0.9), 3),
            "Avg MB per transfer": round(total / len(durations) / 1e6, 3) if durations else 0.0,
            "Throughput (MB/s)": round(total / sum(durations) / 1e6, 3)
            if sum(durations) > 0 else 0.0,
            "Handshakes": int(sum(_number(h) for h in self.data["handshakes"])),
        }
        return out

    def is_empty(self) -> bool:
        return not (self.data["transfer_duration"] or self.data["failed_loads"]
                    or any(_number(h) for h in self.data["handshakes"]))

    def __repr__(self) -> str:
        return f"KvferryConnectorStats({self.reduce()})"


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class StatsTaker:
    """A worker's figures since the previous take, from the native worker (Worker.stats and
    Worker.take_load_transfers). Never raises: a native error yields empty figures."""

    def __init__(self) -> None:
        self._failures: dict[str, int] = {}
        self._counts: dict[str, int] = {}

    def take(self, worker: Any) -> KvferryConnectorStats:
        out = KvferryConnectorStats()
        try:
            transfers = worker.take_load_transfers()
            now = worker.stats()
        except Exception:  # never into vLLM's step: figures are best effort
            return out
        for t in transfers:
            out.data["transfer_duration"].append(_number(t.get("duration_us")) / 1e6)
            out.data["bytes_transferred"].append(int(_number(t.get("bytes"))))
        failures = now.get("failures") if isinstance(now.get("failures"), dict) else {}
        for code, count in failures.items():
            new = int(_number(count)) - self._failures.get(code, 0)
            out.data["failed_loads"].extend([str(code)] * max(new, 0))
            self._failures[code] = int(_number(count))
        for key in ("handshakes", "reads"):
            value = int(_number(now.get(key)))
            delta = value - self._counts.get(key, 0)
            self._counts[key] = value
            if delta > 0:
                out.data[key].append(delta)
        return out


# Transfer times from 1 ms to 60 s, bytes from 64 KiB to 16 GiB (a load is one request's KV on
# one worker).
_TIME_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0]
_BYTE_BUCKETS = [float(1 << s) for s in range(16, 35, 2)]


class KvferryPromMetrics(_PromBase):  # type: ignore[misc, valid-type]
    """kvferry's series in vLLM's /metrics, named as vLLM names its own (``vllm:`` prefix,
    seconds, ``_total`` added to counters by prometheus_client), one child per engine:

      vllm:kvferry_xfer_time_seconds        histogram of load transfer times
      vllm:kvferry_bytes_transferred        histogram of bytes per load
      vllm:kvferry_num_failed_transfers     counter of failed loads, by ``code``
      vllm:kvferry_handshakes               counter of handshakes with prefill ranks

    `metric_types` maps prometheus_client's Gauge, Counter and Histogram to the classes vLLM
    wants used (its multiprocess-safe wrappers); `labelnames` and `per_engine_labelvalues` are
    vLLM's (model name, engine index)."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list,
                 per_engine_labelvalues: dict):
        if _PromBase is not object:  # pragma: no cover - with vLLM
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        types = _metric_types(metric_types)
        labelnames = list(labelnames)
        time = types["Histogram"](
            name="vllm:kvferry_xfer_time_seconds",
            documentation="Time kvferry took to load one request's KV on one worker.",
            buckets=_TIME_BUCKETS, labelnames=labelnames)
        size = types["Histogram"](
            name="vllm:kvferry_bytes_transferred",
            documentation="Bytes kvferry read for one request on one worker.",
            buckets=_BYTE_BUCKETS, labelnames=labelnames)
        failed = types["Counter"](
            name="vllm:kvferry_num_failed_transfers",
            documentation="kvferry loads that failed, by status code.",
            labelnames=labelnames + ["code"])
        handshakes = types["Counter"](
            name="vllm:kvferry_handshakes",
            documentation="kvferry handshakes with prefill ranks.", labelnames=labelnames)
        self._per_engine = {
            engine: (time.labels(*values), size.labels(*values), failed, list(values),
                     handshakes.labels(*values))
            for engine, values in dict(per_engine_labelvalues).items()}

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
        """Records one interval's aggregated figures (KvferryConnectorStats.data) of engine
        `engine_idx`; unknown engines and malformed figures are ignored, never raised."""
        series = self._per_engine.get(engine_idx)
        if series is None or not isinstance(transfer_stats_data, dict):
            return
        time, size, failed, values, handshakes = series
        for d in _list(transfer_stats_data.get("transfer_duration")):
            time.observe(_number(d))
        for b in _list(transfer_stats_data.get("bytes_transferred")):
            size.observe(_number(b))
        for code in _list(transfer_stats_data.get("failed_loads")):
            failed.labels(*values, str(code)).inc()
        count = sum(_number(h) for h in _list(transfer_stats_data.get("handshakes")))
        if count > 0:
            handshakes.inc(count)


def _metric_types(metric_types: Any) -> dict[str, Any]:
    """vLLM's metric_types ({prometheus_client.Gauge: cls, ...}) by class name; prometheus_client
    itself where vLLM gives none."""
    out: dict[str, Any] = {}
    for base, cls in dict(metric_types or {}).items():
        out[getattr(base, "__name__", str(base))] = cls
    if not {"Histogram", "Counter"} <= out.keys():
        import prometheus_client

        out.setdefault("Histogram", prometheus_client.Histogram)
        out.setdefault("Counter", prometheus_client.Counter)
    return out
