"""Device tensors as kvferry's vLLM adapter sees them, without a GPU or an NPU.

A FakeDeviceTensor's bytes live in a torch CPU tensor of its own that kvferry never sees;
data_ptr() is an address kvferry cannot read (as device memory is), so registering it instead
of a host mirror would fail every transfer. The torch ops host-buffer mode's own block copy uses
(kvferry.vllm_hostcopy) work as on a CUDA or torch_npu tensor and are as strict: index and
source tensors must be on this device (a CPU tensor or one of another device is refused, as the
real runtimes refuse it), and data leaves or enters only through to("cpu") and copy_(). A class
attribute `fail` names an op that raises, as a broken device would.
"""

from __future__ import annotations

from typing import Any, Optional


class FakeDevice:
    """torch.device("cuda:0") or torch_npu's torch.device("npu:0"), as the adapter reads it:
    type, index and str()."""

    def __init__(self, type_: str, index: int = 0):
        self.type, self.index = type_, index

    def __str__(self) -> str:
        return f"{self.type}:{self.index}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeDevice) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))


# The error each runtime raises for a broken device, for `fail`.
DEVICE_ERRORS = {"cuda": "CUDA error: an illegal memory access was encountered",
                 "npu": "ACL stream synchronize failed, error code:507015"}


class FakeDeviceTensor:
    """A tensor on a device: see the module docstring. Subclasses fix the device type."""

    device_type = "cuda"
    fail: Optional[str] = None

    def __init__(self, storage: Any, fake_address: int = 0x7E0000000000, index: int = 0):
        self.storage, self.address = storage, fake_address
        self.shape, self.dtype = storage.shape, storage.dtype
        self.device = FakeDevice(self.device_type, index)

    def _like(self, storage: Any) -> "FakeDeviceTensor":
        return type(self)(storage, index=self.device.index)

    def data_ptr(self) -> int:
        return self.address

    def stride(self):
        return self.storage.stride()

    def element_size(self) -> int:
        return self.storage.element_size()

    def _on_device(self, t: Any, what: str) -> Any:
        if not isinstance(t, FakeDeviceTensor) or t.device != self.device:
            other = getattr(t, "device", "cpu")
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at "
                               f"least two devices, {self.device} and {other}! ({what})")
        return t.storage

    def _check(self, op: str) -> None:
        if type(self).fail == op:
            raise RuntimeError(DEVICE_ERRORS[self.device_type])

    def new_tensor(self, data: Any, dtype: Any = None) -> "FakeDeviceTensor":
        import torch
        return self._like(torch.tensor(data, dtype=dtype))

    def new_empty(self, shape: Any) -> "FakeDeviceTensor":
        import torch
        return self._like(torch.empty(shape, dtype=self.storage.dtype))

    def index_select(self, dim: int, index: Any) -> "FakeDeviceTensor":
        self._check("index_select")
        return self._like(self.storage.index_select(dim, self._on_device(index, "index")))

    def index_copy_(self, dim: int, index: Any, source: Any) -> "FakeDeviceTensor":
        self._check("index_copy_")
        self.storage.index_copy_(dim, self._on_device(index, "index"),
                                 self._on_device(source, "source"))
        return self

    def copy_(self, source: Any) -> "FakeDeviceTensor":  # host -> device
        self._check("copy_")
        import torch
        if isinstance(source, FakeDeviceTensor):
            source = self._on_device(source, "source")
        assert isinstance(source, torch.Tensor) and str(source.device) == "cpu"
        self.storage.copy_(source)
        return self

    def to(self, device: Any = None, **kwargs: Any) -> Any:  # device -> host
        self._check("to")
        device = kwargs.get("device", device)
        assert str(device) == "cpu", device
        return self.storage.clone()


class FakeCudaTensor(FakeDeviceTensor):
    """A CUDA tensor (device cuda:N)."""

    device_type = "cuda"


class FakeNpuTensor(FakeDeviceTensor):
    """A torch_npu tensor (device npu:N): tensor.device.type "npu", .index, data_ptr()."""

    device_type = "npu"
