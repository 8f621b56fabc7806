"""A vLLM-shaped harness for kvferry.vllm.KvferryConnector (issue 12).

It drives the connector the way vLLM v1 does, without vLLM:
  * one worker process per TP rank (spawned, as vLLM's multiproc executor runs workers), each
    with vLLM's parallel state answering get_tensor_model_parallel_rank/world_size, cache tensors
    allocated in the attention backend's real shape and strides (torch CPU tensors), and the
    model runner's connector call order: bind_connector_metadata, start_load_kv, (forward),
    wait_for_save, get_finished(finished_req_ids), get_block_ids_with_load_errors,
    clear_connector_metadata;
  * a scheduler per instance (prefill, decode) in this process with vLLM Request fields and
    statuses, a KVCacheBlocks-like allocation, the connector's scheduler hooks in vLLM's order,
    and the asserts of vLLM's scheduler: WAITING_FOR_REMOTE_KVS -> RUNNING only after
    finished_recving, finished_recving/finished_sending only for requests it holds
    (`assert req_id in self.requests`), and KVOutputAggregator's rule that a request is finished
    only when every TP rank reported it;
  * a proxy hop that forwards kv_transfer_params through JSON as vLLM's toy proxy
    (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py) does: the prefill request gets
    {"do_remote_decode": True, "do_remote_prefill": False, "remote_*": None} and max_tokens 1,
    and the prefill response's kv_transfer_params become the decode request's.

Cache contents are a deterministic function of (seed, layer, model-wide head), so the test can
check every byte a decode rank holds against what the prefill instance computed, whatever the
two TP sizes and layouts are.

On Ascend (issue 22 item 3) it also builds what vllm-ascend's NPU model runner hands over: a
tuple of parts per layer, each its own buffer (backends "ascend_*"), as torch_npu tensors
(g["device"] "npu": fake NPU tensors, tests/python/fake_devices.py) with no copy op handed over
(vllm-ascend never calls set_host_xfer_buffer_ops, so host-buffer mode copies with torch), the
LLM-DataDist connector's kv_transfer_config and environment as they are (g["seed_config"]), and
NPU memory from the fake CANN runtime the C++ tests use (g["acl"]: the path of
libfake_libascendcl.so, which kvferry then opens as libascendcl.so).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import json
import math
import multiprocessing
import os
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

# ----------------------------------------------------------------------------- vLLM's types


class RequestStatus(enum.IntEnum):
    """vllm.v1.request.RequestStatus (the members a connector sees)."""

    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_IGNORED = 7
    FINISHED_ERROR = 8

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


class KVConnectorRole(enum.IntEnum):
    SCHEDULER = 0
    WORKER = 1


@dataclass
class SamplingParams:
    max_tokens: int = 16


@dataclass
class Request:
    """The fields of vllm.v1.request.Request that connectors and the scheduler use."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: Optional[dict] = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    client_index: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)


@dataclass
class KVCacheBlock:
    block_id: int


class KVCacheBlocks:
    """vllm.v1.core.kv_cache_manager.KVCacheBlocks: one group of blocks (no hybrid allocator)."""

    def __init__(self, blocks: list[KVCacheBlock]):
        self.blocks = (blocks,)

    def get_block_ids(self) -> tuple[list[int]]:
        return ([b.block_id for b in self.blocks[0]],)

    def get_unhashed_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks[0]]


@dataclass
class KVConnectorOutput:
    """vllm.v1.outputs.KVConnectorOutput (the fields kvferry fills)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_stats: Any = None


class KVOutputAggregator:
    """vllm.distributed.kv_transfer.kv_connector.utils.KVOutputAggregator: a request is finished
    sending/receiving only when every one of `world_size` ranks has reported it."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.send_left: dict[str, int] = {}
        self.recv_left: dict[str, int] = {}

    def _update(self, ids, left: dict[str, int], out: set[str]) -> None:
        for rid in ids or ():
            n = left.get(rid, self.world_size) - 1
            assert n >= 0, f"{rid} reported by more ranks than the world size"
            if n == 0:
                left.pop(rid, None)
                out.add(rid)
            else:
                left[rid] = n

    def aggregate(self, per_rank: list[tuple]) -> KVConnectorOutput:
        """As KVOutputAggregator.aggregate: the first worker's kv_connector_stats object is the
        accumulator, each later one is folded in with `acc = acc.aggregate(s)` after
        `assert isinstance(acc, type(s))`."""
        out = KVConnectorOutput()
        assert len(per_rank) == self.world_size
        for sending, recving, invalid, _errors, stats in per_rank:
            self._update(sending, self.send_left, out.finished_sending)
            self._update(recving, self.recv_left, out.finished_recving)
            out.invalid_block_ids |= set(invalid or ())
            if stats is None:
                continue
            if out.kv_connector_stats is None:
                out.kv_connector_stats = stats
            else:
                assert isinstance(out.kv_connector_stats, type(stats))
                out.kv_connector_stats = out.kv_connector_stats.aggregate(stats)
        return out


# ----------------------------------------------------------------------------- cache tensors

