"""kvferry.vllm driven as today's vLLM drives a connector (issue 28), each test naming the vLLM
file and function it follows:

  * the worker step of vllm/v1/worker/kv_connector_model_runner_mixin.py
    (_get_kv_connector_output) and gpu_model_runner.py (execute_model): handle_preemptions with
    the step's metadata, bind_connector_metadata, start_load_kv before the forward only when the
    step has synchronous loads (SchedulerOutput.has_sync_kv_loads, PR 53333) and after it
    otherwise, wait_for_layer_load/save_kv_layer per layer, wait_for_save, get_finished,
    get_block_ids_with_load_errors, get_kv_connector_stats, build_connector_worker_meta,
    clear_connector_metadata, every step;
  * KVOutputAggregator.aggregate (vllm/distributed/kv_transfer/kv_connector/utils.py) folding
    the workers' stats, the scheduler's update_from_output merging its own connector's and
    make_stats handing their data to the loggers (vllm/v1/metrics/loggers.py:
    KVConnectorLogging, KVConnectorProm with build_prom_metrics);
  * KVTransferConfig.kv_role "kv_both" (vllm/config/kv_transfer.py);
  * the scheduler's preempted_req_ids (vllm/v1/core/sched/scheduler.py, _preempt_request);
  * VllmConfig's check of requires_piecewise_for_cudagraph under FULL CUDA graphs;
  * KVConnectorBase_V1.shutdown.
"""
import ast
import os
import socket
import time
from types import SimpleNamespace

import numpy as np
import pytest

import kvferry
import kvferry.vllm
from common import SilentPeer, free_port
from test_vllm_adapter import (BS, LAYERS, Blocks, block_view, config, fa_nhd, fill_blocks,
                               fill_random, poll, request)
from vllm_harness import StatLoggers

prom = pytest.importorskip("prometheus_client",
                           reason="Debian's python3-prometheus-client (make deps) is absent")


def worker_step(work, md, finished=(), caches=None, sync_loads=False, preemptions="metadata",
                preempted=()):
    """One worker step as vLLM's model runner makes it (see the module's docstring). `preemptions`
    is the handle_preemptions API: "metadata" (vLLM main: the metadata, every step) or "ids"
    (earlier: preempted_req_ids, only when some were preempted). Returns the KVConnectorOutput
    fields: (finished_sending, finished_recving, invalid_block_ids, kv_connector_stats)."""
    if preemptions == "metadata":
        work.handle_preemptions(md)
    elif preempted:
        work.handle_preemptions(set(preempted))
    work.bind_connector_metadata(md)
    if sync_loads:
        work.start_load_kv(None)
    for name, cache in (caches or {}).items():
        work.wait_for_layer_load(name)
        work.save_kv_layer(name, cache, None)
    if not sync_loads:
        work.start_load_kv(None)
    work.wait_for_save()
    sending, recving = work.get_finished(set(finished))
    invalid = work.get_block_ids_with_load_errors()
    stats = work.get_kv_connector_stats()
    assert work.build_connector_worker_meta() is None
    work.clear_connector_metadata()
    return sending, recving, invalid, stats


def aggregate(outputs):
    """KVOutputAggregator.aggregate's stats: the first worker's object accumulates the rest."""
    acc = None
    for _s, _r, _i, stats in outputs:
        if stats is None:
            continue
        if acc is None:
            acc = stats
        else:
            assert isinstance(acc, type(stats))
            acc = acc.aggregate(stats)
    return acc


def record_load_errors(work):
    """The native load errors the adapter takes, kept (with their messages) for the test."""
    errors = []
    native = work._worker

    class Recorder:
        def __getattr__(self, name):
            return getattr(native, name)

        def take_load_errors(self):
            got = native.take_load_errors()
            errors.extend(got)
            return got

    work._worker = Recorder()
    return errors


