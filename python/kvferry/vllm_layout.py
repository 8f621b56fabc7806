"""The geometry of vLLM's KV cache tensors, read from their shapes and strides.

vLLM hands ``register_kv_caches`` one tensor per attention layer (vllm-ascend: a tuple per layer).
This module turns them into a kvferry ``CacheSpec`` plus the base address of every part, or
refuses them with an error that names the shape and strides it got. Nothing here trusts a setting
that could disagree with the tensors: the only inputs besides the tensors are the logical block
size vLLM's scheduler counts in and the model-wide KV head count, both from vLLM's own config.

Accepted (see README, "Using kvferry from Python and vLLM"):
  * ``(2, num_blocks, block_size, heads, head_dim)`` (FlashAttention before the K/V-inner change)
    with NHD strides (token-major blocks) or HND strides (head-major blocks);
  * ``(num_blocks, 2, block_size, heads, head_dim)`` (FlashAttention/Triton at vLLM main,
    FlashInfer) with NHD or HND strides: K and V alternate block by block, registered with
    block strides of two blocks;
  * ``(2, num_blocks, heads, block_size, head_dim)``, vLLM's CPU backend (head-major blocks);
  * ``(num_blocks, block_size, kv_lora_rank + qk_rope_head_dim)`` contiguous, vLLM's MLA
    backends: one ``mla_fused`` part whose split (from the model config) enters the hash;
  * vllm-ascend's per-layer tuples of contiguous parts (``kvferry.vllm_ascend_layout``):
    ``(k_cache, v_cache)``, ``(nope_cache, rope_cache)``, ``(nope, rope, indexer_k)``,
    ``(k_cache,)``;
  * dtypes fp16, bf16, fp32 and the 1-byte fp8 caches (uint8, int8, float8_e4m3fn, float8_e5m2).
CUDA and NPU tensors are registered as device memory ("cuda:N", "npu:N"). Device tensors move
through host mirrors when vLLM runs with kv_buffer_device "cpu" (``host_mirrors``); other devices
are refused without it, naming the device and that way out. Refused too,
naming what was found: a fused MLA tensor without the model's kv_lora_rank and qk_rope_head_dim or whose
width disagrees with them, any other shape or stride pattern.
"""

from __future__ import annotations

import dataclasses

import sys
from dataclasses import dataclass
from typing import Any, Optional

from . import _kvferry
from .vllm_ascend_layout import read_tuple_layer
# CacheLayoutError is part of this module's API (raised by read_caches), defined with the rest.
from .vllm_tensor import CacheLayoutError  # noqa: F401
from .vllm_tensor import Geometry, TensorInfo, _contiguous, _logical_blocks, _refuse, tensor_info

# dtype name -> (kvferry dtype, tag). A tag names 1-byte float formats that kvferry moves as
# plain bytes; it goes into the part names, so the compatibility hash tells e4m3 from e5m2.
_DTYPES = {
    "float16": ("fp16", ""), "half": ("fp16", ""), "bfloat16": ("bf16", ""),
    "float32": ("fp32", ""), "float": ("fp32", ""),
    "uint8": ("int8", "fp8"), "int8": ("int8", "fp8"),
    "float8_e4m3fn": ("int8", "fp8_e4m3fn"), "float8_e5m2": ("int8", "fp8_e5m2"),
    "int32": ("int32", ""), "int64": ("int64", ""),
}


@dataclass
class Registration:
    """What register_kv_caches hands the native worker."""

    kind: str  # "mha", "mla", "sparse_mla", "mla_fused"
    layout: str  # "token_major" or "head_major"
    dtype: str
    parts: list[tuple[str, int, int]]  # (name, model-wide heads, head_dim) per part
    num_blocks: int  # logical blocks (vLLM's scheduler block ids)
    tokens_per_block: int  # logical block size
    local_heads: int  # KV heads per part on this rank (1 for MLA parts)
    bases: list[list[int]]  # [unique layer][part]
    layer_names: list[str]  # one name per unique tensor (layers sharing a tensor: the first)
    fields: tuple[int, ...] = ()  # mla_fused: (kv_lora_rank, qk_rope_head_dim or the rest)
    block_strides: tuple[int, ...] = ()  # bytes between blocks of a part; () when packed
    kernel_blocks_per_block: int = 1  # kernel (tensor) blocks in one logical block
    memory: str = "host"  # where the tensors are: "host", "cuda:N" or "npu:N" (memory_kind)
    # >1: num_blocks and tokens_per_block are the kernel's, and one vLLM block id names this many
    # consecutive kernel blocks (kvferry's CacheSpec blocks_per_id)
    blocks_per_id: int = 1


