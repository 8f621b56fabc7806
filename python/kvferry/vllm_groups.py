"""vLLM's KV cache groups (its hybrid KV cache manager, HMA) as kvferry moves them.

vLLM hands a connector that is SupportsHMA its `KVCacheConfig` (vllm/v1/kv_cache_interface.py):
`kv_cache_groups`, each a `KVCacheGroupSpec(layer_names, kv_cache_spec)`, and block ids per
group (`KVCacheBlocks.get_block_ids()`, a tuple of lists; `request_finished_all_groups`), where
block 0 is the null block (vllm/v1/core/block_pool.py) that a sliding-window group's table holds
for the blocks before its window (SlidingWindowManager.remove_skipped_blocks). kvferry moves each
group it can as a KV cache group of its own (a full-attention group every block, a sliding window
its window's); groups vLLM does not transfer (`enable_kv_transfer` False, the EAGLE/MTP draft
groups, which the decode side recomputes, as NixlConnector leaves them) are left out on both
sides. Other kinds (Mamba and linear-attention state, chunked local attention, ...) are refused
at registration, naming the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from . import _kvferry

NULL_BLOCK = 0  # vLLM's null block id
NO_BLOCK = -1  # kvferry's kNoBlock

# vLLM's spec classes kvferry moves (vllm/v1/kv_cache_interface.py); any other is refused by name.
_MOVED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec",
                "SlidingWindowMLASpec")


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
        out.append(TransferGroup(i, tuple(_get(g, "layer_names", ()) or ()), type(spec).__name__,
                                 int(window), int(_get(spec, "block_size", block_size) or
                                                  block_size)))
    return out


def refuse_unmovable(groups: Sequence[TransferGroup]) -> None:
    """A group of a kind kvferry does not move (Mamba and linear-attention state, chunked local
    attention, ...) is refused before the first request, naming it."""
    for g in groups:
        if g.kind not in _MOVED_SPECS:
            what = ("Mamba / linear-attention state" if "Mamba" in g.kind else
                    "a kind of KV cache kvferry does not move")
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
        ids = block_ids[g.index] if g.index < len(block_ids) else ()
        first = first_token // max(g.block_size, 1)
        out.append([NO_BLOCK if int(b) == NULL_BLOCK else int(b) for b in list(ids)[first:]])
    return out
