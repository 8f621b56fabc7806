"""vllm-ascend's KV cache tensors: a tuple of parts per attention layer.

vllm-ascend's NPU model runner (vllm_ascend/worker/model_runner_v1.py,
``_allocate_kv_cache_tensors`` and ``_reshape_kv_cache_tensors``) allocates every part of a
layer as its own buffer, 2 MiB-aligned when a KV connector is configured, blocks outermost, and
hands ``register_kv_caches`` one tuple per layer. The shapes read from it and from its attention
backends' ``get_kv_cache_shape`` (README, "vLLM on Ascend"), all token-major:

  * MHA/GQA ``(k_cache, v_cache)``, each ``(num_blocks, block_size, num_kv_heads, head_size)``:
    AscendAttentionBackend's ``(2, num_blocks, block_size, heads, head_size)`` split in two. With
    vllm-ascend's int8 cache (``additional_config`` ``kv_cache_dtype`` "int8",
    ``get_bsh_kv_cache_shape``) each is ``(num_blocks, block_size, num_kv_heads * head_size)``,
    the same bytes; the model's KV head count splits the rows.
  * MLA ``(nope_cache, rope_cache)``: ``(num_blocks, block_size, 1, kv_lora_rank)`` and
    ``(num_blocks, block_size, 1, qk_rope_head_dim)``; widths checked against the model config.
  * DeepSeek sparse attention adds its indexer keys: ``(nope, rope, indexer_k)``, the third
    ``(num_blocks, block_size, 1, 128)``.
  * One part, ``(k_cache,)``: ``(num_blocks, block_size, 1, width)``, sparse C8's packed cache
    (nope bytes, then rope and scales); moved as one replicated part of whole blocks.

Kernel blocks may be smaller than vLLM's blocks (a whole number per block); being token-major,
a logical block is still one run per part. Anything else is refused naming the shape found.
"""

from __future__ import annotations

from typing import Optional

from .vllm_tensor import Geometry, TensorInfo, _contiguous, _logical_blocks, _refuse

_MLA_LABELS = ("latent", "rope", "indexer")


def read_tuple_layer(name: str, infos: list[TensorInfo], block_size: int,
                     total_kv_heads: Optional[int], local_heads: Optional[int], tp_size: int,
                     mla_split: Optional[tuple[int, int]], dtype: str,
                     suffix: str) -> tuple[Geometry, list[int]]:
    """The geometry of one layer's tuple of parts and each part's base address. `local_heads`
    is this rank's KV head count from the model config (None when unknown), `mla_split` the
    model's (kv_lora_rank, qk_rope_head_dim) for an MLA model; `dtype` and `suffix` the kvferry
    dtype and part-name tag of the parts' element type."""
    first = infos[0]
    for info in infos:
        if not _contiguous(info):
            raise _refuse(name, info, "each part of a per-layer tuple must be contiguous (its "
                          "own buffer, as vllm-ascend allocates it)")
        if len(info.shape) not in (3, 4):
            raise _refuse(name, info, "a part of a per-layer tuple must be (num_blocks, "
                          "block_size, heads, dim) or (num_blocks, block_size, dim)")
        if info.shape[0] != first.shape[0]:
            raise _refuse(name, info, f"part block count differs from {first.shape[0]}")
    bases = [i.address for i in infos]
    equal = len(infos) == 2 and infos[0].shape == infos[1].shape
    if equal and len(first.shape) == 4:
        return _kv_pair(name, first, block_size, total_kv_heads, local_heads, tp_size, dtype,
                        suffix), bases
    if equal and mla_split is None:
        return _bsh_pair(name, first, block_size, total_kv_heads, local_heads, dtype,
                         suffix), bases
    if len(infos) == 1:
        return _one_part(name, first, block_size, mla_split, dtype, suffix), bases
    if len(infos) == 2 and all(len(i.shape) == 4 and i.shape[2] != 1 for i in infos):
        raise _refuse(name, first, (
            f"K and V must have one shape (num_blocks, block_size, heads, head_dim), found "
            f"{first.shape} and {infos[1].shape}"))
    if len(infos) in (2, 3):
        return _mla_parts(name, infos, block_size, mla_split, dtype, suffix), bases
    raise _refuse(name, first, f"{len(infos)} parts per layer: kvferry knows (k, v), "
                  "(nope, rope), (nope, rope, indexer_k) and (k_cache,)")


def _mha_parts(suffix: str, model_heads: int, head_dim: int) -> tuple[tuple[str, int, int], ...]:
    return (("k" + suffix, model_heads, head_dim), ("v" + suffix, model_heads, head_dim))