# Backends: name -> (logical shape kind, physical order of the logical dims).
#   kv_first: logical (2, num_blocks, block_size, heads, head_dim)
#   kv_inner: logical (num_blocks, 2, block_size, heads, head_dim)
#   cpu:      logical (2, num_blocks, heads, block_size, head_dim)
#   mla:      logical (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)
#   ascend_*: vllm-ascend's tuple per layer, each part contiguous: (k, v) each (num_blocks,
#             block_size, heads, head_dim); (nope, rope) each (num_blocks, block_size, 1, dim);
#             (nope, rope, indexer_k), the indexer g["indexer"] wide (DeepSeek's 128)
BACKENDS = {
    "flash_attn_old_nhd": ("kv_first", (0, 1, 2, 3, 4)),
    "flash_attn_old_hnd": ("kv_first", (0, 1, 3, 2, 4)),
    "flash_attn_nhd": ("kv_inner", (0, 1, 2, 3, 4)),  # FlashAttention/Triton at vLLM main
    "flash_attn_hnd": ("kv_inner", (0, 1, 3, 2, 4)),  # stride_order for HND
    "flashinfer_hnd": ("kv_inner", (0, 1, 3, 2, 4)),
    "cpu": ("cpu", (0, 1, 2, 3, 4)),
    "mla": ("mla", (0, 1, 2)),
    "ascend_mha": ("ascend_kv", (0, 1, 2, 3)),
    "ascend_mla": ("ascend_latent", (0, 1, 2, 3)),
    "ascend_sfa": ("ascend_latent", (0, 1, 2, 3)),
}


def is_latent(g: dict) -> bool:
    """MLA-style caches: no head axis, replicated on every TP rank."""
    return g["backend"] in ("mla", "ascend_mla", "ascend_sfa")


def part_widths(g: dict) -> tuple[int, ...]:
    """The widths of an MLA-style layer's parts: (nope, rope[, indexer]); g["width"] in all."""
    if g["backend"] == "ascend_sfa":
        return (g["lora"], g["width"] - g["lora"] - g["indexer"], g["indexer"])
    if g["backend"] == "ascend_mla":
        return (g["lora"], g["width"] - g["lora"])
    return (g["width"],)


def local_heads(model_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first model-wide head, count) of a TP rank, vLLM's split (heads replicated when fewer
    than ranks)."""
    if model_heads >= tp:
        n = model_heads // tp
        return rank * n, n
    return rank // (tp // model_heads), 1


def model_content(g: dict, layer: int) -> np.ndarray:
    """The prefill instance's bytes of one layer, model-wide: MHA (2, blocks, block_size, heads,
    head_dim * itemsize); MLA (blocks, block_size, width * itemsize). Independent of TP."""
    rng = np.random.default_rng(g["seed"] * 1000 + layer)
    isz = g["itemsize"]
    if is_latent(g):
        shape = (g["num_blocks"], g["block_size"], g["width"] * isz)
    else:
        shape = (2, g["num_blocks"], g["block_size"], g["heads"], g["head_dim"] * isz)
    return rng.integers(0, 256, shape, dtype=np.uint8)


def _byte_view(torch, base, order):
    """The logical view of `base`'s bytes: base is the physical tensor; the last dim grows by
    the element size."""
    inverse = [order.index(i) for i in range(len(order))]
    return base.view(torch.uint8).permute(*inverse)


class Canon:
    """A layer's bytes in model_content's canonical layout, over the cache's own memory:
    `views` are byte views of its tensors, joined by "one" (the single view), "stack" (K and V,
    each (nb, bs, h, d * itemsize)) or "concat" (MLA-style parts, each (nb, bs, 1, w *
    itemsize), side by side in a row)."""

    def __init__(self, torch, views: list, join: str = "one"):
        self.torch, self.views, self.join = torch, views, join

    def write(self, full: np.ndarray) -> None:
        if self.join == "stack":
            pieces = [full[i] for i in range(len(self.views))]
        elif self.join == "concat":
            edges = np.cumsum([0] + [v.shape[-1] for v in self.views])
            pieces = [full[:, :, None, a:b] for a, b in zip(edges[:-1], edges[1:])]
        else:
            pieces = [full]
        for view, piece in zip(self.views, pieces):
            view.copy_(self.torch.from_numpy(np.ascontiguousarray(piece)))

    def read(self) -> np.ndarray:
        arrays = [v.numpy().copy() for v in self.views]
        if self.join == "stack":
            return np.stack(arrays)
        if self.join == "concat":
            return np.concatenate([a[:, :, 0] for a in arrays], axis=-1)
        return arrays[0]


def build_cache(torch, g: dict, tp: int, rank: int, alloc=None):
    """One layer's tensor (vllm-ascend: tuple of tensors) in the backend's shape and strides,
    and a Canon of its bytes in the canonical layout of model_content (heads cut to this
    rank's). `alloc(shape, dtype)` makes zeroed memory (torch.zeros by default)."""
    kind, order = BACKENDS[g["backend"]]
    dtype = getattr(torch, g["dtype"])
    alloc = alloc or (lambda shape, dt: torch.zeros(shape, dtype=dt))
    nb, bs, d = g["num_blocks"], g["block_size"], g["head_dim"]
    if kind == "mla":
        base = alloc((nb, bs, g["width"]), dtype)
        return base, Canon(torch, [base.view(torch.uint8)])
    if kind == "ascend_latent":
        parts = tuple(alloc((nb, bs, 1, w), dtype) for w in part_widths(g))
        return parts, Canon(torch, [p.view(torch.uint8) for p in parts], "concat")
    _, h = local_heads(g["heads"], tp, rank)
    if kind == "ascend_kv":
        parts = tuple(alloc((nb, bs, h, d), dtype) for _ in range(2))
        return parts, Canon(torch, [p.view(torch.uint8) for p in parts], "stack")
    logical = {"kv_first": (2, nb, bs, h, d), "kv_inner": (nb, 2, bs, h, d),
               "cpu": (2, nb, h, bs, d)}[kind]
    physical = tuple(logical[i] for i in order)
    base = alloc(physical, dtype)
    inverse = [order.index(i) for i in range(len(order))]
    tensor = base.permute(*inverse)  # logical shape, the backend's strides
    assert tuple(tensor.shape) == logical
    view = _byte_view(torch, base, list(order))
    canon = {"kv_first": view, "kv_inner": view.transpose(0, 1),
             "cpu": view.transpose(2, 3)}[kind]  # (2, nb, bs, h, d * itemsize)
    return tensor, Canon(torch, [canon])


# ----------------------------------------------------------------------------- host-buffer mode


def on_device(g: dict, cache, layer: int, acl: "Optional[FakeAcl]"):
    """A layer's tensor (or tuple) as device tensors (fake_devices.py) of g["device"] ("cuda"
    by default, "npu"): with fake CANN memory (g["acl"]) at its real address, which kvferry
    registers as npu:0; else at addresses kvferry cannot read (host-buffer mode never reads
    them: it registers host mirrors). Vllm-ascend's parts each start 2 MiB-aligned."""
    from fake_devices import FakeCudaTensor, FakeNpuTensor

    kind = FakeNpuTensor if g.get("device") == "npu" else FakeCudaTensor
    tensors = list(cache) if isinstance(cache, tuple) else [cache]
    out = []
    for i, t in enumerate(tensors):
        address = t.data_ptr() if acl is not None else 0x7F0000000000 + (layer << 32) + (i << 28)
        out.append(kind(t, address))
    return tuple(out) if isinstance(cache, tuple) else out[0]


class FakeAcl:
    """NPU memory from the fake CANN runtime (tests/unit/device/fake_libascendcl.cc): memory it
    allocates (aclrtMalloc) and kvferry's acl device reads, writes, exports and imports through
    it. Setting KVFERRY_ACL_LIBRARY before kvferry first touches NPU memory makes kvferry open
    this library as libascendcl.so; dlopen of one path gives one library, so the allocations
    here are the ones kvferry queries."""

    def __init__(self, path: str):
        os.environ["KVFERRY_ACL_LIBRARY"] = path
        self.lib = ctypes.CDLL(path)
        self.lib.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                         ctypes.c_int]
        assert self.lib.aclInit(None) in (0, 100002)  # ACL_ERROR_REPEAT_INITIALIZE
        assert self.lib.aclrtSetDevice(0) == 0
        self.buffers: list = []  # never freed: the caches live as long as the process

    def zeros(self, torch, shape: tuple, dtype):
        size = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        ptr = ctypes.c_void_p()
        assert self.lib.aclrtMalloc(ctypes.byref(ptr), size, 0) == 0, "aclrtMalloc failed"
        buffer = (ctypes.c_uint8 * size).from_address(ptr.value)
        self.buffers.append(buffer)
        tensor = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
        tensor.zero_()
        assert tensor.data_ptr() == ptr.value
        return tensor


