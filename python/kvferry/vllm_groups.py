"""vLLM's KV cache groups (its hybrid KV cache manager, HMA) as kvferry moves them.

vLLM hands a connector that is SupportsHMA its `KVCacheConfig` (vllm/v1/kv_cache_interface.py):
`kv_cache_groups`, each a `KVCacheGroupSpec(layer_names, kv_cache_spec)`, and block ids per
group (`KVCacheBlocks.get_block_ids()`, a tuple of lists; `request_finished_all_groups`), where
block 0 is the null block (vllm/v1/core/block_pool.py) that a sliding-window group's table holds
for the blocks before its window (SlidingWindowManager.remove_skipped_blocks). kvferry moves each
group it can as a KV cache group of its own (a full-attention group every block, a sliding window
its window's); groups vLLM does not transfer (`enable_kv_transfer` False, the EAGLE/MTP draft
groups, which the decode side recomputes, as NixlConnector leaves them) are left out on both
sides. Mamba and linear-attention groups (MambaSpec) move as state groups: per request the block
holding its state, as NixlConnector moves them (nixl/base_scheduler.py get_exchange_clipped_blocks:
the last block, speculative slots dropped), with vLLM's token rule (the prefill side computes the
prompt less its last token). Other kinds (chunked local attention, ...) are refused at
registration, naming the group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from . import _kvferry
from .vllm_layout import memory_kind, tensor_info

NULL_BLOCK = 0  # vLLM's null block id
NO_BLOCK = -1  # kvferry's kNoBlock

# vLLM's spec classes kvferry moves (vllm/v1/kv_cache_interface.py); any other is refused by name.
_MOVED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec",
                "SlidingWindowMLASpec", "MambaSpec")


@dataclass(frozen=True)
class StateGeometry:
    """A MambaSpec's state (vllm/v1/kv_cache_interface.py): the per-rank shapes and dtypes of
    its tensors (conv state first, then the SSM state), its mamba_type, and the speculative
    blocks trailing a request's state block."""
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    mamba_type: str
    num_speculative_blocks: int


@dataclass(frozen=True)
class TransferGroup:
    """One of vLLM's KV cache groups that kvferry moves: its index among vLLM's groups, its
    layer names, the spec's class name, its sliding window in tokens (0: full attention) and
    block size."""
    index: int
    layer_names: tuple[str, ...]
    kind: str
    sliding_window: int
    block_size: int
    state: Optional[StateGeometry] = None


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def transfer_groups(kv_cache_config: Any, block_size: int) -> Optional[list[TransferGroup]]:
    """The groups kvferry moves, in vLLM's order; None without a KVCacheConfig, or with one group
    of full attention (kvferry's one-group path, as before HMA). One sliding-window group takes
    the groups path too: its table holds vLLM's null block before the window."""
    groups = _get(kv_cache_config, "kv_cache_groups")
    if not groups:
        return None
    if len(groups) == 1 and type(_get(groups[0], "kv_cache_spec")).__name__ in (
            "FullAttentionSpec", "MLAAttentionSpec") and not _get(
                _get(groups[0], "kv_cache_spec"), "sliding_window"):
        return None
    out: list[TransferGroup] = []
    for i, g in enumerate(groups):
        # vLLM's transfer groups (KVCacheConfig.transfer_groups): a group it excludes from
        # transfer is recomputed on the decode side. is_eagle_group is not such a flag (a
        # prefix-cache hint on a group that also holds the model's own layers): it moves.
        if _get(g, "enable_kv_transfer", True) is False:
            continue
        spec = _get(g, "kv_cache_spec")
        window = _get(spec, "sliding_window") or 0
        state = None
        if type(spec).__name__ == "MambaSpec":
            state = StateGeometry(
                tuple(tuple(int(x) for x in shape) for shape in _get(spec, "shapes", ())),
                tuple(str(d).replace("torch.", "") for d in _get(spec, "dtypes", ())),
                str(getattr(_get(spec, "mamba_type", "mamba2"), "value",
                            _get(spec, "mamba_type", "mamba2"))).lower(),
                int(_get(spec, "num_speculative_blocks", 0) or 0))
        out.append(TransferGroup(i, tuple(_get(g, "layer_names", ()) or ()), type(spec).__name__,
                                 int(window), int(_get(spec, "block_size", block_size) or
                                                  block_size), state))
    return out


