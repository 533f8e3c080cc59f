"""`tttv profile --trace`: a torch.profiler trace of one step, and the operators that cost most in it.

The profiler follows a wait / warmup / active schedule over the run's steps (training steps or denoising steps, as
`MemoryProfiler.end_step` announces them): it waits through all but the last two, warms up on the second to last and
records the last (a single step run is recorded whole), with memory events, input shapes and Python stacks. When the
active step ends it writes:
- trace.json: the Chrome trace (ui.perfetto.dev or chrome://tracing);
- trace_top.md / trace_top.json: the top operators of that step by their own device time and by their own memory
  (allocated minus freed inside the operator), from `key_averages()`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TOP = 15


def schedule_for(steps: int) -> tuple[int, int, int]:
    """(wait, warmup, active) that records the last of `steps` steps after one warm-up step."""
    if steps <= 1:
        return 0, 0, 1
    return steps - 2, 1, 1


def _is_operator(key: str) -> bool:
    """An operator or kernel, not a Python frame that `with_stack` adds, nor the schedule's step marker."""
    return not (".py(" in key or key.startswith(("<built-in", "ProfilerStep")))


def top_operators(averages: Any, on_cuda: bool, top: int = TOP) -> dict[str, list[dict[str, Any]]]:
    """The `top` operators by own time and by own memory from `profile.key_averages()`."""
    rows = []
    for a in averages:
        if not _is_operator(a.key):
            continue
        device_us = getattr(a, "self_device_time_total", None) if on_cuda else None
        memory = getattr(a, "self_device_memory_usage", 0) if on_cuda else getattr(a, "self_cpu_memory_usage", 0)
        rows.append({"operator": a.key, "calls": int(a.count),
                     "self_time_ms": (device_us if device_us is not None else a.self_cpu_time_total) / 1e3,
                     "self_memory_bytes": int(memory or 0)})
    by_time = sorted(rows, key=lambda r: r["self_time_ms"], reverse=True)[:top]
    by_memory = sorted(rows, key=lambda r: r["self_memory_bytes"], reverse=True)[:top]
    return {"clock": "device" if on_cuda else "cpu", "by_time": by_time, "by_memory": by_memory}


def write_top(top: dict[str, Any], out: Path) -> None:
    (out / "trace_top.json").write_text(json.dumps(top, indent=1))
    lines = ["# Top operators of the traced step", ""]
    for key, title, col in (("by_time", f"by own {top['clock']} time", "self_time_ms"),
                            ("by_memory", "by own memory (allocated minus freed inside)", "self_memory_bytes")):
        lines += [f"## {title}", "", "| operator | calls | own time ms | own memory MiB |", "|---|---|---|---|"]
        lines += [f"| `{r['operator']}` | {r['calls']} | {r['self_time_ms']:.2f} | "
                  f"{r['self_memory_bytes'] / 2**20:.1f} |" for r in top[key]]
        lines.append("")
    (out / "trace_top.md").write_text("\n".join(lines))


@contextlib.contextmanager
def traced(dev: Any, out: Path, steps: int, prof: Any) -> Iterator[Any]:
    """torch.profiler over the run, stepped by `prof.end_step`; the trace and its top operators land in `out`."""
    import torch

    on_cuda = dev.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    wait, warmup, active = schedule_for(steps)
    written: list[bool] = []

    def ready(p: torch.profiler.profile) -> None:
        p.export_chrome_trace(str(out / "trace.json"))
        write_top(top_operators(p.key_averages(), on_cuda), out)
        written.append(True)

    p = torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True,
                               schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                               on_trace_ready=ready)
    prof.step_listeners.append(p.step)
    try:
        with p:
            yield p
    finally:
        prof.step_listeners.remove(p.step)
        if not written:
            (out / "trace_top.md").write_text("# Top operators\n\nNo step completed inside the traced window "
                                              "(the run stopped before it, e.g. out of memory).\n")
