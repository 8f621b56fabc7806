"""Hybrid models in vLLM (issue 29): the adapter driven as vLLM drives a SupportsHMA connector,
with a real-shaped KVCacheConfig. Each test cites the vLLM file and function it follows:

- vllm/v1/kv_cache_interface.py: KVCacheConfig(num_blocks, kv_cache_tensors, kv_cache_groups),
  KVCacheGroupSpec(layer_names, kv_cache_spec), FullAttentionSpec / SlidingWindowSpec /
  MambaSpec, KVCacheTensor(size, shared_by): layer i of every group shares one tensor;
- vllm/v1/core/kv_cache_manager.py KVCacheBlocks.get_block_ids(): a tuple of lists, one per
  group; vllm/v1/core/block_pool.py: block 0 is the null block, which
  SlidingWindowManager.remove_skipped_blocks puts in a window group's table before its window;
- vllm/v1/core/sched/scheduler.py Scheduler.schedule (update_state_after_alloc with the
  request's whole KVCacheBlocks and num_external_computed_tokens) and _connector_finished
  (request_finished_all_groups for a SupportsHMA connector);
- the connector's constructor (vllm_config, role, kv_cache_config), as vLLM's factory calls it.
"""

from types import SimpleNamespace

import numpy as np
import pytest

import kvferry
import kvferry.vllm
import kvferry.vllm_groups
from common import free_port
from test_vllm_adapter import BS, DIM, HEADS, NB, config, request
from test_vllm_today import aggregate, poll
from test_vllm_today import worker_step as _worker_step


def worker_step(work, md, finished=(), caches=None, sched=None, sync_loads=False):
    """A worker step (test_vllm_today.worker_step: every per-step worker hook in vLLM's order,
    start_load_kv before the forward with `sync_loads`, after it otherwise); then, with `sched`,
    the scheduler's per-step hooks on its output as vllm/v1/core/sched/scheduler.py
    update_from_output calls them (take_events, update_connector_output)."""
    out = _worker_step(work, md, finished, caches, sync_loads=sync_loads)
    if sched is not None:
        assert tuple(sched.take_events()) == ()
        sched.update_connector_output(SimpleNamespace(
            finished_sending=out[0], finished_recving=out[1], invalid_block_ids=out[2],
            kv_connector_stats=out[3]))
    return out


class FullAttentionSpec(SimpleNamespace):
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


class KVCacheBlocks:
    """vllm/v1/core/kv_cache_manager.py KVCacheBlocks: get_block_ids() is one list per group."""

    def __init__(self, groups):
        self.groups = [list(g) for g in groups]

    def get_block_ids(self):
        return tuple(list(g) for g in self.groups)

    def get_unhashed_block_ids(self):
        raise AssertionError("get_unhashed_block_ids asserts one group in vLLM")


def load_and_release(d_sched, d_work, d_id, p_sched, p_work, p_id, d_caches=None,
                     p_caches=None):
    """The decode side's steps until its load of `d_id` finished (it is awaited in the first
    step's metadata), then the prefill side's until its hold of `p_id` ended, each as vLLM's
    workers and scheduler step (worker_step; with caches, the layer hooks for those layers)."""
    mds = [d_sched.build_connector_meta(None)]
    assert mds[0].awaited == (d_id,)
    got = poll(lambda: worker_step(d_work, mds.pop() if mds else
                                   d_sched.build_connector_meta(None), caches=d_caches,
                                   sched=d_sched)[1],
               "the load")
    assert got == {d_id}
    assert poll(lambda: worker_step(p_work, p_sched.build_connector_meta(None),
                                    finished={p_id}, caches=p_caches, sched=p_sched)[0],
                "the prefill release") == {p_id}


def attention_layers(kcc, caches):
    """The layers vLLM's attention ops call wait_for_layer_load and save_kv_layer for
    (attention/layer.py unified_attention_with_output); Mamba mixers call neither."""
    names = {n for g in kcc.kv_cache_groups if type(g.kv_cache_spec).__name__ != "MambaSpec"
             for n in g.layer_names}
    return {n: c for n, c in caches.items() if n in names}


WINDOW = 2 * BS  # tokens


def gpt_oss_like(layers=4, window=WINDOW):
    """A gpt-oss-like model: layers alternating full attention and a sliding window, two KV
    cache groups (vLLM's HybridKVCacheCoordinator), layer i of both groups one tensor
    (KVCacheTensor shared_by)."""
    full = [f"model.layers.{i}.self_attn.attn" for i in range(0, layers, 2)]
    swa = [f"model.layers.{i}.self_attn.attn" for i in range(1, layers, 2)]
    spec = dict(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype="int32")
    groups = [SimpleNamespace(layer_names=full, kv_cache_spec=FullAttentionSpec(**spec)),
              SimpleNamespace(layer_names=swa,
                              kv_cache_spec=SlidingWindowSpec(sliding_window=window, **spec))]
    tensors = [SimpleNamespace(size=0, shared_by=[f, w]) for f, w in zip(full, swa)]
    return SimpleNamespace(num_blocks=NB, kv_cache_tensors=tensors, kv_cache_groups=groups)