def has_state(groups: Optional[Sequence[TransferGroup]]) -> bool:
    """Whether a state group moves: vLLM's token rule for them then holds on both sides."""
    return any(g.state is not None for g in groups or ())


def refuse_unmovable(groups: Sequence[TransferGroup]) -> None:
    """A group of a kind kvferry does not move (Mamba and linear-attention state, chunked local
    attention, ...) is refused before the first request, naming it."""
    for g in groups:
        if g.kind not in _MOVED_SPECS:
            what = "a kind of KV cache kvferry does not move"
            raise _kvferry.NotSupportedError(
                f"KV cache group {g.index} ({g.kind}, layers {', '.join(g.layer_names[:3])}"
                f"{', ...' if len(g.layer_names) > 3 else ''}) holds {what} (kvferry moves "
                f"{', '.join(_MOVED_SPECS)}); serve this model without kvferry's P/D transfer, "
                "or with a connector that moves such groups")


def group_block_ids(block_ids: Sequence[Sequence[int]], groups: Sequence[TransferGroup],
                    first_token: int = 0) -> list[list[int]]:
    """vLLM's block ids per group (all its groups, in its order) as kvferry takes them: the
    transferred groups only, from the block holding `first_token` on, vLLM's null block as
    kvferry's "no block"."""
    out = []
    for g in groups:
        ids = list(block_ids[g.index] if g.index < len(block_ids) else ())
        if g.state is not None:
            # The request's state block: its last, less the speculative slots after it and
            # vLLM's null blocks before it ("align" mode), as get_exchange_clipped_blocks.
            spec = min(g.state.num_speculative_blocks, max(len(ids) - 1, 0))
            real = [int(b) for b in ids[:len(ids) - spec] if int(b) != NULL_BLOCK]
            out.append(real[-1:])
            continue
        first = first_token // max(g.block_size, 1)
        out.append([NO_BLOCK if int(b) == NULL_BLOCK else int(b) for b in ids[first:]])
    return out


def state_parts(g: TransferGroup, tp_size: int, conv_dim_first: bool
                ) -> list[tuple[str, int, int, str]]:
    """A state group's parts as kvferry takes them, (name, model-wide extent of the TP-split
    axis, elements per unit of it, dtype), in page order. The conv state in vLLM's DS layout
    (channels outermost, VLLM_SSM_CONV_STATE_LAYOUT=DS) splits into its sub-projections (gated
    delta net Q, K, V; Mamba 2 x, B, C; as NixlConnector's derive_mamba_conv_split), each its
    channels across TP; in the SD layout (kernel taps outermost) it is one part whole per rank,
    so the two sides need one TP size (a different one is refused at the handshake). The SSM
    state splits by its heads."""
    st = g.state
    if st is None or len(st.shapes) != 2 or len(st.dtypes) != 2 or len(st.shapes[0]) != 2:
        raise _kvferry.NotSupportedError(
            f"KV cache group {g.index} (MambaSpec, {st.mamba_type if st else '?'}) has state "
            f"shapes {st.shapes if st else ()}; kvferry moves a 2-D conv state and an SSM state")
    conv, ssm = st.shapes
    conv_dt, ssm_dt = st.dtypes
    ssm_part = ("ssm", ssm[0] * tp_size, _prod(ssm[1:]), ssm_dt)
    if not conv_dim_first:
        return [("conv", tp_size, _prod(conv), conv_dt), ssm_part]
    channels, taps = conv
    if "gdn" in st.mamba_type or "delta" in st.mamba_type:
        value = ssm[0] * ssm[1]  # value heads * head_v_dim
        names = ("conv_q", "conv_k", "conv_v")
    elif "mamba1" in st.mamba_type:
        return [("conv_x", channels * tp_size, taps, conv_dt), ssm_part]
    else:  # Mamba 2: x (heads * head_dim), then B and C
        value = ssm[0] * ssm[1]
        names = ("conv_x", "conv_b", "conv_c")
    key = (channels - value) // 2
    dims = (key, key, value) if names[0] == "conv_q" else (value, key, key)
    if key <= 0 or 2 * key + value != channels:
        raise _kvferry.NotSupportedError(
            f"KV cache group {g.index} ({st.mamba_type}) has a conv state of {channels} channels "
            f"and an SSM state of {ssm}, which do not decompose into its sub-projections")
    return [(n, d * tp_size, taps, conv_dt) for n, d in zip(names, dims)] + [ssm_part]


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for x in shape:
        out *= int(x)
    return out


