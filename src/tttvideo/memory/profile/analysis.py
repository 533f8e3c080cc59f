"""Pure arithmetic over a `Recording`: base memory per component, activation memory per phase and per block, total
peaks, fragmentation and memory outside PyTorch. No torch, no I/O: a unit test drives it with scripted numbers.

Definitions (all in bytes; "allocated" is the backend's live-tensor figure, host RSS on CPU):
- base memory of a component = allocated after its load minus before (negative for a release);
- activation peak of a phase or block = highest allocated inside it minus allocated at its entry;
- retained = allocated at exit minus at entry (what a forward keeps for backward, what a backward frees);
- fragmentation = reserved minus allocated; inactive split bytes, allocator retries and OOMs come from the
  allocator (retries and OOMs as increases over the recording, the counters being process-lifetime totals);
- outside PyTorch = driver used (total minus free) minus reserved: CUDA context, NCCL, cuBLAS workspaces, and any
  other process on the card.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from tttvideo.memory.profile.events import BLOCK, COMPONENT, MARK, PHASE, Event, MemorySample, Recording


@dataclass
class ComponentRow:
    name: str
    measured: int  # allocated after the load minus before
    counted: int | None  # bytes the caller counted (parameters, gradients), where given
    load_peak: int  # transient above the start during the load (e.g. an fp32 copy before a cast)


@dataclass
class PhaseRow:
    name: str
    occurrences: int
    activation_peak: int  # max over occurrences of (peak inside - allocated at entry)
    peak_step: int | None  # the step where that max happened
    entry: int  # allocated at entry of that occurrence
    peak_allocated: int  # absolute peak of that occurrence
    peak_reserved: int
    retained: int  # allocated at exit minus at entry, for that occurrence
    seconds: float  # mean duration over occurrences


@dataclass
class BlockRow:
    name: str
    direction: str  # forward, recompute (checkpointed forward during backward) or backward
    occurrences: int
    activation_peak: int  # max over occurrences
    retained: int  # max over occurrences of (exit - entry): a forward's saved activations
    seconds: float


@dataclass
class Fragmentation:
    at_peak: int  # peak reserved - peak allocated: what the allocator held beyond the tensors' own peak
    max: int
    mean: float
    std: float  # fluctuation over the timeline
    max_ratio: float  # max of (reserved - allocated) / reserved
    inactive_split_max: int | None
    inactive_split_final: int | None
    alloc_retries: int | None
    num_ooms: int | None


@dataclass
class Totals:
    peak_allocated: int
    peak_reserved: int
    final_allocated: int
    final_reserved: int
    base_total: int  # sum of measured component deltas
    outside_torch_final: int | None
    outside_torch_max: int | None
    driver_peak: int | None
    device_total: int | None


@dataclass
class Summary:
    backend: str
    labels: dict[str, str]
    status: str  # ok, oom, error
    components: list[ComponentRow]
    phases: list[PhaseRow]
    blocks: list[BlockRow]
    marks: dict[str, int]  # mark name -> allocated at its last occurrence
    totals: Totals
    fragmentation: Fragmentation
    oom: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    step_seconds: list[float] = field(default_factory=list)  # per training / denoising step, in order

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _natural_key(name: str) -> tuple[Any, ...]:
    """'block 10' after 'block 9'."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _first_seen_order(events: list[Event]) -> dict[str, int]:
    order: dict[str, int] = {}
    for e in sorted(events, key=lambda e: e.start.t):
        order.setdefault(e.name, len(order))
    return order


def components(events: list[Event]) -> list[ComponentRow]:
    rows: dict[str, ComponentRow] = {}
    for e in events:
        if e.kind != COMPONENT or not e.closed:
            continue
        counted = e.extra.get("counted_bytes")
        measured = 0 if e.extra.get("counted_only") else e.delta
        load_peak = 0 if e.extra.get("counted_only") else e.activation_peak
        row = rows.get(e.name)
        if row is None:
            rows[e.name] = ComponentRow(e.name, measured, None if counted is None else int(counted), load_peak)
        else:
            # A component recorded twice (loaded in two pieces, or counted and measured) adds up.
            row.measured += measured
            row.load_peak = max(row.load_peak, load_peak)
            if counted is not None:
                row.counted = (row.counted or 0) + int(counted)
    order = _first_seen_order([e for e in events if e.kind == COMPONENT])
    return sorted(rows.values(), key=lambda r: order[r.name])


def phases(events: list[Event]) -> list[PhaseRow]:
    groups: dict[str, list[Event]] = {}
    for e in events:
        if e.kind == PHASE:
            groups.setdefault(e.name, []).append(e)
    rows = []
    for name, evs in groups.items():
        top = max(evs, key=lambda e: e.activation_peak)
        rows.append(PhaseRow(
            name=name, occurrences=len(evs), activation_peak=top.activation_peak, peak_step=top.step,
            entry=top.start.allocated, peak_allocated=top.peak_allocated, peak_reserved=top.peak_reserved,
            retained=top.delta, seconds=sum(e.duration for e in evs) / len(evs),
        ))
    order = _first_seen_order([e for e in events if e.kind == PHASE])
    return sorted(rows, key=lambda r: order[r.name])


DIRECTIONS = ("forward", "recompute", "backward")


