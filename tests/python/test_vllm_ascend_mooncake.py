"""kvferry.vllm with the configurations of vllm-ascend's Mooncake connectors (issue 28 item 8):
MooncakeConnectorV1, MooncakeLayerwiseConnector and MooncakeHybridConnector, which replaced the
LLM-DataDist connector (vllm-ascend PR 4780), with only kv_connector and kv_connector_module_path
changed. What each test follows was read from github.com/vllm-project/vllm-ascend at 182b75ea
(vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_connector.py,
mooncake_layerwise_connector.py, mooncake_hybrid_connector.py; vllm_ascend/utils.py,
ascend_config.py, platform.py; the tutorials under docs/source/tutorials/ and
examples/disaggregated_prefill_v1/), and at a77045f3 (PR 4780 itself) for the port arithmetic
of that time. The LLM-DataDist configuration's own tests are in test_vllm_ascend.py."""
import json
import logging
import sys
import uuid
from types import SimpleNamespace
from typing import Optional

import numpy as np
import pytest

import kvferry
import kvferry.vllm
import kvferry.vllm_ascend
from common import free_port
from test_vllm_adapter import (BS, DIM, HEADS, NB, Blocks, fake_parallel_state, offer_and_load,
                               poll, request)
from test_vllm_ascend import check_loaded, clean_env, npu_caches, settings  # noqa: F401

HOST = "127.0.0.2"  # VLLM_HOST_IP: what vLLM's get_ip() answers, where Mooncake listens


def placement(p_dp: int, p_tp: int, d_dp: int, d_tp: int) -> dict:
    """kv_connector_extra_config as every tutorial writes it: both roles' DP and TP sizes."""
    return {"prefill": {"dp_size": p_dp, "tp_size": p_tp},
            "decode": {"dp_size": d_dp, "tp_size": d_tp}}


# Each tutorial's --kv-transfer-config, per instance, as written there (kv_connector is replaced
# by `mooncake_config`), and the parallel sizes its vllm serve line runs: (tp, dp_size, the DP
# ranks one instance config serves).
TUTORIALS = {
    # docs/source/tutorials/features/pd_disaggregation_mooncake_single_node.md: 1P1D on one host.
    "single_node_v1": (
        {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": "30000",
         "kv_connector_extra_config": placement(1, 1, 1, 1)}, (1, 1, (0,)),
        {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_consumer", "kv_port": "30100",
         "kv_connector_extra_config": placement(1, 1, 1, 1)}, (1, 1, (0,))),
    # examples/disaggregated_prefill_v1/mooncake_connector_deployment_guide.md: DP 2, TP 2 each
    # (vLLM's internal DP), kv_rank and kv_parallel_size set, kv_buffer_device "npu".
    "deployment_guide_v1": (
        {"kv_connector": "MooncakeConnectorV1", "kv_buffer_device": "npu",
         "kv_role": "kv_producer", "kv_parallel_size": 1, "kv_port": "20001", "kv_rank": 0,
         "kv_connector_extra_config": placement(2, 2, 2, 2)}, (2, 2, (0, 1)),
        {"kv_connector": "MooncakeConnectorV1", "kv_buffer_device": "npu",
         "kv_role": "kv_consumer", "kv_parallel_size": 1, "kv_port": "20002", "kv_rank": 1,
         "kv_connector_extra_config": placement(2, 2, 2, 2)}, (2, 2, (0, 1))),
    # docs/source/tutorials/features/pd_disaggregation_mooncake_multi_node.md, "Layerwise":
    # prefill DP 2 x TP 8 (one DP rank per node, external DP, kv_port 36000 on node 1 and 36100
    # on node 2), decode DP 32 x TP 1 (16 ranks per node, kv_port 36200 on both nodes).
    "multi_node_layerwise": (
        {"kv_connector": "MooncakeLayerwiseConnector", "kv_role": "kv_producer",
         "kv_port": "36100", "kv_connector_extra_config": placement(2, 8, 32, 1)}, (8, 2, (1,)),
        {"kv_connector": "MooncakeLayerwiseConnector", "kv_role": "kv_consumer",
         "kv_port": "36200", "kv_connector_extra_config": placement(2, 8, 32, 1)},
        (1, 32, (0, 16, 31))),
    # The same tutorial, "Non-layerwise".
    "multi_node_v1": (
        {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": "36000",
         "kv_connector_extra_config": placement(2, 8, 32, 1)}, (8, 2, (0,)),
        {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_consumer", "kv_port": "36200",
         "kv_connector_extra_config": placement(2, 8, 32, 1)}, (1, 32, (15, 16))),
    # docs/source/tutorials/models/DeepSeek-V4-Flash.md: engine_id "0" and "1".
    "deepseek_v4_hybrid": (
        {"kv_connector": "MooncakeHybridConnector", "kv_role": "kv_producer", "kv_port": "30000",
         "engine_id": "0", "kv_connector_extra_config": placement(4, 4, 16, 1)}, (4, 4, (0, 3)),
        {"kv_connector": "MooncakeHybridConnector", "kv_role": "kv_consumer", "kv_port": "30100",
         "engine_id": "1", "kv_connector_extra_config": placement(4, 4, 16, 1)}, (1, 16, (9,))),
}