def pair(p_role="kv_producer", d_role="kv_consumer", layers=LAYERS, d_extra=None):
    pport, dport = free_port(), free_port()
    p = (kvferry.vllm.KvferryConnector(config(p_role, pport), "SCHEDULER"),
         kvferry.vllm.KvferryConnector(config(p_role, pport), "WORKER"))
    d = (kvferry.vllm.KvferryConnector(config(d_role, dport), "SCHEDULER"),
         kvferry.vllm.KvferryConnector(config(d_role, dport, d_extra), "WORKER"))
    p_caches = {f"l{i}": fa_nhd() for i in range(layers)}
    d_caches = {f"l{i}": fa_nhd() for i in range(layers)}
    p[1].register_kv_caches(p_caches)
    d[1].register_kv_caches(d_caches)
    return pport, p, p_caches, dport, d, d_caches


def offer(p_sched, p_work, rid, blocks, caches=None):
    """A prefill request that stopped on its length cap: vLLM's request_finished offers it; the
    next step's metadata holds it."""
    req = request(rid, {"do_remote_decode": True}, len(blocks) * BS, "FINISHED_LENGTH_CAPPED")
    delay, params = p_sched.request_finished(req, blocks)
    assert delay
    return params, worker_step(p_work, p_sched.build_connector_meta(None), caches=caches)


def test_stats_hook_called_every_step_never_raises_and_reaches_vllms_loggers():
    """Before issue 28, get_kv_connector_stats raised TypeError (dict - int) on every call once
    registered: vLLM's engine died at its first step. Here every step calls it on both sides, a
    load that succeeds and one that fails (a failures dict is then non-empty) go through, and
    the aggregated figures reach reduce() and kvferry's series in a Prometheus registry."""
    # A load from a port nobody listens on fails by its transfer deadline: 3 s here.
    pport, (p_sched, p_work), p_caches, dport, (d_sched, d_work), _ = pair(
        d_extra={"transfer_timeout_ms": 3000})
    for c in p_caches.values():
        fill_random(c, 3)
    loggers = StatLoggers(kvferry.vllm.KvferryConnector, config("kv_consumer", dport))
    params, out = offer(p_sched, p_work, "r-1", [1, 2])
    dead = dict(params, remote_port=free_port())  # nobody listens: a failed load
    req = request("d-1", dict(params), 2 * BS)
    assert d_sched.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    d_sched.update_state_after_alloc(req, Blocks([5, 6]), 2 * BS)
    req2 = request("d-2", dead, 2 * BS)
    d_sched.get_num_new_matched_tokens(req2, 0)
    d_sched.update_state_after_alloc(req2, Blocks([7, 8]), 2 * BS)
    md = d_sched.build_connector_meta(SimpleNamespace(preempted_req_ids=set()))
    done, invalid = set(), set()
    deadline = time.monotonic() + 40
    while done != {"d-1", "d-2"}:
        assert time.monotonic() < deadline, f"loads not reported in 40 s: {done}"
        time.sleep(0.005)
        outs = [worker_step(d_work, md), worker_step(p_work, p_sched.build_connector_meta(None))]
        md = d_sched.build_connector_meta(SimpleNamespace(preempted_req_ids=set()))
        done |= outs[0][1] or set()
        invalid |= outs[0][2]
        stats = aggregate(outs)
        own = d_sched.get_kv_connector_stats()  # the scheduler-side connector's (None)
        if stats is not None and own is not None:
            stats = stats.aggregate(own)
        loggers.record(stats.data if stats is not None else None)
    assert invalid == {7, 8}
    summary = {k: sum(d.get(k, 0) for d in loggers.logged)
               for k in ("Num successful transfers", "Num failed transfers")}
    assert summary == {"Num successful transfers": 1, "Num failed transfers": 1}, loggers.logged
    text = loggers.text()
    assert 'vllm:kvferry_xfer_time_seconds_count{engine="0",model_name="harness-model"} 1.0' \
        in text, text
    assert 'vllm:kvferry_bytes_transferred_sum{engine="0",model_name="harness-model"} ' \
        f'{float(2 * block_view(p_caches["l0"], 1).nbytes * LAYERS)}' in text, text
    assert 'vllm:kvferry_num_failed_transfers_total{' in text and 'code="' in text, text


