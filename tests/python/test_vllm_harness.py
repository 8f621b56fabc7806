"""kvferry.vllm inside a vLLM-shaped deployment (issue 12's harness, tests/python/vllm_harness.py):
one process per TP rank, vLLM's scheduler order and asserts, backend tensors in their real shapes
and strides, the toy proxy's kv_transfer_params hop. Every byte a decode rank holds is checked."""
import os

import pytest

import kvferry
from common import free_port
from vllm_harness import (Instance, RequestStatus, check_every_byte, decode_request,
                          proxy_hop, run_until, seed_environment, start_ranks)

pytest.importorskip("torch", reason="Debian's python3-torch (make deps) is absent")

PROMPT = 14  # three full blocks of 4 tokens and a partial one


@pytest.fixture(scope="module")
def ranks():
    procs = start_ranks(4)  # two prefill and two decode ranks at most; reused by every case
    yield procs
    for p in procs:
        p.close()


def geometry(backend, dtype="float16", heads=4, **kw):
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4, "uint8": 1}[dtype]
    g = dict(layers=2, num_blocks=16, block_size=4, heads=heads, head_dim=8, dtype=dtype,
             itemsize=itemsize, seed=7, backend=backend)
    if backend in ("mla", "ascend_mla"):
        g.update(lora=24, width=32)
    if backend == "ascend_sfa":  # nope 24, rope 8, DeepSeek sparse attention's indexer keys 128
        g.update(lora=24, indexer=128, width=24 + 8 + 128)
    g.update(kw)
    return g


def pair(ranks, g, p_tp, d_tp, d_g=None):
    pport, dport = free_port(p_tp), free_port(d_tp)
    prefill = Instance(g, "kv_producer", pport, ranks[:p_tp])
    decode = Instance(d_g or g, "kv_consumer", dport, ranks[p_tp:p_tp + d_tp])
    return prefill, decode


def disaggregated(prefill, decode, rid="req-1"):
    """One request through prefill, the proxy and decode; returns (remote, local) block pairs."""
    params = proxy_hop(prefill, rid, PROMPT)
    assert params["do_remote_prefill"] is True and len(params["remote_block_ids"]) == 4
    req = decode_request(rid, PROMPT, params)
    decode.add_request(req)
    decode.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    local = list(decode.blocks[rid])
    run_until([prefill, decode], lambda: req.status == RequestStatus.RUNNING,
              f"{rid} to run on the decode side")
    assert decode.promoted[rid] == PROMPT - 1  # vLLM recomputes the last prompt token
    # Every prefill rank reported the send: the hold ended and vLLM freed the blocks.
    run_until([prefill, decode], lambda: rid not in prefill.requests, "the prefill release")
    return list(zip(params["remote_block_ids"], local))


CASES = [  # (id, backend, dtype, prefill TP, decode TP, heads, transport)
    ("mha_tp2to2_nhd_tcp", "flash_attn_nhd", "float16", 2, 2, 4, "tcp"),
    ("mha_tp2to2_hnd_kv_first", "flash_attn_old_hnd", "bfloat16", 2, 2, 4, "auto"),
    ("mha_tp2to1_hnd_flashinfer", "flashinfer_hnd", "float16", 2, 1, 4, "auto"),
    ("mha_tp1to2_hnd_flash", "flash_attn_hnd", "float32", 1, 2, 4, "auto"),
    ("mha_tp1to2_cpu_backend", "cpu", "float32", 1, 2, 4, "tcp"),
    ("mha_fp8_tp2to2_nhd_kv_first", "flash_attn_old_nhd", "uint8", 2, 2, 4, "auto"),
    ("mha_replicated_heads_tp2to1", "flash_attn_nhd", "float16", 2, 1, 1, "auto"),
    ("mla_tp2to1", "mla", "bfloat16", 2, 1, 1, "auto"),
    ("mla_tp1to2", "mla", "float16", 1, 2, 1, "tcp"),
]


