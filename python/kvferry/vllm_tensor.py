"""What kvferry reads from one KV cache tensor, shared by the layout readers.

``kvferry.vllm_layout`` (vLLM's one tensor per layer) and ``kvferry.vllm_ascend_layout``
(vllm-ascend's tuple of parts per layer) both build on this module; neither imports the other's
internals back, so the dependency runs one way: vllm_layout -> vllm_ascend_layout -> here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from . import _kvferry


@dataclass(frozen=True)
class TensorInfo:
    """Address, logical shape, strides in elements, element type and device of one tensor."""

    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    itemsize: int
    device: str

    def describe(self) -> str:
        return f"shape {self.shape}, strides {self.strides}, dtype {self.dtype}, device {self.device}"


def tensor_info(t: Any) -> TensorInfo:
    """Reads a torch tensor or a numpy array without copying it."""
    if hasattr(t, "data_ptr"):  # torch
        dtype = str(t.dtype).replace("torch.", "")
        return TensorInfo(int(t.data_ptr()), tuple(int(x) for x in t.shape),
                          tuple(int(x) for x in t.stride()), dtype, int(t.element_size()),
                          str(t.device))
    item = int(t.dtype.itemsize)
    return TensorInfo(int(t.ctypes.data), tuple(int(x) for x in t.shape),
                      tuple(int(s) // item for s in t.strides), str(t.dtype), item, "cpu")


class CacheLayoutError(_kvferry.NotSupportedError):  # type: ignore[misc, valid-type]
    """The tensors are in a layout kvferry cannot move without corrupting them."""


class Geometry(NamedTuple):
    """What one layer's tensors say about the cache; every layer must give the same."""

    kind: str
    layout: str
    dtype: str
    parts: tuple[tuple[str, int, int], ...]
    num_blocks: int
    local_heads: int
    block_strides: tuple[int, ...] = ()
    kernel_blocks_per_block: int = 1
    fields: tuple[int, ...] = ()
    # >1: num_blocks counts kernel blocks, registered as they are, this many per vLLM block id
    # (a logical block that is not one run per part: K and V alternating per kernel block, or
    # head-major kernel blocks). 1: num_blocks counts logical blocks.
    blocks_per_id: int = 1


def _refuse(name: str, info: TensorInfo, why: str) -> CacheLayoutError:
    return CacheLayoutError(f"layer {name}: {info.describe()}: {why}")


def _logical_blocks(name: str, info: TensorInfo, kernel_blocks: int, kernel_size: int,
                    logical_size: int) -> int:
    """Logical block count: vLLM's scheduler may count in blocks larger than the kernel's."""
    if logical_size % kernel_size != 0:
        raise _refuse(name, info, (
            f"the tensor's block size {kernel_size} does not divide vLLM's block size "
            f"{logical_size}"))
    ratio = logical_size // kernel_size
    if kernel_blocks % ratio != 0:
        raise _refuse(name, info, (
            f"{kernel_blocks} kernel blocks are not a whole number of logical blocks of "
            f"{ratio} kernel blocks"))
    return kernel_blocks // ratio


def _contiguous(info: TensorInfo) -> bool:
    expected = 1
    for size, stride in zip(reversed(info.shape), reversed(info.strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