def ascend_engine_id(configured: Optional[str]) -> str:
    """The engine_id a vllm-ascend instance runs with: vLLM fills one in when the config has
    none, and vllm-ascend appends "-<uuid4 hex>" (platform.py check_and_update_config, section
    "KV Transfer Config"; since 41fbc5eb in ascend_config.py), so no two instances share one."""
    return f"{configured or uuid.uuid4()}-{uuid.uuid4().hex}"


def mooncake_config(ktc: dict, tp: int = 1, dp_size: int = 1, dp_rank: int = 0, pp: int = 1,
                    engine_id: Optional[str] = None, **parallel):
    """VllmConfig as the connector reads it for a tutorial's kv_transfer_config, with only
    kv_connector and kv_connector_module_path changed (a JSON round trip, as vllm serve parses
    --kv-transfer-config); `parallel` adds ParallelConfig fields."""
    ktc = dict(json.loads(json.dumps(ktc)), kv_connector="KvferryConnector",
               kv_connector_module_path="kvferry.vllm")
    ktc["engine_id"] = engine_id if engine_id is not None else ascend_engine_id(
        ktc.get("engine_id"))
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(**ktc),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                        data_parallel_size=dp_size, data_parallel_rank=dp_rank,
                                        prefill_context_parallel_size=1,
                                        decode_context_parallel_size=1, **parallel),
        cache_config=SimpleNamespace(block_size=BS),
        model_config=SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: HEADS))


@pytest.fixture
def mooncake_env(clean_env):  # noqa: F811 - test_vllm_ascend's fixture, reused
    clean_env.setenv("VLLM_HOST_IP", HOST)
    return clean_env


# ------------------------------------------------------------------- Mooncake's port arithmetic

def mooncake_side_channel_port(connector: str, kv_port: int, dp_rank: int, tp: int,
                               pp: int = 1, pcp: int = 1) -> int:
    """The base port of one DP rank: what the scheduler advertises as remote_port
    (request_finished) and its workers add their device index to. mooncake_connector.py and
    mooncake_hybrid_connector.py, MooncakeConnectorScheduler.__init__ and
    MooncakeConnectorWorker.__init__ ("Handshake base port"): kv_port + data_parallel_rank * tp *
    pp (* pcp; the hybrid connector asserts pcp 1). mooncake_layerwise_connector.py,
    MooncakeLayerwiseConnectorScheduler.__init__: kv_port + data_parallel_rank * tp (no PP)."""
    if connector == "MooncakeLayerwiseConnector":
        return kv_port + dp_rank * tp
    return kv_port + dp_rank * tp * pp * pcp


def mooncake_handshake_port(connector: str, kv_port: int, dp_rank: int, tp: int, tp_rank: int,
                            pp: int = 1, pp_rank: int = 0) -> int:
    """Where one worker listens (pcp 1). mooncake_connector.py MooncakeConnectorWorker.__init__
    and KVCacheSendingThread.run: side_channel_port + (pp_rank * pcp + pcp_rank) * tp + tp_rank;
    mooncake_hybrid_connector.py: side_channel_port + pp_rank * tp + tp_rank;
    mooncake_layerwise_connector.py MooncakeLayerwiseConnectorWorker.__init__:
    side_channel_port + tp_rank (its base adds pcp_rank * tp)."""
    base = mooncake_side_channel_port(connector, kv_port, dp_rank, tp, pp)
    if connector == "MooncakeLayerwiseConnector":
        return base + tp_rank
    return base + pp_rank * tp + tp_rank