def copy_kv_blocks_for(torch, kind: str, calls: list):
    """vLLM's copy_kv_blocks(src_caches, dst_caches, src_block_ids, dst_block_ids, direction)
    for this backend's tensors: whole blocks, indexed on the block dim; records each call."""
    from fake_devices import FakeDeviceTensor

    block_dim = 1 if kind in ("kv_first", "cpu") else 0

    def copy(src_caches, dst_caches, src_ids, dst_ids, direction):
        calls.append((direction, list(src_ids)))
        for name, src in src_caches.items():
            dst = dst_caches[name]
            src = src.storage if isinstance(src, FakeDeviceTensor) else src
            dst = dst.storage if isinstance(dst, FakeDeviceTensor) else dst
            s_idx, d_idx = torch.tensor(src_ids), torch.tensor(dst_ids)
            if block_dim == 0:
                dst[d_idx] = src[s_idx]
            else:
                dst[:, d_idx] = src[:, s_idx]
    return copy


# ----------------------------------------------------------------------------- worker processes


def _fake_vllm(size: int, rank: int, cpu: bool, pp: int = 1, pp_rank: int = 0) -> None:
    """vLLM's parallel state and platform as the connector reads them in a worker process:
    the TP group's size and rank, and the pipeline group (get_pp_group(): a GroupCoordinator's
    world_size and rank_in_group)."""
    ps = types.ModuleType("vllm.distributed.parallel_state")
    ps.get_tensor_model_parallel_world_size = lambda: size
    ps.get_tensor_model_parallel_rank = lambda: rank
    ps.get_pp_group = lambda: types.SimpleNamespace(world_size=pp, rank_in_group=pp_rank,
                                                   is_first_rank=pp_rank == 0,
                                                   is_last_rank=pp_rank == pp - 1)
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: cpu)
    for name in ("vllm", "vllm.distributed"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["vllm.distributed.parallel_state"] = ps
    sys.modules["vllm.platforms"] = platforms


# vllm-ascend's tutorial for its LLM-DataDist connector (docs/source/tutorials/
# single_node_pd_disaggregation_llmdatadist.md), with only the connector's name and module path
# changed: engine_id "0" and kv_port "20001" on both instances; the port each listens on comes
# from VLLM_ASCEND_LLMDD_RPC_PORT (Instance's env), the devices from the rank table.
SEED_KV_TRANSFER_CONFIG = {"kv_connector": "KvferryConnector", "kv_buffer_device": "npu",
                           "kv_role": None, "kv_parallel_size": 1, "kv_port": "20001",
                           "engine_id": "0", "kv_connector_module_path": "kvferry.vllm"}


def pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """vllm/distributed/utils.py get_pp_indices without VLLM_PP_LAYER_PARTITION: [start, end)
    of a stage, the remainder layers going to the stages before the last."""
    per, rem = divmod(num_layers, pp_size)
    sizes = [per] * pp_size
    for i in range(rem):  # vLLM spreads the remainder over the non-last partitions
        sizes[pp_size - 2 - i if pp_size > 1 else 0] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def vllm_config(g: dict, role: str, port: int, tp: int, extra: Optional[dict] = None,
                pp: int = 1):
    """The parts of VllmConfig the connector reads; the same object for every rank. With
    g["seed_config"] the kv_transfer_config is SEED_KV_TRANSFER_CONFIG (kv_buffer_device
    g["seed_config"]) and nothing else: no extra config."""
    heads = g.get("heads", 1)
    model = types.SimpleNamespace(use_mla=is_latent(g), get_total_num_kv_heads=lambda: heads,
                                  hf_text_config=types.SimpleNamespace(
                                      num_hidden_layers=g["layers"]))
    if is_latent(g):
        widths = part_widths(g)
        rope = widths[1] if len(widths) > 1 else g["width"] - g["lora"]
        model.hf_text_config.kv_lora_rank = g["lora"]
        model.hf_text_config.qk_rope_head_dim = rope
    parallel = types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                     data_parallel_rank=0)
    cache = types.SimpleNamespace(block_size=g["block_size"])
    if g.get("seed_config"):
        ktc = dict(SEED_KV_TRANSFER_CONFIG, kv_role=role, kv_buffer_device=g["seed_config"])
        return types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(**ktc),
                                     parallel_config=parallel, cache_config=cache,
                                     model_config=model)
    kv_extra = {"base_port": port, "host": "127.0.0.1", "transport": g.get("transport", "auto"),
                "transfer_timeout_ms": 10000}
    if g.get("register"):  # the instance registers in etcd (docs/fleet.md); scheduler side
        kv_extra["register"] = g["register"]
    kv_extra.update(extra or {})
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(
            kv_role=role, engine_id=f"{role}-{port}", kv_connector_extra_config=kv_extra,
            kv_load_failure_policy=g.get("policy", "recompute"),
            kv_buffer_device="cpu" if g.get("host_buffer") else g.get("device", "cuda")),
        parallel_config=parallel, cache_config=cache, model_config=model)


