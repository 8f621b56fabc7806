"""kvferry.vllm driven the way vLLM's scheduler and workers drive it (issue 12): hostile params
never raise out of a scheduler hook, only loads vLLM handed over are reported received, ranks come
from vLLM's parallel state, and cache tensors in each backend's real shape and strides move
byte-exact or are refused by name."""
import sys
import time
import types
from types import SimpleNamespace

import numpy as np
import pytest

import kvferry
import kvferry.vllm
import kvferry.vllm_ascend
import kvferry.vllm_layout
from kvferry.vllm_layout import CacheLayoutError
from common import SilentPeer, free_port
# Device tensors (host-buffer mode): bytes kvferry never sees, torch ops as strict as CUDA's.
from fake_devices import FakeCudaTensor, FakeDeviceTensor

BS, HEADS, DIM, NB, LAYERS = 4, 2, 8, 16, 2


def config(role, port, extra=None, tp=1, heads=HEADS, block_size=BS, policy=None, mla=None,
           buffer_device=None):
    """vLLM's config as connectors read it; `mla` = (kv_lora_rank, qk_rope_head_dim) for an MLA
    model (vLLM reads both from the HF config)."""
    model = SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: heads)
    if mla is not None:
        model = SimpleNamespace(use_mla=True, get_total_num_kv_heads=lambda: 1,
                                hf_text_config=SimpleNamespace(kv_lora_rank=mla[0],
                                                               qk_rope_head_dim=mla[1]))
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role=role, engine_id=f"{role}-{port}", kv_load_failure_policy=policy,
            kv_buffer_device=buffer_device,
            kv_connector_extra_config=dict({"base_port": port}, **(extra or {}))),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, data_parallel_rank=0),
        cache_config=SimpleNamespace(block_size=block_size),
        model_config=model)


class Blocks:
    """vLLM's KVCacheBlocks, as far as connectors use it."""

    def __init__(self, ids):
        self.ids = list(ids)

    def get_unhashed_block_ids(self):
        return list(self.ids)

    def get_block_ids(self):
        return (list(self.ids),)


def request(rid, params, prompt_tokens, status="WAITING"):
    return SimpleNamespace(request_id=rid, kv_transfer_params=params,
                           prompt_token_ids=list(range(prompt_tokens)),
                           num_prompt_tokens=prompt_tokens, status=SimpleNamespace(name=status))


def poll(fn, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


GOOD = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "p",
        "remote_host": "127.0.0.1", "remote_port": 5557, "remote_tp_size": 1}
HOSTILE = [
    {"do_remote_prefill": True},
    dict(GOOD, remote_block_ids="1,2"),
    dict(GOOD, remote_block_ids=[1, "2"]),
    dict(GOOD, remote_block_ids=[1, -2]),
    dict(GOOD, remote_block_ids=[True]),
    dict(GOOD, remote_port="5557"),
    dict(GOOD, remote_port=70000),
    dict(GOOD, remote_tp_size=0),
    dict(GOOD, remote_tp_size=300),  # past kvferry's 256: the native scheduler refuses it
    dict(GOOD, remote_port=65535, remote_tp_size=2),  # rank 1's port would be 65536
    dict(GOOD, remote_pp_size=0),
    dict(GOOD, remote_pp_size=2, remote_port=65535),
    dict(GOOD, remote_host=""),
    dict(GOOD, remote_engine_id=None),
    dict(GOOD, remote_engine_id="x" * 5000),
    dict(GOOD, remote_request_id=7),
    {k: v for k, v in GOOD.items() if k != "remote_tp_size"},
    dict(GOOD, remote_rank_hosts="10.0.0.1"),
    dict(GOOD, remote_rank_hosts=["10.0.0.1", "10.0.0.2"]),  # 2 hosts for 1 rank
    dict(GOOD, remote_pp_size=2, remote_rank_hosts=["10.0.0.1", ""]),
    dict(GOOD, remote_rank_hosts=[7]),
]


@pytest.mark.parametrize("params", HOSTILE)
def test_hostile_params_never_raise_and_mean_no_remote_prefill(params):
    sched = kvferry.vllm.KvferryConnector(config("kv_consumer", 5557), "SCHEDULER")
    req = request("h", dict(params), 8)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, Blocks([]), 0)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    assert sched.build_connector_meta(None).awaited == ()
    assert sched.request_finished(req, []) == (False, None)


def test_rank_hosts_come_from_every_workers_handshake_metadata():
    """vllm/v1/engine/core.py EngineCore.__init__ hands the scheduler every worker's
    get_handshake_metadata keyed by (pp_rank, tp_rank): kvferry serves pp_rank > 0 (vLLM's base
    class refuses it), names each rank's host, and refuses a worker configured otherwise."""
    md = kvferry.vllm.KvferryHandshakeMetadata
    got = {(s, q): md("p", f"10.0.0.{s + 1}", 5557 + s * 2 + q, s, q)
           for s in range(2) for q in range(2)}
    hosts = kvferry.vllm.rank_hosts(got, "p", "10.0.0.1", 5557, 0, 2, 2)
    assert hosts == ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
    same = {k: md("p", "10.0.0.1", v.port, v.pp_rank, v.tp_rank) for k, v in got.items()}
    assert kvferry.vllm.rank_hosts(same, "p", "10.0.0.1", 5557, 0, 2, 2) == []
    assert kvferry.vllm.rank_hosts({0: object()}, "p", "h", 5557, 0, 1, 1) == []  # others'
    for wrong in (md("q", "h", 5557, 0, 0), md("p", "h", 5558, 0, 0), md("p", "h", 5559, 2, 0)):
        with pytest.raises(ValueError, match="expected engine 'p'"):
            kvferry.vllm.rank_hosts({(0, 0): wrong}, "p", "h", 5557, 0, 2, 1)
    sched = kvferry.vllm.KvferryConnector(
        config("kv_producer", 5557, {"pp_size": 2, "tp_size": 2, "host": "10.0.0.1"}),
        "SCHEDULER")
    engine = sched._settings.engine_id
    sched.set_xfer_handshake_metadata_pp_aware(
        {k: md(engine, v.host, v.port, v.pp_rank, v.tp_rank) for k, v in got.items()})
    _, params = sched.request_finished(
        request("r", {"do_remote_decode": True}, 2 * BS, "FINISHED_LENGTH_CAPPED"), [1, 2])
    assert params["remote_rank_hosts"] == hosts
    assert kvferry.vllm.remote_prefill_params(params)[0]["remote_rank_hosts"] == hosts


def test_nixl_shaped_params_are_accepted():
    sched = kvferry.vllm.KvferryConnector(config("kv_consumer", 5557), "SCHEDULER")
    nixl = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[4, 5]],
            "remote_engine_id": "p", "remote_request_id": "p-1", "remote_host": "127.0.0.1",
            "remote_port": 5600, "tp_size": 1}
    req = request("n", nixl, 2 * BS)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    sched.update_state_after_alloc(req, Blocks([9, 10]), 2 * BS)
    assert nixl["do_remote_prefill"] is False
    assert sched.build_connector_meta(None).awaited == ("n",)


# ---------------------------------------------------------------- cache layouts

def fa_nhd(dtype=np.float32):  # (2, num_blocks, block_size, heads, head_dim), NHD strides
    return np.zeros((2, NB, BS, HEADS, DIM), dtype=dtype)