def test_stats_survive_vllms_process_boundary_and_foreign_shapes():
    """vLLM serialises the stats between processes and rebuilds them from `data`: only lists of
    plain values, and aggregate/reduce/observe take malformed or older shapes without raising."""
    import pickle

    cls = kvferry.vllm.KvferryConnector
    s = cls.build_kv_connector_stats({"transfer_duration": [0.25], "bytes_transferred": [100]})
    assert all(isinstance(v, list) for v in s.data.values())
    t = pickle.loads(pickle.dumps(s))
    s.aggregate(t).aggregate({"failed_loads": ["Timeout"], "handshakes": "x"}).aggregate(None)
    s.aggregate(cls.build_kv_connector_stats({"transfer_duration": 5, "failures": {"a": 1}}))
    assert s.reduce()["Num successful transfers"] == 2 and s.reduce()["Num failed transfers"] == 1
    assert cls.build_kv_connector_stats(None).is_empty()
    assert not cls.build_kv_connector_stats({"failed_loads": ["Timeout"]}).is_empty()
    loggers = StatLoggers(cls, config("kv_consumer", 1))
    loggers.prom.observe({"transfer_duration": ["bad", None], "failed_loads": 3}, 0)
    loggers.prom.observe({"transfer_duration": [0.1]}, 7)  # an engine vLLM never named
    loggers.prom.observe(None, 0)


@pytest.mark.parametrize("sync_loads", [False, True], ids=["start_after_forward", "start_before"])
def test_layerwise_plan_is_the_current_steps_in_both_step_orders(sync_loads):
    """vLLM main starts loads after the forward unless the step has synchronous loads (PR
    53333). The step's layer-wise saves must be announced by that step's save_kv_layer calls
    either way: a one-chunk prompt is read layer by layer during its own step, before vLLM
    offers its hold (before the fix, with the load started after the forward, the step's
    layers were announced from the previous step's plan: nothing until the hold)."""
    pport, (p_sched, p_work), p_caches, dport, (d_sched, d_work), d_caches = pair()
    for i, c in enumerate(p_caches.values()):
        fill_random(c, 1000 + i)
    remote, local = [12, 13, 3], [5, 6, 7]
    dreq = request("d-1", {"do_remote_prefill": True, "transfer_id": "xfer-1",
                           "remote_engine_id": f"kv_producer-{pport}", "remote_host": "127.0.0.1",
                           "remote_port": pport, "remote_tp_size": 1}, 3 * BS)
    assert d_sched.get_num_new_matched_tokens(dreq, 0) == (3 * BS, True)
    d_sched.update_state_after_alloc(dreq, Blocks(local), 3 * BS)
    worker_step(d_work, d_sched.build_connector_meta(None), sync_loads=sync_loads)
    preq = request("p-1", {"do_remote_decode": True, "transfer_id": "xfer-1"}, 3 * BS)
    preq.num_computed_tokens = 0
    p_sched.update_state_after_alloc(preq, Blocks(remote), 0)
    out = SimpleNamespace(num_scheduled_tokens={"p-1": 3 * BS}, scheduled_cached_reqs=None,
                          preempted_req_ids=set())
    worker_step(p_work, p_sched.build_connector_meta(out), caches=p_caches, sync_loads=sync_loads)
    # Only the step's own announcements can finish the load: vLLM has not offered a hold yet.
    got = poll(lambda: worker_step(d_work, d_sched.build_connector_meta(None))[1],
               "the layer-wise load, from the step's own save_kv_layer calls")
    assert got == {"d-1"} and d_work.get_block_ids_with_load_errors() == set()
    for name in p_caches:
        for r, l in zip(remote, local):
            assert np.array_equal(block_view(p_caches[name], r), block_view(d_caches[name], l))


