"""The Python module: errors, the scheduler, a transfer between two Python processes, failure
reporting, and the vLLM adapter driven as vLLM drives it."""
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

import kvferry
import kvferry.vllm
from common import BLOCKS, DIM, HEADS, LAYERS, TOKENS, expected_block, free_port

HERE = os.path.dirname(os.path.abspath(__file__))


def test_errors_map_to_exception_classes():
    with pytest.raises(kvferry.InvalidArgumentError, match="no layers"):
        kvferry.CacheSpec.mha(0, 8, 64, 16, 16)
    with pytest.raises(kvferry.NotFoundError):
        kvferry.RankTable.load("/nonexistent/ranktable.json")
    assert issubclass(kvferry.UnauthenticatedError, kvferry.Error)
    assert issubclass(kvferry.Error, RuntimeError)


def test_transport_backends_and_options_come_from_the_registry():
    # Issue 13: backends are listed by the transport's registry, and their options are a map of
    # "<backend>.<option>" strings checked by the backend, with errors that name the key.
    assert kvferry.transport_backends() == ["shm", "tcp", "ucx"]
    worker = kvferry.Worker("kv_consumer", "py-opts", base_port=free_port(),
                            transport_options={"tcp.connections": "2", "shm.threads": "1"})
    assert worker.stats()["bytes_read"] == 0
    with pytest.raises(kvferry.InvalidArgumentError, match="tcp.connections"):
        kvferry.Worker("kv_consumer", "py-opts", base_port=free_port(),
                       transport_options={"tcp.connections": "0"})
    with pytest.raises(kvferry.InvalidArgumentError, match="unknown transport option tcp.nope"):
        kvferry.Worker("kv_consumer", "py-opts", base_port=free_port(),
                       transport_options={"tcp.nope": "1"})
    with pytest.raises(kvferry.InvalidArgumentError, match="unknown transport 'rdma'"):
        kvferry.Worker("kv_consumer", "py-opts", base_port=free_port(), transport="rdma")


def test_cache_spec_and_hash():
    a = kvferry.CacheSpec.mha(2, 8, 64, 16, 16, "bf16", tp_size=2, tp_rank=1)
    b = kvferry.CacheSpec.mha(2, 8, 64, 99, 16, "bf16")
    assert a.block_bytes(0) == 16 * 4 * 64 * 2
    assert a.hash == b.hash
    assert kvferry.CacheSpec.mla(2, 512, 64, 16, 16).kind == "mla"


def test_interleaved_parts_register_only_in_the_documented_scheme():
    # docs/transport.md, "Region ids": interleaved parts need one stride, at least K block + V
    # block (a page may end in padding, as vLLM's Mamba pages), and V one block after K;
    # anything else is refused at registration, before any peer sees it.
    parts = [("k", 2, 8), ("v", 2, 8)]
    block = TOKENS * 2 * 8 * 2  # fp16
    buf = np.zeros(BLOCKS * 3 * block, dtype=np.uint8)
    base = buf.ctypes.data
    good = kvferry.CacheSpec.create("mha", 1, parts, BLOCKS, TOKENS, "fp16",
                                    block_strides=[2 * block, 2 * block])
    assert good.block_stride(1) == 2 * block
    assert good.canonical_text == kvferry.CacheSpec.create(
        "mha", 1, parts, BLOCKS, TOKENS, "fp16").canonical_text  # strides not in the hash
    kvferry.Worker("kv_consumer", "w-ok", base_port=free_port()).register_kv_caches(
        good, [[base, base + block]])
    padded = kvferry.CacheSpec.create("mha", 1, parts, BLOCKS, TOKENS, "fp16",
                                      block_strides=[3 * block, 3 * block])
    kvferry.Worker("kv_consumer", "w-pad", base_port=free_port()).register_kv_caches(
        padded, [[base, base + block]])
    uneven = kvferry.CacheSpec.create("mha", 1, parts, BLOCKS, TOKENS, "fp16",
                                      block_strides=[3 * block, 2 * block])
    with pytest.raises(kvferry.NotSupportedError, match="stride"):
        kvferry.Worker("kv_consumer", "w-gap", base_port=free_port()).register_kv_caches(
            uneven, [[base, base + block]])
    with pytest.raises(kvferry.NotSupportedError, match="layer 0 part 1 starts"):
        kvferry.Worker("kv_consumer", "w-far", base_port=free_port()).register_kv_caches(
            good, [[base + block, base]])


def test_scheduler_rules_and_incomplete_params():
    s = kvferry.Scheduler("decode", "d-0")
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "p",
              "remote_host": "127.0.0.1", "remote_port": 5557, "remote_tp_size": 1}
    assert s.get_num_new_matched_tokens(params, 32, 0) == (32, True)
    s.update_state_after_alloc("r", params, [7, 8])
    assert params["do_remote_prefill"] is False
    assert s.build_connector_meta()
    bad = {"do_remote_prefill": True}
    with pytest.raises(kvferry.InvalidArgumentError, match="remote_block_ids"):
        s.update_state_after_alloc("r2", bad, [1])
    assert bad["do_remote_prefill"] is False


