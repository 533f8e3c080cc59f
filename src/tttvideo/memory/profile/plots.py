"""PNG plots of a profile (matplotlib, Agg backend, imported lazily so the profiler itself never needs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tttvideo.memory.profile.analysis import Summary
from tttvideo.memory.profile.events import GIB, MIB, OOM, PHASE, Recording


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _scale(max_bytes: float) -> tuple[float, str]:
    return (GIB, "GiB") if max_bytes >= GIB else (MIB, "MiB")


def _empty(path: Path, text: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 2))
    ax.text(0.5, 0.5, text, ha="center", va="center")
    ax.set_axis_off()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def timeline(rec: Recording, s: Summary, path: Path) -> None:
    """Allocated and reserved over time (plus the driver figure on CUDA), with every phase shaded and named."""
    plt = pyplot()
    tl = rec.timeline
    if not tl:
        _empty(path, "no samples recorded")
        return
    top = max(max(x.peak_reserved, x.reserved, x.driver_used or 0) for x in tl)
    div, unit = _scale(top)
    t = [x.t for x in tl]
    fig, ax = plt.subplots(figsize=(11, 5.2))
    # One colour per phase name, so the steps of a run read as a repeating pattern.
    phase_events = [e for e in rec.events if e.kind == PHASE]
    names = list(dict.fromkeys(e.name for e in phase_events))
    cmap = plt.get_cmap("tab10")
    colors = {n: cmap(i % 10) for i, n in enumerate(names)}
    seen: set[str] = set()
    for e in phase_events:
        ax.axvspan(e.start.t, e.end.t, color=colors[e.name], alpha=0.15, lw=0,
                   label=None if e.name in seen else f"phase: {e.name}")
        seen.add(e.name)
    ax.plot(t, [x.allocated / div for x in tl], color="C0", lw=1.5, label=s.labels.get("allocated", "allocated"))
    # A sample's peak is the highest allocated since the previous sample: drawn as a step over that interval.
    ax.plot(t, [x.peak_allocated / div for x in tl], color="C0", lw=0.7, alpha=0.6, drawstyle="steps-pre",
            label="peak between samples")
    if s.backend != "cpu":
        ax.plot(t, [x.reserved / div for x in tl], color="C3", lw=1.2, label=s.labels.get("reserved", "reserved"))
    if any(x.driver_used is not None for x in tl):
        ax.plot(t, [(x.driver_used or 0) / div for x in tl], color="0.4", lw=1, ls="--",
                label=s.labels.get("driver", "driver used"))
    for e in rec.events:
        if e.kind == OOM:
            ax.plot([e.start.t], [e.start.allocated / div], "rx", ms=12, mew=3, label=f"OOM: {e.name}")
    ax.set_xlabel("seconds")
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    ax.set_title(f"Memory timeline ({s.labels.get('unit', s.backend)})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=7, ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def components(s: Summary, path: Path) -> None:
    """Base memory per component: measured delta, and the counted bytes where the caller gave them."""
    if not s.components:
        _empty(path, "no components recorded")
        return
    plt = pyplot()
    rows = s.components
    top = max(max(abs(c.measured), abs(c.counted or 0)) for c in rows)
    div, unit = _scale(top)
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    y = list(range(len(rows)))
    ax.barh([i - 0.2 for i in y], [c.measured / div for c in rows], height=0.4, color="C0", label="measured")
    ax.barh([i + 0.2 for i in y], [(c.counted or 0) / div for c in rows], height=0.4, color="C2", alpha=0.7,
            label="counted")
    ax.set_yticks(y, [c.name for c in rows])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title("Base memory per component")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def blocks(s: Summary, path: Path) -> None:
    """Per block: activation peak of forward, recompute and backward, and what the forward retained."""
    if not s.blocks:
        _empty(path, "no block hooks recorded")
        return
    plt = pyplot()
    names = list(dict.fromkeys(b.name for b in s.blocks))
    series = {
        "forward retained": {b.name: b.retained for b in s.blocks if b.direction == "forward"},
        "forward peak": {b.name: b.activation_peak for b in s.blocks if b.direction == "forward"},
        "recompute peak": {b.name: b.activation_peak for b in s.blocks if b.direction == "recompute"},
        "backward peak": {b.name: b.activation_peak for b in s.blocks if b.direction == "backward"},
    }
    series = {k: v for k, v in series.items() if v}
    top = max(abs(v) for d in series.values() for v in d.values()) or 1
    div, unit = _scale(top)
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(min(16, max(8, 0.12 * len(names) * len(series) + 4)), 4))
    for j, (label, d) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, [d.get(n, 0) / div for n in names], width=width, label=label)
    ax.set_xticks(range(len(names)), [n.split()[-1] for n in names], fontsize=7)
    ax.set_xlabel(names[0].rsplit(" ", 1)[0] if " " in names[0] else "block")
    ax.set_ylabel(unit)
    ax.set_title("Activation memory per block (max over calls)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