# Device types whose memory kvferry moves itself (docs/device.md): the tensor's device type and
# index name the memory kind ("cuda:1", "npu:0" for torch_npu's tensors).
_DEVICE_TYPES = ("cuda", "npu")


def memory_kind(name: str, info: TensorInfo) -> str:
    """The kvferry memory kind of a tensor: "host" for CPU tensors, "cuda:N" or "npu:N" for
    CUDA and NPU ones; other devices are refused naming the type and the way out."""
    if info.device.startswith("cpu"):
        return "host"
    kind, _, index = info.device.partition(":")
    if kind in _DEVICE_TYPES:
        return f"{kind}:{index or 0}"
    raise _refuse(name, info, (
        f"the cache is in {info.device} memory; kvferry moves host and "
        f"{', '.join(_DEVICE_TYPES)} memory itself, not {kind} (transfers would fail later "
        "with misleading errors); set kv_buffer_device \"cpu\" in vLLM's KVTransferConfig "
        "(host-buffer mode: kvferry moves host mirrors of the cache and vLLM's copy ops move "
        "blocks between them and the device), or run vLLM with its CPU backend"))


# torch_npu's storage formats whose bytes are laid out as the strides say (ACL_FORMAT_NCHW,
# NHWC, ND, NDHWC, NCDHW); the others (FRACTAL_NZ, NC1HWC0, ...) tile the last dims.
_NPU_PLAIN_FORMATS = (0, 1, 2, 27, 30)


def npu_storage_format(t: Any) -> Optional[int]:
    """torch_npu's storage format of an NPU tensor (torch_npu.get_npu_format), or None where
    torch_npu is not loaded (then no tensor is an NPU tensor) or cannot tell."""
    torch_npu = sys.modules.get("torch_npu")
    get = getattr(torch_npu, "get_npu_format", None)
    if get is None:
        return None
    try:
        return int(get(t))
    except Exception:  # not an NPU tensor, or a torch_npu without it
        return None


def _check_npu_format(name: str, t: Any, info: TensorInfo) -> None:
    """kvferry moves an NPU tensor's bytes as its shape and strides place them; a tensor in a
    private format (vllm-ascend casts caches to FRACTAL_NZ on some SoCs) is not laid out so."""
    fmt = npu_storage_format(t)
    if fmt is not None and fmt not in _NPU_PLAIN_FORMATS:
        raise _refuse(name, info, (
            f"the NPU tensor's storage format is ACL format {fmt} (torch_npu.get_npu_format), "
            "not one laid out as its strides say (ND, NCHW, ...); kvferry would move the wrong "
            "bytes. Set \"kv_buffer_device\": \"cpu\" in --kv-transfer-config on both instances "
            "(host-buffer mode: torch converts the format when it copies blocks to the host)"))


def _dtype(name: str, info: TensorInfo) -> tuple[str, str]:
    if info.dtype not in _DTYPES:
        raise _refuse(name, info, f"dtype {info.dtype} is not one of {sorted(_DTYPES)}")
    return _DTYPES[info.dtype]


def _dense_inner(info: TensorInfo, dims: tuple[int, int, int]) -> Optional[tuple[int, int, int]]:
    """The physical order of three logical dims (outermost first) when they are densely packed
    with the last one innermost and contiguous; None otherwise."""
    a, b, d = dims
    s, st = info.shape, info.strides
    if st[d] != 1:
        return None
    if st[b] == s[d] and st[a] == s[b] * s[d]:
        return (a, b, d)
    if st[a] == s[d] and st[b] == s[a] * s[d]:
        return (b, a, d)
    return None