def fa_hnd(dtype=np.float32):  # same logical shape, stride order (0, 1, 3, 2, 4)
    return np.zeros((2, NB, HEADS, BS, DIM), dtype=dtype).transpose(0, 1, 3, 2, 4)


def fa_main_nhd(dtype=np.float32):  # vLLM main (FlashAttention/Triton): (num_blocks, 2, ...)
    return np.zeros((NB, 2, BS, HEADS, DIM), dtype=dtype)


def fa_main_hnd(dtype=np.float32):  # (num_blocks, 2, ...) with stride order (0, 1, 3, 2, 4)
    return np.zeros((NB, 2, HEADS, BS, DIM), dtype=dtype).transpose(0, 1, 3, 2, 4)


def cpu_backend(dtype=np.float32):  # vLLM's CPU backend: (2, num_blocks, heads, block_size, dim)
    return np.zeros((2, NB, HEADS, BS, DIM), dtype=dtype)


def ascend_tuple(dtype=np.float32):  # vllm-ascend: (K, V) per layer
    return tuple(np.zeros((NB, BS, HEADS, DIM), dtype=dtype) for _ in range(2))


LORA, ROPE = 24, 8  # a small kv_lora_rank + qk_rope_head_dim


def mla_fused(dtype=np.float32):  # vLLM's MLA backends: (num_blocks, block_size, lora + rope)
    return np.zeros((NB, BS, LORA + ROPE), dtype=dtype)


def fill_random(cache, seed):
    rng = np.random.default_rng(seed)
    for part in (cache if isinstance(cache, tuple) else [cache]):
        base = part.base if part.base is not None else part
        base.reshape(-1).view(np.uint8)[...] = rng.integers(0, 256, base.nbytes, dtype=np.uint8)


def block_view(cache, block):
    """Logical contents of one block, every part: what must arrive byte for byte."""
    if isinstance(cache, tuple):
        return np.stack([p[block] for p in cache]).view(np.uint8)
    if cache.ndim == 3:  # fused MLA: blocks outermost
        return np.ascontiguousarray(cache[block]).view(np.uint8)
    if cache.shape[1] == 2 and cache.shape[0] == NB:  # (num_blocks, 2, ...): K and V inside
        return np.ascontiguousarray(cache[block]).view(np.uint8)
    return np.ascontiguousarray(cache[:, block]).view(np.uint8)


def transfer(make, dtype=np.float32, p_make=None, expect_release=True, wrap=lambda c: c,
             p_kw=None, d_kw=None):
    """Prefill holds request r-1's blocks; decode loads them as vLLM drives both sides."""
    pport, dport = free_port(), free_port()
    p_kw, d_kw = p_kw or {}, d_kw or {}
    p_sched = kvferry.vllm.KvferryConnector(config("kv_producer", pport, **p_kw), "SCHEDULER")
    p_work = kvferry.vllm.KvferryConnector(config("kv_producer", pport, **p_kw), "WORKER")
    d_sched = kvferry.vllm.KvferryConnector(config("kv_consumer", dport, **d_kw), "SCHEDULER")
    d_work = kvferry.vllm.KvferryConnector(config("kv_consumer", dport, **d_kw), "WORKER")
    p_caches = {f"l{i}": (p_make or make)(dtype) for i in range(LAYERS)}
    d_caches = {f"l{i}": make(dtype) for i in range(LAYERS)}
    for i, c in enumerate(p_caches.values()):
        fill_random(c, i)
    p_work.register_kv_caches({k: wrap(c) for k, c in p_caches.items()})
    d_work.register_kv_caches({k: wrap(c) for k, c in d_caches.items()})
    remote, local = [12, 13, 3], [5, 6, 7]
    preq = request("r-1", {"do_remote_decode": True}, 3 * BS, "FINISHED_LENGTH_CAPPED")
    delay, params = p_sched.request_finished(preq, remote)
    assert delay
    p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
    p_work.start_load_kv(None)
    dreq = request("d-1", dict(params), 3 * BS)
    assert d_sched.get_num_new_matched_tokens(dreq, 0) == (3 * BS, True)
    d_sched.update_state_after_alloc(dreq, Blocks(local), 3 * BS)
    d_work.bind_connector_metadata(d_sched.build_connector_meta(None))
    d_work.start_load_kv(None)
    got = poll(lambda: d_work.get_finished(set())[1], "the load")
    assert got == {"d-1"}
    errors = d_work.get_block_ids_with_load_errors()
    if expect_release:
        sent = poll(lambda: p_work.get_finished({"r-1"})[0], "the prefill side's release")
        assert sent == {"r-1"}
    return p_caches, d_caches, remote, local, errors


@pytest.mark.parametrize("make", [fa_nhd, fa_hnd, fa_main_nhd, fa_main_hnd, cpu_backend,
                                  ascend_tuple],
                         ids=["flash_nhd", "flash_hnd", "flash_main_nhd", "flash_main_hnd",
                              "cpu_backend", "ascend_tuple"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint8], ids=["fp32", "fp16", "fp8"])
def test_layouts_move_every_byte(make, dtype):
    p, d, remote, local, errors = transfer(make, dtype)
    assert errors == set()
    for name in p:
        for r, l in zip(remote, local):
            np.testing.assert_array_equal(block_view(d[name], l), block_view(p[name], r))


@pytest.mark.parametrize("make", [fa_nhd, fa_hnd, fa_main_nhd, fa_main_hnd, cpu_backend],
                         ids=["flash_nhd", "flash_hnd", "flash_main_nhd", "flash_main_hnd", "cpu"])
