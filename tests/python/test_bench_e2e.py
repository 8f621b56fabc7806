"""Reports that show kvferry, not the demo engine (issue 16, item 6): the demo's report leads with
the connector's per-request figures, whose bytes add up to what the decode instance read, and
`bench e2e --chart` plots per-request transfer time and rate against prompt length."""
import json
import os
import subprocess

import pytest

CLI = os.environ.get("KVFERRY_CLI", "")
SMALL = ["--layers", "2", "--num-blocks", "512", "--no-progress"]


def _cli():
    if not CLI:
        pytest.skip("KVFERRY_CLI (the kvferry binary) is not set; ctest sets it")
    return CLI


def test_the_demo_report_leads_with_the_connector_and_its_bytes_add_up():
    cli = _cli()
    out = subprocess.run([cli, "demo", "--requests", "30", "--max-prompt", "600", "--json"] + SMALL,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    conn = report["connector"]
    assert report["done"] == 30
    # Every request read something (no prefix cache before the first requests end is not
    # guaranteed, so: at least one load, each with bytes and a time).
    assert 0 < conn["loads"] <= 30
    assert conn["bytes"] == report["bytes_moved"], "per-request bytes must add up to the " \
        "decode instance's bytes_read"
    assert 0 < conn["transfer_ms_p50"] <= conn["transfer_ms_p99"] <= conn["transfer_ms_max"]
    assert 0 < conn["request_gbps_p10"] <= conn["request_gbps_p50"]

    text = subprocess.run([cli, "demo", "--requests", "10", "--max-prompt", "300"] + SMALL,
                          capture_output=True, text=True, timeout=240)
    assert text.returncode == 0, text.stderr[-2000:]
    lines = [ln for ln in text.stdout.splitlines() if not ln.startswith("kvferry demo:")]
    assert lines[0].startswith("kvferry "), lines[:3]
    assert "per request: transfer p50" in lines[0]
    assert any(ln.startswith("demo engine   its own costs") for ln in lines), lines


def test_bench_e2e_charts_the_per_request_figures_without_the_warmup(tmp_path):
    cli = _cli()
    chart = tmp_path / "e2e.png"
    out = subprocess.run([cli, "bench", "e2e", "--prompts", "64,256", "--requests", "6",
                          "--warmup", "2", "--chart", str(chart), "--json"] + SMALL[:-1],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert [p["prompt_tokens"] for p in report["points"]] == [64, 256]
    for p in report["points"]:
        conn = p["connector"]
        assert p["requests"] == 6 and p["warmup"] == 2
        # Only the measured requests: six loads of equal prompts, so equal bytes each; the
        # warm-up's bytes are in the run-wide bytes_moved only.
        assert conn["loads"] == 6, conn
        assert conn["bytes"] == 6 * conn["request_bytes_p50"]
        assert conn["bytes"] < p["bytes_moved"]
        assert 0 < conn["transfer_ms_p50"] <= conn["transfer_ms_p99"]
        assert conn["request_gbps_p50"] > 0
    assert report["points"][1]["connector"]["request_bytes_p50"] > \
        report["points"][0]["connector"]["request_bytes_p50"]
    assert any(b["backend"] == "shm" for b in report["transport_baselines"]["results"])
    with open(chart, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "e2e.png.dat").exists() and not (tmp_path / "e2e.png.gp").exists()


def test_bench_e2e_sweeps_concurrency_with_each_requests_own_exposed_transfer(tmp_path):
    """Issue 30, item 2: figures that hold under load. `--concurrency` takes a list and sweeps it;
    per point each request's exposed transfer runs from the end of its own prefill compute to
    its decode's first step (the instances report both on the host's steady clock), the prefill's
    queue is reported apart, and the decode instance's peak threads and memory come with it. At
    concurrency 8 the requests queue at the prefill: TTFT less compute and first step (the old
    figure) counts that queue, the request's own exposed transfer does not."""
    cli = _cli()
    out = subprocess.run([cli, "bench", "e2e", "--layerwise", "both", "--concurrency", "1,8",
                          "--prompts", "128", "--requests", "8", "--warmup", "1",
                          "--compute-us-per-token", "200", "--json",
                          "--chart", str(tmp_path / "sweep.png")] + SMALL[:-1],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # The sweep's chart (exposed transfer and decode threads against concurrency).
    with open(tmp_path / "sweep.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["sweep.png"]
    points = json.loads(out.stdout)["points"]
    assert [(p["concurrency"], p["mode"]) for p in points] == [
        (1, "whole"), (1, "layerwise"), (8, "whole"), (8, "layerwise")]
    for p in points:
        assert p["failed"] == 0 and p["requests"] == 8
        assert 0 < p["decode_threads_peak"] < 200, p["decode_threads_peak"]
        assert p["decode_rss_peak_bytes"] > 0
        assert 0 <= p["prefill_queue_p50_ms"] <= p["prefill_queue_p99_ms"]
        assert p["exposed_p50_ms"] <= p["exposed_p99_ms"]
        # Of it, the part until the decode engine saw the load finished: never after the
        # first step began (the step that verifies it starts at or after that moment).
        assert p["exposed_to_loaded_p50_ms"] <= p["exposed_p50_ms"], p
        assert p["exposed_to_loaded_p99_ms"] <= p["exposed_p99_ms"], p
        assert p["exposed_to_loaded_p50_ms"] != 0, p  # reported (0 where it was missing)
    busy = [p for p in points if p["concurrency"] == 8]
    # 8 requests of 25.6 ms of compute each, one prefill at a time: the later ones wait.
    assert all(p["prefill_queue_p99_ms"] > 20 for p in busy), busy
    assert all(p["exposed_p50_ms"] < p["exposed_ttft_p50_ms"] for p in busy), busy


def test_bench_transport_reports_cpu_per_gb_on_each_side_and_ucx_at_kvferrys_segments():
    """Issue 30, items 3 and 5: `bench transport` reports the CPU seconds (user + system) per GB
    moved by the reader (this process, every thread) and by the serving peer process, and its
    baseline's where the baseline runs in this process; the ucx baseline runs ucx_perftest with
    the TCP segment sizes kvferry's UCX context uses (like for like), the UCX-defaults figure
    beside it."""
    cli = _cli()
    out = subprocess.run([cli, "bench", "transport", "--backends", "shm,tcp,ucx", "--sizes",
                          "65536", "--pool-mib", "16", "--rounds", "1", "--min-seconds", "0.2",
                          "--json"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, UCX_TLS="tcp"))
    assert out.returncode == 0, out.stderr[-2000:]
    results = {r["backend"]: r for r in json.loads(out.stdout)["results"]}
    assert set(results) == {"shm", "tcp", "ucx"}, results
    for name, r in results.items():
        assert r["gbps"] > 0, r
        assert 0 < r["reader_cpu_s_per_gb"] < 100, r
        assert 0 <= r["server_cpu_s_per_gb"] < 100, r
    # The tcp peer sends every byte itself; shm's peer only serves the mapping.
    assert results["tcp"]["server_cpu_s_per_gb"] > 0
    assert results["shm"]["baseline"] == "memcpy_gather" and results["shm"]["baseline_cpu_s_per_gb"] > 0
    assert results["tcp"]["baseline"] == "tcp_stream" and results["tcp"]["baseline_cpu_s_per_gb"] > 0
    if results["ucx"]["baseline"] == "ucx_perftest_get":  # Debian's ucx-utils (make deps)
        assert results["ucx"]["baseline_gbps"] > 0 and results["ucx"]["baseline_default_gbps"] > 0