def make_cache():
    caches = [[np.zeros((BLOCKS, TOKENS, HEADS, DIM), dtype=np.int32) for _ in range(2)]
              for _ in range(LAYERS)]
    return caches, [[c.ctypes.data for c in layer] for layer in caches]


def wait_received(worker, request_id, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        _, receiving = worker.get_finished()
        if request_id in receiving:
            return True
        time.sleep(0.01)
    return False


def test_transfer_between_two_processes_and_failure_reporting():
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    peer = subprocess.Popen([sys.executable, os.path.join(HERE, "prefill_peer.py"), str(port)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        params1 = json.loads(peer.stdout.readline())
        params2 = json.loads(peer.stdout.readline())
        caches, bases = make_cache()
        spec = kvferry.CacheSpec.mha(LAYERS, HEADS, DIM, BLOCKS, TOKENS, "int32")
        worker = kvferry.Worker("kv_consumer", "py-decode", base_port=free_port(),
                                transfer_timeout_ms=3000)
        worker.register_kv_caches(spec, bases)
        scheduler = kvferry.Scheduler("decode", "py-decode")

        local = [0, 1, 2, 6]
        assert scheduler.get_num_new_matched_tokens(params1, 4 * TOKENS, 0) == (4 * TOKENS, True)
        scheduler.update_state_after_alloc("d-1", params1, local)
        worker.start_load_kv(scheduler.build_connector_meta())
        assert wait_received(worker, "d-1")
        assert worker.take_load_errors() == []
        for l in range(LAYERS):
            for p in range(2):
                for i, remote in enumerate(params1["remote_block_ids"]):
                    np.testing.assert_array_equal(caches[l][p][local[i]], expected_block(l, p, remote))
        assert peer.stdout.readline().strip() == "freed req-1"
        assert worker.stats()["bytes_read"] == LAYERS * 2 * 4 * TOKENS * HEADS * DIM * 4
        # The metrics snapshot (issue 16): the same load, with its latency distribution.
        m = worker.metrics()
        assert (m["engine_id"], m["role"], m["tp_rank"]) == ("py-decode", "decode", 0)
        assert m["loads_done"] == 1 and m["handshakes"] == 1
        assert m["bytes_read"] == worker.stats()["bytes_read"]
        t = m["transfer_latency"]
        assert t["count"] == 1 and t["buckets"][-1] == (None, 1)
        assert t["min_us"] <= t["p50_us"] <= t["p99_us"] <= t["max_us"]
        assert m["transport"]["bytes_read"] >= m["bytes_read"]
        assert m["transport"]["staging_bytes"] == 0  # host memory: nothing staged
        assert m["transport"]["registered_bytes"] == {"host": LAYERS * 2 * BLOCKS * TOKENS * HEADS * DIM * 4}
        # Per-transfer records: this load once, with the bytes it read.
        [rec] = worker.take_load_transfers()
        assert rec["request_id"] == "d-1" and rec["bytes"] == worker.stats()["bytes_read"]
        assert rec["duration_us"] > 0
        assert worker.take_load_transfers() == []
        text = worker.metrics_text()
        assert "# TYPE kvferry_transfer_latency_seconds histogram" in text
        assert 'kvferry_loads_total{engine_id="py-decode",role="decode",dp_rank="0",tp_rank="0",' \
            'outcome="done"} 1' in text

        # The prefill process dies: the next load fails, reported with its block ids.
        peer.kill()
        peer.wait()
        scheduler.update_state_after_alloc("d-2", params2, [20, 21])
        worker.start_load_kv(scheduler.build_connector_meta())
        assert wait_received(worker, "d-2")
        errors = worker.take_load_errors()
        assert len(errors) == 1
        assert errors[0]["request_id"] == "d-2"
        assert errors[0]["block_ids"] == [20, 21]
        assert errors[0]["code"] in ("PeerDisconnected", "Unavailable", "Timeout")
        assert errors[0]["recompute"] is True

        # A load the engine aborts stops, is still reported once, and asks for no recompute.
        assert worker.abort_load("no-such-request") is False
        scheduler.update_state_after_alloc("d-3", dict(params2, do_remote_prefill=True), [22, 23])
        worker.start_load_kv(scheduler.build_connector_meta())
        assert worker.abort_load("d-3", "client went away") is True
        assert wait_received(worker, "d-3")
        errors = worker.take_load_errors()
        assert [e["code"] for e in errors] == ["Cancelled"]
        assert "client went away" in errors[0]["message"]
        assert errors[0]["recompute"] is False
    finally:
        if peer.poll() is None:
            peer.stdin.close()
            peer.wait(timeout=10)


def test_vllm_adapter_moves_a_request_as_vllm_drives_it():
    prefill_port, decode_port = free_port(), free_port()

    def config(role, port):
        return SimpleNamespace(
            kv_transfer_config=SimpleNamespace(
                kv_role=role, engine_id=f"{role}-0",
                kv_connector_extra_config={"base_port": port, "block_size": TOKENS}),
            parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank_local=0),
            cache_config=SimpleNamespace(block_size=TOKENS))

    p_sched = kvferry.vllm.KvferryConnector(config("kv_producer", prefill_port), "SCHEDULER")
    p_work = kvferry.vllm.KvferryConnector(config("kv_producer", prefill_port), "WORKER")
    d_sched = kvferry.vllm.KvferryConnector(config("kv_consumer", decode_port), "SCHEDULER")
    d_work = kvferry.vllm.KvferryConnector(config("kv_consumer", decode_port), "WORKER")

    p_caches, _ = make_cache()
    for l in range(LAYERS):
        for p in range(2):
            for b in range(BLOCKS):
                p_caches[l][p][b] = expected_block(l, p, b)
    d_caches, _ = make_cache()
    p_work.register_kv_caches({f"layer.{l}": tuple(p_caches[l]) for l in range(LAYERS)})
    d_work.register_kv_caches({f"layer.{l}": tuple(d_caches[l]) for l in range(LAYERS)})

    # Prefill: the request stops on its length cap; the connector holds its blocks.
    req = SimpleNamespace(request_id="r-1", kv_transfer_params={"do_remote_decode": True},
                          num_prompt_tokens=3 * TOKENS,
                          status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))
    delay, params = p_sched.request_finished(req, [12, 13, 14])
    assert delay and params["remote_port"] == prefill_port
    p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
    p_work.start_load_kv(None)

    # Decode: the proxy forwards params; the scheduler and worker load them.
    dreq = SimpleNamespace(request_id="r-1d", kv_transfer_params=params,
                           num_prompt_tokens=3 * TOKENS, status=None)
    assert d_sched.get_num_new_matched_tokens(dreq, 0) == (3 * TOKENS, True)
    d_sched.update_state_after_alloc(dreq, [5, 6, 7], 3 * TOKENS)
    d_work.bind_connector_metadata(d_sched.build_connector_meta(None))
    d_work.start_load_kv(None)
    deadline = time.time() + 10
    received = set()
    while "r-1d" not in received and time.time() < deadline:
        _, r = d_work.get_finished(set())
        received |= r or set()
        time.sleep(0.01)
    assert "r-1d" in received
    assert d_work.get_block_ids_with_load_errors() == set()
    for l in range(LAYERS):
        for p in range(2):
            for local, remote in zip([5, 6, 7], [12, 13, 14]):
                np.testing.assert_array_equal(d_caches[l][p][local], expected_block(l, p, remote))
    sending = set()
    while "r-1" not in sending and time.time() < deadline:
        s, _ = p_work.get_finished({"r-1"})  # vLLM has finished r-1
        sending |= s or set()
        time.sleep(0.01)
    assert "r-1" in sending
    for c in (p_work, d_work):
        c.shutdown()


def test_setup_py_names_the_interpreter_and_packages_it_lacks():
    """A python3 that does not see Debian's packages (pyenv first on PATH; here Debian's own
    with site disabled) gets a message naming the interpreter, the missing packages and the one
    to use, instead of pip's bare "invalid command 'bdist_wheel'" (issue 28 item 12)."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(["/usr/bin/python3", "-S", os.path.join(root, "setup.py"), "--version"],
                         capture_output=True, text=True, timeout=60, cwd=root)
    assert out.returncode != 0
    assert "has no setuptools and no wheel package" in out.stderr, out.stderr
    assert "/usr/bin/python3 -m venv --system-site-packages" in out.stderr


def test_host_memory_is_a_zeroed_writable_buffer_that_a_tensor_keeps_alive():
    import gc

    mem = kvferry.HostMemory(10_000)
    assert len(mem) == 10_000 and mem.address % 4096 == 0
    view = memoryview(mem)
    assert (view.readonly, view.format, view.nbytes) == (False, "B", 10_000)
    assert bytes(view[:16]) == bytes(16)
    view[3] = 7
    assert bytes(memoryview(mem)[:4]) == b"\x00\x00\x00\x07"
    view.release()
    with open("/proc/self/maps") as maps:  # a memfd a same-host shm reader can map (issue 30)
        assert any("/memfd:kvferry-served" in line and
                   int(line.split("-")[0], 16) == mem.address for line in maps)
    with pytest.raises(kvferry.InvalidArgumentError):
        kvferry.HostMemory(0)
    torch = pytest.importorskip("torch", reason="Debian's python3-torch (make deps) is absent")
    t = torch.frombuffer(kvferry.HostMemory(4096), dtype=torch.uint8)  # the only reference
    gc.collect()
    t.fill_(9)  # the memory lives as long as the tensor
    assert int(t.sum()) == 9 * 4096
