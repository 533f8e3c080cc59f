"""The data the memory profiler records: samples of the allocator's counters and the named events built from them.

Everything here is a plain dataclass that round-trips through JSON, so that `analysis` can work on a saved run
exactly as on a live one, and a unit test can build events by hand.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MIB = 1024**2
GIB = 1024**3

# Event kinds. A "component" is a load (its delta is base memory); a "phase" is a stretch of work whose peak is
# reset at entry (its peak minus its entry is activation memory); a "block" is one call of a hooked module inside a
# phase; a "mark" is a single named sample; an "oom" records where the allocator gave up.
COMPONENT = "component"
PHASE = "phase"
BLOCK = "block"
MARK = "mark"
OOM = "oom"
KINDS = (COMPONENT, PHASE, BLOCK, MARK, OOM)


@dataclass
class MemorySample:
    """One reading of the backend's counters, in bytes. Fields a backend cannot measure are None.

    On CUDA: `allocated`/`reserved` are the caching allocator's figures, `peak_*` are since the last peak reset,
    `driver_used` is total minus free from the driver (everything on the card: our process's CUDA context, NCCL
    buffers, other libraries and other processes). On CPU: `allocated` and `reserved` are both the host resident set
    size (torch's CPU tensors are plain malloc and invisible to any finer counter), `peak_*` is the kernel's resident
    high-water mark since the last reset, and `tracemalloc_*` count Python-heap objects only.
    """

    t: float
    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    inactive_split: int | None = None
    alloc_retries: int | None = None
    num_ooms: int | None = None
    driver_used: int | None = None
    driver_total: int | None = None
    tracemalloc_current: int | None = None
    tracemalloc_peak: int | None = None
    label: str = ""

    @property
    def fragmentation(self) -> int:
        """Bytes the allocator holds but no tensor uses."""
        return self.reserved - self.allocated

    @property
    def outside_torch(self) -> int | None:
        """Device memory in use that PyTorch's allocator does not own (CUDA context, NCCL, cuBLAS workspaces...)."""
        if self.driver_used is None:
            return None
        return self.driver_used - self.reserved


@dataclass
class Event:
    """A named interval (or instant, for marks) with the samples at its two ends.

    `peak_allocated`/`peak_reserved` are the highest values reached inside the interval, folded across every peak
    reset that nested intervals made. `phase` is the enclosing phase's name (for blocks and components loaded inside a
    phase), `direction` is "forward" or "backward" for blocks, `step` the training/sampling step if the caller gave
    one. `extra` carries numbers a caller counted itself (e.g. bytes of gradients summed over parameters).
    """

    kind: str
    name: str
    start: MemorySample
    end: MemorySample
    peak_allocated: int
    peak_reserved: int
    phase: str | None = None
    direction: str | None = None
    step: int | None = None
    depth: int = 0
    closed: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def delta(self) -> int:
        """Allocated at the end minus at the start: what the interval left behind."""
        return self.end.allocated - self.start.allocated

    @property
    def activation_peak(self) -> int:
        """Highest allocated inside the interval above what was allocated at its start."""
        return self.peak_allocated - self.start.allocated

    @property
    def duration(self) -> float:
        return self.end.t - self.start.t


def sample_from_dict(d: dict[str, Any]) -> MemorySample:
    return MemorySample(**d)


def event_from_dict(d: dict[str, Any]) -> Event:
    d = dict(d)
    d["start"] = sample_from_dict(d["start"])
    d["end"] = sample_from_dict(d["end"])
    return Event(**d)


@dataclass
class Recording:
    """What a profiler run produced: metadata, events in closing order, and the timeline of every sample taken."""

    meta: dict[str, Any]
    events: list[Event]
    timeline: list[MemorySample]

    def to_dict(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "events": [asdict(e) for e in self.events],
            "timeline": [asdict(s) for s in self.timeline],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recording:
        return cls(
            meta=dict(d.get("meta", {})),
            events=[event_from_dict(e) for e in d.get("events", [])],
            timeline=[sample_from_dict(s) for s in d.get("timeline", [])],
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Recording:
        return cls.from_dict(json.loads(Path(path).read_text()))