def test_torch_tensors_move_every_byte(make):
    torch = pytest.importorskip("torch", reason="Debian's python3-torch (make deps) is absent")

    def wrap(c):
        t = torch.from_numpy(c)  # same memory, shape and strides, read through torch's API
        assert t.stride() == tuple(s // c.itemsize for s in c.strides)
        return t

    p, d, remote, local, errors = transfer(make, np.float16, wrap=wrap)
    assert errors == set()
    for name in p:
        for r, l in zip(remote, local):
            np.testing.assert_array_equal(block_view(d[name], l), block_view(p[name], r))


@pytest.mark.parametrize("dtype", [np.float16, np.uint8], ids=["fp16", "fp8"])
def test_fused_mla_moves_every_byte(dtype):
    p, d, remote, local, errors = transfer(mla_fused, dtype, p_kw={"mla": (LORA, ROPE)},
                                           d_kw={"mla": (LORA, ROPE)})
    assert errors == set()
    for name in p:
        for r, l in zip(remote, local):
            np.testing.assert_array_equal(block_view(d[name], l), block_view(p[name], r))
    reg = geometry_of(mla_fused, mla=(LORA, ROPE))
    assert (reg.kind, reg.fields, reg.parts) == ("mla_fused", (LORA, ROPE),
                                                 [("latent_rope", 1, LORA + ROPE)])


def test_fused_mla_with_another_split_is_refused_not_corrupted():
    # Same row width (32), different split: the compatibility hash differs, no byte moves.
    p, d, remote, local, errors = transfer(mla_fused, p_kw={"mla": (LORA, ROPE)},
                                           d_kw={"mla": (LORA - 8, ROPE + 8)},
                                           expect_release=False)
    assert errors == set(local)
    for name in d:
        assert not d[name].any()


def test_fused_mla_needs_the_split_from_the_model_config():
    with pytest.raises(CacheLayoutError, match="kv_lora_rank") as e:
        geometry_of(mla_fused)  # use_mla False: no split
    assert "(16, 4, 32)" in str(e.value)
    with pytest.raises(CacheLayoutError, match="row width 32 is not kv_lora_rank 24"):
        geometry_of(mla_fused, mla=(LORA, ROPE + 1))


@pytest.mark.parametrize("p_make, d_make", [(fa_main_nhd, fa_nhd), (fa_nhd, fa_main_nhd),
                                             (fa_main_hnd, fa_hnd)],
                         ids=["strided_to_packed", "packed_to_strided", "hnd_strided_to_packed"])
def test_strided_and_packed_sides_of_one_model_exchange_blocks(p_make, d_make):
    # Block strides are this side's memory layout, not in the compatibility hash.
    p, d, remote, local, errors = transfer(d_make, p_make=p_make)
    assert errors == set()
    for name in p:
        for r, l in zip(remote, local):
            np.testing.assert_array_equal(block_view(d[name], l), block_view(p[name], r))


def test_interleaved_caches_register_one_region_per_layer():
    w = kvferry.vllm.KvferryConnector(config("kv_consumer", free_port()), "WORKER")
    w.register_kv_caches({"l0": fa_main_hnd(), "l1": fa_main_hnd()})
    block = BS * HEADS * DIM * 4
    assert w._registration.block_strides == (2 * block, 2 * block)
    assert w._registration.layout == "head_major"
    assert [b[1] - b[0] for b in w._registration.bases] == [block, block]
    assert w._spec.block_stride(1) == 2 * block


def test_nhd_against_hnd_is_refused_not_corrupted():
    p, d, remote, local, errors = transfer(fa_hnd, p_make=fa_nhd, expect_release=False)
    assert errors == set(local)
    for name in d:
        assert not d[name].any(), "no byte may land when the layouts differ"


def geometry_of(make, **kw):
    w = kvferry.vllm.KvferryConnector(config("kv_consumer", free_port(), **kw), "WORKER")
    w.register_kv_caches({"l0": make(np.float32)})
    return w._registration


def test_geometry_read_from_shape_and_strides():
    assert (geometry_of(fa_nhd).layout, geometry_of(fa_nhd).local_heads) == ("token_major", HEADS)
    assert geometry_of(fa_hnd).layout == "head_major"
    cpu = geometry_of(cpu_backend)
    assert (cpu.layout, cpu.local_heads, cpu.tokens_per_block) == ("head_major", HEADS, BS)
    # Logical blocks of 8 tokens over kernel blocks of 4: 16 kernel blocks are 8 logical ones.
    big = geometry_of(fa_nhd, block_size=2 * BS)
    assert (big.num_blocks, big.tokens_per_block) == (NB // 2, 2 * BS)
    assert big.kernel_blocks_per_block == 2 and geometry_of(fa_nhd).kernel_blocks_per_block == 1
    main = geometry_of(fa_main_nhd)
    assert (main.layout, main.num_blocks, main.block_strides[0]) == (
        "token_major", NB, 2 * BS * HEADS * DIM * 4)
    assert geometry_of(fa_main_hnd).layout == "head_major"
    # K and V alternating per kernel block: a logical block of two kernel blocks is no one run,
    # so the kernel blocks are registered, two per vLLM block id (issue 28 item 5).
    kernel = geometry_of(fa_main_nhd, block_size=2 * BS)
    assert (kernel.num_blocks, kernel.tokens_per_block, kernel.blocks_per_id) == (NB, BS, 2)
    assert geometry_of(fa_hnd, block_size=2 * BS).blocks_per_id == 2
    assert geometry_of(fa_nhd, block_size=2 * BS).blocks_per_id == 1  # one run: logical blocks


@pytest.mark.parametrize("tensor, words", [
    (np.zeros((NB, 3, BS, HEADS, DIM), np.float32)[:, :2], "side by side"),
    (np.zeros((NB, BS, 576), np.float32), "MLA"),
    (np.zeros((2, NB, BS, HEADS, DIM), np.float32)[:, :, :, :, ::2], "dense"),
    (np.zeros((2, NB, 3, 5, DIM), np.float32), "heads"),
    (np.zeros((2, NB, BS, HEADS, DIM), np.complex64), "dtype"),
])
def test_unknown_layouts_are_refused_naming_shape_and_strides(tensor, words):
    w = kvferry.vllm.KvferryConnector(config("kv_consumer", free_port()), "WORKER")
    with pytest.raises(CacheLayoutError, match=words) as e:
        w.register_kv_caches({"l0": tensor})
    assert str(tuple(tensor.shape)) in str(e.value) and "strides" in str(e.value)


class DeviceTensor:
    """A CUDA tensor as the adapter sees one: data_ptr() is device memory."""

    shape = (2, NB, BS, HEADS, DIM)
    dtype = "torch.float16"
    device = "cuda:0"

    def data_ptr(self):
        return 0x7F0000000000

    def stride(self):
        return (NB * BS * HEADS * DIM, BS * HEADS * DIM, HEADS * DIM, DIM, 1)

    def element_size(self):
        return 2


def host_cache_like_device():
    """A CPU cache with DeviceTensor's geometry."""
    return np.zeros(DeviceTensor.shape, dtype=np.float16)


class Float8Tensor:
    """A CPU torch float8 tensor as the adapter sees one (Debian's torch 1.13 has no float8):
    1-byte elements over a numpy buffer, torch's dtype name."""

    def __init__(self, array, dtype):
        self.array, self.dtype, self.device = array, dtype, "cpu"
        self.shape = array.shape

    def data_ptr(self):
        return self.array.ctypes.data

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def element_size(self):
        return 1


def test_float8_dtypes_are_one_byte_and_told_apart_by_the_hash():
    specs = {}
    for dtype, tag in (("torch.float8_e4m3fn", "fp8_e4m3fn"), ("torch.float8_e5m2", "fp8_e5m2")):
        w = kvferry.vllm.KvferryConnector(config("kv_consumer", free_port()), "WORKER")
        w.register_kv_caches({"l0": Float8Tensor(fa_main_nhd(np.uint8), dtype)})
        assert w._spec.block_bytes(0) == BS * HEADS * DIM
        assert w._registration.parts[0][0] == "k:" + tag
        specs[dtype] = w._spec.canonical_text
    assert specs["torch.float8_e4m3fn"] != specs["torch.float8_e5m2"]


def test_cuda_tensors_register_as_cuda_memory_and_other_devices_are_refused():
    # A CUDA tensor is registered as cuda:0 memory (docs/device.md). Here there is no driver
    # (UnavailableError "no CUDA driver"); on a GPU machine this fake's address is no allocation
    # (InvalidArgumentError): either way the error names the memory kind.
    w = kvferry.vllm.KvferryConnector(config("kv_consumer", free_port()), "WORKER")
    with pytest.raises((kvferry.UnavailableError, kvferry.InvalidArgumentError)) as e:
        w.register_kv_caches({"l0": DeviceTensor()})
    assert "cuda:0" in str(e.value) or "no CUDA" in str(e.value), str(e.value)
    # Another device type: refused before anything is registered, naming it and the way out.
    xpu = DeviceTensor()
    xpu.device = "xpu:0"
    w2 = kvferry.vllm.KvferryConnector(config("kv_consumer", free_port()), "WORKER")
    with pytest.raises(kvferry.NotSupportedError, match="xpu:0 memory") as e2:
        w2.register_kv_caches({"l0": xpu})
    assert 'kv_buffer_device "cpu"' in str(e2.value)  # the way out
    # Layers in two memories at once are refused.
    with pytest.raises(kvferry.InvalidArgumentError, match="more than one memory"):
        kvferry.vllm_layout.read_caches({"l0": DeviceTensor(), "l1": host_cache_like_device()},
                                        BS, None, 1, False)


def _cuda_driver_loads():
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_cuda_refusal_without_a_driver_names_what_a_vllm_user_can_do():
    """Regression (issue 21, item 4): CUDA caches without a CUDA driver were refused with the
    CLI's advice "install the NVIDIA driver, or use the sim device"; a vLLM user has no sim
    device. The refusal names the two ways out a vLLM user has."""
    if _cuda_driver_loads():
        pytest.skip("SKIPPED: libcuda.so.1 loads on this machine, so the no-driver refusal cannot "
                    "happen here (test_cuda_refusal_is_rewritten_for_vllm_users still runs)")
    w = kvferry.vllm.KvferryConnector(config("kv_consumer", free_port()), "WORKER")
    with pytest.raises(kvferry.UnavailableError) as e:
        w.register_kv_caches({"l0": DeviceTensor()})
    message = str(e.value)
    assert "no CUDA driver" in message and "cuda:0" in message, message
    assert "NVIDIA driver is installed" in message, message
    assert '"kv_buffer_device": "cpu"' in message, message
    assert "sim device" not in message, message


def refused_registration(monkeypatch, caches, memory, native):
    """The message register_kv_caches raises when the native worker refuses `memory` with
    UnavailableError(native), as the device layer does without a driver or runtime."""
    class Unavailable:
        def __init__(self, *args, **kwargs):
            pass

        def register_kv_caches(self, spec, bases, memory_kind):
            assert memory_kind == memory
            raise kvferry.UnavailableError(native)

    monkeypatch.setattr(kvferry.vllm._kvferry, "Worker", Unavailable)
    w = kvferry.vllm.KvferryConnector(config("kv_consumer", free_port()), "WORKER")
    with pytest.raises(kvferry.UnavailableError) as e:
        w.register_kv_caches(caches)
    return str(e.value)


@pytest.mark.parametrize("native", [
    "region 0: no CUDA driver: dlopen(libcuda.so.1) failed: libcuda.so.1: cannot open shared "
    "object file: No such file or directory; install the NVIDIA driver, or use the sim device",
    "region 0: no CUDA device: cuInit failed: CUresult 100 (no CUDA-capable device is detected)",
], ids=["no_driver", "no_device"])
def test_cuda_refusal_is_rewritten_for_vllm_users(monkeypatch, native):
    message = refused_registration(monkeypatch, {"l0": DeviceTensor()}, "cuda:0", native)
    assert native.split(": ", 1)[1].split(";")[0] in message  # what was found, kept
    assert "NVIDIA driver is installed" in message and '"kv_buffer_device": "cpu"' in message
    assert "sim device" not in message


def test_replicated_heads_and_head_count_checked_against_the_model():
    # 1 KV head in the model, TP 2: every rank holds the one head (replicated).
    port = free_port(2)
    w = kvferry.vllm.KvferryConnector(
        config("kv_consumer", port, extra={"tp_rank": 1}, tp=2, heads=1), "WORKER")
    w.register_kv_caches({"l0": np.zeros((2, NB, BS, 1, DIM), np.float32)})
    assert w._spec.local_heads(0) == 1
    # Tensors with 2 heads per rank where the model says 2 heads over TP 2 (1 each): refused.
    bad = kvferry.vllm.KvferryConnector(
        config("kv_consumer", free_port(), extra={"tp_rank": 0}, tp=2, heads=2), "WORKER")
    with pytest.raises(kvferry.Error):
        bad.register_kv_caches({"l0": np.zeros((2, NB, BS, 2, DIM), np.float32)})


def test_layers_sharing_a_tensor_are_registered_once():
    shared = fa_nhd()
    w = kvferry.vllm.KvferryConnector(config("kv_consumer", free_port()), "WORKER")
    w.register_kv_caches({"l0": shared, "l1": shared, "l2": fa_nhd()})
    assert w._registration.layer_names == ["l0", "l2"]


# ---------------------------------------------------------------- ranks and requests

def fake_parallel_state(monkeypatch, size, rank):
    ps = types.ModuleType("vllm.distributed.parallel_state")
    ps.get_tensor_model_parallel_world_size = lambda: size
    ps.get_tensor_model_parallel_rank = lambda: rank
    for name in ("vllm", "vllm.distributed"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", ps)


def test_tp_ranks_come_from_vllms_parallel_state(monkeypatch):
    port = free_port(2)
    workers = []
    for rank in (0, 1):  # the same config on every rank, as vLLM passes it
        fake_parallel_state(monkeypatch, 2, rank)
        w = kvferry.vllm.KvferryConnector(config("kv_producer", port, tp=2, heads=4), "WORKER")
        w.register_kv_caches({"l0": np.zeros((2, NB, BS, 2, DIM), np.float32)})
        workers.append(w)
    assert [w._spec.tp_rank for w in workers] == [0, 1]
    assert workers[1]._worker.listener_endpoint.endswith(str(port + 1))


def test_tp_above_one_without_parallel_state_is_a_clear_error():
    w = kvferry.vllm.KvferryConnector(config("kv_producer", free_port(), tp=2, heads=4), "WORKER")
    with pytest.raises(kvferry.InvalidArgumentError, match="parallel state"):
        w.register_kv_caches({"l0": np.zeros((2, NB, BS, 2, DIM), np.float32)})


def test_aborted_waiting_request_only_notifies_the_prefill_side():
    pport, dport = free_port(), free_port()
    p_sched = kvferry.vllm.KvferryConnector(config("kv_producer", pport), "SCHEDULER")
    p_work = kvferry.vllm.KvferryConnector(config("kv_producer", pport), "WORKER")
    d_sched = kvferry.vllm.KvferryConnector(config("kv_consumer", dport), "SCHEDULER")
    d_work = kvferry.vllm.KvferryConnector(config("kv_consumer", dport), "WORKER")
    p_work.register_kv_caches({"l0": fa_nhd()})
    d_work.register_kv_caches({"l0": fa_nhd()})
    delay, params = p_sched.request_finished(
        request("r-1", {"do_remote_decode": True}, 2 * BS, "FINISHED_LENGTH_CAPPED"), [1, 2])
    p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
    p_work.start_load_kv(None)
    # Decode: the request waits (no blocks yet) and is aborted: vLLM frees it at once.
    dreq = request("d-1", dict(params), 2 * BS)
    assert d_sched.get_num_new_matched_tokens(dreq, 0) == (2 * BS, True)
    dreq.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert d_sched.request_finished(dreq, []) == (False, None)
    md = d_sched.build_connector_meta(None)
    assert md.awaited == ()
    d_work.bind_connector_metadata(md)
    d_work.start_load_kv(None)
    assert poll(lambda: p_work.get_finished({"r-1"})[0], "the prefill release") == {"r-1"}
    # The native worker reports its empty load as done; the adapter must not pass it on.
    native, seen = d_work._worker, set()

    class Recorder:
        def __getattr__(self, name):
            return getattr(native, name)

        def get_finished(self):
            sending, receiving = native.get_finished()
            seen.update(receiving)
            return sending, receiving

    d_work._worker = Recorder()
    results = []
    poll(lambda: results.append(d_work.get_finished({"d-1"})) or "d-1" in seen, "the native report")
    assert set(results) == {(None, None)}
    assert d_work.get_block_ids_with_load_errors() == set()


def test_load_failure_reported_as_invalid_blocks_and_policy_read_from_config():
    port = free_port()
    d_sched = kvferry.vllm.KvferryConnector(config("kv_consumer", port, policy="fail"), "SCHEDULER")
    d_work = kvferry.vllm.KvferryConnector(config("kv_consumer", port, policy="fail"), "WORKER")
    assert d_work._settings.failure_policy == "fail"
    d_work.register_kv_caches({"l0": fa_nhd()})
    dead = dict(GOOD, remote_port=free_port(), remote_block_ids=[1, 2])  # nobody listens
    dreq = request("d-9", dead, 2 * BS)
    assert d_sched.get_num_new_matched_tokens(dreq, 0) == (2 * BS, True)
    d_sched.update_state_after_alloc(dreq, Blocks([3, 4]), 2 * BS)
    d_work.bind_connector_metadata(d_sched.build_connector_meta(None))
    d_work.start_load_kv(None)
    assert poll(lambda: d_work.get_finished(set())[1], "the failed load", 40) == {"d-9"}
    assert d_work.get_block_ids_with_load_errors() == {3, 4}


def test_contract_details():
    c = kvferry.vllm.KvferryConnector(config("kv_consumer", free_port()), "SCHEDULER")
    assert c.role == "SCHEDULER"  # the role vLLM gave, untouched
    cfg = config("kv_consumer", 1)
    assert kvferry.vllm.KvferryConnector.get_required_kvcache_layout(cfg) == "HND"
    cfg.model_config.use_mla = True
    assert kvferry.vllm.KvferryConnector.get_required_kvcache_layout(cfg) is None
    s = kvferry.vllm.KvferryConnector.build_kv_connector_stats(
        {"transfer_duration": [0.5], "bytes_transferred": [5]})
    s.aggregate(kvferry.vllm.KvferryConnector.build_kv_connector_stats(
        {"transfer_duration": [1.5], "bytes_transferred": [7], "failed_loads": ["Timeout"]}))
    reduced = s.reduce()
    assert reduced["Num successful transfers"] == 2 and reduced["Num failed transfers"] == 1
    assert reduced["Avg xfer time (ms)"] == 1000.0 and not s.is_empty()


def test_finished_req_ids_abort_a_load_in_flight():
    """vLLM lists a request in finished_req_ids when it finishes it (client abort) while its load
    runs: the adapter cancels the native load at once, reports the request once in
    finished_recving, and reports none of its blocks as load errors (nothing to recompute)."""
    with SilentPeer() as silent:
        port = free_port()
        d_sched = kvferry.vllm.KvferryConnector(config("kv_consumer", port), "SCHEDULER")
        d_work = kvferry.vllm.KvferryConnector(config("kv_consumer", port), "WORKER")
        d_work.register_kv_caches({"l0": fa_nhd()})
        params = dict(GOOD, remote_port=silent.port, remote_block_ids=[1, 2])
        dreq = request("d-7", params, 2 * BS)
        assert d_sched.get_num_new_matched_tokens(dreq, 0) == (2 * BS, True)
        d_sched.update_state_after_alloc(dreq, Blocks([3, 4]), 2 * BS)
        d_work.bind_connector_metadata(d_sched.build_connector_meta(None))
        d_work.start_load_kv(None)
        native, aborted, codes = d_work._worker, [], []

        class Recorder:
            def __getattr__(self, name):
                return getattr(native, name)

            def abort_load(self, rid, why):
                aborted.append(rid)
                return native.abort_load(rid, why)

            def take_load_errors(self):
                errors = native.take_load_errors()
                codes.extend((e["request_id"], e["code"]) for e in errors)
                return errors

        d_work._worker = Recorder()
        got = d_work.get_finished({"d-7"})[1] or poll(lambda: d_work.get_finished(set())[1],
                                                       "the aborted load")
        assert aborted == ["d-7"]
        assert got == {"d-7"}
        # Cancelled, not the handshake's timeout: the abort reached the load.
        assert codes == [("d-7", "Cancelled")]
        assert d_work.get_block_ids_with_load_errors() == set()
        assert d_work.get_finished(set()) == (None, None)  # reported once


# ------------------------------------------------ host-buffer mode (kv_buffer_device "cpu")

class CopyOps:
    """vLLM's copy_kv_blocks for these layouts: copies whole blocks between the device tensors
    and the host mirrors, and records each call; `fail` makes a direction raise."""

    def __init__(self, block_dim, fail=None):
        self.block_dim, self.fail, self.calls = block_dim, fail, []

    def __call__(self, src_caches, dst_caches, src_ids, dst_ids, direction):
        import torch
        self.calls.append((direction, list(src_ids)))
        if direction == self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        for name, src in src_caches.items():
            dst = dst_caches[name]
            src = src.storage if isinstance(src, FakeDeviceTensor) else src
            dst = dst.storage if isinstance(dst, FakeDeviceTensor) else dst
            s_idx, d_idx = torch.tensor(src_ids), torch.tensor(dst_ids)
            if self.block_dim == 0:
                dst[d_idx] = src[s_idx]
            else:
                dst[:, d_idx] = src[:, s_idx]


def device_caches(torch, make, seed_base, layers=LAYERS):
    arrays = {f"l{i}": make(np.float16) for i in range(layers)}
    for i, a in enumerate(arrays.values()):
        fill_random(a, seed_base + i)
    wrapped = {k: FakeCudaTensor(torch.from_numpy(a), 0x7F0000000000 + (i << 32))
               for i, (k, a) in enumerate(arrays.items())}
    return arrays, wrapped


def served_ranges():
    """The address ranges of this process's kvferry.HostMemory (its /proc/self/maps lines)."""
    with open("/proc/self/maps") as maps:
        return [tuple(int(x, 16) for x in line.split()[0].split("-"))
                for line in maps if "/memfd:kvferry-served" in line]


def host_mode_pair(make, d_fail=None, copy_ops=True):
    torch = pytest.importorskip("torch", reason="Debian's python3-torch (make deps) is absent")
    pport, dport = free_port(), free_port()
    sides = {}
    for role, port in (("kv_producer", pport), ("kv_consumer", dport)):
        cfg = config(role, port, buffer_device="cpu")
        sides[role] = (kvferry.vllm.KvferryConnector(cfg, "SCHEDULER"),
                       kvferry.vllm.KvferryConnector(cfg, "WORKER"))
    block_dim = 0 if make in (fa_main_nhd, fa_main_hnd) else 1
    p_arrays, p_dev = device_caches(torch, make, 0)
    d_arrays, d_dev = device_caches(torch, make, 100)
    p_ops, d_ops = CopyOps(block_dim), CopyOps(block_dim, fail=d_fail)
    p_work, d_work = sides["kv_producer"][1], sides["kv_consumer"][1]
    p_work.register_kv_caches(p_dev)  # vLLM's order: register, then hand over the copy ops
    d_work.register_kv_caches(d_dev)
    if copy_ops:  # else: a vLLM that never calls set_host_xfer_buffer_ops (issue 21, item 5)
        p_work.set_host_xfer_buffer_ops(p_ops)
        d_work.set_host_xfer_buffer_ops(d_ops)
    return sides, (p_arrays, p_dev, p_ops), (d_arrays, d_dev, d_ops)


def dev_block(arrays, name, block):
    return block_view(arrays[name], block)


def offer_and_load(sides, preq, remote, local, decode_id):
    """Host-buffer mode, after the prefill step that saved `preq`'s blocks: vLLM finishes the
    prefill request (the hold is offered), the decode instance takes its params and starts the
    load into `local`; returns the params vLLM got, once the load is reported (never raising
    into vLLM)."""
    (p_sched, p_work), (d_sched, d_work) = sides["kv_producer"], sides["kv_consumer"]
    p_work.clear_connector_metadata()
    preq.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    delay, params = p_sched.request_finished(preq, remote)
    assert delay
    p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
    p_work.start_load_kv(None)
    dreq = request(decode_id, dict(params), len(remote) * BS)
    assert d_sched.get_num_new_matched_tokens(dreq, 0) == (len(remote) * BS, True)
    d_sched.update_state_after_alloc(dreq, Blocks(local), len(remote) * BS)
    d_work.bind_connector_metadata(d_sched.build_connector_meta(None))
    d_work.start_load_kv(None)
    assert poll(lambda: d_work.get_finished(set())[1], "the load") == {decode_id}
    return params


@pytest.mark.parametrize("make", [fa_nhd, fa_hnd, fa_main_nhd, fa_main_hnd],
                         ids=["flash_nhd", "flash_hnd", "flash_main_nhd", "flash_main_hnd"])
def test_host_buffer_mode_moves_every_byte_between_device_caches(make):
    sides, (p_arrays, p_dev, p_ops), (d_arrays, d_dev, d_ops) = host_mode_pair(make)
    (p_sched, p_work), (d_sched, d_work) = sides["kv_producer"], sides["kv_consumer"]
    # Host mirrors: same shape and strides as the device tensors, memory of their own, which
    # kvferry allocated (HostMemory: a memfd a same-host shm reader maps read-only, issue 30).
    served = served_ranges()
    for name, dev in p_dev.items():
        mirror = p_work._host_caches[name]
        assert str(mirror.device) == "cpu"
        assert (tuple(mirror.shape), mirror.stride()) == (tuple(dev.shape), dev.stride())
        assert mirror.data_ptr() != dev.storage.data_ptr()
        assert any(lo <= mirror.data_ptr() < hi for lo, hi in served), name
    assert p_work._registration.bases[0][0] == p_work._host_caches["l0"].data_ptr()
    remote, local = [12, 13, 3], [5, 6, 7]
    # Prefill: vLLM allocates and schedules the request; its prompt completes in this step.
    preq = request("r-1", {"do_remote_decode": True}, 3 * BS, "RUNNING")
    p_sched.update_state_after_alloc(preq, Blocks(remote), 0)
    md = p_sched.build_connector_meta(None)
    assert md.saves == {"r-1": remote}
    p_work.bind_connector_metadata(md)
    p_work.start_load_kv(None)
    assert p_ops.calls == []
    p_work.wait_for_save()  # end of the forward step: device -> host, blocking
    assert p_ops.calls == [("d2h", remote)]
    for name in p_arrays:
        for b in remote:
            np.testing.assert_array_equal(block_view(p_work._host_caches[name].numpy(), b),
                                          dev_block(p_arrays, name, b))
    p_work.clear_connector_metadata()
    # Only now (after the step) does vLLM call request_finished, which offers the hold.
    preq.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    delay, params = p_sched.request_finished(preq, remote)
    assert delay and params["remote_block_ids"] == remote
    p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
    p_work.start_load_kv(None)
    p_work.wait_for_save()
    assert p_ops.calls == [("d2h", remote)]  # saved once
    # Decode: the load lands in the host mirrors, then host -> device before finished_recving.
    dreq = request("d-1", dict(params), 3 * BS)
    assert d_sched.get_num_new_matched_tokens(dreq, 0) == (3 * BS, True)
    d_sched.update_state_after_alloc(dreq, Blocks(local), 3 * BS)
    md = d_sched.build_connector_meta(None)
    assert md.load_blocks == {"d-1": local} and md.saves == {}
    d_work.bind_connector_metadata(md)
    d_work.start_load_kv(None)
    deadline = time.monotonic() + 10
    while True:
        assert time.monotonic() < deadline, "timed out waiting for the load"
        before = list(d_ops.calls)
        got = d_work.get_finished(set())[1]
        if got:
            break
        assert before == [] and d_ops.calls == []  # nothing copied before the load is done
    assert got == {"d-1"}
    assert d_ops.calls == [("h2d", local)]  # ran inside the call that reported the request
    assert d_work.get_block_ids_with_load_errors() == set()
    for name in p_arrays:
        for r, l in zip(remote, local):
            np.testing.assert_array_equal(dev_block(d_arrays, name, l),
                                          dev_block(p_arrays, name, r))
    sent = poll(lambda: p_work.get_finished({"r-1"})[0], "the prefill side's release")
    assert sent == {"r-1"}


@pytest.mark.parametrize("make", [fa_nhd, fa_hnd, fa_main_nhd, fa_main_hnd],
                         ids=["flash_nhd", "flash_hnd", "flash_main_nhd", "flash_main_hnd"])
def test_host_buffer_mode_without_copy_ops_copies_blocks_with_torch(make):
    """Regression (issue 21, item 5): a vLLM that never calls set_host_xfer_buffer_ops made
    wait_for_save raise InvalidArgumentError into vLLM (which ends its EngineCore). Now torch
    copies the blocks on the cache's device, both ways, byte for byte."""
    sides, (p_arrays, p_dev, p_ops), (d_arrays, d_dev, d_ops) = host_mode_pair(make,
                                                                               copy_ops=False)
    (p_sched, p_work), (_, d_work) = sides["kv_producer"], sides["kv_consumer"]
    d_before = {name: a.copy() for name, a in d_arrays.items()}
    p_mirrors_before = {name: m.numpy().copy() for name, m in p_work._host_caches.items()}
    remote, local = [12, 13, 3], [5, 6, 7]
    preq = request("r-9", {"do_remote_decode": True}, 3 * BS, "RUNNING")
    p_sched.update_state_after_alloc(preq, Blocks(remote), 0)
    p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
    p_work.start_load_kv(None)
    p_work.wait_for_save()  # device -> host with torch; raised before the fix
    for name in p_arrays:
        mirror = p_work._host_caches[name].numpy()
        for b in range(NB):  # the request's blocks copied, no other block touched
            got = block_view(mirror, b)
            if b in remote:
                np.testing.assert_array_equal(got, dev_block(p_arrays, name, b))
            else:
                np.testing.assert_array_equal(got, block_view(p_mirrors_before[name], b))
    offer_and_load(sides, preq, remote, local, "d-9")
    assert d_work.get_block_ids_with_load_errors() == set()
    for name in p_arrays:  # host -> device with torch: the loaded blocks, and only they
        for b in range(NB):
            got = dev_block(d_arrays, name, b)
            if b in local:
                np.testing.assert_array_equal(got, dev_block(p_arrays, name,
                                                             remote[local.index(b)]))
            else:
                np.testing.assert_array_equal(got, block_view(d_before[name], b))
    assert p_ops.calls == [] and d_ops.calls == []
    sent = poll(lambda: p_work.get_finished({"r-9"})[0], "the prefill side's release")
    assert sent == {"r-9"}


def test_host_buffer_mode_torch_copy_failing_device_to_host_raises(monkeypatch):
    # As with vLLM's op: a broken device must not let stale host bytes be offered.
    sides, _, _ = host_mode_pair(fa_nhd, copy_ops=False)
    p_sched, p_work = sides["kv_producer"]
    monkeypatch.setattr(FakeCudaTensor, "fail", "index_select")
    req = request("s", {"do_remote_decode": True}, BS, "RUNNING")
    p_sched.update_state_after_alloc(req, Blocks([3]), 0)
    p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        p_work.wait_for_save()


@pytest.mark.parametrize("failure", ["h2d raises", "torch copy raises"])
def test_host_buffer_mode_failed_device_copy_is_a_load_error_not_an_exception(failure,
                                                                              monkeypatch):
    sides, (p_arrays, p_dev, p_ops), (d_arrays, d_dev, d_ops) = host_mode_pair(
        fa_nhd, d_fail="h2d" if failure == "h2d raises" else None)
    (p_sched, p_work), (_, d_work) = sides["kv_producer"], sides["kv_consumer"]
    if failure == "torch copy raises":
        # No copy op from vLLM: torch copies, and the device fails the host -> device copy.
        d_work.set_host_xfer_buffer_ops(None)
        monkeypatch.setattr(FakeCudaTensor, "fail", "copy_")
    remote, local = [2, 3], [9, 10]
    preq = request("r-2", {"do_remote_decode": True}, 2 * BS, "RUNNING")
    p_sched.update_state_after_alloc(preq, Blocks(remote), 0)
    p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
    p_work.start_load_kv(None)
    p_work.wait_for_save()
    offer_and_load(sides, preq, remote, local, "d-2")
    assert d_work.get_block_ids_with_load_errors() == set(local)
    for name in d_arrays:  # the device blocks were not touched: vLLM recomputes them
        for l in local:
            assert not np.array_equal(dev_block(d_arrays, name, l),
                                      dev_block(p_arrays, name, remote[local.index(l)]))


def test_host_buffer_mode_saves_when_the_last_chunk_runs_and_never_offers_unsaved_blocks():
    sched = kvferry.vllm.KvferryConnector(config("kv_producer", free_port(),
                                                 buffer_device="cpu"), "SCHEDULER")
    # Chunked prefill: 3 blocks of prompt in two steps; the save ships with the last chunk.
    req = request("c", {"do_remote_decode": True}, 3 * BS, "RUNNING")
    req.num_computed_tokens = 0
    sched.update_state_after_alloc(req, Blocks([12]), 0)
    out = SimpleNamespace(num_scheduled_tokens={"c": BS},
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]))
    assert sched.build_connector_meta(out).saves == {}
    req.num_computed_tokens = BS
    out = SimpleNamespace(num_scheduled_tokens={"c": 2 * BS},
                          scheduled_cached_reqs=SimpleNamespace(req_ids=["c"],
                                                                new_block_ids=[([13, 3],)]))
    assert sched.build_connector_meta(out).saves == {"c": [12, 13, 3]}
    req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    assert sched.request_finished(req, [12, 13, 3])[0] is True
    # Finished before its last chunk ran: its blocks never reached the host, so no hold.
    early = request("e", {"do_remote_decode": True}, 3 * BS, "RUNNING")
    early.num_computed_tokens = 0
    sched.update_state_after_alloc(early, Blocks([4]), 0)
    out = SimpleNamespace(num_scheduled_tokens={"e": BS},
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]))
    assert sched.build_connector_meta(out).saves == {}
    early.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    assert sched.request_finished(early, [4]) == (False, None)
    # Without kv_buffer_device "cpu" nothing is saved.
    plain = kvferry.vllm.KvferryConnector(config("kv_producer", free_port()), "SCHEDULER")
    plain.update_state_after_alloc(request("x", {"do_remote_decode": True}, BS), Blocks([1]), 0)
    assert plain.build_connector_meta(None).saves == {}


