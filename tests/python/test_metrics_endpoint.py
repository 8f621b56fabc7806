"""kvferry serve --metrics-port, read by Prometheus's own text parser (python3-prometheus-client):
every family parses with its declared type, histograms are cumulative and end in +Inf with
_count equal to it (issue 16, item 4)."""
import os
import subprocess
import urllib.request

import pytest

from common import free_port

prometheus_parser = pytest.importorskip(
    "prometheus_client.parser", reason="python3-prometheus-client is not installed (make deps)")

CLI = os.environ.get("KVFERRY_CLI", "")


@pytest.fixture
def serve():
    if not CLI:
        pytest.skip("KVFERRY_CLI (the kvferry binary) is not set; ctest sets it")
    p = subprocess.Popen([CLI, "serve", "--role", "decode", "--base-port", str(free_port()),
                          "--control-port", "0", "--metrics-port", "0", "--num-blocks", "64",
                          "--layers", "2", "--tp", "2", "--exit-on-stdin-eof"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, KVFERRY_SECRET=""))
    try:
        assert p.stdout.readline().startswith("READY ")
        line = p.stdout.readline().strip()
        assert line.startswith("METRICS http://127.0.0.1:"), line
        yield line.split(" ", 1)[1]
    finally:
        p.stdin.close()
        p.wait(timeout=30)


def test_prometheus_parser_reads_every_family(serve):
    with urllib.request.urlopen(serve, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    families = {f.name: f for f in prometheus_parser.text_string_to_metric_families(text)}
    # The parser strips _total from counter names.
    assert families["kvferry_loads"].type == "counter"
    assert families["kvferry_holds_outstanding"].type == "gauge"
    assert families["kvferry_requests_in_flight"].type == "gauge"
    assert families["kvferry_transfer_latency_seconds_quantiles"].type == "summary"
    hist = families["kvferry_transfer_latency_seconds"]
    assert hist.type == "histogram"
    ranks = {s.labels["tp_rank"] for s in hist.samples}
    assert ranks == {"0", "1"}
    for rank in ranks:
        samples = [s for s in hist.samples if s.labels["tp_rank"] == rank]
        buckets = [s for s in samples if s.name.endswith("_bucket")]
        assert buckets[-1].labels["le"] == "+Inf"
        bounds = [float(b.labels["le"]) for b in buckets]
        assert bounds == sorted(bounds)
        counts = [b.value for b in buckets]
        assert counts == sorted(counts)
        count = [s for s in samples if s.name.endswith("_count")]
        assert count[0].value == counts[-1]
    for f in families.values():
        assert f.documentation, f.name