def _kv_pair(name: str, info: TensorInfo, block_size: int, total_kv_heads: Optional[int],
             local: Optional[int], tp_size: int, dtype: str, suffix: str) -> Geometry:
    """(k_cache, v_cache), each (num_blocks, block_size, heads, head_dim): token-major, as
    vllm-ascend allocates them. (num_blocks, heads, block_size, head_dim) pairs are read as
    head-major blocks."""
    nb, x, y, head_dim = info.shape
    token_major = (x == block_size) if local is None else (y == local and block_size % x == 0)
    head_major = y == block_size and (local is None or x == local)
    if token_major:
        nblocks = _logical_blocks(name, info, nb, x, block_size)
        heads, layout, ratio = y, "token_major", nb // nblocks
    elif head_major:
        nblocks, heads, layout, ratio = nb, x, "head_major", 1
    else:
        raise _refuse(name, info, (
            f"neither (num_blocks, block_size, heads, head_dim) with this rank's {local} KV "
            f"heads and blocks of vLLM's {block_size} tokens (or a divisor) nor "
            "(num_blocks, heads, block_size, head_dim)" if local is not None else
            f"no dim 1 or 2 is vLLM's block size {block_size}"))
    model_heads = total_kv_heads if total_kv_heads is not None else heads * tp_size
    return Geometry("mha", layout, dtype, _mha_parts(suffix, model_heads, head_dim), nblocks,
                    heads, (), ratio)


def _bsh_pair(name: str, info: TensorInfo, block_size: int, total_kv_heads: Optional[int],
              local: Optional[int], dtype: str, suffix: str) -> Geometry:
    """(k_cache, v_cache), each (num_blocks, block_size, heads * head_size): vllm-ascend's int8
    cache. Each token's row is its heads one after another, so the blocks are the token-major
    blocks of the 4-D pair; the model's KV head count splits the row."""
    nb, x, width = info.shape
    if total_kv_heads is None or local is None:
        raise _refuse(name, info, (
            "equal (num_blocks, block_size, width) K and V are vllm-ascend's int8 cache (heads "
            "* head_size per token), but the model config gives no KV head count to split the "
            "rows (model_config.get_total_num_kv_heads())"))
    if width % local != 0:
        raise _refuse(name, info, f"the row width {width} is not this rank's {local} KV heads "
                      "times a head size")
    nblocks = _logical_blocks(name, info, nb, x, block_size)
    return Geometry("mha", "token_major", dtype, _mha_parts(suffix, total_kv_heads, width // local),
                    nblocks, local, (), nb // nblocks)


def _latent_width(name: str, info: TensorInfo) -> int:
    """The width of an MLA-style part: (num_blocks, block_size, width) or
    (num_blocks, block_size, 1, width); it has no head axis to split."""
    if len(info.shape) == 4 and info.shape[2] != 1:
        raise _refuse(name, info, (
            f"an MLA part holds one latent head per token; dim 2 is {info.shape[2]}, not 1"))
    return info.shape[-1]


def _mla_parts(name: str, infos: list[TensorInfo], block_size: int,
               mla_split: Optional[tuple[int, int]], dtype: str, suffix: str) -> Geometry:
    """(nope, rope) and (nope, rope, indexer_k): replicated parts of different widths."""
    first = infos[0]
    widths = [_latent_width(name, i) for i in infos]
    for info in infos[1:]:
        if info.shape[1] != first.shape[1]:
            raise _refuse(name, info, f"part block size differs from {first.shape[1]}")
    if mla_split is not None and tuple(widths[:2]) != tuple(mla_split):
        raise _refuse(name, first, (
            f"the nope and rope parts are {widths[0]} and {widths[1]} wide, but the model config "
            f"gives kv_lora_rank {mla_split[0]} and qk_rope_head_dim {mla_split[1]}"))
    if mla_split is None and len(infos) == 2 and widths[0] == widths[1]:
        raise _refuse(name, first, "two parts of equal width that are not 4-D K and V")
    nblocks = _logical_blocks(name, first, first.shape[0], first.shape[1], block_size)
    parts = tuple((_MLA_LABELS[i] + suffix, 1, w) for i, w in enumerate(widths))
    kind = "mla" if len(infos) == 2 else "sparse_mla"
    return Geometry(kind, "token_major", dtype, parts, nblocks, 1, (),
                    first.shape[0] // nblocks)


def _one_part(name: str, info: TensorInfo, block_size: int,
              mla_split: Optional[tuple[int, int]], dtype: str, suffix: str) -> Geometry:
    """(k_cache,): one replicated row per token, moved in whole blocks as kvferry's one-part
    kind (mla_fused), whose two fields enter the compatibility hash: (kv_lora_rank,
    qk_rope_head_dim) for a row of exactly those, else (kv_lora_rank, the rest of the row) for
    sparse C8's packed row (nope bytes, then rope and scales), named "packed"."""
    width = _latent_width(name, info)
    if mla_split is None:
        raise _refuse(name, info, (
            "a one-part layer (k_cache,) is a packed MLA row (vllm-ascend's sparse C8 cache); "
            "kvferry describes it by the model's kv_lora_rank, and the model config gives none "
            "(model_config.use_mla with hf_text_config.kv_lora_rank and qk_rope_head_dim)"))
    lora, rope = mla_split
    if width == lora + rope:
        label, fields = "latent_rope", (lora, rope)
    elif width > lora:
        label, fields = "packed", (lora, width - lora)
    else:
        raise _refuse(name, info, (
            f"the row width {width} is not above the model's kv_lora_rank {lora}: not a packed "
            "MLA row"))
    nblocks = _logical_blocks(name, info, info.shape[0], info.shape[1], block_size)
    return Geometry("mla_fused", "token_major", dtype, ((label + suffix, 1, width),), nblocks, 1,
                    (), info.shape[0] // nblocks, fields)
