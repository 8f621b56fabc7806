"""kvferry serve --metrics-port, read by Prometheus's own text parser (python3-prometheus-client):
every family parses with its declared type, histograms are cumulative and end in +Inf with
_count equal to it (issue 16, item 4)."""
import json
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
    p = subprocess.Popen([CLI, "serve", "--role", "decode", "--base-port", str(free_port(2)),
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


def _start_serve(role, secret):
    p = subprocess.Popen([CLI, "serve", "--role", role, "--base-port", str(free_port(2)),
                          "--control-port", "0", "--metrics-port", "0", "--num-blocks", "256",
                          "--layers", "2", "--tp", "2", "--exit-on-stdin-eof"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, KVFERRY_SECRET=secret))
    ready = p.stdout.readline().strip()
    assert ready.startswith("READY "), ready
    metrics = p.stdout.readline().strip()
    assert metrics.startswith("METRICS "), metrics
    return p, ready.split(" ", 1)[1], metrics.split(" ", 1)[1]


def _scrape(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            samples[key] = s.value
    return samples


def _sum(samples, name, **labels):
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


def test_counters_scraped_during_a_demo_match_its_report():
    """Issue 16: a prefill and a decode instance with /metrics, driven by kvferry demo as the
    proxy; scraped mid-run (every sample parses) and after it, the decode side's loads and bytes
    equal what the demo reports, and the prefill side's holds all ended."""
    if not CLI:
        pytest.skip("KVFERRY_CLI (the kvferry binary) is not set; ctest sets it")
    secret = "metrics-demo-secret"
    prefill, prefill_control, prefill_metrics = _start_serve("prefill", secret)
    decode, decode_control, decode_metrics = _start_serve("decode", secret)
    try:
        demo = subprocess.Popen([CLI, "demo", "--prefill-control", prefill_control,
                                 "--decode-control", decode_control, "--requests", "40",
                                 "--max-prompt", "600", "--layers", "2", "--num-blocks", "256",
                                 "--no-progress", "--json"],
                                stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, KVFERRY_SECRET=secret))
        during = _scrape(decode_metrics)  # while the demo runs: the format holds mid-run too
        assert _sum(during, "kvferry_loads_total") >= 0
        out, _ = demo.communicate(timeout=120)
        assert demo.returncode == 0, out
        report = json.loads(out)
        assert report["done"] == 40 and report["failed"] == 0 and not report["leaked"], report
        after = _scrape(decode_metrics)
        assert _sum(after, "kvferry_loads_total", outcome="done") == report["done"] * 2  # TP 2
        assert _sum(after, "kvferry_loads_total", outcome="failed") == 0
        assert _sum(after, "kvferry_bytes_read_total") == report["bytes_moved"]
        p_after = _scrape(prefill_metrics)
        assert _sum(p_after, "kvferry_holds_outstanding") == 0
        ended = _sum(p_after, "kvferry_holds_ended_total")
        assert ended == report["done"] * 2, ended  # each rank's hold of each request ended once
    finally:
        for p in (prefill, decode):
            p.stdin.close()
            p.wait(timeout=30)
