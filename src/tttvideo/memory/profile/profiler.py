"""`MemoryProfiler`: named memory events recorded while the real pipeline runs.

Instrumenting a pipeline takes a few calls:

    prof = MemoryProfiler()                      # CUDA if a GPU is visible, else host RSS
    with prof.component("transformer"):          # base memory: what the load leaves allocated
        model = build_model(cfg)
    prof.attach_block_hooks(model.blocks)        # activation memory per block, forward and backward
    with prof.phase("forward", step=0):          # peak is reset at entry; activation peak = peak - entry
        loss = model(x).square().mean()
    with prof.phase("backward", step=0):
        loss.backward()
    prof.save("out/events.json")

Nested intervals each get their own peak: every peak reset is preceded by a reading whose peak is folded into every
open interval, so resetting for block 3 never loses the phase's peak. A disabled profiler
(`MemoryProfiler.disabled()`) records nothing and reads no memory: its `phase` and `component` are plain
`contextlib.nullcontext`s and its other calls return at once, so pipeline code can take one without branching.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tttvideo.memory.profile.backends import MemoryBackend, make_backend
from tttvideo.memory.profile.events import BLOCK, COMPONENT, MARK, OOM, PHASE, Event, MemorySample, Recording


def is_oom(exc: BaseException) -> bool:
    """True for the allocator running out: CUDA's OutOfMemoryError, Python's MemoryError, or torch's CPU allocator."""
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except (ImportError, AttributeError):
        pass
    msg = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in msg.lower() or "can't allocate memory" in msg)


def _in_backward() -> bool:
    """Whether autograd is running a backward pass right now (a forward seen then is a checkpoint recompute)."""
    try:
        import torch

        return torch._C._current_graph_task_id() != -1
    except (ImportError, AttributeError):
        return False


@dataclass
class _Frame:
    kind: str
    name: str
    start: MemorySample
    peak_allocated: int
    peak_reserved: int
    phase: str | None
    direction: str | None
    step: int | None
    depth: int
    extra: dict[str, Any] = field(default_factory=dict)