def test_piecewise_cudagraphs_are_asked_for_while_layerwise_saving_is_on():
    cls = kvferry.vllm.KvferryConnector
    assert cls.requires_piecewise_for_cudagraph({}) is True
    assert cls.requires_piecewise_for_cudagraph({"layerwise": False}) is False
    assert cls.requires_piecewise_for_cudagraph({"layerwise": "false"}) is False


def test_preempted_layerwise_prefill_leg_fails_its_reader_at_once_and_holds_nothing():
    """vLLM preempts a layer-wise prefill leg after its first layer: its blocks are freed, so
    its transfer ends at once (the decode load fails naming the preemption, not by the progress
    deadline), and when vLLM later recomputes and finishes it, nothing is announced or held."""
    pport, (p_sched, p_work), p_caches, dport, (d_sched, d_work), _ = pair()
    errors = record_load_errors(d_work)
    dreq = request("d-1", {"do_remote_prefill": True, "transfer_id": "xfer-p",
                           "remote_engine_id": f"kv_producer-{pport}", "remote_host": "127.0.0.1",
                           "remote_port": pport, "remote_tp_size": 1}, 2 * BS)
    d_sched.get_num_new_matched_tokens(dreq, 0)
    d_sched.update_state_after_alloc(dreq, Blocks([1, 2]), 2 * BS)
    worker_step(d_work, d_sched.build_connector_meta(None))
    preq = request("p-1", {"do_remote_decode": True, "transfer_id": "xfer-p"}, 2 * BS)
    preq.num_computed_tokens = 0
    p_sched.update_state_after_alloc(preq, Blocks([8, 9]), 0)
    first = {"l0": p_caches["l0"]}  # the step wrote its first layer only (chunk of one layer)
    out = SimpleNamespace(num_scheduled_tokens={"p-1": BS}, scheduled_cached_reqs=None,
                          preempted_req_ids=set())
    worker_step(p_work, p_sched.build_connector_meta(out), caches=first)
    out = SimpleNamespace(num_scheduled_tokens={}, scheduled_cached_reqs=None,
                          preempted_req_ids={"p-1"})
    worker_step(p_work, p_sched.build_connector_meta(out))
    got = poll(lambda: worker_step(d_work, d_sched.build_connector_meta(None))[1],
               "the decode load's failure")
    assert got == {"d-1"}
    assert [e["code"] for e in errors] != [] and "preempted" in errors[0]["message"], errors
    # vLLM reschedules it from token 0 (update_state_after_alloc again), computes and finishes it.
    p_sched.update_state_after_alloc(preq, Blocks([10, 11]), 0)
    out = SimpleNamespace(num_scheduled_tokens={"p-1": 2 * BS}, scheduled_cached_reqs=None,
                          preempted_req_ids=set())
    md = p_sched.build_connector_meta(out)
    assert md.layerwise == {}, "a preempted leg must not be announced again"
    worker_step(p_work, md, caches=p_caches)
    preq.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    assert p_sched.request_finished(preq, [10, 11]) == (False, None)
    worker_step(p_work, p_sched.build_connector_meta(None))
    assert p_work.stats()["holds_outstanding"] == 0