@pytest.mark.parametrize("backend, dtype, p_tp, d_tp, heads, transport",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_disaggregated_request_moves_every_byte(ranks, backend, dtype, p_tp, d_tp, heads,
                                                transport):
    g = geometry(backend, dtype, heads, transport=transport)
    prefill, decode = pair(ranks, g, p_tp, d_tp)
    pairs = disaggregated(prefill, decode)
    check_every_byte(g, decode, pairs)
    assert decode.load_errors == []


def test_strided_prefill_against_packed_decode(ranks):
    # (num_blocks, 2, ...) on the prefill side, (2, num_blocks, ...) on the decode side: strides
    # are memory layout, not model geometry, so the two sides exchange blocks.
    g = geometry("flash_attn_hnd")
    prefill, decode = pair(ranks, g, 2, 2, d_g=dict(g, backend="flash_attn_old_hnd"))
    pairs = disaggregated(prefill, decode)
    check_every_byte(dict(g, backend="flash_attn_old_hnd"), decode, pairs)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_unequal_tp_with_nhd_moves_strided_head_slices(ranks, p_tp, d_tp):
    # NHD (token-major) caches, as vllm-ascend always has them, with unequal TP sizes: each
    # decode rank's heads move as one piece per token slot (issue 22 item 6). Before, every such
    # load failed NotSupported and was recomputed.
    g = geometry("flash_attn_nhd")
    prefill, decode = pair(ranks, g, p_tp, d_tp)
    pairs = disaggregated(prefill, decode)
    check_every_byte(g, decode, pairs)
    assert decode.load_errors == []


# Pipeline parallelism (issue 28 item 1), as vLLM runs it: every stage a worker process with its
# own layers (vllm/model_executor/models/utils.py make_layers over get_pp_indices), the stage
# from get_pp_group(), KVOutputAggregator expecting parallel_config.world_size (PP x TP) reports
# of every finished request.
@pytest.mark.parametrize("backend", ["flash_attn_nhd", "mla"])
def test_pipeline_parallel_stages_each_read_their_own_layers(ranks, backend):
    g = geometry(backend, layers=4, heads=2 if backend != "mla" else 1)
    prefill = Instance(g, "kv_producer", free_port(2), ranks[:2], pp=2)
    decode = Instance(g, "kv_consumer", free_port(2), ranks[2:4], pp=2)
    pairs = disaggregated(prefill, decode)  # both prefill stages' holds released by readers
    check_every_byte(g, decode, pairs)
    assert decode.load_errors == []


def test_pipeline_stages_on_their_own_hosts_each_read_their_own_stages_host(ranks):
    """PP 2 on both sides with every stage on a host of its own (127.0.0.1 and 127.0.0.2, two
    loopback addresses standing for two nodes), as a multi-node deployment places them. The
    prefill scheduler learns each stage's host from vLLM's handshake metadata
    (vllm/v1/engine/core.py EngineCore.__init__ -> set_xfer_handshake_metadata_pp_aware) and
    names them in kv_transfer_params; the decode stage 1 reads the prefill's stage 1 on its
    host. Before, it dialled stage 1's port on remote_host, where nothing listens, so every load
    of stage 1 failed (and its prefill hold was never read)."""
    g = geometry("flash_attn_nhd", layers=4, heads=2)
    hosts = ["127.0.0.1", "127.0.0.2"]
    prefill = Instance(g, "kv_producer", free_port(2), ranks[:2], pp=2, stage_hosts=hosts)
    decode = Instance(g, "kv_consumer", free_port(2), ranks[2:4], pp=2, stage_hosts=hosts)
    pairs = disaggregated(prefill, decode)
    assert prefill.responses["req-1"]["remote_rank_hosts"] == hosts, prefill.responses
    check_every_byte(g, decode, pairs)
    assert decode.load_errors == []


@pytest.mark.parametrize("p_pp,d_pp", [(2, 1), (1, 2), (1, 3), (3, 1)])
def test_unequal_pipeline_parallel_sizes_read_by_layer_ranges(ranks, p_pp, d_pp):
    """Prefill and decode with different PP sizes (which NixlConnector does not do): each decode
    stage reads each of its layers from the prefill stage holding it (vLLM's get_pp_indices
    splits differ), every byte verified by model-wide layer, and every prefill stage's hold is
    released by its readers: every decode stage tells every prefill stage, so each counts the
    same readers (KVOutputAggregator on the prefill side waits for all PP x TP reports). Before,
    such loads were refused NotSupported and recomputed."""
    g = geometry("flash_attn_nhd", layers=4, heads=2)
    prefill = Instance(g, "kv_producer", free_port(p_pp), ranks[:p_pp], pp=p_pp)
    decode = Instance(g, "kv_consumer", free_port(d_pp), ranks[p_pp:p_pp + d_pp], pp=d_pp)
    pairs = disaggregated(prefill, decode)
    assert prefill.responses["req-1"].get("remote_pp_size", 1) == p_pp
    check_every_byte(g, decode, pairs)
    assert decode.load_errors == []


def test_a_model_of_another_depth_is_refused_whatever_the_stages(ranks):
    """The model's depth is in the compatibility hash where a stage's range is not: a decode
    instance of a 6-layer model never reads a 4-layer model's stages, whose layers 0..3 it would
    otherwise find (refused at the handshake, recomputed, nothing read)."""
    g = geometry("flash_attn_nhd", layers=4, heads=2)
    prefill = Instance(g, "kv_producer", free_port(2), ranks[:2], pp=2)
    decode = Instance(dict(g, layers=6), "kv_consumer", free_port(2), ranks[2:4], pp=2)
    params = proxy_hop(prefill, "depth-1", PROMPT)
    req = decode_request("depth-1", PROMPT, params)
    decode.add_request(req)
    run_until([prefill, decode], lambda: req.status == RequestStatus.RUNNING,
              "the refused load to be recomputed")
    assert {code for _, code, _ in decode.load_errors} == {"NotSupported"}, decode.load_errors
    assert all("layers=4" in m and "layers=6" in m for _, _, m in decode.load_errors)
    check_every_byte(dict(g, layers=6), decode, [])  # not a byte read


HOSTILE = [
    {"do_remote_prefill": True},
    {"do_remote_prefill": True, "remote_block_ids": "1,2", "remote_engine_id": "p",
     "remote_host": "127.0.0.1", "remote_port": 1, "remote_tp_size": 1},
    {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "p",
     "remote_host": "127.0.0.1", "remote_port": 70000, "remote_tp_size": 1},
    {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": None,
     "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1},
    {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "p",
     "remote_host": "127.0.0.1", "remote_port": 1, "remote_tp_size": 0},
    {"do_remote_prefill": "yes please", "remote_block_ids": [[1, 2]]},
    ["not", "a", "dict"],
]


def test_hostile_params_are_prefilled_locally_and_never_raise(ranks):
    g = geometry("flash_attn_nhd", heads=2, num_blocks=32)  # room for every request
    decode = Instance(g, "kv_consumer", free_port(2), ranks[:2])
    reqs = [decode_request(f"h-{i}", PROMPT, p) for i, p in enumerate(HOSTILE)]
    for r in reqs:
        decode.add_request(r)
    decode.step()  # no hook raises; no request waits for remote KV
    assert all(r.status == RequestStatus.RUNNING and r.num_computed_tokens == PROMPT
               for r in reqs)
    run_until([decode], lambda: not decode.requests, "the requests to finish")
    assert decode.load_errors == []


def test_aborted_waiting_request_only_frees_the_prefill_side(ranks):
    g = geometry("flash_attn_nhd")
    prefill, decode = pair(ranks, g, 2, 2)
    params = proxy_hop(prefill, "req-a", PROMPT)
    decode.add_request(decode_request("req-a", PROMPT, params))
    decode.finish_requests("req-a", RequestStatus.FINISHED_ABORTED)  # still WAITING
    assert "req-a" not in decode.requests
    # The decode workers tell the prefill ranks to free; vLLM's asserts in update_from_output
    # fail if a worker reports req-a in finished_recving.
    run_until([prefill, decode], lambda: "req-a" not in prefill.requests, "the prefill release")
    for _ in range(3):
        decode.step()
    check_every_byte(g, decode, [])


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_load_failure_reported_as_invalid_blocks_with_the_policy(ranks, policy):
    g = geometry("flash_attn_nhd", policy=policy)
    prefill, decode = pair(ranks, g, 1, 1)
    params = proxy_hop(prefill, "req-f", PROMPT)
    params["remote_block_ids"] = [1, 2, 3, 999]  # past the prefill cache: the read is refused
    req = decode_request("req-f", PROMPT, params)
    decode.add_request(req)
    if policy == "recompute":
        run_until([prefill, decode], lambda: req.status == RequestStatus.RUNNING, "recompute")
        assert decode.promoted["req-f"] == 0  # recomputed from the first invalid block
    else:
        run_until([prefill, decode], lambda: req.status == RequestStatus.FINISHED_ERROR,
                  "the request to fail")
        run_until([decode], lambda: "req-f" not in decode.requests, "its blocks to be freed")
    assert [(e[0], e[1]) for e in decode.load_errors] == [("req-f", "InvalidArgument")]
    check_every_byte(g, decode, [])


@pytest.mark.parametrize("backend, p_tp, d_tp", [("flash_attn_hnd", 2, 1), ("mla", 1, 2)],
                         ids=["mha_hnd_tp2to1", "mla_tp1to2"])
def test_host_buffer_mode_moves_every_byte_between_device_caches(ranks, backend, p_tp, d_tp):
    # kv_buffer_device "cpu": kvferry moves host mirrors; vLLM's copy ops move the blocks
    # device -> host in the prefill step and host -> device before finished_recving.
    g = geometry(backend, "float16", 4 if backend != "mla" else 1, host_buffer=True)
    prefill, decode = pair(ranks, g, p_tp, d_tp)
    pairs = disaggregated(prefill, decode)
    check_every_byte(g, decode, pairs)  # the decode ranks' device tensors
    assert decode.load_errors == []
    remote = [r for r, _ in pairs]
    local = [l for _, l in pairs]
    for calls in prefill.copies():
        assert calls == [("d2h", remote)]
    for calls in decode.copies():
        assert calls == [("h2d", local)]


# ------------------------------------------------------------- vllm-ascend (issue 22 item 3)

ASCEND_CASES = [  # (id, backend, dtype, prefill TP, decode TP, model KV heads)
    ("mha_tp2to1", "ascend_mha", "bfloat16", 2, 1, 4),
    ("mla_tp2to2", "ascend_mla", "bfloat16", 2, 2, 1),
    ("sparse_mla_tp2to1", "ascend_sfa", "float16", 2, 1, 1),
]


@pytest.mark.parametrize("backend, dtype, p_tp, d_tp, heads", [c[1:] for c in ASCEND_CASES],
                         ids=[c[0] for c in ASCEND_CASES])
def test_vllm_ascend_npu_caches_in_host_buffer_mode_move_every_byte(ranks, backend, dtype, p_tp,
                                                                    d_tp, heads):
    # vllm-ascend's caches as its NPU model runner hands them over: a tuple of parts per layer,
    # torch_npu tensors; kv_buffer_device "cpu" and no copy op (vllm-ascend never calls
    # set_host_xfer_buffer_ops), so torch copies the blocks on the NPU both ways. MHA caches are
    # token-major: TP 2 -> 1 reads each prefill rank's heads as strided pieces.
    g = geometry(backend, dtype, heads, device="npu", host_buffer=True)
    prefill, decode = pair(ranks, g, p_tp, d_tp)
    pairs = disaggregated(prefill, decode)
    check_every_byte(g, decode, pairs)  # the decode ranks' NPU tensors
    assert decode.load_errors == []
    assert prefill.copies() == [[]] * p_tp and decode.copies() == [[]] * d_tp  # torch copied


def fake_acl_library() -> str:
    """The fake CANN runtime the C++ tests build (tests/unit/device/fake_libascendcl.cc), next
    to the build's Python package or CLI; "" when this is not a build tree (the wheel test)."""
    candidates = [os.environ.get("KVFERRY_FAKE_ACL", "")]
    package = os.path.dirname(os.path.abspath(kvferry.__file__))  # <build>/python/kvferry
    candidates.append(os.path.join(package, "..", "..", "tests", "libfake_libascendcl.so"))
    cli = os.environ.get("KVFERRY_CLI", "")
    if cli:
        candidates.append(os.path.join(os.path.dirname(cli), "tests", "libfake_libascendcl.so"))
    return next((os.path.normpath(c) for c in candidates if c and os.path.isfile(c)), "")


@pytest.mark.parametrize("buffer_device", ["cpu", "npu"])
def test_llm_datadist_tutorial_config_moves_every_byte(ranks, tmp_path, buffer_device):
    """vllm-ascend's tutorial kv_transfer_config for its LLM-DataDist connector with only
    kv_connector and kv_connector_module_path changed, and its environment: engine_id "0" and
    kv_port "20001" on both instances, each listening on its own VLLM_ASCEND_LLMDD_RPC_PORT,
    devices from the rank table in DISAGGREGATED_PREFILL_RANK_TABLE_PATH. kv_buffer_device "npu"
    (the tutorial's) moves NPU memory itself, here the fake CANN runtime's; "cpu" is host-buffer
    mode. Equal engine ids on the two instances confuse nothing (kvferry.vllm_ascend)."""
    acl = ""
    if buffer_device == "npu":
        acl = fake_acl_library()
        if not acl:
            pytest.skip("SKIPPED: tests/libfake_libascendcl.so (built with the C++ tests) is not "
                        "in this build tree or KVFERRY_FAKE_ACL; NPU memory needs a CANN runtime")
    g = geometry("ascend_mha", "bfloat16", 4, device="npu", seed_config=buffer_device,
                 host_buffer=buffer_device == "cpu", acl=acl)
    pport, dport = free_port(2), free_port(1)
    p_env, d_env = seed_environment(str(tmp_path), pport, 2, dport, 1)
    prefill = Instance(g, "kv_producer", pport, ranks[:2], p_env)
    decode = Instance(g, "kv_consumer", dport, ranks[2:3], d_env)
    pairs = disaggregated(prefill, decode)
    params = prefill.responses["req-1"]
    assert (params["remote_engine_id"], params["remote_port"]) == ("0", pport)
    memory = "npu:0" if buffer_device == "npu" else "host"  # host: the mirrors are registered
    assert prefill.registrations() == [dict(memory=memory, kind="mha", layout="token_major",
                                            engine_id="0", base_port=pport)] * 2
    assert decode.registrations() == [dict(memory=memory, kind="mha", layout="token_major",
                                           engine_id="0@decode", base_port=dport)]
    check_every_byte(g, decode, pairs)
    assert decode.load_errors == []


def test_a_registered_prefill_instance_drains_through_vllms_step_loop(ranks):
    """kv_connector_extra_config "register" on the prefill instance, a real etcd, and vLLM's
    step loop (every hook, in vLLM's order, with the aggregator's KVConnectorOutput): after
    `kvferry drain etcd://.../instances/prefill/p0` the instance stays draining while its request
    is held, and reports drained in its key once the decode instance has read it and
    finished_sending has reached the scheduler through update_connector_output."""
    import subprocess

    import etcd_server
    from kvferry.fleet import b64, call, parse_etcd_url

    if not etcd_server.available():
        pytest.skip("SKIPPED LOUDLY: etcd is not installed (Debian's etcd-server; make deps)")
    cli = os.environ.get("KVFERRY_CLI", "")
    if not cli:
        pytest.skip("KVFERRY_CLI (the kvferry binary) is not set; ctest sets it")
    with etcd_server.EtcdServer() as etcd:
        key = "/fleet/instances/prefill/p0"
        base, _ = parse_etcd_url(etcd.url("/fleet"))

        def state() -> str:
            import base64
            import json
            kvs = call(base, "/v3/kv/range", {"key": b64(key)}, 2).get("kvs", [])
            return json.loads(base64.b64decode(kvs[0]["value"]))["state"] if kvs else ""

        g = geometry("flash_attn_hnd", transport="tcp")
        p_g = dict(g, register={"etcd": etcd.url("/fleet"), "url": "http://127.0.0.1:8100",
                                "name": "p0", "ttl_s": 3})
        pport, dport = free_port(2), free_port(2)
        prefill = Instance(p_g, "kv_producer", pport, ranks[:2])
        decode = Instance(g, "kv_consumer", dport, ranks[2:4])
        try:
            assert state() == "serving"
            params = proxy_hop(prefill, "req-d", PROMPT)  # held for its reader
            drained = subprocess.run([cli, "drain", etcd.url(key)], capture_output=True,
                                     text=True, timeout=30)
            assert drained.returncode == 0, drained.stderr
            run_until([prefill], lambda: prefill.connector._draining.is_set(),
                      "the adapter to adopt the drain (its next keepalive)")
            prefill.step()
            assert state() == "draining"  # req-d is still held
            req = decode_request("req-d", PROMPT, params)
            decode.add_request(req)
            run_until([prefill, decode], lambda: "req-d" not in prefill.requests,
                      "the prefill release")
            run_until([prefill], lambda: state() == "drained", "drained in the key")
            local = list(decode.blocks["req-d"])
            check_every_byte(g, decode, list(zip(params["remote_block_ids"], local)))
        finally:
            prefill.connector.shutdown()
            decode.connector.shutdown()
        assert state() == ""  # the key was revoked at shutdown