class MemoryProfiler:
    def __init__(
        self,
        backend: MemoryBackend | None = None,
        *,
        device: str = "auto",
        enabled: bool = True,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self.backend: MemoryBackend | None = None
        self.events: list[Event] = []
        self.timeline: list[MemorySample] = []
        self.meta: dict[str, Any] = dict(meta or {})
        self.oom: dict[str, Any] | None = None
        self._stack: list[_Frame] = []
        self._open_blocks: dict[str, list[_Frame]] = {}
        self._hooks: list[Any] = []
        self.step_listeners: list[Callable[[], None]] = []  # called at each end_step (torch.profiler's schedule)
        self._snapshot_on = False
        if not enabled:
            return
        self.backend = backend if backend is not None else make_backend(device)
        self.meta.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S"))
        self.meta.setdefault("backend", self.backend.describe())
        self._t0 = time.perf_counter()
        self._t0_backend: float | None = None
        self.mark("start")

    @classmethod
    def disabled(cls) -> MemoryProfiler:
        """A profiler that records nothing (every context a nullcontext, every other call a no-op)."""
        return cls(enabled=False)

    # ----------------------------------------------------------------------------------------------------- sampling
    def _take(self, label: str) -> MemorySample:
        assert self.backend is not None
        self.backend.synchronize()
        s = self.backend.read()
        # Times are relative to the first sample, whatever clock the backend uses.
        if self._t0_backend is None:
            self._t0_backend = s.t
        s.t = s.t - self._t0_backend
        s.label = label
        self.timeline.append(s)
        for f in self._stack:
            f.peak_allocated = max(f.peak_allocated, s.peak_allocated, s.allocated)
            f.peak_reserved = max(f.peak_reserved, s.peak_reserved, s.reserved)
        return s

    def _current_phase(self) -> str | None:
        for f in reversed(self._stack):
            if f.kind == PHASE:
                return f.name
        return None

    def _open(self, kind: str, name: str, *, direction: str | None = None, step: int | None = None,
              reset: bool = True, extra: dict[str, Any] | None = None) -> _Frame:
        label = f"{name} {direction}" if direction else name
        s = self._take(f"{label} start")
        if step is None:
            step = next((f.step for f in reversed(self._stack) if f.step is not None), None)
        if reset:
            self.backend.reset_peak()  # type: ignore[union-attr]
        frame = _Frame(kind, name, s, s.allocated, s.reserved, self._current_phase(), direction, step,
                       len(self._stack), dict(extra or {}))
        self._stack.append(frame)
        return frame

    def _close(self, frame: _Frame) -> Event:
        label = f"{frame.name} {frame.direction}" if frame.direction else frame.name
        s = self._take(f"{label} end")
        # Frames opened above this one and never closed (an exception skipped their exit hook) end here too.
        idx = next((i for i in range(len(self._stack) - 1, -1, -1) if self._stack[i] is frame), None)
        if idx is None:
            raise RuntimeError(f"memory profiler: {label} closed twice or never opened")
        for stale in reversed(self._stack[idx + 1:]):
            self.events.append(self._event(stale, s, closed=bool(stale.extra.get("closed_by_phase"))))
        del self._stack[idx:]
        event = self._event(frame, s, closed=True)
        self.events.append(event)
        return event

    @staticmethod
    def _event(f: _Frame, end: MemorySample, closed: bool) -> Event:
        return Event(kind=f.kind, name=f.name, start=f.start, end=end, peak_allocated=f.peak_allocated,
                     peak_reserved=f.peak_reserved, phase=f.phase, direction=f.direction, step=f.step,
                     depth=f.depth, closed=closed, extra=f.extra)

    # ------------------------------------------------------------------------------------------------ recording API
    def component(self, name: str, counted_bytes: int | None = None) -> AbstractContextManager[dict[str, Any]]:
        """Base memory of a load: allocated after minus before. Yields a dict the caller may add counted bytes to
        (`info["counted_bytes"] = ...`, e.g. parameter bytes) so the report can compare measured and counted."""
        if not self.enabled:
            return contextlib.nullcontext({})
        return self._component(name, counted_bytes)

    @contextlib.contextmanager
    def _component(self, name: str, counted_bytes: int | None) -> Iterator[dict[str, Any]]:
        frame = self._open(COMPONENT, name, extra={} if counted_bytes is None else {"counted_bytes": counted_bytes})
        try:
            yield frame.extra
        except BaseException as exc:
            self._note_oom(exc)
            raise
        finally:
            self._close(frame)

    def add_component(self, name: str, counted_bytes: int) -> None:
        """A component known by count rather than by a load (e.g. gradients: sum of `p.grad` bytes)."""
        if not self.enabled:
            return
        s = self._take(f"{name} (counted)")
        self.events.append(Event(kind=COMPONENT, name=name, start=s, end=s, peak_allocated=s.allocated,
                                 peak_reserved=s.reserved, phase=self._current_phase(), depth=len(self._stack),
                                 extra={"counted_bytes": int(counted_bytes), "counted_only": True}))

    def phase(self, name: str, step: int | None = None) -> AbstractContextManager[None]:
        """A stretch of work whose peak is reset at entry; an OOM inside records where it happened."""
        if not self.enabled:
            return contextlib.nullcontext()
        return self._phase(name, step)

    @contextlib.contextmanager
    def _phase(self, name: str, step: int | None) -> Iterator[None]:
        frame = self._open(PHASE, name, step=step)
        try:
            yield
        except BaseException as exc:
            self._note_oom(exc)
            raise
        finally:
            self._close(frame)

    def mark(self, name: str) -> MemorySample | None:
        """A single named sample (no reset), shown on the timeline."""
        if not self.enabled:
            return None
        s = self._take(name)
        self.events.append(Event(kind=MARK, name=name, start=s, end=s, peak_allocated=s.peak_allocated,
                                 peak_reserved=s.peak_reserved, phase=self._current_phase(), depth=len(self._stack)))
        return s

    def end_step(self, name: str) -> None:
        """The end of a training or denoising step: a mark named `name`, then the step listeners."""
        self.mark(name)
        for listener in self.step_listeners:
            listener()

    def location(self) -> str:
        """Where the pipeline is now, in words: "backward of block 17", "forward", "load of transformer"."""
        block = next((f for f in reversed(self._stack) if f.kind == BLOCK), None)
        phase = self._current_phase()
        comp = next((f for f in reversed(self._stack) if f.kind == COMPONENT), None)
        if block is not None:
            where = f"{block.direction} of {block.name}"
            return where if phase in (None, block.direction) else f"{phase} ({where})"
        if phase is not None:
            return phase
        if comp is not None:
            return f"load of {comp.name}"
        return "outside any phase"

    def _note_oom(self, exc: BaseException) -> None:
        if self.oom is not None or not is_oom(exc):
            return
        where = self.location()
        s = self._take(f"OOM in {where}")
        step = next((f.step for f in reversed(self._stack) if f.step is not None), None)
        self.oom = {"location": where, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                    "step": step, "allocated": s.allocated, "reserved": s.reserved}
        self.events.append(Event(kind=OOM, name=where, start=s, end=s, peak_allocated=s.peak_allocated,
                                 peak_reserved=s.peak_reserved, phase=self._current_phase(), step=step,
                                 depth=len(self._stack), extra=dict(self.oom)))

    def record_oom(self, exc: BaseException) -> dict[str, Any] | None:
        """For callers that catch an OOM outside any phase: note it (if not yet) and return the record."""
        if self.enabled:
            self._note_oom(exc)
        return self.oom

    # ------------------------------------------------------------------------------------------------------ hooks
    def attach_block_hooks(self, blocks: Sequence[Any], prefix: str = "block", backward: bool = True) -> None:
        """Record every call of each module: forward (pre/post hooks), forward recompute under checkpointing
        (a forward seen during backward), and backward (full backward pre/post hooks) as `block` events named
        f"{prefix} {i}". Backward hooks need tensor outputs; pass backward=False for modules that return other
        things."""
        if not self.enabled:
            return
        # Autograd warns once per backward that the full backward hook of a module whose inputs need no grad fires
        # early; `_bwd_post` handles that case (see `_pop_block`), so the warning is noise in a profile.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                                "respect to module outputs")
        for i, module in enumerate(blocks):
            name = f"{prefix} {i}"
            self._hooks.append(module.register_forward_pre_hook(self._fwd_pre(name)))
            self._hooks.append(module.register_forward_hook(self._fwd_post(name)))
            if backward:
                self._hooks.append(module.register_full_backward_pre_hook(self._bwd_pre(name)))
                self._hooks.append(module.register_full_backward_hook(self._bwd_post(name)))

    def detach_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def close(self) -> None:
        """End recording: a last sample, hooks removed, the backend's own tracing (tracemalloc) stopped. The
        recording stays available; further calls on the profiler are no-ops."""
        if not self.enabled:
            return
        self.mark("end")
        self.detach_hooks()
        self.backend.close()  # type: ignore[union-attr]
        self.enabled = False

    def _push_block(self, name: str, direction: str) -> None:
        frame = self._open(BLOCK, name, direction=direction)
        self._open_blocks.setdefault(f"{name}/{direction}", []).append(frame)

    def _pop_block(self, name: str, direction: str, defer: bool = False) -> None:
        frames = self._open_blocks.get(f"{name}/{direction}")
        if not frames:
            return  # opened before hooks were attached, or already unwound by an exception
        frame = frames.pop()
        if not any(f is frame for f in self._stack):
            return
        if defer:
            # Autograd calls the full backward hook of a module whose inputs need no grad (the first block when the
            # embedding is frozen) right after its pre-hook, before the block's own gradients are computed; the
            # block's backward really ends with the enclosing phase, which closes this frame.
            frame.extra["closed_by_phase"] = True
            return
        self._close(frame)

    def _fwd_pre(self, name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            self._push_block(name, "recompute" if _in_backward() else "forward")
        return hook

    def _fwd_post(self, name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            self._pop_block(name, "recompute" if _in_backward() else "forward")
        return hook

    def _bwd_pre(self, name: str) -> Callable[..., None]:
        def hook(module: Any, grad_output: Any) -> None:
            self._push_block(name, "backward")
        return hook

    def _bwd_post(self, name: str) -> Callable[..., None]:
        def hook(module: Any, grad_input: Any, grad_output: Any) -> None:
            self._pop_block(name, "backward", defer=all(g is None for g in grad_input))
        return hook

    # ------------------------------------------------------------------------------------- torch's own instruments
    def start_snapshot(self, max_entries: int = 200_000) -> bool:
        """Start torch's allocator history (CUDA only) for a pytorch.org/memory_viz snapshot; False on CPU."""
        if not self.enabled or getattr(self.backend, "name", "") != "cuda":
            return False
        import torch

        torch.cuda.memory._record_memory_history(max_entries=max_entries)
        self._snapshot_on = True
        return True

    def dump_snapshot(self, path: str | Path) -> Path | None:
        if not self._snapshot_on:
            return None
        import torch

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self._snapshot_on = False
        return path

    # ------------------------------------------------------------------------------------------------------ output
    def recording(self) -> Recording:
        meta = dict(self.meta)
        if self.backend is not None:
            meta.setdefault("backend", self.backend.describe())
            meta["labels"] = dict(self.backend.labels)
        meta.setdefault("python", platform.python_version())
        meta.setdefault("git_commit", git_commit())
        meta.setdefault("argv", list(sys.argv))
        if self.oom is not None:
            meta["oom"] = dict(self.oom)
        return Recording(meta=meta, events=list(self.events), timeline=list(self.timeline))

    def save(self, path: str | Path) -> Path:
        return self.recording().save(path)


def git_commit() -> str:
    """The commit of the source tree, for results files: $GIT_COMMIT where set (a lent GPU machine's copy of the work
    tree may carry a stale .git), else HEAD of this checkout, else ''."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""