@contextlib.contextmanager
def environment(env: Optional[dict]):
    """os.environ with `env` set, restored afterwards (the connector reads the reference's
    variables when it is made)."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank_main(conn) -> None:  # pragma: no cover - runs in the child
    import torch

    import kvferry.vllm

    state: dict[str, Any] = {}
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "close":
                conn.send(("ok", None))
                return
            if cmd == "init":
                old = state.pop("connector", None)
                if old is not None:
                    old.shutdown()
                    del old
                g, role, port, tp, rank, env, pp, pp_rank = arg
                _fake_vllm(tp, rank, g["backend"] == "cpu", pp, pp_rank)
                with environment(env):  # the reference's variables, read when it is made
                    c = kvferry.vllm.KvferryConnector(vllm_config(g, role, port, tp, pp=pp),
                                                      KVConnectorRole.WORKER)
                acl = None
                if g.get("acl"):  # NPU memory from the fake CANN runtime, kept per process
                    acl = state.get("acl") or FakeAcl(g["acl"])
                    state["acl"] = acl
                alloc = (lambda shape, dt: acl.zeros(torch, shape, dt)) if acl else None
                caches, views = {}, []
                first, end = pp_indices(g["layers"], pp_rank, pp)
                for layer in range(first, end):  # this pipeline stage's layers (make_layers)
                    tensor, canon = build_cache(torch, g, tp, rank, alloc)
                    if role == "kv_producer":
                        full = model_content(g, layer)
                        if not is_latent(g):
                            first, n = local_heads(g["heads"], tp, rank)
                            full = full[:, :, :, first:first + n]
                        canon.write(full)
                    if g.get("host_buffer") or acl:  # the canonical views stay on the device
                        tensor = on_device(g, tensor, layer, acl)
                    caches[f"model.layers.{layer}.self_attn.attn"] = tensor
                    views.append(canon)
                c.register_kv_caches(caches)
                copies: list = []
                # The model runner's order: then the copy ops, where the platform hands them
                # over (vllm-ascend never does: torch copies, kvferry/vllm_hostcopy.py).
                if g.get("host_buffer") and g.get("copy_ops", g.get("device") != "npu"):
                    c.set_host_xfer_buffer_ops(
                        copy_kv_blocks_for(torch, BACKENDS[g["backend"]][0], copies))
                errors: list = []
                native = c._worker

                class Recorder:  # keeps the native load errors' messages for the test
                    def __getattr__(self, name):
                        return getattr(native, name)

                    def take_load_errors(self):
                        got = native.take_load_errors()
                        errors.extend((e["request_id"], e["code"], e["message"]) for e in got)
                        return got

                c._worker = Recorder()
                state.update(connector=c, views=views, errors=errors, caches=caches,
                             copies=copies, layers=list(range(first, end)))
                conn.send(("ok", None))
            elif cmd == "step":
                # vLLM's worker step with a connector (vllm/v1/worker/gpu_model_runner.py
                # execute_model, kv_connector_model_runner_mixin.py _get_kv_connector_output):
                # handle_preemptions with the metadata every step, bind, start_load_kv before the
                # forward only when the step has synchronous loads (PR 53333; kvferry's loads are
                # all asynchronous, so after it), the forward's per-layer hooks, then
                # wait_for_save, get_finished, get_block_ids_with_load_errors,
                # get_kv_connector_stats, build_connector_worker_meta, clear_connector_metadata.
                c = state["connector"]
                metadata, finished_req_ids, sync_loads = arg
                c.handle_preemptions(metadata)
                c.bind_connector_metadata(metadata)
                if sync_loads:
                    c.start_load_kv(None)
                for name, tensor in state["caches"].items():  # the forward pass
                    c.wait_for_layer_load(name)
                    c.save_kv_layer(name, tensor, None)
                if not sync_loads:
                    c.start_load_kv(None)
                c.wait_for_save()
                sending, recving = c.get_finished(set(finished_req_ids))
                invalid = c.get_block_ids_with_load_errors()
                stats = c.get_kv_connector_stats()
                assert c.build_connector_worker_meta() is None
                c.clear_connector_metadata()
                reported = list(state["errors"])
                state["errors"].clear()
                conn.send(("ok", (set(sending or ()), set(recving or ()), set(invalid), reported,
                                  stats)))
            elif cmd == "handshake":
                # vllm/v1/worker/gpu_worker.py get_kv_connector_handshake_metadata: this
                # worker's metadata keyed by (pp_rank, tp_rank), after the caches are registered.
                c = state["connector"]
                md = c.get_handshake_metadata()
                conn.send(("ok", None if md is None else {(md.pp_rank, md.tp_rank): md}))
            elif cmd == "copies":
                conn.send(("ok", list(state["copies"])))
            elif cmd == "registration":  # what the connector registered, and as which engine
                c = state["connector"]
                reg = c._registration
                conn.send(("ok", {"memory": reg.memory, "kind": reg.kind, "layout": reg.layout,
                                  "engine_id": c._settings.engine_id,
                                  "base_port": c._settings.base_port}))
            elif cmd == "read":  # (model-wide layer index, canonical bytes) of each layer held
                conn.send(("ok", list(zip(state["layers"], [v.read() for v in state["views"]]))))
            else:
                conn.send(("error", f"unknown command {cmd}"))
        except Exception as e:  # reported to the test, which fails with it
            conn.send(("error", f"{type(e).__name__}: {e}"))


class RankProcess:
    """One TP rank's worker process."""

    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_rank_main, args=(child,), daemon=True)
        self.proc.start()

    def send(self, cmd: str, arg: Any = None) -> None:
        self.conn.send((cmd, arg))

    def recv(self, timeout: float = 120.0) -> Any:  # the first answer waits for torch to load
        if not self.conn.poll(timeout):
            raise AssertionError(f"worker process {self.proc.pid} did not answer in {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RankError(value)
        return value

    def call(self, cmd: str, arg: Any = None) -> Any:
        self.send(cmd, arg)
        return self.recv()

    def close(self) -> None:
        try:
            self.call("close")
        finally:
            self.proc.join(10)


class RankError(AssertionError):
    """An exception inside a worker process, with its type and message."""


def start_ranks(count: int) -> list[RankProcess]:
    ctx = multiprocessing.get_context("spawn")
    return [RankProcess(ctx) for _ in range(count)]


# ----------------------------------------------------------------------------- one instance


@dataclass
class CachedRequestData:
    """vllm.v1.core.sched.output.CachedRequestData: the requests scheduled again, with the
    blocks each got in this step (one list per KV cache group) and its computed tokens."""

    req_ids: list[str]
    new_block_ids: list[Optional[tuple[list[int], ...]]]
    num_computed_tokens: list[int]


@dataclass
class SchedulerOutput:
    """vllm.v1.core.sched.output.SchedulerOutput, the fields connectors read; `scheduled` is
    the harness's own (the running requests, in order)."""

    scheduled_new_reqs: list
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    scheduled: list[str]
    has_sync_kv_loads: bool = False  # PR 53333: no synchronous loads, so loads start after
    kv_connector_metadata: Any = None


class StatLoggers:
    """What vLLM's stat loggers do with SchedulerStats.kv_connector_stats (a dict: the
    aggregated stats' data; vllm/v1/metrics/loggers.py): LoggingStatLogger's
    KVConnectorLogging rebuilds an object with the connector class's
    build_kv_connector_stats(data=...) and logs reduce(); PrometheusStatLogger's KVConnectorProm
    calls build_prom_metrics once, with prometheus_client's classes and labelnames
    ["model_name", "engine"], and observe(data, engine_idx) each interval. Metrics register in a
    registry of their own (vLLM has one instance per process; the tests have several)."""

    def __init__(self, connector_cls: Any, vllm_cfg: Any):
        import prometheus_client as prom

        self.registry = prom.CollectorRegistry()

        def bound(cls):
            return lambda *a, **kw: cls(*a, registry=self.registry, **kw)

        types_ = {prom.Gauge: bound(prom.Gauge), prom.Counter: bound(prom.Counter),
                  prom.Histogram: bound(prom.Histogram)}
        self.cls = connector_cls
        self.prom = connector_cls.build_prom_metrics(vllm_cfg, types_, ["model_name", "engine"],
                                                     {0: ["harness-model", "0"]})
        self.logged: list[dict] = []

    def record(self, data: Optional[dict]) -> None:
        if not data:
            return
        self.logged.append(self.cls.build_kv_connector_stats(data=data).reduce())
        if self.prom is not None:
            self.prom.observe(data, 0)

    def text(self) -> str:
        import prometheus_client as prom

        return prom.generate_latest(self.registry).decode()


class Instance:
    """One vLLM instance: its scheduler (here) and its TP ranks (worker processes)."""

    def __init__(self, g: dict, role: str, port: int, ranks: list[RankProcess],
                 env: Optional[dict] = None, pp: int = 1, stage_hosts: Optional[list] = None):
        """`env`: environment variables the instance's processes start with (the reference's
        VLLM_ASCEND_LLMDD_RPC_PORT, DISAGGREGATED_PREFILL_RANK_TABLE_PATH, ...). `pp`: pipeline
        stages; the ranks are stage-major (vLLM's DP x PP x TP rank order), TP = ranks / pp.
        `stage_hosts`: each stage on a host of its own (its workers' KVFERRY_HOST), as a
        multi-node deployment places them; the scheduler stays on the configured host."""
        import kvferry.vllm

        assert len(ranks) % pp == 0
        self.g, self.role, self.ranks, self.pp = g, role, ranks, pp
        self.tp = len(ranks) // pp
        for r, proc in enumerate(ranks):
            stage = r // self.tp
            rank_env = dict(env or {})
            if stage_hosts:
                rank_env["KVFERRY_HOST"] = stage_hosts[stage]
            proc.send("init", (g, role, port, self.tp, r % self.tp, rank_env or env, pp, stage))
        for proc in ranks:
            proc.recv()
        with environment(env):
            cfg = vllm_config(g, role, port, self.tp, pp=pp)
            self.connector = kvferry.vllm.KvferryConnector(cfg, KVConnectorRole.SCHEDULER)
        # vllm/v1/engine/core.py EngineCore.__init__: after the caches are registered, every
        # worker's handshake metadata, merged into one dict keyed by (pp_rank, tp_rank), goes to
        # the scheduler's connector (set_xfer_handshake_metadata_pp_aware).
        content: dict = {}
        for proc in ranks:
            content.update(proc.call("handshake") or {})
        if content:
            self.connector.set_xfer_handshake_metadata_pp_aware(content)
        self.stat_loggers = StatLoggers(type(self.connector), cfg)
        self.preempt_next: set[str] = set()  # running requests to preempt in the next schedule()
        self.bs = g["block_size"]
        # Block 0 is vLLM's null block; the rest in a per-instance order, so that remote and
        # local block ids differ and a misrouted block cannot go unnoticed.
        order = np.random.default_rng(port).permutation(np.arange(1, g["num_blocks"]))
        self.free = [int(b) for b in order]
        self.blocks: dict[str, list[int]] = {}
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        self.finished_req_ids: set[str] = set()
        self.responses: dict[str, Optional[dict]] = {}  # finished: the kv_transfer_params
        # KVOutputAggregator.from_connector: parallel_config.world_size reports (PP x TP).
        self.aggregator = KVOutputAggregator(len(ranks))
        self.load_errors: list[tuple] = []  # (request, code, message) from every rank
        # num_computed_tokens of each request promoted out of WAITING_FOR_REMOTE_KVS
        self.promoted: dict[str, int] = {}
        self.scheduled_once: set[str] = set()  # scheduled since they last started (vLLM's
        # scheduled_new_reqs are the others)

    # vLLM's Scheduler.add_request / finish_requests / _free_request
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_requests(self, rid: str, status: RequestStatus) -> None:
        req = self.requests[rid]
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        loading = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        req.status = status
        self._free_request(req, keep=loading)

    def _free_request(self, req: Request, keep: bool = False) -> None:
        delay, params = self.connector.request_finished(req, self.blocks.get(req.request_id, []))
        self.responses[req.request_id] = params
        self.finished_req_ids.add(req.request_id)
        if not delay and not keep:  # a load in flight keeps its blocks until finished_recving
            self._free_blocks(req)

    def _free_blocks(self, req: Request) -> None:
        self.free.extend(self.blocks.pop(req.request_id, []))
        del self.requests[req.request_id]

    def _allocate(self, req: Request, tokens: int) -> list[int]:
        need = math.ceil(tokens / self.bs) - len(self.blocks.get(req.request_id, []))
        assert need <= len(self.free), "the harness ran out of blocks"
        new, self.free = self.free[:need], self.free[need:]
        self.blocks.setdefault(req.request_id, []).extend(new)
        return new

    def _update_waiting_for_remote_kv(self, req: Request) -> None:
        if req.request_id in self.failed_recving_kv_req_ids:
            self.failed_recving_kv_req_ids.discard(req.request_id)  # recompute from there
        else:
            n = min(len(self.blocks[req.request_id]) * self.bs, req.num_tokens)
            req.num_computed_tokens = n - 1 if n == req.num_tokens else n
        self.finished_recving_kv_req_ids.discard(req.request_id)
        self.promoted[req.request_id] = req.num_computed_tokens

    def schedule(self) -> SchedulerOutput:
        for req in list(self.waiting):
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if req.request_id not in self.finished_recving_kv_req_ids:
                    continue
                self._update_waiting_for_remote_kv(req)
                req.status = RequestStatus.WAITING
            if req.num_computed_tokens == 0 and req.request_id not in self.blocks:
                ext, load_async = self.connector.get_num_new_matched_tokens(req, 0)
                new = self._allocate(req, req.num_prompt_tokens)
                # vLLM hands the request's blocks (kv_cache_manager.get_blocks): all new here.
                self.connector.update_state_after_alloc(
                    req, KVCacheBlocks([KVCacheBlock(b) for b in new]), ext)
                if load_async:
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    continue
                req.num_computed_tokens = ext
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        preempted = self._preempt()
        # Running requests run every step: the rest of the prompt, or one decode token.
        scheduled = [r.request_id for r in self.running]
        tokens = {r.request_id: r.num_tokens - r.num_computed_tokens for r in self.running}
        cached = [r for r in self.running if r.request_id in self.scheduled_once]
        new = [r for r in self.running if r.request_id not in self.scheduled_once]
        self.scheduled_once.update(r.request_id for r in new)
        out = SchedulerOutput(
            new, CachedRequestData([r.request_id for r in cached], [None] * len(cached),
                                   [r.num_computed_tokens for r in cached]),
            tokens, sum(tokens.values()), set(self.finished_req_ids), preempted, scheduled)
        # vLLM builds the metadata from the output, before _update_after_schedule.
        out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self.finished_req_ids.clear()
        return out

    def _preempt(self) -> set[str]:
        """vLLM's _preempt_request for the requests in preempt_next: their blocks are freed at
        once (no request_finished), num_computed_tokens goes back to 0 and they wait again, to
        be scheduled (and their connector hooks called) anew."""
        out = set()
        for req in [r for r in self.running if r.request_id in self.preempt_next]:
            self.running.remove(req)
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            req.num_preemptions += 1
            self.free.extend(self.blocks.pop(req.request_id, []))
            self.scheduled_once.discard(req.request_id)
            self.waiting.insert(0, req)
            out.add(req.request_id)
        self.preempt_next -= out
        return out

    def step(self) -> KVConnectorOutput:
        """schedule(), every rank's worker step, then update_from_output."""
        out = self.schedule()
        for proc in self.ranks:  # metadata is pickled to every rank, as vLLM broadcasts it
            proc.send("step", (out.kv_connector_metadata, out.finished_req_ids,
                               out.has_sync_kv_loads))
        per_rank = [proc.recv() for proc in self.ranks]
        for r in per_rank:
            self.load_errors.extend(r[3])
        kv_out = self.aggregator.aggregate(per_rank)
        self.update_from_output(out, kv_out)
        return kv_out

    def update_from_output(self, out: SchedulerOutput, kv_out: KVConnectorOutput) -> None:
        # The workers' stats merged with the scheduler-side connector's, then make_stats hands
        # their data (a dict) to the stat loggers.
        stats = kv_out.kv_connector_stats
        if stats is not None:
            own = self.connector.get_kv_connector_stats()
            if own is not None:
                stats = stats.aggregate(own)
        self.stat_loggers.record(stats.data if stats is not None else None)
        failed = self._handle_invalid_blocks(kv_out.invalid_block_ids)
        for rid in out.scheduled:  # one token each: the prefill side stops at max_tokens 1
            req = self.requests.get(rid)
            if req is None or req.is_finished() or rid in failed:
                continue
            req.output_token_ids.append(7)
            req.num_computed_tokens = req.num_tokens - 1
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                self.running.remove(req)
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self._free_request(req)
        if failed and self.g.get("policy", "recompute") == "fail":
            for rid in failed:
                self.finish_requests(rid, RequestStatus.FINISHED_ERROR)
        # update_from_output takes the connector's KV events every step; then
        # _update_from_kv_xfer_finished hands it the output first, and checks with vLLM's asserts.
        assert tuple(self.connector.take_events()) == ()
        self.connector.update_connector_output(kv_out)
        for rid in kv_out.finished_recving:
            assert rid in self.requests, f"finished_recving names {rid}, which vLLM does not hold"
            req = self.requests[rid]
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(rid)
            else:
                assert req.is_finished(), f"{rid} received while {req.status.name}"
                self._free_blocks(req)
        for rid in kv_out.finished_sending:
            assert rid in self.requests, f"finished_sending names {rid}, which vLLM does not hold"
            self._free_blocks(self.requests[rid])

    def _handle_invalid_blocks(self, invalid: set[int]) -> set[str]:
        """vLLM's _handle_invalid_blocks for async loads: the requests owning them recompute
        from the first invalid block ("recompute") or are failed ("fail")."""
        failed = set()
        for rid, ids in self.blocks.items():
            bad = [i for i, b in enumerate(ids) if b in invalid]
            req = self.requests.get(rid)
            if not bad or req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            failed.add(rid)
            self.failed_recving_kv_req_ids.add(rid)
            req.num_computed_tokens = bad[0] * self.bs
        return failed

    def copies(self) -> list[list[tuple]]:
        """Every rank's host-buffer copy op calls, (direction, block ids)."""
        for proc in self.ranks:
            proc.send("copies")
        return [proc.recv() for proc in self.ranks]

    def registrations(self) -> list[dict]:
        """Every rank's registered memory kind, cache kind and layout, kvferry engine id and
        base port."""
        for proc in self.ranks:
            proc.send("registration")
        return [proc.recv() for proc in self.ranks]

    def read(self) -> list[list[tuple[int, np.ndarray]]]:
        """Every rank's caches as [rank] lists of (model-wide layer, canonical byte array)."""
        for proc in self.ranks:
            proc.send("read")
        return [proc.recv() for proc in self.ranks]


# ----------------------------------------------------------------------------- the proxy


def prefill_request(rid: str, prompt_tokens: int) -> Request:
    """What the toy proxy sends the prefill instance: max_tokens 1, remote decode asked."""
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
    return Request(rid, list(range(prompt_tokens)), SamplingParams(max_tokens=1), params)


def run_until(instances: list[Instance], done, what: str, timeout: float = 20.0) -> None:
    """Steps every instance until done() holds (an event the engines report), with a deadline."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        for inst in instances:
            inst.step()


def proxy_hop(prefill: Instance, rid: str, prompt_tokens: int) -> dict:
    """Prefill through the toy proxy's first leg; returns the decode request's params as the
    proxy forwards them (a JSON round trip of the prefill response)."""
    prefill.add_request(prefill_request(rid, prompt_tokens))
    run_until([prefill], lambda: rid in prefill.responses, f"prefill of {rid}")
    response = json.loads(json.dumps({"kv_transfer_params": prefill.responses[rid]}))
    return response["kv_transfer_params"]


def decode_request(rid: str, prompt_tokens: int, params: Optional[dict]) -> Request:
    return Request(rid, list(range(prompt_tokens)), SamplingParams(max_tokens=4), params)


# ----------------------------------------------------------------------------- verification


def expected_decode_bytes(g: dict, decode: Instance, rank: int, layer: int,
                          pairs: list[tuple[int, int]], like: np.ndarray) -> np.ndarray:
    """What decode rank `rank` (its TP rank in its pipeline stage) must hold in model-wide
    `layer`: the prefill instance's bytes of each remote block in its local block (this rank's
    heads), zeros everywhere else."""
    want = np.zeros_like(like)
    full = model_content(g, layer)
    for remote, local in pairs:
        if is_latent(g):
            want[local] = full[remote]
        else:
            first, n = local_heads(g["heads"], decode.tp, rank)
            want[:, local] = full[:, remote, :, first:first + n]
    return want


def check_every_byte(g: dict, decode: Instance, pairs: list[tuple[int, int]]) -> None:
    held: dict[int, int] = {}  # model-wide layer -> ranks holding it
    for r, layers in enumerate(decode.read()):
        rank = r % decode.tp  # ranks are stage-major
        for layer, got in layers:
            held[layer] = held.get(layer, 0) + 1
            want = expected_decode_bytes(g, decode, rank, layer, pairs, got)
            if not np.array_equal(got, want):
                bad = np.argwhere(got != want)
                raise AssertionError(
                    f"decode rank {rank} layer {layer}: {len(bad)} bytes differ, first at "
                    f"{tuple(int(x) for x in bad[0])} (pairs remote->local {pairs})")
    assert held == {layer: decode.tp for layer in range(g["layers"])}, (
        f"the decode ranks hold layers {held}; expected every one of {g['layers']} layers on "
        f"its stage's {decode.tp} TP ranks")


# ----------------------------------------------------------------------------- vllm-ascend's setup


def seed_environment(directory: str, prefill_port: int, p_tp: int, decode_port: int,
                     d_tp: int) -> tuple[dict, dict]:
    """The environment of vllm-ascend's single-node LLM-DataDist tutorial for a prefill and a
    decode instance on this host: a rank table in gen_ranktable.sh's format (server 127.0.0.1,
    the prefill devices first, then the decode ones), each instance's own
    VLLM_ASCEND_LLMDD_RPC_PORT and ASCEND_RT_VISIBLE_DEVICES, and VLLM_HOST_IP (vLLM's get_ip(),
    which the rank table is searched by)."""
    def entry(device: int) -> dict:
        return {"server_id": "127.0.0.1", "device_id": str(device), "device_ip": "127.0.0.1",
                "cluster_id": str(device + 1)}

    table = {"version": "1.0", "server_count": "1", "status": "completed",
             "prefill_device_list": [entry(d) for d in range(p_tp)],
             "decode_device_list": [entry(p_tp + d) for d in range(d_tp)]}
    path = os.path.join(directory, "ranktable.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(table, f)
    common = {"DISAGGREGATED_PREFILL_RANK_TABLE_PATH": path, "VLLM_HOST_IP": "127.0.0.1"}
    prefill = dict(common, VLLM_ASCEND_LLMDD_RPC_PORT=str(prefill_port),
                   ASCEND_RT_VISIBLE_DEVICES=",".join(str(d) for d in range(p_tp)))
    decode = dict(common, VLLM_ASCEND_LLMDD_RPC_PORT=str(decode_port),
                  ASCEND_RT_VISIBLE_DEVICES=",".join(str(p_tp + d) for d in range(d_tp)))
    return prefill, decode