def test_the_port_arithmetic_is_mooncakes_of_pr_4780_and_of_today():
    # At a77045f3 (PR 4780) mooncake_connector.py's worker listened on kv_port +
    # data_parallel_rank * tp * pcp + pcp_rank * tp + tp_rank (no PP term): with pcp 1 and pp 1
    # the same ports as today's, which this file's helpers follow.
    for dp_rank, tp, tp_rank in ((0, 1, 0), (1, 2, 1), (3, 8, 5)):
        then = 30000 + dp_rank * tp + tp_rank
        for connector in ("MooncakeConnectorV1", "MooncakeLayerwiseConnector",
                          "MooncakeHybridConnector"):
            assert mooncake_handshake_port(connector, 30000, dp_rank, tp, tp_rank) == then


def pipeline_state(monkeypatch, tp: int, tp_rank: int, pp: int, pp_rank: int) -> None:
    """vLLM's parallel state of one worker process: test_vllm_adapter's TP group, plus the
    pipeline group (get_pp_group(), as the Mooncake workers read pp_rank)."""
    fake_parallel_state(monkeypatch, tp, tp_rank)
    sys.modules["vllm.distributed.parallel_state"].get_pp_group = (
        lambda: SimpleNamespace(world_size=pp, rank_in_group=pp_rank))