def blocks(events: list[Event]) -> list[BlockRow]:
    groups: dict[tuple[str, str], list[Event]] = {}
    for e in events:
        # An unclosed block frame has no real end: a checkpoint recompute that autograd stops early once it has
        # what backward needs, or a block interrupted by an exception. Its numbers would be the parent's.
        if e.kind == BLOCK and e.closed:
            groups.setdefault((e.name, e.direction or "forward"), []).append(e)
    rows = [
        BlockRow(name=name, direction=direction, occurrences=len(evs),
                 activation_peak=max(e.activation_peak for e in evs), retained=max(e.delta for e in evs),
                 seconds=sum(e.duration for e in evs) / len(evs))
        for (name, direction), evs in groups.items()
    ]
    rank = {d: i for i, d in enumerate(DIRECTIONS)}
    return sorted(rows, key=lambda r: (_natural_key(r.name), rank.get(r.direction, 99)))


def marks(events: list[Event]) -> dict[str, int]:
    return {e.name: e.start.allocated for e in events if e.kind == MARK}


def _counter_increase(timeline: list[MemorySample], attr: str) -> int | None:
    values = [getattr(s, attr) for s in timeline if getattr(s, attr) is not None]
    return (values[-1] - values[0]) if values else None


def fragmentation(timeline: list[MemorySample]) -> Fragmentation:
    if not timeline:
        return Fragmentation(0, 0, 0.0, 0.0, 0.0, None, None, None, None)
    frag = [s.fragmentation for s in timeline]
    mean = sum(frag) / len(frag)
    std = math.sqrt(sum((f - mean) ** 2 for f in frag) / len(frag))
    # Peaks happen between samples; both run-wide peaks are exact (see `totals`), so their difference is the
    # allocator's overhead at the high-water mark, whereas reserved - allocated at any one sample may be cache
    # left over after the peak has passed.
    peak_alloc = max(max(s.peak_allocated, s.allocated) for s in timeline)
    peak_res = max(max(s.peak_reserved, s.reserved) for s in timeline)
    ratios = [s.fragmentation / s.reserved for s in timeline if s.reserved > 0]
    inactive = [s.inactive_split for s in timeline if s.inactive_split is not None]
    return Fragmentation(
        at_peak=peak_res - peak_alloc, max=max(frag), mean=mean, std=std,
        max_ratio=max(ratios) if ratios else 0.0,
        inactive_split_max=max(inactive) if inactive else None,
        inactive_split_final=inactive[-1] if inactive else None,
        alloc_retries=_counter_increase(timeline, "alloc_retries"),
        num_ooms=_counter_increase(timeline, "num_ooms"),
    )


def totals(events: list[Event], timeline: list[MemorySample]) -> Totals:
    if not timeline:
        return Totals(0, 0, 0, 0, 0, None, None, None, None)
    outside = [s.outside_torch for s in timeline if s.outside_torch is not None]
    drivers = [s.driver_used for s in timeline if s.driver_used is not None]
    device_total = next((s.driver_total for s in timeline if s.driver_total is not None), None)
    last = timeline[-1]
    return Totals(
        # Every peak reset is preceded by a sample, so the largest sampled peak is the run's true peak.
        peak_allocated=max(max(s.peak_allocated, s.allocated) for s in timeline),
        peak_reserved=max(max(s.peak_reserved, s.reserved) for s in timeline),
        final_allocated=last.allocated, final_reserved=last.reserved,
        base_total=sum(r.measured for r in components(events)),
        outside_torch_final=outside[-1] if outside else None,
        outside_torch_max=max(outside) if outside else None,
        driver_peak=max(drivers) if drivers else None,
        device_total=device_total,
    )


def step_seconds(events: list[Event]) -> list[float]:
    """Seconds of each step: between consecutive 'denoise step k/n' marks (the first from the enclosing phase's
    start), or the sum of the phases a training step was split into (forward, backward, optimizer step)."""
    steps = [e for e in events if e.kind == MARK and e.name.startswith("denoise step ")]
    if steps:
        starts = [e for e in events if e.kind == PHASE and e.name == steps[0].phase]
        t = [starts[0].start.t if starts else steps[0].start.t] + [e.start.t for e in steps]
        return [b - a for a, b in zip(t, t[1:])]
    per_step: dict[int, float] = {}
    for e in events:
        if e.kind == PHASE and e.step is not None:
            per_step[e.step] = per_step.get(e.step, 0.0) + e.duration
    return [per_step[k] for k in sorted(per_step)]


def summarize(rec: Recording, status: str | None = None) -> Summary:
    meta = rec.meta
    oom = meta.get("oom")
    if status is None:
        status = "oom" if oom else str(meta.get("status", "ok"))
    backend = meta.get("backend", {})
    return Summary(
        backend=str(backend.get("backend", "unknown")) if isinstance(backend, dict) else str(backend),
        labels=dict(meta.get("labels", {})),
        status=status,
        components=components(rec.events),
        phases=phases(rec.events),
        blocks=blocks(rec.events),
        marks=marks(rec.events),
        totals=totals(rec.events, rec.timeline),
        fragmentation=fragmentation(rec.timeline),
        oom=dict(oom) if oom else None,
        meta={k: v for k, v in meta.items() if k not in ("labels", "oom")},
        step_seconds=step_seconds(rec.events),
    )