def state_cache(g: Any, caches: dict[str, Any], tp_size: int, tp_rank: int
                 ) -> tuple[Any, list[list[int]], str]:
    """A Mamba / linear-attention group's cache as vLLM's model runner makes it
    (gpu_model_runner.py _reshape_kv_cache_tensors): per layer its state tensors, views of one
    page per block (the conv state at the page's start, the SSM state right after it, a stride
    of one page); or as vllm-ascend's makes it (worker/model_runner_v1.py
    _reshape_kv_cache_tensors): each state a contiguous (num_blocks, ...) run of its own. Its
    spec, its bases per layer and part, and the memory they are in."""
    conv_first = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT", "SD").upper() == "DS"
    parts = state_parts(g, tp_size, conv_first)
    bases, memory, num_blocks, page = [], None, None, None
    for name in g.layer_names:
        if name not in caches:
            continue
        tensors = caches[name]
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 2:
            raise _kvferry.InvalidArgumentError(
                f"KV cache group {g.index} layer {name}: expected its state tensors [conv, ssm] "
                f"(vLLM's MambaSpec), found {type(tensors).__name__}")
        conv, ssm = tensor_info(tensors[0]), tensor_info(tensors[1])
        conv_bytes, ssm_bytes = _block_bytes(conv), _block_bytes(ssm)
        conv_stride, ssm_stride = conv.strides[0] * conv.itemsize, ssm.strides[0] * ssm.itemsize
        paged = (ssm_stride == conv_stride and ssm.address == conv.address + conv_bytes)
        # vllm-ascend's layout (worker/model_runner_v1.py _reshape_kv_cache_tensors): each state
        # a contiguous (num_blocks, ...) view of its own, every block's conv state first, then
        # every block's SSM state (which the attention layers sharing the buffer alias as K).
        packed = (conv_stride == conv_bytes and ssm_stride == ssm_bytes and
                  (ssm.address >= conv.address + conv.shape[0] * conv_bytes or
                   conv.address >= ssm.address + ssm.shape[0] * ssm_bytes))
        if not (paged or packed) or ssm.shape[0] != conv.shape[0]:
            raise _kvferry.NotSupportedError(
                f"KV cache group {g.index} layer {name}: its conv and SSM states are neither one "
                "page per block with the SSM state right after the conv state (vLLM's Mamba "
                "layout) nor each a contiguous run of blocks (vllm-ascend's); kvferry cannot "
                "tell where each block's state is")
        layer_page = (conv_stride, ssm_stride)
        if (num_blocks, page) not in ((None, None), (conv.shape[0], layer_page)):
            raise _kvferry.InvalidArgumentError(
                f"KV cache group {g.index} layer {name} has {conv.shape[0]} blocks of strides "
                f"{layer_page} bytes and an earlier layer {num_blocks} of {page}; a group's "
                "layers have one geometry")
        num_blocks, page = conv.shape[0], layer_page
        where = memory_kind(name, conv)
        if memory is not None and where != memory:
            raise _kvferry.InvalidArgumentError(
                f"KV cache group {g.index} layer {name} is in {where} memory, an earlier one in "
                f"{memory}")
        memory = where
        # The conv parts one after another in a block's conv state; the SSM state (the last
        # part) at its own address: right after the conv state in a page, or in its own run.
        offsets, at = [], conv.address
        for part in parts[:-1]:
            offsets.append(at)
            at += part[1] // tp_size * part[2] * _dtype_size(part[3])
        bases.append(offsets + [ssm.address])
    strides = [int(page[0]) for _ in parts[:-1]] + [int(page[1])] if page else [0] * len(parts)
    spec = _kvferry.CacheSpec.create(
        "state", len(bases), list(parts), int(num_blocks or 0), g.block_size, parts[0][3],
        "token_major", tp_size, tp_rank, [], strides, 0, 1, 0, 0)
    return spec, bases, memory or "host"


def _block_bytes(info: Any) -> int:
    """Bytes of one block of a (num_blocks, ...) state tensor."""
    out = info.itemsize
    for x in info.shape[1:]:
        out *= int(x)
    return out


def _dtype_size(dtype: str) -> int:
    d = dtype.replace("torch.", "")
    sizes = {"float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "float32": 4,
             "float": 4, "fp32": 4, "int8": 1, "int32": 4, "int64": 8}
    if d not in sizes:
        raise _kvferry.NotSupportedError(
            f"a state part of dtype {dtype}; kvferry moves state of {', '.join(sorted(sizes))}")
    return sizes[d]