def caches_for(kv_cache_config, seed=None):
    """The model runner's tensors: one (2, NB, BS, HEADS, DIM) tensor per KVCacheTensor, every
    layer it is shared by a view of it."""
    out = {}
    for i, t in enumerate(kv_cache_config.kv_cache_tensors):
        tensor = np.zeros((2, NB, BS, HEADS, DIM), np.int32)  # bytes compare exactly (no NaN)
        if seed is not None:
            tensor.reshape(-1).view(np.uint8)[...] = np.random.default_rng(seed + i).integers(
                0, 256, tensor.nbytes, dtype=np.uint8)
        for name in t.shared_by:
            out[name] = tensor
    return out


def hybrid_pair(kv_cache_config):
    pport, dport = free_port(), free_port()
    made = []
    for role, port in (("kv_producer", pport), ("kv_consumer", dport)):
        made.append(tuple(kvferry.vllm.KvferryConnector(config(role, port), r, kv_cache_config)
                          for r in ("SCHEDULER", "WORKER")))
    p_caches, d_caches = caches_for(kv_cache_config, seed=7), caches_for(kv_cache_config)
    made[0][1].register_kv_caches(p_caches)
    made[1][1].register_kv_caches(d_caches)
    return made[0], p_caches, made[1], d_caches


def test_the_connector_supports_hma_and_a_gpt_oss_like_model_moves_its_window_only():
    """Prefill 30 tokens (8 blocks of 4); the decode instance loads all of them. The full group
    moves every block; the window group (8 tokens) only the blocks holding the last 8 tokens, from
    the start of the block they begin in; its blocks before the window are vLLM's null block on
    the prefill side (freed) and not allocated on the decode side."""
    assert hasattr(kvferry.vllm.KvferryConnector, "request_finished_all_groups")
    kcc = gpt_oss_like()
    (p_sched, p_work), p_caches, (d_sched, d_work), d_caches = hybrid_pair(kcc)
    prompt = 30
    # vLLM keeps a window group's blocks from the one holding the first token still attended
    # (SlidingWindowManager: skipped tokens n - window + 1): blocks 5..7 here, null before.
    p_full, p_swa = [1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 0, 0, 9, 10, 11]
    req = request("r-1", {"do_remote_decode": True}, prompt, "FINISHED_LENGTH_CAPPED")
    delay, params = p_sched.request_finished_all_groups(req, (p_full, p_swa))
    assert delay and params["remote_group_block_ids"] == [[-1] * 5 + [9, 10, 11]]
    worker_step(p_work, p_sched.build_connector_meta(None), sched=p_sched)
    d_full, d_swa = [8, 7, 6, 5, 4, 3, 2, 1], [0, 0, 0, 0, 0, 12, 13, 14]
    dreq = request("d-1", dict(params), prompt)
    assert d_sched.get_num_new_matched_tokens(dreq, 0) == (prompt, True)
    d_sched.update_state_after_alloc(dreq, KVCacheBlocks((d_full, d_swa)), prompt)
    load_and_release(d_sched, d_work, "d-1", p_sched, p_work, "r-1")
    full = [f"model.layers.{i}.self_attn.attn" for i in (0, 2)]
    swa = [f"model.layers.{i}.self_attn.attn" for i in (1, 3)]
    for name in full:
        for pb, db in zip(p_full, d_full):
            assert np.array_equal(d_caches[name][:, db], p_caches[name][:, pb]), (name, db)
    for name in swa:
        # The window is tokens [22, 30), from the start of block 5 (tokens 20..23): blocks 5
        # and 6 whole, block 7 the prompt's tokens 28 and 29.
        assert np.array_equal(d_caches[name][:, 12], p_caches[name][:, 9]), name
        assert np.array_equal(d_caches[name][:, 13], p_caches[name][:, 10]), name
        assert np.array_equal(d_caches[name][:, 14, :2], p_caches[name][:, 11, :2]), name
    # Nothing else of the shared tensors was written: the full group's blocks and the window's.
    written = set(d_full) | {12, 13, 14}
    for name in full + swa:
        for b in range(NB):
            if b not in written:
                assert not d_caches[name][:, b].any(), (name, b)
    # Bytes: a block of a part is BS * HEADS * DIM * 4; the full group 8 blocks, the window's
    # 2.5 (blocks 5 and 6, half of 7), each of 2 parts of 2 layers: 10,752 bytes, where moving
    # every layer as full attention (vLLM without HMA) moves 16,384.
    block = BS * HEADS * DIM * 4
    assert d_work._worker.stats()["bytes_read"] == (8 + 2.5) * block * 2 * 2


PAGE = 2 * BS * HEADS * DIM * 4  # one attention block, K and V: vLLM pads the state to it
CONV, TAPS, VHEADS, HV, HK = 32, 3, 2, 8, 2  # GDN: Q, K 8 channels each, V 16; state (2, 8, 2)
MAX_LEN = 1024