def test_host_buffer_mode_failing_device_to_host_copy_raises_rather_than_serving_stale_bytes():
    sides, (p_arrays, p_dev, p_ops), _ = host_mode_pair(fa_nhd)
    p_sched, p_work = sides["kv_producer"]
    p_ops.fail = "d2h"
    req = request("s", {"do_remote_decode": True}, BS, "RUNNING")
    p_sched.update_state_after_alloc(req, Blocks([3]), 0)
    p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        p_work.wait_for_save()


@pytest.mark.parametrize("copy_ops", [True, False], ids=["vllm_op", "torch"])
def test_host_buffer_mode_copies_kernel_blocks_when_they_are_smaller(copy_ops):
    # vLLM's copy ops take the tensors' (kernel) block ids, as NixlConnector hands them
    # (_logical_to_kernel_block_ids): logical block b of 2 kernel blocks is kernel 2b, 2b+1.
    # Without an op, torch copies the same kernel blocks, and no other.
    torch = pytest.importorskip("torch", reason="Debian's python3-torch (make deps) is absent")
    cfg = config("kv_producer", free_port(), block_size=2 * BS, buffer_device="cpu")
    sched = kvferry.vllm.KvferryConnector(cfg, "SCHEDULER")
    work = kvferry.vllm.KvferryConnector(cfg, "WORKER")
    arrays, dev = device_caches(torch, fa_nhd, 0, layers=1)
    ops = CopyOps(1)
    work.register_kv_caches(dev)
    if copy_ops:
        work.set_host_xfer_buffer_ops(ops)
    before = work._host_caches["l0"].numpy().copy()
    req = request("k", {"do_remote_decode": True}, 4 * BS, "RUNNING")
    sched.update_state_after_alloc(req, Blocks([3, 1]), 0)
    work.bind_connector_metadata(sched.build_connector_meta(None))
    work.wait_for_save()
    assert ops.calls == ([("d2h", [6, 7, 2, 3])] if copy_ops else [])
    mirror = work._host_caches["l0"].numpy()
    for b in range(NB):
        expected = dev_block(arrays, "l0", b) if b in (6, 7, 2, 3) else block_view(before, b)
        np.testing.assert_array_equal(block_view(mirror, b), expected)