@pytest.mark.parametrize("api", ["metadata", "ids"])
def test_preempted_decode_load_is_stopped_and_reported(api):
    """handle_preemptions, in both of vLLM's signatures (main: the metadata every step; before:
    preempted_req_ids when some were): a load still running for a preempted request stops and is
    reported once in finished_recving, with no blocks to recompute (vLLM recomputes it)."""
    with SilentPeer() as silent:
        port = free_port()
        d_sched = kvferry.vllm.KvferryConnector(config("kv_consumer", port), "SCHEDULER")
        d_work = kvferry.vllm.KvferryConnector(config("kv_consumer", port), "WORKER")
        d_work.register_kv_caches({"l0": fa_nhd()})
        params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "p",
                  "remote_host": "127.0.0.1", "remote_port": silent.port,
                  "remote_tp_size": 1}
        dreq = request("d-7", params, 2 * BS)
        d_sched.get_num_new_matched_tokens(dreq, 0)
        d_sched.update_state_after_alloc(dreq, Blocks([3, 4]), 2 * BS)
        worker_step(d_work, d_sched.build_connector_meta(SimpleNamespace(preempted_req_ids=set())))
        md = d_sched.build_connector_meta(SimpleNamespace(preempted_req_ids={"d-7"}))
        assert md.preempted == ("d-7",)
        _, recving, invalid, _ = worker_step(d_work, md, preemptions=api, preempted={"d-7"})
        seen = set(recving or ())
        if not seen:
            seen = poll(lambda: worker_step(d_work, d_sched.build_connector_meta(None))[1],
                        "the preempted load's report")
        assert seen == {"d-7"} and invalid == set()


def test_kv_both_instances_prefill_and_decode_for_each_other():
    """Two kv_both instances (vLLM's NIXL guide puts kv_both on both): request A is prefilled
    on the first and decoded on the second, request B the other way, on the same caches; every
    byte of both arrives, and each hold is released by its reader."""
    aport, (a_sched, a_work), a_caches, bport, (b_sched, b_work), b_caches = pair(
        "kv_both", "kv_both")
    for i, c in enumerate(a_caches.values()):
        fill_blocks(c, [1, 2], 10 + i)
    for i, c in enumerate(b_caches.values()):
        fill_blocks(c, [3, 4], 20 + i)
    cases = [(a_sched, a_work, a_caches, [1, 2], b_sched, b_work, b_caches, [5, 6], "A"),
             (b_sched, b_work, b_caches, [3, 4], a_sched, a_work, a_caches, [7, 8], "B")]
    for p_sched, p_work, p_caches, remote, d_sched, d_work, d_caches, local, rid in cases:
        params, _ = offer(p_sched, p_work, f"p-{rid}", remote)
        assert params["remote_engine_id"] == p_sched._settings.engine_id  # named as a prefill
        req = request(f"d-{rid}", dict(params), 2 * BS)
        assert d_sched.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
        d_sched.update_state_after_alloc(req, Blocks(local), 2 * BS)
        mds = [d_sched.build_connector_meta(None)]

        def decode_step():
            md = mds.pop() if mds else d_sched.build_connector_meta(None)
            return worker_step(d_work, md)[1]

        got = poll(decode_step, f"request {rid}'s load")
        assert got == {f"d-{rid}"} and d_work.get_block_ids_with_load_errors() == set()
        for name in p_caches:
            for r, l in zip(remote, local):
                assert np.array_equal(block_view(p_caches[name], r), block_view(d_caches[name], l))
        assert poll(lambda: worker_step(p_work, p_sched.build_connector_meta(None),
                                        finished={f"p-{rid}"})[0],
                    f"the release of {rid}'s hold") == {f"p-{rid}"}


def test_shutdown_stops_and_joins_the_worker_and_is_harmless_twice():
    """KVConnectorBase_V1.shutdown: the native worker stops (its listener's port is free when
    shutdown returns, even though something else still refers to the worker) and every per-step
    hook vLLM may still call answers without raising."""
    port = free_port()
    work = kvferry.vllm.KvferryConnector(config("kv_consumer", port), "WORKER")
    work.register_kv_caches({"l0": fa_nhd()})
    kept = work._worker  # a reference held elsewhere (before the fix, the worker lived on)
    work.shutdown()
    assert kept.closed
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))  # the listener is gone
    with pytest.raises(kvferry.UnavailableError, match="closed"):
        kept.stats()
    work.shutdown()
    assert worker_step(work, kvferry.vllm.KvferryConnectorMetadata()) == (None, None, set(), None)
    kvferry.vllm.KvferryConnector(config("kv_consumer", port), "SCHEDULER").shutdown()