def _kv_first(name: str, info: TensorInfo, block_size: int, local_heads: Optional[int],
              prefer_heads_first: bool) -> tuple[str, int, int, int, int, list[int]]:
    """A (2, num_blocks, X, Y, head_dim) tensor: K and V are each one contiguous region.
    Returns (layout, kernel blocks, kernel block size, local heads, head_dim, [K base, V base])."""
    s, st = info.shape, info.strides
    if st[1] != s[2] * s[3] * s[4] or st[0] < s[1] * st[1]:
        raise _refuse(name, info, "K and V are not each one dense region of whole blocks")
    order = _dense_inner(info, (2, 3, 4))
    if order is None:
        raise _refuse(name, info, "the inside of a block is not densely packed with head_dim "
                      "innermost")
    # Which logical dim holds tokens: FlashAttention puts tokens at 2, the CPU backend heads.
    tokens_at_2 = (s[3] == local_heads) if local_heads is not None else s[2] == block_size
    tokens_at_3 = (s[2] == local_heads) if local_heads is not None else s[3] == block_size
    if tokens_at_2 and tokens_at_3:  # equal sizes: the backend decides
        tokens_at_2 = not prefer_heads_first
    elif not tokens_at_2 and not tokens_at_3:
        raise _refuse(name, info, (
            f"neither dim 2 nor dim 3 holds this rank's {local_heads} KV heads"
            if local_heads is not None else
            f"neither dim 2 nor dim 3 is vLLM's block size {block_size}"))
    token_dim, head_dim_axis = (2, 3) if tokens_at_2 else (3, 2)
    layout = "token_major" if order[0] == token_dim else "head_major"
    base = info.address
    return (layout, s[1], s[token_dim], s[head_dim_axis], s[4],
            [base, base + st[0] * info.itemsize])


def _kv_inner(name: str, info: TensorInfo, block_size: int, local_heads: Optional[int]
              ) -> tuple[str, int, int, int, list[int], int]:
    """A (num_blocks, 2, block_size, heads, head_dim) tensor (FlashAttention/Triton at vLLM main,
    FlashInfer): K and V alternate block by block. Returns (layout, kernel blocks, local heads,
    head_dim, [K base, V base], block stride in bytes)."""
    s, st = info.shape, info.strides
    block = s[2] * s[3] * s[4]
    if st[1] != block or st[0] != 2 * block:
        raise _refuse(name, info, (
            "K and V of one block are not two dense blocks side by side (expected strides "
            f"({2 * block}, {block}, ...))"))
    order = _dense_inner(info, (2, 3, 4))
    if order is None:
        raise _refuse(name, info, "the inside of a block is not densely packed with head_dim "
                      "innermost")
    if local_heads is not None and s[3] != local_heads:
        raise _refuse(name, info, f"dim 3 is not this rank's {local_heads} KV heads")
    layout = "token_major" if order[0] == 2 else "head_major"
    base = info.address
    return (layout, s[0], s[3], s[4], [base, base + block * info.itemsize],
            2 * block * info.itemsize)


def is_host_tensor(t: Any) -> bool:
    """Whether a tensor (or every part of a per-layer tuple) lives in host memory."""
    parts = list(t) if isinstance(t, (tuple, list)) else [t]
    return all(tensor_info(p).device.startswith("cpu") for p in parts)