@pytest.mark.parametrize("connector, tp, pp, dp_rank", [
    ("MooncakeConnectorV1", 2, 2, 1),
    ("MooncakeHybridConnector", 2, 2, 1),
    ("MooncakeLayerwiseConnector", 2, 1, 1),
    ("MooncakeConnectorV1", 1, 1, 2),
])
def test_each_worker_listens_on_mooncakes_handshake_port(mooncake_env, connector, tp, pp,
                                                         dp_rank):
    # Prefill instance of DP rank dp_rank (of dp_rank + 1), every (pp_rank, tp_rank) worker: it
    # listens where that Mooncake connector's worker does, and the scheduler offers Mooncake's
    # side-channel port as remote_port, this host's get_ip() as remote_host.
    dp_size = dp_rank + 1
    kv_port = free_port(dp_size * pp * tp)
    extra = {"prefill": {"dp_size": dp_size, "tp_size": tp, "pp_size": pp},
             "decode": {"dp_size": dp_size, "tp_size": tp, "pp_size": pp}}
    ktc = {"kv_connector": connector, "kv_role": "kv_producer", "kv_port": str(kv_port),
           "kv_connector_extra_config": extra}
    cfg = mooncake_config(ktc, tp=tp, dp_size=dp_size, dp_rank=dp_rank, pp=pp)
    workers = []
    try:
        for pp_rank in range(pp):
            for tp_rank in range(tp):
                pipeline_state(mooncake_env, tp, tp_rank, pp, pp_rank)
                w = kvferry.vllm.KvferryConnector(cfg, "WORKER")
                workers.append(w)
                w.register_kv_caches({  # this stage's layers, (K, V) of this rank's heads
                    f"model.layers.{pp_rank * 2 + i}.self_attn.attn":
                        tuple(np.zeros((NB, BS, HEADS // tp, DIM), np.float16) for _ in "kv")
                    for i in range(2)})
                want = mooncake_handshake_port(connector, kv_port, dp_rank, tp, tp_rank, pp,
                                               pp_rank)
                assert w._worker.listener_endpoint.endswith(f":{want}"), (
                    w._worker.listener_endpoint, want)
    finally:
        for w in workers:
            w.shutdown()
    sched = kvferry.vllm.KvferryConnector(cfg, "SCHEDULER")
    delay, params = sched.request_finished(
        request("r-0", {"do_remote_decode": True}, 2 * BS, "FINISHED_LENGTH_CAPPED"), [1, 2])
    assert delay
    assert params["remote_port"] == mooncake_side_channel_port(connector, kv_port, dp_rank, tp,
                                                                pp)
    assert (params["remote_host"], params["remote_tp_size"]) == (HOST, tp)


# ------------------------------------------------------------------- the tutorials' configs

@pytest.mark.parametrize("name", sorted(TUTORIALS))
def test_each_tutorials_config_is_accepted_on_both_roles(mooncake_env, name):
    p_ktc, (p_tp, p_dp, p_ranks), d_ktc, (d_tp, d_dp, d_ranks) = TUTORIALS[name]
    connector = p_ktc["kv_connector"]
    for ktc, tp, dp_size, ranks in ((p_ktc, p_tp, p_dp, p_ranks), (d_ktc, d_tp, d_dp, d_ranks)):
        for dp_rank in ranks:
            engine_id = ascend_engine_id(ktc.get("engine_id"))
            cfg = mooncake_config(ktc, tp=tp, dp_size=dp_size, dp_rank=dp_rank,
                                  engine_id=engine_id)
            sched = kvferry.vllm.KvferryConnector(cfg, "SCHEDULER")
            s = sched._settings
            # Mooncake's base is kv_port (quoted in the tutorials), at vLLM's get_ip().
            assert (s.base_port, s.host, s.dp_rank, s.tp_size) == (
                int(ktc["kv_port"]), HOST, dp_rank, tp)
            if ktc["kv_role"] == "kv_consumer":
                assert s.engine_id == engine_id + kvferry.vllm_ascend.DECODE_ID_SUFFIX
                continue
            assert s.engine_id == engine_id
            # What the prefill offers the decode side (through the proxy, unchanged):
            # mooncake_connector.py MooncakeConnectorScheduler.request_finished names
            # remote_engine_id, remote_host (get_ip()) and remote_port (the side-channel port).
            _, params = sched.request_finished(
                request("r-1", {"do_remote_decode": True}, BS, "FINISHED_LENGTH_CAPPED"), [4])
            assert (params["remote_engine_id"], params["remote_host"], params["remote_port"],
                    params["remote_tp_size"]) == (
                engine_id, HOST,
                mooncake_side_channel_port(connector, int(ktc["kv_port"]), dp_rank, tp), tp)


def test_keys_that_mean_nothing_to_kvferry_are_accepted_and_change_nothing(mooncake_env):
    # use_ascend_direct (GLM5.md, Kimi-K2.6.md... : read by no connector since vllm-ascend PR
    # 4547), tls_config (mooncake_layerwise_connector.py MooncakeLayerwiseConnectorScheduler:
    # the metaserver client), ascend_local_comm_res_path (utils.setup_ascend_local_comm_res),
    # pp_layer_partition (MooncakeConnectorWorker._get_prefill_decode_size), kv_rank and
    # kv_parallel_size (the deployment guide).
    base = TUTORIALS["single_node_v1"][0]
    plain = settings(mooncake_config(base))
    extra = dict(placement(1, 1, 1, 1), use_ascend_direct=True,
                 tls_config={"ssl_enable": False}, ascend_local_comm_res_path="/etc/ub")
    extra["prefill"]["pp_layer_partition"] = "2,2"
    dressed = settings(mooncake_config(dict(base, kv_rank=0, kv_parallel_size=1,
                                            kv_connector_extra_config=extra)))
    assert (dressed.base_port, dressed.host, dressed.transport) == (
        plain.base_port, plain.host, plain.transport)


def test_equal_pipelines_on_both_roles_are_accepted(mooncake_env):
    # Mooncake asserts decode pp_size 1 (MooncakeConnectorWorker._get_prefill_decode_size);
    # kvferry also reads between equal pipelines, stage s from stage s.
    extra = {"prefill": {"dp_size": 1, "tp_size": 1, "pp_size": 2},
             "decode": {"dp_size": 1, "tp_size": 1, "pp_size": 2}}
    ktc = dict(TUTORIALS["single_node_v1"][2], kv_connector_extra_config=extra)
    assert settings(mooncake_config(ktc, pp=2)).pp_size == 2


def test_unequal_pipelines_are_accepted_as_mooncake_reads_them(mooncake_env):
    # Mooncake's decode (pp_size 1) reads every stage of a pipelined prefill; kvferry reads each
    # decode stage's layers from the prefill stages holding them (test_vllm_harness:
    # test_unequal_pipeline_parallel_sizes_read_by_layer_ranges moves the bytes).
    extra = {"prefill": {"dp_size": 1, "tp_size": 1, "pp_size": 2},
             "decode": {"dp_size": 1, "tp_size": 1, "pp_size": 1}}
    ktc = dict(TUTORIALS["single_node_v1"][0], kv_connector_extra_config=extra)
    assert settings(mooncake_config(ktc, pp=2)).pp_size == 2


def test_kv_port_absent_is_vllms_default(mooncake_env):
    # KVTransferConfig.kv_port defaults to 14579; the Mooncake connectors add to it.
    ktc = dict(TUTORIALS["single_node_v1"][0])
    del ktc["kv_port"]
    assert settings(mooncake_config(ktc)).base_port == kvferry.vllm_ascend.VLLM_DEFAULT_KV_PORT
    # kvferry's own base_port still decides where it is given.
    ktc["kv_connector_extra_config"] = dict(placement(1, 1, 1, 1), base_port=7001)
    assert settings(mooncake_config(ktc)).base_port == 7001


# ------------------------------------------------------------------- refusals

def with_extra(change):
    """The single-node tutorial's prefill config with its extra config changed by `change`."""
    ktc = json.loads(json.dumps(TUTORIALS["single_node_v1"][0]))
    change(ktc["kv_connector_extra_config"])
    return ktc


def _set(path, value):
    def change(extra):
        *parents, key = path
        for p in parents:
            extra = extra[p]
        extra[key] = value
    return change


@pytest.mark.parametrize("ktc, parallel, words", [
    (with_extra(lambda e: e.pop("prefill")), {}, ['"prefill" is None', "describes both roles"]),
    (with_extra(lambda e: e["decode"].pop("tp_size")), {},
     ["decode has no tp_size", "require dp_size and tp_size"]),
    (with_extra(_set(("prefill", "tp_size"), "1")), {},
     ["prefill.tp_size must be an integer 1..256", "found '1'"]),
    (with_extra(_set(("prefill", "dp_size"), 0)), {}, ["prefill.dp_size", "found 0"]),
    (with_extra(_set(("decode", "pp_size"), True)), {}, ["decode.pp_size", "found True"]),
    (with_extra(_set(("prefill", "cp_size"), 2)), {},
     ["prefill has 'cp_size'", "read dp_size, tp_size, pp_size, pp_layer_partition"]),
    (with_extra(_set(("prefill", "tp_size"), 2)), {},
     ["prefill.tp_size is 2", "tensor-parallel size 1", "Set it to 1"]),
    (with_extra(_set(("prefill", "dp_size"), 2)), {},
     ["prefill.dp_size is 2", "data-parallel size 1"]),
    (with_extra(lambda e: None), {"prefill_context_parallel_size": 2},
     ["prefill_context_parallel_size is 2", "without context parallelism"]),
    (dict(with_extra(_set(("decode", "tp_size"), 2)), kv_role="kv_both"), {},
     ["decode.tp_size is 2", "this decode instance runs tensor-parallel size 1"]),
    (dict(with_extra(lambda e: None), kv_port="3O000"), {}, ["kv_port", "found '3O000'"]),
], ids=["an_entry_missing", "tp_size_missing", "tp_size_a_string", "dp_size_zero",
        "pp_size_a_bool", "a_key_mooncake_does_not_read",
        "tp_not_this_instances", "dp_not_this_instances", "context_parallel",
        "kv_both_checks_both_entries", "kv_port_not_a_number"])
def test_bad_values_are_refused_saying_what_was_expected_and_found(mooncake_env, ktc, parallel,
                                                                   words):
    # Following MooncakeConnectorWorker._get_prefill_decode_size (the asserts on both entries),
    # vllm_ascend/utils.py check_kv_extra_config (each role's entry against vLLM's sizes) and
    # the Mooncake workers' assert that pp and pcp are not both above 1.
    pp = parallel.pop("pp", 1)
    cfg = mooncake_config(ktc, pp=pp)
    for key, value in parallel.items():
        setattr(cfg.parallel_config, key, value)
    with pytest.raises(kvferry.InvalidArgumentError) as e:
        settings(cfg)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("variable, value, setting", [
    ("VLLM_ASCEND_LLMDD_RPC_PORT", "5959", '"base_port"'),
    ("VLLM_ASCEND_LLMDD_RPC_IP", "10.0.0.9", '"host"'),
])
def test_the_llm_datadist_variables_are_refused_with_a_mooncake_config(mooncake_env, variable,
                                                                        value, setting):
    # The Mooncake connectors never read them (vllm-ascend PR 4780 removed them from envs.py);
    # where they are left set, they would silently move where kvferry listens.
    mooncake_env.setenv(variable, value)
    with pytest.raises(kvferry.InvalidArgumentError) as e:
        settings(mooncake_config(TUTORIALS["single_node_v1"][0]))
    message = str(e.value)
    assert f"{variable} is set ('{value}')" in message, message
    assert f"Unset {variable}" in message and setting in message, message


def test_the_layerwise_proxys_metaserver_legs_are_logged_and_prefilled_locally(mooncake_env,
                                                                               caplog):
    # load_balance_proxy_layerwise_server_example.py sends the decode instance
    # {"do_remote_decode": False, "do_remote_prefill": True, "metaserver": URL} first;
    # MooncakeLayerwiseConnectorScheduler.update_state_after_alloc posts its blocks there and
    # the prefill pushes. kvferry's decode reads from the prefill: the request is computed
    # locally and the log names the proxy to use instead.
    ktc = TUTORIALS["multi_node_layerwise"][2]
    sched = kvferry.vllm.KvferryConnector(mooncake_config(ktc, dp_size=32), "SCHEDULER")
    params = {"do_remote_decode": False, "do_remote_prefill": True,
              "metaserver": "http://10.0.0.1:8000/v1/metaserver"}
    with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
        assert sched.get_num_new_matched_tokens(request("d-1", params, 2 * BS), 0) == (0, False)
    text = caplog.text
    assert "metaserver" in text and "load_balance_proxy_server_example.py" in text, text


# ------------------------------------------------------------------- end to end

def test_the_single_node_tutorial_moves_every_byte_through_the_proxys_params(mooncake_env):
    # pd_disaggregation_mooncake_single_node.md's two instances on one host, each its own
    # kv_port (free ports here instead of 30000/30100), engine ids as vllm-ascend makes them,
    # kv_buffer_device "cpu" (host-buffer mode: no CANN here; torch copies the "NPU" blocks).
    # load_balance_proxy_server_example.py's legs: build_prefill_request's params to the
    # prefill, then the prefill response's kv_transfer_params to the decode instance.
    torch = pytest.importorskip("torch", reason="Debian's python3-torch (make deps) is absent")
    p_ktc, _, d_ktc, _ = TUTORIALS["single_node_v1"]
    pport, dport = free_port(), free_port()
    sides = {}
    for role, ktc, port in (("kv_producer", p_ktc, pport), ("kv_consumer", d_ktc, dport)):
        cfg = mooncake_config(dict(ktc, kv_port=str(port), kv_buffer_device="cpu"))
        sides[role] = (kvferry.vllm.KvferryConnector(cfg, "SCHEDULER"),
                       kvferry.vllm.KvferryConnector(cfg, "WORKER"))
    (p_sched, p_work), (_, d_work) = sides["kv_producer"], sides["kv_consumer"]
    p_dev, p_raw = npu_caches(torch, 5)
    d_dev, d_raw = npu_caches(torch, 6)
    d_before = {k: v.copy() for k, v in d_raw.items()}
    p_work.register_kv_caches(p_dev)
    d_work.register_kv_caches(d_dev)
    remote, local = [10, 1, 14], [3, 4, 8]
    proxy_leg = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    preq = request("r-mc", proxy_leg, 3 * BS, "RUNNING")
    p_sched.update_state_after_alloc(preq, Blocks(remote), 0)
    p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
    p_work.start_load_kv(None)
    p_work.wait_for_save()
    params = offer_and_load(sides, preq, remote, local, "d-mc")
    assert (params["remote_host"], params["remote_port"]) == (HOST, pport)
    assert d_work.get_block_ids_with_load_errors() == set()
    check_loaded(p_raw, d_raw, d_before, remote, local)
    assert poll(lambda: p_work.get_finished({"r-mc"})[0], "the release") == {"r-mc"}
    for _, work in sides.values():
        work.shutdown()