def test_every_per_step_hook_answers_in_every_state():
    """The hooks vLLM calls every step never raise: before registration, with metadata of no
    requests, and on the scheduler side's connector (whose stats vLLM merges)."""
    work = kvferry.vllm.KvferryConnector(config("kv_producer", free_port()), "WORKER")
    assert worker_step(work, kvferry.vllm.KvferryConnectorMetadata()) == (None, None, set(), None)
    sched = kvferry.vllm.KvferryConnector(config("kv_producer", free_port()), "SCHEDULER")
    assert sched.get_kv_connector_stats() is None
    work.register_kv_caches({"l0": fa_nhd()})
    for _ in range(3):
        assert worker_step(work, sched.build_connector_meta(None))[3] is None


def test_layout_modules_import_in_one_direction():
    """vllm_layout -> vllm_ascend_layout -> vllm_tensor; neither of the latter imports back."""
    package = os.path.dirname(kvferry.vllm.__file__)
    for module in ("vllm_ascend_layout.py", "vllm_tensor.py"):
        tree = ast.parse(open(os.path.join(package, module), encoding="utf-8").read())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "vllm_layout" not in names, f"{module} imports vllm_layout: {names}"


def test_a_decode_stage_pointed_at_another_stages_layers_is_refused_not_read():
    """The pipeline-parallel corruption of issue 28: a decode stage that reaches a prefill stage
    holding other layers (stage 1, layers 2-3, at the port of stage 0, layers 0-1, as a proxy
    or host layout can make happen) read them into its own layers with no error. Each layer is
    now read only from a prefill stage that holds it (the model's depth, 4 here, is in the
    compatibility hash; the stage's range is checked against the layers asked for): the load is
    refused after the handshake and not a byte moves."""
    pport, dport = free_port(), free_port(2)

    def staged(role, port, extra):
        cfg = config(role, port, extra)
        cfg.model_config.hf_text_config = SimpleNamespace(num_hidden_layers=4)
        return cfg

    p_sched = kvferry.vllm.KvferryConnector(
        staged("kv_producer", pport, {"pp_size": 2, "pp_rank": 0}), "SCHEDULER")
    p_work = kvferry.vllm.KvferryConnector(
        staged("kv_producer", pport, {"pp_size": 2, "pp_rank": 0}), "WORKER")
    d_sched = kvferry.vllm.KvferryConnector(
        staged("kv_consumer", dport, {"pp_size": 2, "pp_rank": 1}), "SCHEDULER")
    d_work = kvferry.vllm.KvferryConnector(
        staged("kv_consumer", dport, {"pp_size": 2, "pp_rank": 1, "transfer_timeout_ms": 5000}),
        "WORKER")
    p_caches = {f"model.layers.{i}.self_attn.attn": fa_nhd() for i in (0, 1)}
    d_caches = {f"model.layers.{i}.self_attn.attn": fa_nhd() for i in (2, 3)}
    for i, c in enumerate(p_caches.values()):
        fill_random(c, 50 + i)
    p_work.register_kv_caches(p_caches)
    d_work.register_kv_caches(d_caches)
    assert p_work._spec.first_layer == 0 and d_work._spec.first_layer == 2
    errors = record_load_errors(d_work)
    params, _ = offer(p_sched, p_work, "r-1", [1, 2])
    assert params["remote_pp_size"] == 2
    # Stage 1 of the decode side reads remote_port + 1 * remote_tp_size: aimed at stage 0.
    aimed = dict(params, remote_port=pport - 1)
    req = request("d-1", aimed, 2 * BS)
    d_sched.get_num_new_matched_tokens(req, 0)
    d_sched.update_state_after_alloc(req, Blocks([5, 6]), 2 * BS)
    mds = [d_sched.build_connector_meta(None)]
    got = poll(lambda: worker_step(d_work, mds.pop() if mds else
                                   d_sched.build_connector_meta(None))[1], "the refused load")
    assert got == {"d-1"}
    assert p_work._spec.model_layers == d_work._spec.model_layers == 4
    assert errors and errors[0]["code"] == "NotSupported", errors
    assert "layers [2, 4)" in errors[0]["message"], errors[0]["message"]
    assert "they hold [0, 2)" in errors[0]["message"], errors[0]["message"]
    assert all(not c.any() for c in d_caches.values()), "a byte of another stage was read"


