"""benchmarks/stage_chain.py's results file: the merging of a chain run in parts into one file, and the table it
prints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def merged(out: Path, result: dict[str, Any]) -> dict[str, Any]:
    """`result` with the rows of `out`'s earlier run on the same machine kind that this run did not redo: a chain
    too long for one lease of the machine runs in parts (e.g. --durations 3 9 18, then 30 63) into one file. Each
    row names the commit and overrides it ran at."""
    try:
        old = json.loads(out.read_text()) if out.is_file() else {}
    except ValueError:
        old = {}
    same = all(old.get(k) == result[k] for k in ("benchmark", "device", "gpus", "preset"))
    if not same:
        return result
    run = {k: old.get(k) for k in ("git_commit", "overrides")}
    # a stage is its length and config: a run of another config set (--configs) at the same length adds a row
    redone = {(r["duration_s"], r.get("config")) for r in result["stages"]}
    # a sampled length's layouts are compared with this run's one-process latents: an earlier run's go with them
    resampled = {s["duration_s"] for s in result["samples"]}
    stages = [{**run, **r} for r in old.get("stages", [])
              if (r["duration_s"], r.get("config")) not in redone] + result["stages"]
    samples = [{**run, **s} for s in old.get("samples", []) if s["duration_s"] not in resampled]
    stages.sort(key=lambda r: (r["duration_s"], r.get("config") or ""))
    return {**result, "stages": stages, "samples": samples + result["samples"]}


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['device']}, torch {result['torch']}, {result['gpus']} GPU(s), {result['preset']}, "
          f"{result['steps_per_stage']} steps per stage")
    print(f"{'stage':>6} {'s/step':>8} {'alloc GiB':>9} {'resv GiB':>9} {'smi GiB':>8} {'host GiB':>8} "
          f"{'ckpt GiB':>8} {'save s':>7} {'plan resv':>9} {'plan host':>9} {'plan s':>7}  notes")
    for r in result["stages"]:
        if "error" in r:
            cap = f" under the planner's cap {r['cap_gib']:.1f} GiB" if "cap_gib" in r else ""
            print(f"{r['duration_s']:>5}s  failed{cap} (exit {r['exit_code']}): {r['error']}")
            continue
        notes = [f"under the planner's cap {r['cap_gib']:.1f} GiB"] if "cap_gib" in r else []
        if "killed_after_step" in r:
            notes.append(f"kill -9 of {r['killed']} in step {r['killed_after_step'] + 1}: launch exited in "
                         f"{r['launch_exit_s']:.0f} s, resumed, each step once: {r['resumed_steps_once']}")
        last = (r.get("time_by_step") or [{}])[-1]
        if "optimizer_s" in last:  # the last step's time beside the model's forward and backward
            notes.append(f"step {last['step']}: {last['step_s']:.1f} s, of it data {last['data_s']:.2f}, optimizer "
                         f"{last['optimizer_s']:.2f}, EMA {last['ema_s']:.2f}")
        if "reshard" in r:
            rs = r["reshard"]
            notes.append(f"resumed on {rs['gpus']} GPU(s): " + (f"failed: {rs['error']}" if "error" in rs else
                                                                f"step {rs['steps'][-1]} {rs['step_s']:.1f} s"))
        smi = f"{max(r['peak_gpu_used_gib']):>8.1f}" if r["peak_gpu_used_gib"] else f"{'-':>8}"
        step = f"{r['median_step_s']:>8.2f}" if r["median_step_s"] is not None else f"{'-':>8}"
        # "-" where the planner has no step time for this GPU (an H200 row keeps the H100 figure as h100_step_s)
        plan_s = f"{r['predicted_step_s']:>7.1f}" if r.get("predicted_step_s") is not None else f"{'-':>7}"
        print(f"{r['duration_s']:>5}s {step} {r['peak_allocated_gib']:>9.1f} "
              f"{r['peak_reserved_gib']:>9.1f} {smi} {r['peak_host_gib']:>8.1f} {r['checkpoint_gib'] or 0:>8.2f} "
              f"{r['checkpoint_save_s'] or 0:>7.1f} {r.get('predicted_reserved_gib') or 0:>9.1f} "
              f"{r.get('predicted_host_gib') or 0:>9.1f} {plan_s}  {'; '.join(notes)}")
    for s in result["samples"]:
        diff = (f", latents vs one process: max |d| {s['max_abs_diff_vs_1']:.3g} ({s['max_rel_diff_vs_1']:.2%} "
                f"of the largest)" if "max_abs_diff_vs_1" in s else "")
        denoise = f" (denoising {s['denoise_s']:.1f} s)" if "denoise_s" in s else ""
        print(f"sample {s['duration_s']} s, layout {s['layout']} ({s['gpus']} GPU(s)): exit {s['exit_code']}, "
              f"{s['wall_s']:.0f} s{denoise}{diff}" + (f": {s['error']}" if "error" in s else ""))