def host_mirrors(kv_caches: dict[str, Any]) -> dict[str, Any]:
    """vLLM's host-buffer mode (kv_buffer_device "cpu"): a CPU tensor per device tensor with
    the same shape, strides and dtype, so the mirror's geometry is the device cache's and vLLM's
    block copy ops (which index blocks, whatever the strides) move whole blocks between them.
    Layers sharing one device tensor share one mirror. Keys and tuple structure are kept.

    Each mirror's memory is a kvferry.HostMemory (a sealed memfd) that the tensor keeps alive
    through the buffer protocol: a same-host shm reader maps it read-only and copies it with
    memcpy instead of walking this process's page table (docs/transport.md, shm)."""
    import torch  # host-buffer mode runs inside vLLM, which has torch

    from ._kvferry import HostMemory

    made: dict[tuple[int, tuple[int, ...]], Any] = {}

    def mirror(t: Any) -> Any:
        info = tensor_info(t)
        key = (info.address, info.shape)
        if key not in made:
            # The elements the strides reach, as torch.empty_strided would allocate them.
            extent = 1 + sum((n - 1) * st for n, st in zip(info.shape, info.strides))
            if any(n == 0 for n in info.shape):
                extent = 0
            nbytes = extent * t.element_size()
            raw = torch.frombuffer(HostMemory(max(nbytes, 1)), dtype=torch.uint8)
            made[key] = raw[:nbytes].view(t.dtype).as_strided(info.shape, info.strides)
        return made[key]

    out: dict[str, Any] = {}
    for name, cache in kv_caches.items():
        if isinstance(cache, (tuple, list)):
            out[name] = type(cache)(mirror(t) for t in cache)
        else:
            out[name] = mirror(cache)
    return out


def read_caches(kv_caches: dict[str, Any], block_size: int, total_kv_heads: Optional[int],
                tp_size: int, prefer_heads_first: bool,
                mla_split: Optional[tuple[int, int]] = None) -> Registration:
    """Reads every layer's tensors. `block_size` is vLLM's logical block size; `total_kv_heads`
    the model's (None: this rank's heads times tp_size, no replication); `mla_split` the model's
    (kv_lora_rank, qk_rope_head_dim) when it is an MLA model (None otherwise)."""
    if not kv_caches:
        raise _kvferry.InvalidArgumentError("register_kv_caches got no layers")
    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    memories: dict[str, str] = {}  # memory kind -> the first layer in it
    geometry = None
    bases: list[list[int]] = []
    names: list[str] = []
    for name, cache in kv_caches.items():
        tensors = list(cache) if isinstance(cache, (tuple, list)) else [cache]
        infos = [tensor_info(t) for t in tensors]
        for t, info in zip(tensors, infos):
            kind = memory_kind(name, info)
            memories.setdefault(kind, name)
            if kind.startswith("npu"):
                _check_npu_format(name, t, info)
        key = (infos[0].address, infos[0].shape)
        if key in seen:  # a layer sharing another's tensor: registered once
            continue
        g, layer_bases = _read_layer(name, infos, block_size, total_kv_heads, tp_size,
                                     prefer_heads_first, mla_split,
                                     isinstance(cache, (tuple, list)))
        if geometry is None:
            geometry = g
        elif g != geometry:
            raise _kvferry.InvalidArgumentError(
                f"layer {name} has geometry {g}, layer {names[0]} {geometry}; kvferry needs "
                "every attention layer alike")
        seen[key] = name
        bases.append(layer_bases)
        names.append(name)
    assert geometry is not None
    if len(memories) > 1:
        raise _kvferry.InvalidArgumentError(
            "the caches are in more than one memory (" +
            ", ".join(f"{m}: layer {n}" for m, n in memories.items()) +
            "); kvferry registers one worker's caches in one memory")
    g = geometry
    return Registration(g.kind, g.layout, g.dtype, list(g.parts), g.num_blocks,
                        block_size // g.blocks_per_id, g.local_heads, bases, names,
                        tuple(g.fields), tuple(g.block_strides), g.kernel_blocks_per_block,
                        next(iter(memories)), g.blocks_per_id)