# ---------------------------------------------------------------- layer-wise (issue 20)

LAYERWISE_HOSTILE = [
    {"do_remote_prefill": True, "transfer_id": 5, "remote_engine_id": "p",
     "remote_host": "127.0.0.1", "remote_port": 5557, "remote_tp_size": 1},
    {"do_remote_prefill": True, "transfer_id": "", "remote_engine_id": "p",
     "remote_host": "127.0.0.1", "remote_port": 5557, "remote_tp_size": 1},
    {"do_remote_prefill": True, "transfer_id": "x" * 2000, "remote_engine_id": "p",
     "remote_host": "127.0.0.1", "remote_port": 5557, "remote_tp_size": 1},
    {"do_remote_prefill": True, "transfer_id": "x", "remote_host": "127.0.0.1",
     "remote_port": 5557, "remote_tp_size": 1},
]


@pytest.mark.parametrize("params", LAYERWISE_HOSTILE)
def test_hostile_layerwise_params_never_raise(params):
    sched = kvferry.vllm.KvferryConnector(config("kv_consumer", 5557), "SCHEDULER")
    req = request("h", dict(params), 8)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, Blocks([]), 0)
    assert sched.build_connector_meta(None).awaited == ()


def fill_blocks(cache, blocks, seed):
    """Writes random bytes into `blocks` of every part of one layer's cache (fa_nhd layout)."""
    rng = np.random.default_rng(seed)
    for b in blocks:
        view = cache[:, b]
        view[...] = rng.integers(0, 256, view.nbytes, dtype=np.uint8).view(cache.dtype).reshape(
            view.shape)


