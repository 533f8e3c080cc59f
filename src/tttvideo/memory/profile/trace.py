"""`tttv profile --trace`: a torch.profiler trace of one step, and the operators that cost most in it.

The profiler follows a wait / warmup / active schedule over the run's steps (training steps or denoising steps, as
`MemoryProfiler.end_step` announces them): it waits through all but the last two, warms up on the second to last and
records the last (a single step run is recorded whole), with memory events, input shapes and Python stacks. When the
active step ends it writes:
- trace.json: the Chrome trace (ui.perfetto.dev or chrome://tracing);
- trace_top.md / trace_top.json: where that step's device time went by kind of kernel (the TTT scan, attention,
  matrix products, compiled glue, norms, copies, collectives, the rest), then the top operators by their own device
  time and by their own memory (allocated minus freed inside the operator), from `key_averages()`.
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


def is_kernel(average: Any) -> bool:
    """A device-side event (a kernel, a copy, a memset), not the CPU-side operator that launched it, nor a range
    annotated on the device's timeline: torch.compile's "## Call CompiledFxGraph ... ##" and the range of each
    Triton kernel it launches (named as the kernel) span kernels that are rows of their own."""
    kind = getattr(average, "device_type", None)
    return (kind is not None and getattr(kind, "name", str(kind)) != "CPU"
            and not getattr(average, "is_user_annotation", False) and not average.key.startswith("## "))


# Kinds of kernel, by name, first match wins: what a step's time is spent on (how much the TTT scan, how much
# attention, how much the glue around them).
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("TTT scan (Triton)", ("_mlp_fwd_kernel", "_reverse_kernel", "_output_path_kernel", "_dk_kernel",
                           "_linear_fwd_kernel", "_linear_bwd_kernel")),
    ("TTT glue (Triton)", ("_scan_inputs_fwd_kernel", "_scan_inputs_bwd_kernel")),
    ("collectives (NCCL)", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_generated_fort_native_sdpa")),
    ("matrix products", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "wgmma")),
    ("compiled glue (Inductor)", ("triton_poi", "triton_red", "triton_per", "triton_tem")),
    ("norms", ("layer_norm", "layernorm", "rms_norm", "group_norm")),
    ("copies, gathers, concatenation", ("copy", "cat", "gather", "scatter", "index", "memcpy", "memset")),
)
OTHER_KIND = "other (elementwise, reductions)"


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in low for m in marks)), OTHER_KIND)


def time_by_kind(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Own device time summed per kind of kernel, largest first, with its share of the step. Only the kernels count:
    an ATen operator or autograd node reports as its own device time that of the kernels it launched, which are
    rows of their own."""
    totals: dict[str, float] = {}
    for r in rows:
        if r.get("kernel") and r["self_time_ms"] > 0:
            kind = kernel_kind(r["operator"])
            totals[kind] = totals.get(kind, 0.0) + r["self_time_ms"]
    whole = sum(totals.values()) or 1.0
    return [{"kind": k, "self_time_ms": t, "share": t / whole}
            for k, t in sorted(totals.items(), key=lambda kv: kv[1], reverse=True)]


def top_operators(averages: Any, on_cuda: bool, top: int = TOP) -> dict[str, Any]:
    """The `top` operators by own time and by own memory from `profile.key_averages()`."""
    rows = []
    for a in averages:
        if not _is_operator(a.key):
            continue
        device_us = getattr(a, "self_device_time_total", None) if on_cuda else None
        memory = getattr(a, "self_device_memory_usage", 0) if on_cuda else getattr(a, "self_cpu_memory_usage", 0)
        rows.append({"operator": a.key, "calls": int(a.count), "kernel": is_kernel(a),
                     "self_time_ms": (device_us if device_us is not None else a.self_cpu_time_total) / 1e3,
                     "self_memory_bytes": int(memory or 0)})
    by_time = sorted(rows, key=lambda r: r["self_time_ms"], reverse=True)[:top]
    by_memory = sorted(rows, key=lambda r: r["self_memory_bytes"], reverse=True)[:top]
    # the kinds are of GPU kernels: a CPU clock's operators are ATen calls, which they would not sort
    kinds = time_by_kind(rows) if on_cuda else []
    return {"clock": "device" if on_cuda else "cpu", "by_kind": kinds, "by_time": by_time, "by_memory": by_memory}


def kind_table(by_kind: list[dict[str, Any]], title: str) -> list[str]:
    """Markdown lines of the device time by kind of kernel, headed by `title` with the total."""
    total = sum(k["self_time_ms"] for k in by_kind)
    lines = [f"{title} ({total:.1f} ms in all)", "", "| kind | own time ms | share |", "|---|---|---|"]
    lines += [f"| {k['kind']} | {k['self_time_ms']:.1f} | {100 * k['share']:.1f} % |" for k in by_kind]
    return lines + [""]


def write_top(top: dict[str, Any], out: Path) -> None:
    (out / "trace_top.json").write_text(json.dumps(top, indent=1))
    lines = ["# Top operators of the traced step", ""]
    if top.get("by_kind"):
        lines += kind_table(top["by_kind"], "## Device time by kind of kernel")
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