# Cache makers of any (kernel) block size and block count, in the logical shapes vLLM's backends
# hand over (the makers of test_vllm_adapter, with the sizes parameters).
SHAPES = {
    "flash_nhd": lambda bs, nb: np.zeros((2, nb, bs, 2, 8), np.float32),
    "flash_hnd": lambda bs, nb: np.zeros((2, nb, 2, bs, 8), np.float32).transpose(0, 1, 3, 2, 4),
    "flash_main_nhd": lambda bs, nb: np.zeros((nb, 2, bs, 2, 8), np.float32),
    "flash_main_hnd": lambda bs, nb: np.zeros((nb, 2, 2, bs, 8),
                                              np.float32).transpose(0, 1, 3, 2, 4),
}


def token_rows(cache, ids, block_size, t):
    """K and V of token t, (2, heads, head_dim), of a request whose vLLM block ids are `ids`
    (block i holds tokens [i * block_size, (i + 1) * block_size)); the tensor's kernel blocks may
    be smaller: vLLM block b is kernel blocks b * ratio .. b * ratio + ratio - 1."""
    kernel = cache.shape[2]
    block, offset = divmod(t, block_size)
    k = ids[block] * (block_size // kernel) + offset // kernel
    if cache.shape[1] == 2:  # (num_blocks, 2, block_size, heads, head_dim)
        return cache[k, :, offset % kernel]
    return cache[:, k, offset % kernel]


def move_tokens(p_side, d_side, prefix_blocks, prompt=75):
    """A prefill instance and a decode instance of the given (shape, kernel block size, vLLM
    block size, kernel blocks) move one request of `prompt` tokens, the decode side holding its
    first `prefix_blocks` vLLM blocks in its prefix cache. Follows vLLM's scheduler
    (vllm/v1/core/sched/scheduler.py, schedule: get_num_new_matched_tokens with the local prefix
    hit, then update_state_after_alloc with num_external_tokens and the new blocks) and worker
    step (worker_step). Checks every token of the load in the decode block and slot that hold
    it, and that nothing else of the decode cache was written."""
    (p_shape, p_kernel, p_bs, p_nb), (d_shape, d_kernel, d_bs, d_nb) = p_side, d_side
    pport, dport = free_port(), free_port()
    p_sched = kvferry.vllm.KvferryConnector(config("kv_producer", pport, block_size=p_bs),
                                            "SCHEDULER")
    p_work = kvferry.vllm.KvferryConnector(config("kv_producer", pport, block_size=p_bs), "WORKER")
    d_sched = kvferry.vllm.KvferryConnector(config("kv_consumer", dport, block_size=d_bs),
                                            "SCHEDULER")
    d_work = kvferry.vllm.KvferryConnector(config("kv_consumer", dport, block_size=d_bs), "WORKER")
    p_caches = {f"l{i}": SHAPES[p_shape](p_kernel, p_nb) for i in range(LAYERS)}
    d_caches = {f"l{i}": SHAPES[d_shape](d_kernel, d_nb) for i in range(LAYERS)}
    for i, c in enumerate(p_caches.values()):
        fill_random(c, 70 + i)
    p_work.register_kv_caches(p_caches)
    d_work.register_kv_caches(d_caches)
    p_ids = p_nb * p_kernel // p_bs  # vLLM block ids each side has
    d_ids = d_nb * d_kernel // d_bs
    remote = list(np.random.default_rng(pport).permutation(p_ids)[:(prompt + p_bs - 1) // p_bs])
    preq = request("p-1", {"do_remote_decode": True}, prompt, "FINISHED_LENGTH_CAPPED")
    delay, params = p_sched.request_finished(preq, [int(b) for b in remote])
    assert delay
    worker_step(p_work, p_sched.build_connector_meta(None))
    computed = prefix_blocks * d_bs
    dreq = request("d-1", dict(params), prompt)
    assert d_sched.get_num_new_matched_tokens(dreq, computed) == (prompt - computed, True)
    order = [int(b) for b in np.random.default_rng(dport).permutation(d_ids)]
    cached, local = order[:prefix_blocks], order[prefix_blocks:(prompt + d_bs - 1) // d_bs]
    d_sched.update_state_after_alloc(dreq, Blocks(local), prompt - computed)
    errors = record_load_errors(d_work)
    mds = [d_sched.build_connector_meta(None)]
    got = poll(lambda: worker_step(d_work, mds.pop() if mds else
                                   d_sched.build_connector_meta(None))[1], "the load")
    assert got == {"d-1"}
    assert errors == [] and d_work.get_block_ids_with_load_errors() == set(), errors
    for name, d in d_caches.items():
        p = p_caches[name]
        written = np.zeros(d.shape, dtype=bool)  # C order, whatever d's strides
        marker = np.arange(d.size).reshape(d.shape)  # to find each element of a token row
        for t in range(computed, prompt):
            np.testing.assert_array_equal(token_rows(d, cached + local, d_bs, t),
                                          token_rows(p, remote, p_bs, t),
                                          err_msg=f"{name} token {t}")
            where = token_rows(marker, cached + local, d_bs, t)
            written.reshape(-1)[where.reshape(-1)] = True
        assert not d[~written].view(np.uint32).any(), (
            f"{name}: bytes outside the load's tokens were written")
    assert poll(lambda: worker_step(p_work, p_sched.build_connector_meta(None),
                                    finished={"p-1"})[0], "the release") == {"p-1"}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("p_bs,d_bs", [(16, 32), (32, 16)], ids=["P16-D32", "P32-D16"])
@pytest.mark.parametrize("prefix_blocks", [0, 1], ids=["no-prefix", "decode-prefix"])
def test_prefill_and_decode_block_sizes_differ(shape, p_bs, d_bs, prefix_blocks):
    """Issue 28 item 5: blocks of 16 tokens on one side and 32 on the other (vLLM's
    cache_config.block_size per instance). Before, tokens per block was in the compatibility
    hash and every load failed ("the KV cache layouts differ"). NixlConnector handles only P
    smaller than D; here both ways, every vLLM cache shape, with and without a decode prefix."""
    move_tokens((shape, p_bs, p_bs, 16), (shape, d_bs, d_bs, 16), prefix_blocks)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_kernel_blocks_smaller_than_vllms_block_in_every_shape(shape, side):
    """Issue 28 item 5: the attention backend's kernel block is smaller than vLLM's block
    (vLLM block b is kernel blocks b * ratio ..; NixlConnector's _logical_to_kernel_block_ids).
    Before, (num_blocks, 2, ...) tensors and head-major ones with such blocks were refused at
    registration. Kernel blocks of 8 in vLLM blocks of 32 on one side, against whole blocks of 16
    on the other, a decode-side prefix: every token checked."""
    small = (shape, 8, 32, 32)
    # The layout (token- or head-major) is in the compatibility hash: the other side shares it.
    plain = ("flash_main_hnd" if shape.endswith("hnd") else "flash_main_nhd", 16, 16, 16)
    if side == "prefill":
        move_tokens(small, plain, prefix_blocks=1)
    else:
        move_tokens(plain, small, prefix_blocks=1)
