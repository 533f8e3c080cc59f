"""Live tensor bytes of a piece of PyTorch code, op by op, and what is alive at their peak: `LiveBytes`.

A TorchDispatchMode that sees every tensor an operator returns. A storage it has not seen is an allocation: its
bytes are added to the live total and a weakref finalizer on the storage subtracts them when the storage dies (a
storage dies when its last tensor does, wherever that tensor is held: autograd's saved tensors keep theirs alive, as
they keep GPU memory alive). Views and in-place results share a storage already counted. Under FakeTensorMode no
memory is touched, so a 63-s block can be traced on a laptop; on real tensors the totals are what the tensors hold
(tests/test_fake_trace.py checks both against hand counts).

Each allocation is labelled by where it was made: the innermost frame of tttvideo's code outside this package
(`block.py:norm_modulate`), the module running it (forward hooks; a checkpoint's recompute in backward runs the
modules again, so it is labelled by them too), the operator, dtype and shape; allocations of the autograd engine
itself (gradients) are labelled by the backward node. At every new peak the live set is copied, so `peak_parts`
says what held the memory at the peak.

What it does not see: the caching allocator's rounding and fragmentation (the planner's reserved fraction), memory
that kernels allocate outside PyTorch (cuBLAS / attention workspaces), and tensors that existed before it started
(weights: count them apart).
"""

from __future__ import annotations

import sys
import weakref
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_PACKAGE = str(Path(__file__).resolve().parents[2])  # .../src/tttvideo
# frames of these are the tools and commands that run the model, not the model: a site is never one of them
_TOOLS = tuple(str(Path(__file__).resolve().parents[2] / name) for name in ("memory", "cli", "train", "api.py"))


@dataclass(frozen=True)
class Allocation:
    """One storage: its bytes and where it was made."""

    nbytes: int
    site: str  # file.py:function:line of the innermost tttvideo frame ("recompute ..." in backward), or
    # "backward: <node>" for what the autograd engine allocates
    module: str  # the module running, "" outside any
    op: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PeakPart:
    """Allocations alive at the peak grouped by (site, module, op, dtype, shape): their count and bytes."""

    site: str
    module: str
    op: str
    dtype: str
    shape: tuple[int, ...]
    count: int
    nbytes: int


def _site() -> tuple[str, bool]:
    """(file.py:function:line of the innermost frame in tttvideo's source outside the memory tools, True), else
    (the innermost frame's file.py:function, False)."""
    frame = sys._getframe(2)
    first = None
    while frame is not None:
        name = frame.f_code.co_filename
        if first is None and "torch" not in name:
            first = frame
        if name.startswith(_PACKAGE) and not name.startswith(_TOOLS):
            return f"{Path(name).name}:{frame.f_code.co_name}:{frame.f_lineno}", True
        frame = frame.f_back
    return (f"{Path(first.f_code.co_filename).name}:{first.f_code.co_name}" if first is not None else "?"), False


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes(model) as live:` counts the bytes of every storage made inside; `model` (optional) names the
    modules. `live.peak`, `live.current`, `live.peak_parts()`; `live.reset_peak()` starts a new peak from what is
    alive now."""

    def __init__(self, model: torch.nn.Module | None = None):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, Allocation] = {}
        self._at_peak: list[Allocation] = []
        self._names = {id(m): name for name, m in model.named_modules()} if model is not None else {}
        self._stack: list[str] = []
        self._hooks: list = []

    # ------------------------------------------------------------------ modules
    def __enter__(self):
        if self._names:
            def pre(module, args):
                name = self._names.get(id(module))
                if name is not None:
                    self._stack.append(name)

            def post(module, args, out):
                if self._names.get(id(module)) is not None and self._stack:
                    self._stack.pop()

            self._hooks = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                           torch.nn.modules.module.register_module_forward_hook(post, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return super().__exit__(*exc)

    # ------------------------------------------------------------------ counting
    def _release(self, key: int) -> None:
        alloc = self._live.pop(key, None)
        if alloc is not None:
            self.current -= alloc.nbytes

    def forget(self, tensor: torch.Tensor) -> None:
        """Stop counting `tensor`'s storage (bytes that something else accounts for)."""
        self._release(tensor.untyped_storage()._cdata)

    def reset_peak(self) -> None:
        self.peak = self.current
        self._at_peak = list(self._live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        new = []
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._live or storage.nbytes() == 0:
                continue
            new.append((key, storage, t))
        if new:
            node = torch._C._current_autograd_node()
            site, in_model = _site()
            if node is not None:  # in backward: a checkpoint's recompute runs model code, the engine does not
                site = f"recompute {site}" if in_model else f"backward: {node.name()}"
            module = self._stack[-1] if self._stack else ""
            for key, storage, t in new:
                self._live[key] = Allocation(storage.nbytes(), site, module, func.__name__, str(t.dtype).replace(
                    "torch.", ""), tuple(t.shape))
                self.current += storage.nbytes()
                weakref.finalize(storage, self._release, key)
            if self.current > self.peak:
                self.peak = self.current
                self._at_peak = list(self._live.values())
        return out

    def peak_parts(self) -> list[PeakPart]:
        """What was alive at the peak, grouped, largest first."""
        groups: dict[tuple, list[Allocation]] = defaultdict(list)
        for a in self._at_peak:
            groups[(a.site, a.module, a.op, a.dtype, a.shape)].append(a)
        parts = [PeakPart(*key, len(v), sum(a.nbytes for a in v)) for key, v in groups.items()]
        return sorted(parts, key=lambda p: -p.nbytes)
