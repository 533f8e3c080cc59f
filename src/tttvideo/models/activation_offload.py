"""Saved activations moved to host memory between forward and backward: `offload_activations(...)`.

Under the context manager every tensor autograd saves for backward that is at least `min_bytes` large is copied to
the CPU when saved (into pinned memory, asynchronously, when it comes from a CUDA device and `pin` is true) and
copied back to its device when backward needs it. The device then holds only the small saved tensors and whatever
the forward still uses; the price is a device-to-host and a host-to-device copy of each offloaded tensor, on the
compute stream (nothing overlaps them with compute yet).

torch.autograd.graph.save_on_cpu does the copying but not what is needed here, so this is its pack/unpack pair
with three changes: a size threshold (small tensors are not worth a copy each), parameters (and views of them)
and the tensors of `keep` (a module: anything sharing storage with its parameters and buffers, e.g. fp8 weight
codes) are never copied (they stay on the device anyway; save_on_cpu would copy every weight a linear layer
saves), and a count of what was offloaded.
A tensor already on the CPU is copied too, as save_on_cpu does with pin_memory: one code path, testable on a CPU,
saving nothing there.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

_Packed = tuple[torch.device, torch.Tensor] | torch.Tensor


class offload_activations(saved_tensors_hooks):  # noqa: N801 - a context manager, named like torch's own
    """`with offload_activations(min_bytes=1 << 20, pin=True, keep=model) as off: loss = model(...)`, then
    `loss.backward()` anywhere; `off.offloaded_bytes` / `off.offloaded_tensors` count what went to the CPU."""

    def __init__(self, min_bytes: int = 1 << 20, pin: bool = True, keep: nn.Module | None = None):
        self.min_bytes = min_bytes
        self.pin = pin and torch.cuda.is_available()
        self.offloaded_bytes = 0
        self.offloaded_tensors = 0
        self._kept: set[int] = set()
        if keep is not None:
            self._kept = {t.untyped_storage().data_ptr() for t in (*keep.parameters(), *keep.buffers())}
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> "offload_activations":
        super().__enter__()
        return self

    def _stays(self, tensor: torch.Tensor) -> bool:
        # autograd hands a linear layer's weight over as a view (its transpose): look at the base too
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter) or tensor.is_sparse:
            return True
        nbytes = tensor.numel() * tensor.element_size()
        return nbytes < self.min_bytes or tensor.untyped_storage().data_ptr() in self._kept

    def _pack(self, tensor: torch.Tensor) -> _Packed:
        if self._stays(tensor):
            return tensor
        pinned = self.pin and tensor.device.type == "cuda"
        packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pinned)
        packed.copy_(tensor, non_blocking=pinned)
        self.offloaded_bytes += packed.numel() * packed.element_size()
        self.offloaded_tensors += 1
        return tensor.device, packed

    def _unpack(self, packed: _Packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, tensor = packed
        return tensor.to(device, non_blocking=self.pin and device.type == "cuda")