def qwen3_next_like(layers=8, tp=1):
    """A Qwen3-Next-like model: of every four layers three gated-delta-net state layers and one
    full attention (vllm/model_executor/models/qwen3_next.py), as vLLM's hybrid allocator groups
    them (kv_cache_utils.py _get_kv_cache_groups_uniform_page_size): one full-attention group and
    three MambaSpec groups of equal size, layer i of every group one KVCacheTensor, the attention
    block size raised so that a block of K and V fills one state page. MambaSpec: shapes
    ((conv_dim, kernel - 1), (value heads, head_v_dim, head_k_dim)) per rank in the DS layout
    (mamba_utils.py gated_delta_net_state_shape), mamba_cache_mode "none" (block size
    max_model_len: one state block per request)."""
    names = [f"model.layers.{i}" for i in range(layers)]
    full = [n + ".self_attn.attn" for n in names[3::4]]
    lin = [[n + ".linear_attn" for n in names[k::4]] for k in range(3)]
    # A spec's shapes are a TP rank's (vLLM divides heads and channels by the TP size).
    attn = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS // tp, head_size=DIM,
                             dtype="int32")
    state = MambaSpec(block_size=MAX_LEN, shapes=((CONV // tp, TAPS), (VHEADS // tp, HV, HK)),
                      dtypes=("float32", "float32"), mamba_type="gdn_attention",
                      num_speculative_blocks=0, mamba_cache_mode="none")
    groups = [SimpleNamespace(layer_names=full, kv_cache_spec=attn)] + [
        SimpleNamespace(layer_names=g, kv_cache_spec=state) for g in lin]
    tensors = [SimpleNamespace(size=NB * PAGE // tp, shared_by=[full[i]] + [g[i] for g in lin])
               for i in range(len(full))]
    return SimpleNamespace(num_blocks=NB, kv_cache_tensors=tensors, kv_cache_groups=groups)


def state_caches_for(kcc, seed=None, tp=1):
    """What vLLM's model runner binds for a Mamba-hybrid model (gpu_model_runner.py
    _reshape_kv_cache_tensors and _update_hybrid_attention_mamba_layout): each KVCacheTensor one
    raw buffer of NB pages; an attention layer's (2, NB, BS, HEADS, DIM) view with K and V side by
    side in each page; a state layer's [conv (NB, CONV, TAPS), ssm (NB, VHEADS, HV, HK)], both a
    page apart per block, the SSM state right after the conv state."""
    out, raws = {}, []
    page, heads, conv_dim, vheads = PAGE // tp, HEADS // tp, CONV // tp, VHEADS // tp
    for i, t in enumerate(kcc.kv_cache_tensors):
        raw = np.zeros(NB * page, np.uint8)
        if seed is not None:
            raw[...] = np.random.default_rng(seed + i).integers(0, 256, raw.size, dtype=np.uint8)
        raws.append(raw)
        block = BS * heads * DIM * 4
        attn = np.lib.stride_tricks.as_strided(
            raw.view(np.int32), (2, NB, BS, heads, DIM), (block, page, heads * DIM * 4, DIM * 4, 4))
        conv = np.lib.stride_tricks.as_strided(raw.view(np.float32), (NB, conv_dim, TAPS),
                                               (page, TAPS * 4, 4))
        ssm = np.lib.stride_tricks.as_strided(raw[conv_dim * TAPS * 4:].view(np.float32),
                                              (NB, vheads, HV, HK), (page, HV * HK * 4, HK * 4, 4))
        out[t.shared_by[0]] = attn
        for name in t.shared_by[1:]:
            out[name] = [conv, ssm]
    return out, raws


def state_pair(kcc, make_caches, seed):
    """A prefill and a decode connector (scheduler and worker each, as vLLM's factory makes
    them with the KVCacheConfig) whose workers registered the caches `make_caches` lays out:
    ((p_sched, p_work), p_caches, (d_sched, d_work), d_caches, d_raw)."""
    pport, dport = free_port(), free_port()
    (p_sched, p_work), (d_sched, d_work) = [
        tuple(kvferry.vllm.KvferryConnector(config(role, port), r, kcc)
              for r in ("SCHEDULER", "WORKER"))
        for role, port in (("kv_producer", pport), ("kv_consumer", dport))]
    p_caches, _ = make_caches(kcc, seed=seed)
    d_caches, d_raw = make_caches(kcc)
    p_work.register_kv_caches(p_caches)
    d_work.register_kv_caches(d_caches)
    return (p_sched, p_work), p_caches, (d_sched, d_work), d_caches, d_raw


def expect_only_written_pages(d_raw, d_blocks, d_work):
    """Pages no group wrote stay zero (shared tensors: one group's block is not another's), and
    the decode worker read 8 whole attention blocks (32 tokens) of 2 parts of 2 full layers (64
    bytes a part a token) and 3 state groups of 2 layers one page each, once."""
    written = set(d_blocks[0]) | {b for g in d_blocks[1:] for b in g}
    for raw in d_raw:
        for b in range(NB):
            if b not in written:
                assert not raw[b * PAGE:(b + 1) * PAGE].any(), b
    assert d_work._worker.stats()["bytes_read"] == 32 * 64 * 2 * 2 + 3 * 2 * PAGE


def test_a_qwen3_next_like_model_starts_and_moves_every_group_with_vllms_token_rule(monkeypatch):
    """The hybrid SSM model registers and starts (before, vLLM refused it at startup), and a P/D
    transfer moves each group as vLLM's NixlConnector does (nixl/base_scheduler.py): the prefill
    side computes the prompt less its last token (_truncate_mamba_request_for_prefill, once), the
    decode side loads that many (_get_remote_prefill_token_count) and each state group's one
    block, the state as of that token (get_exchange_clipped_blocks); request_finished_all_groups
    holds every group's blocks until the decode side read them; nothing is left held."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")  # NixlConnector asserts it too
    kcc = qwen3_next_like()
    (p_sched, p_work), p_caches, (d_sched, d_work), d_caches, d_raw = state_pair(
        kcc, state_caches_for, 3)
    prompt = 30
    req = request("r-1", {"do_remote_decode": True}, prompt)
    req.max_tokens = 16
    # vLLM's scheduler asks every new request (Scheduler.schedule); the prefill side drops the
    # last prompt token and generates one token, once.
    assert p_sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert p_sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert (len(req.prompt_token_ids), req.num_prompt_tokens, req.max_tokens) == (29, 29, 1)
    req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    p_blocks = ([1, 2, 3, 4, 5, 6, 7, 8], [9], [10], [11])  # 29 tokens: 8 blocks; a state each
    delay, params = p_sched.request_finished_all_groups(req, p_blocks)
    assert delay and params["remote_group_block_ids"] == [[9], [10], [11]]
    worker_step(p_work, p_sched.build_connector_meta(None), sched=p_sched)
    dreq = request("d-1", dict(params), prompt)
    assert d_sched.get_num_new_matched_tokens(dreq, 0) == (prompt - 1, True)
    d_blocks = ([8, 7, 6, 5, 4, 3, 2, 1], [12], [13], [14])
    d_sched.update_state_after_alloc(dreq, KVCacheBlocks(d_blocks), prompt - 1)
    load_and_release(d_sched, d_work, "d-1", p_sched, p_work, "r-1",
                     attention_layers(kcc, d_caches), attention_layers(kcc, p_caches))
    for full in kcc.kv_cache_groups[0].layer_names:
        for pb, db in zip(p_blocks[0][:7], d_blocks[0][:7]):
            assert np.array_equal(d_caches[full][:, db], p_caches[full][:, pb]), (full, db)
        # Token 28, the prompt's 29th, is slot 0 of the last block; the 30th is the decode's to
        # compute (the block is read whole, as a one-group load reads it: the decode side
        # writes its slots from 1 on).
        assert np.array_equal(d_caches[full][:, 1, 0], p_caches[full][:, 8, 0]), full
    for g in (1, 2, 3):
        for name in kcc.kv_cache_groups[g].layer_names:
            pb, db = p_blocks[g][0], d_blocks[g][0]
            for part in (0, 1):
                # As bits: random bytes make NaNs, which compare unequal as floats.
                assert np.array_equal(d_caches[name][part][db].view(np.uint32),
                                      p_caches[name][part][pb].view(np.uint32)), name
    # Bytes: 8 whole blocks (32 tokens) of 2 parts of 2 full layers (64 bytes a part a token),
    # and 3 state groups of 2 layers one page each.
    expect_only_written_pages(d_raw, d_blocks, d_work)
    assert d_work._worker.stats()["loads_outstanding"] == 0
    assert p_work._worker.stats()["holds_outstanding"] == 0


def test_state_groups_move_from_prefill_tp1_to_decode_tp2_sliced_by_channels_and_heads(
        monkeypatch):
    """Heterogeneous TP for state groups (NixlConnector's "3-read" Mamba transfer, DS conv
    layout): each decode rank reads its share of the prefill's Q, K and V conv channels and of
    its SSM heads (mamba_utils.py: conv_dim and the value heads divided by the TP size), and its
    attention heads; the prefill rank frees once both decode ranks have read it."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    p_kcc, d_kcc = qwen3_next_like(), qwen3_next_like(tp=2)
    pport, dport = free_port(), free_port()
    p_sched = kvferry.vllm.KvferryConnector(config("kv_producer", pport), "SCHEDULER", p_kcc)
    p_work = kvferry.vllm.KvferryConnector(config("kv_producer", pport), "WORKER", p_kcc)
    d_sched = kvferry.vllm.KvferryConnector(config("kv_consumer", dport, tp=2), "SCHEDULER",
                                            d_kcc)
    d_works = [kvferry.vllm.KvferryConnector(
        config("kv_consumer", dport, extra={"tp_rank": r}, tp=2), "WORKER", d_kcc)
        for r in (0, 1)]
    p_caches, _ = state_caches_for(p_kcc, seed=5)
    p_work.register_kv_caches(p_caches)
    d_caches = [state_caches_for(d_kcc, tp=2)[0] for _ in (0, 1)]
    for w, c in zip(d_works, d_caches):
        w.register_kv_caches(c)
    prompt = 13
    req = request("r-2", {"do_remote_decode": True}, prompt)
    assert p_sched.get_num_new_matched_tokens(req, 0) == (0, False)
    req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    p_blocks = ([1, 2, 3], [4], [5], [6])  # 12 tokens computed: 3 blocks
    _, params = p_sched.request_finished_all_groups(req, p_blocks)
    worker_step(p_work, p_sched.build_connector_meta(None), sched=p_sched)
    dreq = request("d-2", dict(params), prompt)
    assert d_sched.get_num_new_matched_tokens(dreq, 0) == (prompt - 1, True)
    d_blocks = ([9, 10, 11], [12], [13], [14])
    d_sched.update_state_after_alloc(dreq, KVCacheBlocks(d_blocks), prompt - 1)
    mds = [d_sched.build_connector_meta(None)]
    assert mds[0].awaited == ("d-2",)
    done = [set(), set()]
    reported = set()

    def step():
        # One engine step: fresh metadata for both ranks, then the scheduler's hooks on their
        # aggregated output (vllm/distributed/kv_transfer/kv_connector/utils.py
        # KVOutputAggregator: a request is finished once every rank reported it).
        md = mds.pop() if mds else d_sched.build_connector_meta(None)
        outs = [worker_step(w, md, caches=attention_layers(d_kcc, d_caches[r]))
                for r, w in enumerate(d_works)]
        for r, out in enumerate(outs):
            done[r] |= out[1] or set()
        both = (done[0] & done[1]) - reported
        reported.update(both)
        assert tuple(d_sched.take_events()) == ()
        d_sched.update_connector_output(SimpleNamespace(
            finished_sending=None, finished_recving=both or None,
            invalid_block_ids=set().union(*(out[2] for out in outs)),
            kv_connector_stats=aggregate(outs)))
        return reported

    assert poll(step, "both decode ranks' loads") == {"d-2"}
    assert poll(lambda: worker_step(p_work, p_sched.build_connector_meta(None),
                                    finished={"r-2"}, sched=p_sched)[0],
                "the prefill release") == {"r-2"}
    q = CONV // 4  # Q and K channels each; V is half the channels
    for r in (0, 1):
        for g in (1, 2, 3):
            for name in p_kcc.kv_cache_groups[g].layer_names:
                conv = p_caches[name][0][p_blocks[g][0]].view(np.uint32)
                ssm = p_caches[name][1][p_blocks[g][0]].view(np.uint32)
                got_conv = d_caches[r][name][0][d_blocks[g][0]].view(np.uint32)
                got_ssm = d_caches[r][name][1][d_blocks[g][0]].view(np.uint32)
                half = q // 2
                want = np.concatenate([conv[r * half:(r + 1) * half],
                                       conv[q + r * half:q + (r + 1) * half],
                                       conv[2 * q + r * q:2 * q + (r + 1) * q]])
                assert np.array_equal(got_conv, want), (r, name)
                assert np.array_equal(got_ssm[0], ssm[r]), (r, name)
        for name in p_kcc.kv_cache_groups[0].layer_names:
            for pb, db in zip(p_blocks[0], d_blocks[0]):
                assert np.array_equal(d_caches[r][name][:, db, :, 0], p_caches[name][:, pb, :, r])
    assert p_work._worker.stats()["holds_outstanding"] == 0


def test_a_state_group_not_in_vllms_page_layout_is_refused_naming_it(monkeypatch):
    """A state layer whose tensors are not vLLM's page layout (the SSM state right after the conv
    state, a page apart per block) is refused at registration, naming the group and the layer."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    kcc = qwen3_next_like()
    caches, _ = state_caches_for(kcc)
    name = kcc.kv_cache_groups[2].layer_names[1]
    caches[name] = [caches[name][0], np.zeros((NB, VHEADS, HV, HK), np.float32)]
    work = kvferry.vllm.KvferryConnector(config("kv_consumer", free_port()), "WORKER", kcc)
    with pytest.raises(kvferry.NotSupportedError, match=f"KV cache group 2 layer {name}"):
        work.register_kv_caches(caches)


def test_groups_vllm_does_not_transfer_are_left_out_and_eagle_groups_move():
    """vLLM's transfer groups (KVCacheConfig.transfer_groups, KVCacheGroupSpec
    .enable_kv_transfer): a group it excludes (a draft the decode side recomputes) is neither
    registered nor moved, its block ids dropped from the params. is_eagle_group is a prefix-cache
    hint on a group that may hold the model's own layers: that group moves."""
    kcc = gpt_oss_like()
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=DIM, dtype="int32")
    kcc.kv_cache_groups.append(SimpleNamespace(
        layer_names=["draft_model.layers.0.self_attn.attn"], kv_cache_spec=spec,
        enable_kv_transfer=False))
    kcc.kv_cache_groups[0].is_eagle_group = True
    sched = kvferry.vllm.KvferryConnector(config("kv_producer", free_port()), "SCHEDULER", kcc)
    req = request("r", {"do_remote_decode": True}, 8, "FINISHED_LENGTH_CAPPED")
    _, params = sched.request_finished_all_groups(req, ([1, 2], [3, 4], [5, 6]))
    assert params["remote_block_ids"] == [1, 2]
    assert params["remote_group_block_ids"] == [[3, 4]]


def test_params_naming_other_groups_are_prefilled_here_never_raised_into_vllm():
    """A prefill instance of one group (or another model) against a hybrid decode instance:
    get_num_new_matched_tokens says no remote KV (vLLM computes it), update_state_after_alloc
    queues nothing and raises nothing."""
    kcc = gpt_oss_like()
    sched = kvferry.vllm.KvferryConnector(config("kv_consumer", free_port()), "SCHEDULER", kcc)
    one_group = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "p",
                 "remote_host": "127.0.0.1", "remote_port": 5557, "remote_tp_size": 1}
    req = request("d", dict(one_group), 8)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, KVCacheBlocks(([], [])), 0)
    assert sched.build_connector_meta(None).awaited == ()


