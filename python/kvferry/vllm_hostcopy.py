"""Host-buffer mode's block copies with torch, for when vLLM hands over no copy op.

In host-buffer mode (kv_buffer_device "cpu") kvferry moves host mirrors of vLLM's device caches
(``vllm_layout.host_mirrors``) and blocks are copied between each device tensor and its mirror:
device -> host when a prefill completes, host -> device before a load is reported. vLLM hands
its own copy op through ``set_host_xfer_buffer_ops`` on some platforms only (vllm-ascend never
calls it); without one, these functions copy the same blocks with torch: gathered with
``index_select`` on the source's device, moved to the destination's device, scattered with
``index_copy_`` there. Every tensor op runs on the tensor's own device (a CUDA or torch_npu NPU
tensor: the index tensors are made there with ``new_tensor``), on its current stream, so the copy
is ordered after the forward pass that wrote the blocks, as vLLM's own copy op is.
"""

from __future__ import annotations

from typing import Any, Iterator

from .vllm_layout import Registration


def block_axis(tensor: Any, registration: Registration) -> int:
    """The axis of kernel blocks in one cache tensor (or one part of a per-layer tuple):
    1 for ``(2, num_blocks, ...)`` tensors (K and V each one region: the registration has no
    block strides), 0 for every other layout kvferry accepts (``(num_blocks, 2, ...)``, fused
    MLA, the parts of vllm-ascend's per-layer tuples)."""
    shape = tuple(tensor.shape)
    if (registration.kind == "mha" and len(shape) == 5 and shape[0] == 2
            and not registration.block_strides):
        return 1
    return 0


def _pairs(src_caches: dict[str, Any], dst_caches: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """(source, destination) tensors of every layer and part, each destination once (layers
    sharing a tensor share its mirror)."""
    seen: set[int] = set()
    for name, src in src_caches.items():
        dst = dst_caches[name]
        parts = zip(src, dst) if isinstance(src, (tuple, list)) else ((src, dst),)
        for s, d in parts:
            if id(d) in seen:
                continue
            seen.add(id(d))
            yield s, d


def copy_blocks(src_caches: dict[str, Any], dst_caches: dict[str, Any], block_ids: list[int],
                direction: str, registration: Registration) -> None:
    """Copies kernel blocks `block_ids` of every layer from `src_caches` to the same blocks of
    `dst_caches` (the same keys, shapes and strides). `direction` is "d2h" (device caches to
    their host mirrors) or "h2d". Raises what torch raises (a broken device); returns when every
    block is in place (the device -> host move blocks; host -> device is on the device's current
    stream, ordered before the model's next use of the cache)."""
    if direction not in ("d2h", "h2d"):
        raise ValueError(f"direction must be \"d2h\" or \"h2d\", found {direction!r}")
    if not block_ids:
        return
    import torch  # host-buffer mode runs inside vLLM, which has torch

    ids = [int(b) for b in block_ids]
    for src, dst in _pairs(src_caches, dst_caches):
        axis = block_axis(src, registration)
        gathered = src.index_select(axis, src.new_tensor(ids, dtype=torch.long))
        if direction == "d2h":
            moved = gathered.to(device="cpu")
        else:
            moved = dst.new_empty(tuple(gathered.shape))
            moved.copy_(gathered)
        dst.index_copy_(axis, dst.new_tensor(ids, dtype=torch.long), moved)