def test_layerwise_legs_move_every_byte_as_each_layer_is_saved():
    """Both legs at once (docs/layerwise.md): the decode leg subscribes first; the prefill leg is
    computed in two chunks, and each layer's save_kv_layer lets the decode side read it. Blocks
    are scrambled until their layer is written, so a layer read early would fail the check;
    nothing is reported before the last layer of the last chunk; the prefill request is held
    under the transfer id and released by the reader."""
    pport, dport = free_port(), free_port()
    p_sched = kvferry.vllm.KvferryConnector(config("kv_producer", pport), "SCHEDULER")
    p_work = kvferry.vllm.KvferryConnector(config("kv_producer", pport), "WORKER")
    d_sched = kvferry.vllm.KvferryConnector(config("kv_consumer", dport), "SCHEDULER")
    d_work = kvferry.vllm.KvferryConnector(config("kv_consumer", dport), "WORKER")
    p_caches = {f"l{i}": fa_nhd() for i in range(LAYERS)}
    d_caches = {f"l{i}": fa_nhd() for i in range(LAYERS)}
    for i, c in enumerate(p_caches.values()):
        fill_random(c, 1000 + i)  # not written yet: nothing anyone may read
    p_work.register_kv_caches(p_caches)
    d_work.register_kv_caches(d_caches)
    remote, local = [12, 13, 3], [5, 6, 7]
    dparams = {"do_remote_prefill": True, "transfer_id": "xfer-1",
               "remote_engine_id": f"kv_producer-{pport}", "remote_host": "127.0.0.1",
               "remote_port": pport, "remote_tp_size": 1}
    dreq = request("d-1", dparams, 3 * BS)
    assert d_sched.get_num_new_matched_tokens(dreq, 0) == (3 * BS, True)
    d_sched.update_state_after_alloc(dreq, Blocks(local), 3 * BS)
    d_work.bind_connector_metadata(d_sched.build_connector_meta(None))
    d_work.start_load_kv(None)

    preq = request("p-1", {"do_remote_decode": True, "transfer_id": "xfer-1"}, 3 * BS)
    preq.num_computed_tokens = 0
    p_sched.update_state_after_alloc(preq, Blocks(remote[:2]), 0)
    chunks = [(0, 2 * BS, remote[:2], None),
              (2 * BS, BS, [3], SimpleNamespace(req_ids=["p-1"], new_block_ids=[[3]]))]
    for n, (computed, count, written, cached) in enumerate(chunks):
        preq.num_computed_tokens = computed
        out = SimpleNamespace(num_scheduled_tokens={"p-1": count}, scheduled_cached_reqs=cached)
        p_work.bind_connector_metadata(p_sched.build_connector_meta(out))
        p_work.start_load_kv(None)
        for i, (name, cache) in enumerate(p_caches.items()):
            assert not d_work.get_finished(set())[1], f"reported before chunk {n} layer {i}"
            fill_blocks(cache, written, 10 * n + i)  # the forward pass writes this layer
            p_work.save_kv_layer(name, cache, None)
        p_work.wait_for_save()
        p_work.clear_connector_metadata()
    assert poll(lambda: d_work.get_finished(set())[1], "the layer-wise load") == {"d-1"}
    assert d_work.get_block_ids_with_load_errors() == set()
    for name in p_caches:
        for r, l in zip(remote, local):
            assert np.array_equal(block_view(p_caches[name], r), block_view(d_caches[name], l)), \
                f"{name} block {r} -> {l}"
    preq.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    delay, params = p_sched.request_finished(preq, remote)
    assert delay and params["remote_request_id"] == "xfer-1"
    p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
    p_work.start_load_kv(None)
    assert poll(lambda: p_work.get_finished({"p-1"})[0], "the hold's release") == {"p-1"}