def _read_layer(name: str, infos: list[TensorInfo], block_size: int,
                total_kv_heads: Optional[int], tp_size: int, prefer_heads_first: bool,
                mla_split: Optional[tuple[int, int]] = None,
                is_tuple: bool = False) -> tuple[Geometry, list[int]]:
    first = infos[0]
    dtype, tag = _dtype(name, first)
    for info in infos[1:]:
        if info.dtype != first.dtype:
            raise _refuse(name, info, f"part dtype differs from the first part's {first.dtype}")
    suffix = f":{tag}" if tag else ""
    if not is_tuple:
        s = first.shape
        per_block = len(s) == 5 and s[0] == 2 and first.strides[0] < first.strides[1]
        if per_block:
            # vLLM's attention layers beside Mamba layers (gpu_model_runner.py
            # _update_hybrid_attention_mamba_layout): still (2, num_blocks, ...), re-strided so K
            # and V of a block sit side by side in one page; read as (num_blocks, 2, ...).
            first = dataclasses.replace(
                first, shape=(s[1], s[0], *s[2:]),
                strides=(first.strides[1], first.strides[0], *first.strides[2:]))
            s = first.shape
        if len(s) == 5 and s[0] == 2 and not per_block:
            local = None
            if total_kv_heads is not None:
                local = max(total_kv_heads // tp_size, 1)
            layout, kblocks, ksize, heads, head_dim, layer_bases = _kv_first(
                name, first, block_size, local, prefer_heads_first)
            nblocks = _logical_blocks(name, first, kblocks, ksize, block_size)
            model_heads = total_kv_heads if total_kv_heads is not None else heads * tp_size
            parts = (("k" + suffix, model_heads, head_dim), ("v" + suffix, model_heads, head_dim))
            ratio = kblocks // nblocks
            if ratio > 1 and layout == "head_major":
                # A logical block is `ratio` head-major blocks, not one: kernel blocks registered.
                return (Geometry("mha", layout, dtype, parts, kblocks, heads, (), ratio, (), ratio),
                        layer_bases)
            return Geometry("mha", layout, dtype, parts, nblocks, heads, (), ratio), layer_bases
        if len(s) == 5 and s[1] == 2:
            local = None
            if total_kv_heads is not None:
                local = max(total_kv_heads // tp_size, 1)
            layout, kblocks, heads, head_dim, layer_bases, stride = _kv_inner(
                name, first, block_size, local)
            model_heads = total_kv_heads if total_kv_heads is not None else heads * tp_size
            parts = (("k" + suffix, model_heads, head_dim), ("v" + suffix, model_heads, head_dim))
            # K and V alternate per kernel block: a logical block of several kernel blocks is not
            # one run of K and one of V, so kernel blocks are registered, `ratio` per block id.
            ratio = kblocks // _logical_blocks(name, first, kblocks, first.shape[2], block_size)
            return (Geometry("mha", layout, dtype, parts, kblocks, heads, (stride, stride), ratio,
                             (), ratio), layer_bases)
        if len(s) == 3:
            return _fused_mla(name, first, block_size, mla_split, suffix, dtype)
        raise _refuse(name, first, "not a KV cache layout kvferry knows (see the README)")
    # vllm-ascend: a tuple of parts per layer (kvferry.vllm_ascend_layout).
    local = max(total_kv_heads // tp_size, 1) if total_kv_heads is not None else None
    return read_tuple_layer(name, infos, block_size, total_kv_heads, local, tp_size, mla_split,
                            dtype, suffix)


def _fused_mla(name: str, info: TensorInfo, block_size: int,
               mla_split: Optional[tuple[int, int]], suffix: str,
               dtype: str) -> tuple[Geometry, list[int]]:
    """vLLM's MLA cache: (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim), each token's
    row holding latent then rope. Moved as one replicated part of whole blocks; the split comes
    from the model config and enters the compatibility hash."""
    if mla_split is None:
        raise _refuse(name, info, (
            "a 3-D tensor is vLLM's fused MLA cache (num_blocks, block_size, kv_lora_rank + "
            "qk_rope_head_dim), but the model config gives no kv_lora_rank and "
            "qk_rope_head_dim (model_config.use_mla with hf_text_config.kv_lora_rank and "
            "qk_rope_head_dim)"))
    lora, rope = mla_split
    if info.shape[2] != lora + rope:
        raise _refuse(name, info, (
            f"the row width {info.shape[2]} is not kv_lora_rank {lora} + qk_rope_head_dim "
            f"{rope} = {lora + rope} from the model config"))
    if not _contiguous(info):
        raise _refuse(name, info, "a fused MLA cache must be contiguous")
    nblocks = _logical_blocks(name, info, info.shape[0], info.shape[1], block_size)
    parts = (("latent_rope" + suffix, 1, lora + rope),)
    ratio = info.shape[0] // nblocks
    return (Geometry("mla_fused", "token_major", dtype, parts, nblocks, 1, (), ratio, (lora, rope)),
            [info.address])