def test_one_sliding_window_group_takes_the_groups_path():
    """A model whose every layer has a sliding window is one vLLM group with a SlidingWindowSpec:
    its table holds vLLM's null block before the window, which the one-group path would read as
    block 0, so it takes the groups path; one full-attention group keeps the one-group path."""
    kcc = gpt_oss_like()
    swa_only = SimpleNamespace(kv_cache_groups=[kcc.kv_cache_groups[1]])
    groups = kvferry.vllm_groups.transfer_groups(swa_only, BS)
    assert [g.sliding_window for g in groups] == [WINDOW]
    assert kvferry.vllm_groups.group_block_ids(([0, 0, 5, 6],), groups) == [[-1, -1, 5, 6]]
    full_only = SimpleNamespace(kv_cache_groups=[kcc.kv_cache_groups[0]])
    assert kvferry.vllm_groups.transfer_groups(full_only, BS) is None


def test_every_per_step_hook_answers_for_a_hybrid_connector_in_every_state():
    """The hooks vLLM calls every step (vllm/v1/worker/kv_connector_model_runner_mixin.py) never
    raise for a hybrid connector: before registration, after it, with steps of no requests, and
    with a hybrid load that fails (its peer is gone): it ends once, its blocks reported."""
    kcc = gpt_oss_like()
    work = kvferry.vllm.KvferryConnector(config("kv_consumer", free_port(),
                                                {"transfer_timeout_ms": 2000}), "WORKER", kcc)
    sched = kvferry.vllm.KvferryConnector(config("kv_consumer", free_port()), "SCHEDULER", kcc)
    assert worker_step(work, kvferry.vllm.KvferryConnectorMetadata()) == (None, None, set(), None)
    caches = caches_for(kcc)
    work.register_kv_caches(caches)
    for _ in range(2):
        worker_step(work, sched.build_connector_meta(None), caches=caches, sched=sched)
    gone = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "p",
            "remote_host": "127.0.0.1", "remote_port": free_port(), "remote_tp_size": 1,
            "remote_group_block_ids": [[-1, 3]]}
    req = request("d", dict(gone), 2 * BS)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    sched.update_state_after_alloc(req, KVCacheBlocks(([4, 5], [0, 6])), 2 * BS)
    mds = [sched.build_connector_meta(None)]
    outputs = []

    def step():
        outputs.append(worker_step(work, mds.pop() if mds else sched.build_connector_meta(None),
                                   caches=caches, sched=sched))
        return outputs[-1][1]

    assert poll(step, "the failed load to end", timeout=20.0) == {"d"}
    assert set().union(*(o[2] for o in outputs)) == {4, 5, 6}, "every group's blocks, no null"


