"""The proxy's Prometheus metrics (GET /metrics, text format 0.0.4), in a registry of its own.

- kvferry_proxy_requests_total (counter): endpoint (completions, chat_completions), path
  (whole, layerwise)
- kvferry_proxy_requests_finished_total (counter): outcome (ok, client_abort, error)
- kvferry_proxy_legs_total (counter): role (prefill, decode, release), instance
- kvferry_proxy_leg_failures_total (counter): role, instance, reason (connect, timeout,
  disconnected, status, bad_answer)
- kvferry_proxy_retries_total (counter): role
- kvferry_proxy_ttft_seconds (histogram): prefill, decode (instance names)
- kvferry_proxy_outstanding_legs (gauge): role, instance
- kvferry_proxy_instance_up (gauge): role, instance (1 when up and serving, not draining)
- kvferry_proxy_instances (gauge): role, state (serving, draining): the pools' members now

The gauges are read from the pools at each scrape, so instances added or removed at run time
(the admin API, etcd discovery) appear and go.

TTFT is from the proxy receiving the request to the first byte of the decode instance's answer
(for a non-streaming request, the whole answer). A layer-wise request's prefill label is the
instance it read from; release legs are decode legs sent for a client that left after its prefill
answered, so the prefill's hold is read and freed (forward.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .pool import SERVING, STATES, Pool

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ProxyMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, pools: list[Pool]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvferry_proxy_requests", "Client requests received",
                                ["endpoint", "path"], registry=r)
        self.finished = Counter("kvferry_proxy_requests_finished", "Client requests ended",
                                ["outcome"], registry=r)
        self.legs = Counter("kvferry_proxy_legs", "Requests sent to instances",
                            ["role", "instance"], registry=r)
        self.leg_failures = Counter("kvferry_proxy_leg_failures",
                                    "Requests to instances that failed", ["role", "instance",
                                                                          "reason"], registry=r)
        self.retries = Counter("kvferry_proxy_retries",
                               "Legs sent again to another instance", ["role"], registry=r)
        self.ttft = Histogram("kvferry_proxy_ttft_seconds",
                              "Request received to the decode answer's first byte",
                              ["prefill", "decode"], buckets=TTFT_BUCKETS, registry=r)
        self._pools = pools
        r.register(_PoolCollector(pools))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector:
    """The pools' gauges, read at each scrape."""

    def __init__(self, pools: list[Pool]):
        self._pools = pools

    def describe(self):  # no samples at registration: the pools change
        return []

    def collect(self):
        outstanding = GaugeMetricFamily("kvferry_proxy_outstanding_legs", "Legs in flight",
                                        labels=["role", "instance"])
        up = GaugeMetricFamily("kvferry_proxy_instance_up",
                               "1 when the instance takes requests (up and not draining)",
                               labels=["role", "instance"])
        members = GaugeMetricFamily("kvferry_proxy_instances", "Instances in the pools",
                                    labels=["role", "state"])
        for pool in self._pools:
            for inst in pool.instances:
                outstanding.add_metric([pool.role, inst.name], inst.outstanding)
                up.add_metric([pool.role, inst.name],
                              1 if inst.up and inst.state == SERVING else 0)
            for state in STATES:
                members.add_metric([pool.role, state],
                                   sum(1 for i in pool.instances if i.state == state))
        yield outstanding
        yield up
        yield members