def test_layerwise_prefill_aborted_mid_layers_fails_the_decode_load_for_recompute():
    pport, dport = free_port(), free_port()
    p_sched = kvferry.vllm.KvferryConnector(config("kv_producer", pport), "SCHEDULER")
    p_work = kvferry.vllm.KvferryConnector(config("kv_producer", pport), "WORKER")
    d_sched = kvferry.vllm.KvferryConnector(config("kv_consumer", dport), "SCHEDULER")
    d_work = kvferry.vllm.KvferryConnector(config("kv_consumer", dport), "WORKER")
    p_caches = {f"l{i}": fa_nhd() for i in range(LAYERS)}
    p_work.register_kv_caches(p_caches)
    d_work.register_kv_caches({f"l{i}": fa_nhd() for i in range(LAYERS)})
    dreq = request("d-1", {"do_remote_prefill": True, "transfer_id": "xfer-2",
                           "remote_engine_id": f"kv_producer-{pport}",
                           "remote_host": "127.0.0.1", "remote_port": pport,
                           "remote_tp_size": 1}, 2 * BS)
    d_sched.get_num_new_matched_tokens(dreq, 0)
    d_sched.update_state_after_alloc(dreq, Blocks([1, 2]), 2 * BS)
    d_work.bind_connector_metadata(d_sched.build_connector_meta(None))
    d_work.start_load_kv(None)
    preq = request("p-2", {"do_remote_decode": True, "transfer_id": "xfer-2"}, 2 * BS)
    p_sched.update_state_after_alloc(preq, Blocks([8, 9]), 0)
    p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
    p_work.start_load_kv(None)
    p_work.save_kv_layer("l0", p_caches["l0"], None)
    preq.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert p_sched.request_finished(preq, [8, 9]) == (False, None)
    p_work.bind_connector_metadata(p_sched.build_connector_meta(None))
    p_work.start_load_kv(None)
    assert poll(lambda: d_work.get_finished(set())[1], "the failed load") == {"d-1"}
    assert d_work.get_block_ids_with_load_errors() == {1, 2}  # recomputed by vLLM's policy


def test_a_worker_listens_on_its_own_hosts_address_where_ranks_span_hosts():
    """One kv_transfer_config for every worker of an instance, which may run on several hosts:
    KVFERRY_HOST in a worker's environment, or "host": "auto" (vLLM's get_ip(): VLLM_HOST_IP
    here, vLLM not being importable), gives each its own address."""
    listen = kvferry.vllm_ascend.listen_host
    assert listen({"host": "10.0.0.9"}, {"KVFERRY_HOST": "10.0.0.5"}) == "10.0.0.5"
    assert listen({"host": "auto"}, {"VLLM_HOST_IP": "10.1.1.1"}) == "10.1.1.1"
    assert listen({"host": "10.0.0.9"}, {}) == "10.0.0.9"
    with pytest.raises(kvferry.InvalidArgumentError, match="VLLM_HOST_IP or KVFERRY_HOST"):
        listen({"host": "auto"}, {})