@pytest.mark.parametrize("sync_loads", [False, True], ids=["start-after", "start-before"])
def test_a_qwen3_next_like_model_moves_layer_by_layer_in_chunks_its_state_once_final(
        monkeypatch, sync_loads):
    """Layer-wise legs of a hybrid SSM model (docs/layerwise.md, "KV cache groups"). The decode
    leg subscribes first; the prefill leg computes its prompt (less its last token, vLLM's rule)
    in two chunks, as vLLM's scheduler schedules them (Scheduler.schedule:
    num_scheduled_tokens, scheduled_cached_reqs.new_block_ids one list per group). Each step is
    a worker step of every hook in vLLM's order (test_vllm_today.worker_step), the attention
    layers' save_kv_layer from the attention op (attention/layer.py
    unified_attention_with_output); the Mamba mixers call none, so kvferry announces the state
    layers in wait_for_save. The first chunk leaves an intermediate state: a state read then
    (and not again) fails the byte check, and one read twice fails the byte count. The prefill
    request is held under the transfer id (request_finished_all_groups) and freed by its
    reader; nothing is left held. Both of vLLM's step orders (start_load_kv before the forward
    when the step has synchronous loads, after it otherwise: gpu_model_runner.py)."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    kcc = qwen3_next_like()
    (p_sched, p_work), p_caches, (d_sched, d_work), d_caches, d_raw = state_pair(
        kcc, state_caches_for, 11)
    pport = p_work._settings.base_port
    prompt, transfer = 30, "xfer-h"
    dparams = {"do_remote_prefill": True, "transfer_id": transfer,
               "remote_engine_id": f"kv_producer-{pport}", "remote_host": "127.0.0.1",
               "remote_port": pport, "remote_tp_size": 1}
    dreq = request("d-1", dparams, prompt)
    assert d_sched.get_num_new_matched_tokens(dreq, 0) == (prompt - 1, True)
    d_blocks = ([8, 7, 6, 5, 4, 3, 2, 1], [12], [13], [14])
    d_sched.update_state_after_alloc(dreq, KVCacheBlocks(d_blocks), prompt - 1)
    md = d_sched.build_connector_meta(None)
    assert md.awaited == ("d-1",)
    assert not worker_step(d_work, md, caches=attention_layers(kcc, d_caches), sched=d_sched, sync_loads=sync_loads)[1]

    preq = request("p-1", {"do_remote_decode": True, "transfer_id": transfer}, prompt)
    preq.max_tokens = 16
    assert p_sched.get_num_new_matched_tokens(preq, 0) == (0, False)  # truncated to 29, once
    p_blocks = ([1, 2, 3, 4, 5, 6, 7, 8], [9], [10], [11])
    p_sched.update_state_after_alloc(preq, KVCacheBlocks(([1, 2, 3, 4], [9], [10], [11])), 0)
    full = kcc.kv_cache_groups[0].layer_names
    states = [n for g in kcc.kv_cache_groups[1:] for n in g.layer_names]
    chunks = [(0, 16, [1, 2, 3, 4], None),
              (16, 13, [5, 6, 7, 8],
               SimpleNamespace(req_ids=["p-1"], new_block_ids=[([5, 6, 7, 8], [], [], [])]))]
    for n, (computed, count, written, cached) in enumerate(chunks):
        preq.num_computed_tokens = computed
        out = SimpleNamespace(num_scheduled_tokens={"p-1": count}, scheduled_cached_reqs=cached)
        md = p_sched.build_connector_meta(out)
        # The forward pass: this chunk's KV of every attention layer, and each state layer's
        # state as of the chunk's last token (in place, in the request's one state block).
        for i, name in enumerate(full):
            for b in written:
                p_caches[name][:, b] = 1000 * (n + 1) + 10 * i + b
        for i, name in enumerate(states):
            g = 1 + i // 2
            p_caches[name][0][p_blocks[g][0]] = 100.0 * (n + 1) + i
            p_caches[name][1][p_blocks[g][0]] = -100.0 * (n + 1) - i
        worker_step(p_work, md, caches=attention_layers(kcc, p_caches), sched=p_sched, sync_loads=sync_loads)
        if n == 0:
            # Before the next chunk (an event, not a sleep): the decode side has read the first
            # chunk's attention blocks (4 blocks of 2 parts of 2 layers, 64 bytes a part a
            # token), and not the intermediate state.
            chunk_bytes = 16 * 64 * 2 * 2
            poll(lambda: d_work._worker.stats()["bytes_read"] >= chunk_bytes, "the first chunk")
            assert d_work._worker.stats()["bytes_read"] == chunk_bytes
    assert poll(lambda: worker_step(d_work, d_sched.build_connector_meta(None),
                                    caches=attention_layers(kcc, d_caches), sched=d_sched, sync_loads=sync_loads)[1],
                "the layer-wise load") == {"d-1"}
    assert d_work.get_block_ids_with_load_errors() == set()
    for name in full:
        for pb, db in zip(p_blocks[0], d_blocks[0]):
            assert np.array_equal(d_caches[name][:, db], p_caches[name][:, pb]), (name, db)
    for i, name in enumerate(states):
        g = 1 + i // 2
        assert np.all(d_caches[name][0][d_blocks[g][0]] == 200.0 + i), name  # the final state
        assert np.all(d_caches[name][1][d_blocks[g][0]] == -200.0 - i), name
    # Every attention block once (the chunk boundary is a block's), each state once.
    expect_only_written_pages(d_raw, d_blocks, d_work)
    preq.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    delay, params = p_sched.request_finished_all_groups(preq, p_blocks)
    assert delay and params["remote_request_id"] == transfer
    assert poll(lambda: worker_step(p_work, p_sched.build_connector_meta(None),
                                    finished={"p-1"}, sched=p_sched, sync_loads=sync_loads)[0],
                "the hold's release") == {"p-1"}
    assert p_work._worker.stats()["holds_outstanding"] == 0
    assert d_work._worker.stats()["loads_outstanding"] == 0


SSM_ASCEND = (VHEADS, HV, 4)  # 256 bytes a block: one attention K block (vllm-ascend forces it)


def ascend_qwen3_next_like(layers=8):
    """qwen3_next_like as vllm-ascend configures it (patch/platform/patch_mamba_config.py
    verify_and_update_config: an attention block's K as large as a block's SSM state), the
    conv state in the SD layout its NPU kernel takes (ops/gdn.py)."""
    kcc = qwen3_next_like(layers)
    for g in kcc.kv_cache_groups[1:]:
        g.kv_cache_spec = MambaSpec(**dict(vars(g.kv_cache_spec),
                                           shapes=((CONV, TAPS), SSM_ASCEND)))
    return kcc


def ascend_state_caches_for(kcc, seed=None):
    """What vllm-ascend's NPU model runner binds for a Mamba-hybrid model (vllm_ascend/worker/
    model_runner_v1.py _allocate_kv_cache_tensors and _reshape_kv_cache_tensors at 182b75ea):
    each KVCacheTensor one raw buffer [every block's conv state | K of every block | V of every
    block]; a state layer's [conv (NB, CONV, TAPS), ssm (NB, *SSM_ASCEND)], each contiguous, the
    SSM run where the attention layer's K run is; an attention layer's (k, v) tuple, each
    (NB, BS, HEADS, DIM)."""
    out, raws = {}, []
    conv_run = NB * CONV * TAPS * 4
    kb = BS * HEADS * DIM * 4
    for i, t in enumerate(kcc.kv_cache_tensors):
        raw = np.zeros(conv_run + 2 * NB * kb, np.uint8)
        if seed is not None:
            raw[...] = np.random.default_rng(seed + i).integers(0, 256, raw.size, dtype=np.uint8)
        raws.append(raw)
        k = raw[conv_run:conv_run + NB * kb].view(np.int32).reshape(NB, BS, HEADS, DIM)
        v = raw[conv_run + NB * kb:].view(np.int32).reshape(NB, BS, HEADS, DIM)
        conv = raw[:conv_run].view(np.float32).reshape(NB, CONV, TAPS)
        ssm = raw[conv_run:conv_run + NB * kb].view(np.float32).reshape(NB, *SSM_ASCEND)
        out[t.shared_by[0]] = (k, v)
        for name in t.shared_by[1:]:
            out[name] = [conv, ssm]
    return out, raws


def test_vllm_ascends_hybrid_layout_registers_and_moves_every_group():
    """vllm-ascend's hybrid path: its MooncakeHybridConnector moves FullAttentionSpec,
    SlidingWindowSpec and MambaSpec groups (kv_p2p/mooncake_hybrid_connector.py
    register_kv_caches: every sub-view of a shared KVCacheTensor its own base, same TP sizes
    with Mamba). kvferry takes the same caches: the attention layers' (k, v) tuples and the state
    layers' contiguous conv and SSM runs (the SSM run the K run's bytes, as aliased regions), and
    moves each group with vLLM's token rule, every byte checked."""
    kcc = ascend_qwen3_next_like()
    (p_sched, p_work), p_caches, (d_sched, d_work), d_caches, _ = state_pair(
        kcc, ascend_state_caches_for, 17)
    prompt = 22
    req = request("r-a", {"do_remote_decode": True}, prompt)
    assert p_sched.get_num_new_matched_tokens(req, 0) == (0, False)  # 21 tokens computed
    req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    # One block pool for every group (vLLM's hybrid allocator): a block is attention's or a
    # state's, never both, so the aliased K and SSM runs never hold two things at once.
    p_blocks = ([1, 2, 3, 4, 5, 6], [7], [8], [9])
    delay, params = p_sched.request_finished_all_groups(req, p_blocks)
    assert delay
    worker_step(p_work, p_sched.build_connector_meta(None), sched=p_sched)
    dreq = request("d-a", dict(params), prompt)
    assert d_sched.get_num_new_matched_tokens(dreq, 0) == (prompt - 1, True)
    d_blocks = ([10, 11, 12, 13, 14, 15], [2], [3], [4])
    d_sched.update_state_after_alloc(dreq, KVCacheBlocks(d_blocks), prompt - 1)
    load_and_release(d_sched, d_work, "d-a", p_sched, p_work, "r-a",
                     attention_layers(kcc, d_caches), attention_layers(kcc, p_caches))
    for name in kcc.kv_cache_groups[0].layer_names:
        for part in (0, 1):
            for pb, db in zip(p_blocks[0], d_blocks[0]):
                assert np.array_equal(d_caches[name][part][db], p_caches[name][part][pb]), name
    for g in (1, 2, 3):
        for name in kcc.kv_cache_groups[g].layer_names:
            for part in (0, 1):
                assert np.array_equal(d_caches[name][part][d_blocks[g][0]].view(np.uint32),
                                      p_caches[name][part][p_blocks[g][0]].view(np.uint32)), name
    # 6 blocks of K and V of 2 layers, and 3 groups of 2 state layers, conv and SSM each.
    kb = BS * HEADS * DIM * 4
    assert d_work._worker.stats()["bytes_read"] == 6 * kb * 2 * 2 + 3 * 2 * (CONV * TAPS * 4 + kb)
    assert p_work._worker.stats()["holds_outstanding"] == 0
