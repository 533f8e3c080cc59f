"""Issue 36's speed targets, all measured in one process per GPU: a table of figure, measured, target, met.

    PYTHONPATH=src python3 benchmarks/speed.py --quick --profile   # ~5-7 min of one H100 / H200: 63 s from 2 blocks
    PYTHONPATH=src python3 benchmarks/speed.py --parts sample63     # then the 63-s guided step over all 42 blocks
    PYTHONPATH=src python3 benchmarks/speed.py --parts train63      # and the 63-s training step: the full run
    PYTHONPATH=src python3 benchmarks/speed.py --parts train2       # the short training step at micro-batch 2
    PYTHONPATH=src python3 benchmarks/speed.py --preset tiny --device cpu --height 32 --width 48 --text-tokens 8 \
        --long 6 --timed-blocks 1                                   # CPU smoke run (tests/test_speed_benchmark.py)

(PYTHONPATH=src is not needed with the package installed.) Each part reuses the benchmark that owns it:
- train: the trainer's training step (forward + backward, no optimizer step; `benchmarks/model_step.py`'s build,
  step, timing and model-FLOPs count) at the short duration, TTT on and off, the inference forward of both, and
  diffusers' CogVideoXTransformer3DModel beside the TTT-off backbone on the same inputs
  (`benchmarks/diffusers_yardstick.py` through model_step's `run_yardstick`): TTT on / off, backbone vs diffusers
  (forward and training step), MFU.
- sample3 / sample63: one classifier-free-guided denoising step (`benchmarks/sample.py`'s `measure_duration`: batch 2,
  split into attention / TTT / rest), TTT on and off. At the long duration the step runs the first --timed-blocks
  of the 42 blocks and adds the mean block time for the rest (sample.py's extrapolation; exact up to noise, since
  every block has the same shapes): such figures are marked "extrapolated" in the table and the JSON.
- ttt63: one block's bidirectional TTT of the 63-s guided step alone (`benchmarks/ttt_sample_minibatch.py`'s
  `measure`; its two scans alone too), with the scan's kernel calls past the 32-bit limit run side by side (the
  default), in sequence (TTT_KERNEL_GROUPS=serial, the schedule before) and as one launch (TTT_KERNEL_GROUPS=one:
  the conditional and unconditional halves together).
- train63: the training step at the long duration, TTT on and off, whole blocks checkpointed with their inputs
  offloaded to host memory (`checkpointing.offload_activations`); one unwarmed step each (minutes per step, the first
  compile and autotuning included). With TTT it peaks at 113 GiB allocated (H200): it needs a card of more than
  80 GB; docs/training.md's 63-s setup for one 80 GB card checkpoints every sub-module as well.
- train2: the short training step at micro-batch 2 (`train.batch_size = 2`), TTT on and off, beside the targets
  (which are at one clip): the time per clip, the TTT on / off ratio and the MFU when two clips share a step.
The parts run by default: train, sample3, sample63, ttt63; --quick runs the long guided step over its first 2
blocks (--timed-blocks 2) instead of all 42. --profile adds a torch.profiler
breakdown (device time by kind of kernel: TTT scan, attention, matrix products, norms, copies, the rest; and the top
operators; `tttvideo.memory.profile.trace`) of the short training step, of the short guided step and of the long
guided step (its first --profile-blocks blocks), each with its commit, written beside the JSON as
speed_profile_<gpu>.json and .md.

The JSON (default benchmarks/results/speed_<gpu>.json, <gpu> from the device name: h100, h200, cpu) holds the
device, torch, Triton, git commit, every figure and each part's raw rows. A part run again replaces its own entries
and keeps the others' (so the full run can be three commands); the table is printed from all of them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tttvideo.memory.guard.allocator import use_tttv_allocator

# as `tttv` sets it: without it the 63-s guided step's profile, after the timed steps, failed for a 16 GiB block with
# 19 GiB reserved and unused (fragmentation)
use_tttv_allocator()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks this one reuses, run as a script or module
import model_step  # noqa: E402
import sample  # noqa: E402
import ttt_sample_minibatch  # noqa: E402

from tttvideo.config.loader import load_config  # noqa: E402
from tttvideo.dtypes import torch_dtype  # noqa: E402
from tttvideo.layout import VideoLayout  # noqa: E402
from tttvideo.models import build_model  # noqa: E402
from tttvideo.models.backbone import get_preset  # noqa: E402
from tttvideo.results import save_json, save_text  # noqa: E402
from tttvideo.train.distributed import TrainRanks  # noqa: E402

PARTS = ("train", "sample3", "sample63", "ttt63", "train63", "train2")
QUICK_PARTS = ("train", "sample3", "sample63", "ttt63")
# figure -> (what it is, target, "<=" or ">=")
TARGETS: dict[str, tuple[str, float, str]] = {
    "sample_long_ttt_step_s": ("guided sampling step, long, TTT on (s)", 30.0, "<="),
    "sample_long_video_min": ("a long video's sample.steps guided steps, TTT on (min)", 25.0, "<="),
    "train_ratio_short": ("training step TTT on / off, short", 1.4, "<="),
    "train_ratio_long": ("training step TTT on / off, long", 1.4, "<="),
    "sample_ratio_short": ("guided sampling step TTT on / off, short", 1.3, "<="),
    "sample_ratio_long": ("guided sampling step TTT on / off, long", 1.3, "<="),
    "backbone_forward_vs_diffusers": ("backbone vs diffusers: forward (x faster), short", 1.5, ">="),
    "backbone_train_vs_diffusers": ("backbone vs diffusers: training step (x faster), short", 1.5, ">="),
    "mfu_ttt_short": ("MFU of the training step with TTT, short", 0.40, ">="),
    "mfu_ttt_long": ("MFU of the training step with TTT, long", 0.40, ">="),
}
# figures reported beside the targets
INFO = {
    "train_ttt_short_s": "training step, short, TTT on (s)",
    "train_off_short_s": "training step, short, TTT off (s)",
    "mfu_off_short": "MFU of the training step without TTT, short",
    "sample_short_ttt_step_s": "guided sampling step, short, TTT on (s)",
    "sample_short_off_step_s": "guided sampling step, short, TTT off (s)",
    "sample_long_off_step_s": "guided sampling step, long, TTT off (s)",
    "sample_long_ttt_part_s": "guided sampling step, long: its TTT modules (s)",
    "ttt63_block_ms": "one block's TTT at the long guided step, parts side by side (ms)",
    "ttt63_scans_ms": "of which its two scans alone (ms)",
    "ttt63_block_serial_ms": "the same, parts in sequence (TTT_KERNEL_GROUPS=serial) (ms)",
    "ttt63_block_one_ms": "the same, the whole batch as one launch (TTT_KERNEL_GROUPS=one) (ms)",
    "train_ttt_long_s": "training step, long, TTT on (s)",
    "train_off_long_s": "training step, long, TTT off (s)",
    "train_ttt_short_b2_clip_s": "training step, short, micro-batch 2, TTT on, per clip (s)",
    "train_off_short_b2_clip_s": "training step, short, micro-batch 2, TTT off, per clip (s)",
    "train_ratio_short_b2": "training step TTT on / off, short, micro-batch 2",
    "mfu_ttt_short_b2": "MFU of the training step with TTT, short, micro-batch 2",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the long guided step from --timed-blocks 2 of its blocks "
                                                         "(extrapolated to all)")
    ap.add_argument("--parts", default=None,
                    help=f"comma-separated, of {','.join(PARTS)} (default: {','.join(QUICK_PARTS)})")
    ap.add_argument("--profile", action="store_true", help="per-op breakdown of the short training step and the "
                                                           "long guided step")
    ap.add_argument("--profile-blocks", type=int, default=2, help="blocks of the long guided step profiled")
    ap.add_argument("--preset", default="cogvideox-5b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=model_step.DTYPES, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=720)
    ap.add_argument("--text-tokens", type=int, default=0, help="0: the original's length per duration")
    ap.add_argument("--short", type=int, default=3, help="the short duration (s)")
    ap.add_argument("--long", type=int, default=63, help="the long duration (s)")
    ap.add_argument("--timed-blocks", type=int, default=0,
                    help="blocks run of the long guided step (0: all; --quick: 2), the rest extrapolated")
    ap.add_argument("--steps", type=int, default=2, help="timed training steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed training steps first (the short duration)")
    ap.add_argument("--repeats", type=int, default=1, help="timed guided steps (after one warm-up)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config key for every model of the run")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/speed_<gpu>.json)")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    args.parts = args.parts.split(",") if args.parts else list(QUICK_PARTS)
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown {', '.join(unknown)}; use {', '.join(PARTS)}")
    if args.quick:
        args.timed_blocks = args.timed_blocks or 2
    return args


# ------------------------------------------------------------------------------------------------- helpers
def free(device: torch.device) -> None:
    """The last case's GPU memory back before the next one builds (a model held by a cycle, too)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def train_args(args: argparse.Namespace, duration: int, ttt: bool, extra: list[str], steps: int,
               warmup: int, yardstick: bool) -> argparse.Namespace:
    """model_step's arguments for one training case."""
    argv = ["--preset", args.preset, "--device", args.device, "--dtype", args.dtype, "--height", str(args.height),
            "--width", str(args.width), "--text-tokens", str(args.text_tokens), "--durations", str(duration),
            "--steps", str(steps), "--warmup", str(warmup), "--forward", "--budget-s", "100000",
            "--set", f"model.use_ttt={str(ttt).lower()}", *sum((["--set", o] for o in [*args.overrides, *extra]), [])]
    if yardstick:
        argv += ["--yardstick", "diffusers"]
    return model_step.parse_args(argv)


def train_case(args, device, duration: int, ttt: bool, extra=(), steps=None, warmup=None, yardstick=False,
               profile_out: dict | None = None) -> dict[str, Any]:
    """One training row (model_step's run_case, with its fallback to the reference scan), the yardstick beside it,
    and with `profile_out` a profiled step of the same model stored there."""
    margs = train_args(args, duration, ttt, list(extra), steps or args.steps,
                       args.warmup if warmup is None else warmup, yardstick)
    cfg = model_step.bench_config(margs)
    ranks = TrainRanks.start(cfg, get_preset(cfg.model.preset).num_attention_heads, device)
    calls = model_step.count_reference_calls()
    model, build_s, _ = model_step.build(cfg, device)
    layout = VideoLayout.from_config(cfg.layout, cfg.ttt, duration)
    deadline = time.perf_counter() + 100000
    row, failure = model_step.run_duration(cfg, model, layout, margs, device, deadline, ranks)
    row["build_s"] = build_s
    row["ttt_backend"] = "reference" if calls[0] else f"triton ({cfg.ttt.backend})"
    if failure:
        row["fast_path_failure"] = failure
    if yardstick and "median_step_s" in row:
        try:
            row["yardstick"] = model_step.run_yardstick(cfg, model, layout, row, margs, device, deadline, ranks)
        except ImportError as err:  # diffusers missing: the other figures still count
            row["yardstick"] = {"error": f"diffusers not importable: {err}"}
    if profile_out is not None and "median_step_s" in row:
        step = model_step.make_step(cfg, model, device, layout, ranks)
        batch = model_step.random_batch(model, layout, torch_dtype(cfg.model.dtype), device)

        def one_step() -> None:
            step.optimizer.zero_grad(set_to_none=True)
            step.gradients(iter((batch,)), 0)

        profile_out.update(profiled(one_step, device, f"training step, {duration} s, TTT {'on' if ttt else 'off'}"))
        step.optimizer.zero_grad(set_to_none=True)
        del step
    print(json.dumps({k: v for k, v in row.items() if k not in ("layout", "flops")}), flush=True)
    del model
    free(device)
    return row


def profiled(call, device: torch.device, what: str) -> dict[str, Any]:
    """torch.profiler over one call (after the caller's warm-up): device time by kind of kernel and the top
    operators, as `tttv profile --trace` reports them."""
    from tttvideo.memory.profile.trace import top_operators

    on_cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    call()  # warm-up: kernels compiled, allocator settled
    model_step.sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        call()
        model_step.sync(device)
    top = top_operators(prof.key_averages(), on_cuda, top=20)
    top.pop("by_memory", None)  # not recorded (profile_memory off: it slows the step)
    return {"what": what, "git_commit": model_step.git_commit(), **top}


def train_part(args, device, result: dict) -> None:
    short = args.short
    profile = {} if args.profile else None
    on = train_case(args, device, short, True, profile_out=profile)
    off = train_case(args, device, short, False, yardstick=True)
    figures = {"train_ttt_short_s": on.get("median_step_s"), "train_off_short_s": off.get("median_step_s"),
               "mfu_ttt_short": on.get("mfu"), "mfu_off_short": off.get("mfu")}
    if on.get("median_step_s") and off.get("median_step_s"):
        figures["train_ratio_short"] = on["median_step_s"] / off["median_step_s"]
    vs = off.get("yardstick", {}).get("vs_ours", {})
    figures["backbone_forward_vs_diffusers"] = vs.get("forward")
    figures["backbone_train_vs_diffusers"] = vs.get("train_step")
    result["parts"]["train"] = {"rows": {"ttt": on, "off": off}, "figures": figures, "git_commit": result["git_commit"]}
    if profile:
        result.setdefault("profile", {})["train_short"] = profile


def train_batch2_part(args, device, result: dict) -> None:
    """The short training step at micro-batch 2 (`train.batch_size = 2`), TTT on and off: two clips double the
    scan's streams (96 at 48 heads) as well as the rest of the step's work; the figures are per clip."""
    clips = 2
    extra = [f"train.batch_size={clips}"]
    on = train_case(args, device, args.short, True, extra)
    off = train_case(args, device, args.short, False, extra)
    figures = {"train_ttt_short_b2_clip_s": on["median_step_s"] / clips if on.get("median_step_s") else None,
               "train_off_short_b2_clip_s": off["median_step_s"] / clips if off.get("median_step_s") else None,
               "mfu_ttt_short_b2": on.get("mfu")}
    if on.get("median_step_s") and off.get("median_step_s"):
        figures["train_ratio_short_b2"] = on["median_step_s"] / off["median_step_s"]
    result["parts"]["train2"] = {"rows": {"ttt": on, "off": off}, "figures": figures, "overrides": extra,
                                 "git_commit": result["git_commit"]}


def train_long_part(args, device, result: dict) -> None:
    """The long training step, whole blocks checkpointed and their inputs offloaded, one unwarmed step."""
    extra = ["checkpointing.offload_activations=true"] if device.type == "cuda" else []
    on = train_case(args, device, args.long, True, extra, steps=1, warmup=0)
    off = train_case(args, device, args.long, False, extra, steps=1, warmup=0)
    figures = {"train_ttt_long_s": on.get("median_step_s"), "train_off_long_s": off.get("median_step_s"),
               "mfu_ttt_long": on.get("mfu")}
    if on.get("median_step_s") and off.get("median_step_s"):
        figures["train_ratio_long"] = on["median_step_s"] / off["median_step_s"]
    result["parts"]["train63"] = {"rows": {"ttt": on, "off": off}, "figures": figures, "overrides": extra,
                                  "note": "one unwarmed step each (first-step compile and autotuning included)",
                                  "git_commit": result["git_commit"]}


def sample_model(args, device):
    sargs = sample.parse_args(["--preset", args.preset, "--dtype", args.dtype, "--height", str(args.height),
                               "--width", str(args.width), "--text-tokens", str(args.text_tokens),
                               "--device", args.device, "--repeats", str(args.repeats),
                               # with blocks left out at the long duration, sample.py checks the extrapolation
                               # against the full short step; with all blocks run there is nothing to check
                               "--full-until", str(args.short if args.timed_blocks else 10**6),
                               "--timed-blocks", str(args.timed_blocks or 10**6), "--offload-check", "",
                               *sum((["--set", o] for o in args.overrides), [])])
    cfg = sample.benchmark_config(sargs)
    torch.manual_seed(0)
    model = build_model(cfg, device=device).eval().requires_grad_(False)
    return sargs, cfg, model


def sample_part(args, device, result: dict, durations: list[str]) -> None:
    """Guided steps TTT on and off at each of `durations` ("short", "long") with one model; the long step's profile
    over its timed blocks with --profile."""
    sargs, cfg, model = sample_model(args, device)
    dtype = torch_dtype(args.dtype)
    for which in durations:
        seconds = args.short if which == "short" else args.long
        layout = VideoLayout.from_config(cfg.layout, cfg.ttt, f"{seconds}s", phase="sample")
        runs = {}
        for ttt in (True, False):
            runs["ttt" if ttt else "off"] = r = sample.measure_duration(model, layout, sargs, device, dtype, ttt, True)
            print(json.dumps(r), flush=True)
            free(device)
        on, off = runs["ttt"], runs["off"]
        figures = {f"sample_{which}_ttt_step_s": on.get("step_s"), f"sample_{which}_off_step_s": off.get("step_s"),
                   f"sample_{which}_ttt_part_s": on.get("ttt_s")}
        if on.get("step_s") and off.get("step_s"):
            figures[f"sample_ratio_{which}"] = on["step_s"] / off["step_s"]
        if which == "long" and on.get("step_s"):
            # every step counted as guided: where the guidance ramp starts at 1 its first step runs one pass, so
            # this is high by about half a step
            figures["sample_long_video_min"] = cfg.sample.steps * on["step_s"] / 60
        extrapolated = [k for k, r in runs.items() if r.get("blocks_timed", 0) < r.get("blocks_total", 0)]
        result["parts"]["sample3" if which == "short" else "sample63"] = {
            "rows": runs, "figures": figures, "git_commit": result["git_commit"],
            "extrapolated": {k: f"{runs[k]['blocks_timed']} of {runs[k]['blocks_total']} blocks run"
                             for k in extrapolated}}
        if args.profile:  # the long step over its first --profile-blocks blocks, the short one whole
            free(device)
            blocks = args.profile_blocks if which == "long" else len(model.blocks)
            result.setdefault("profile", {})[f"sample_{which}"] = profile_guided(model, layout, blocks, device, dtype)
    del model
    free(device)


def profile_guided(model, layout, blocks: int, device, dtype) -> dict[str, Any]:
    """The guided step over its first `blocks` blocks (every block has the same shapes: the per-block kinds of
    kernel are those of the whole step, less the embeddings and the head)."""
    x, text, uncond = sample.step_inputs(model.spec, layout, device, dtype, seed=0)
    n = len(model.blocks)
    k = min(blocks, n)
    saved = model.block_units
    model.block_units = [(i, i + 1, False) for i in range(k)]
    try:
        with torch.no_grad():
            return profiled(lambda: sample.guided_step(model, layout, x, text, uncond, True), device,
                            f"guided sampling step, {layout.duration_s} s, TTT on, {k} of {n} blocks")
    finally:
        model.block_units = saved


def ttt_long_part(args, device, result: dict) -> None:
    """One block's bidirectional TTT at the long guided step, kernel parts side by side and in sequence."""
    spec = get_preset(args.preset)
    targs = ttt_sample_minibatch.parse_args(["--kinds", "mlp", "--durations", f"{args.long}s", "--mini-batches", "0",
                                             "--dim", str(spec.num_attention_heads * spec.attention_head_dim),
                                             "--heads", str(spec.num_attention_heads),
                                             "--height", str(args.height), "--width", str(args.width),
                                             "--text-tokens", str(args.text_tokens),
                                             "--layers", str(spec.num_layers), "--device", args.device, "--reps", "3"])
    dtype = torch_dtype(args.dtype)
    mini_batch = load_config(None, args.overrides).ttt.sample_mini_batch()
    rows = {}
    previous = os.environ.get("TTT_KERNEL_GROUPS")
    try:
        for schedule in ("concurrent", "serial", "one"):
            os.environ["TTT_KERNEL_GROUPS"] = schedule
            rows[schedule] = ttt_sample_minibatch.measure(targs, "mlp", f"{args.long}s", mini_batch, device, dtype)
            print(json.dumps({"schedule": schedule, **rows[schedule]}), flush=True)
            free(device)
    finally:
        if previous is None:
            os.environ.pop("TTT_KERNEL_GROUPS", None)
        else:
            os.environ["TTT_KERNEL_GROUPS"] = previous
    result["parts"]["ttt63"] = {"rows": rows, "git_commit": result["git_commit"], "figures": {
        "ttt63_block_ms": rows["concurrent"].get("block_ms"), "ttt63_scans_ms": rows["concurrent"].get("scans_ms"),
        "ttt63_block_serial_ms": rows["serial"].get("block_ms"), "ttt63_block_one_ms": rows["one"].get("block_ms")}}


# ------------------------------------------------------------------------------------------------- output
def figures(result: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in result["parts"].values():
        out.update({k: v for k, v in part["figures"].items() if v is not None})
    return out


def extrapolated_figures(result: dict) -> set[str]:
    marked = set()
    for name in ("sample3", "sample63"):
        part = result["parts"].get(name, {})
        which = "short" if name == "sample3" else "long"
        if "ttt" in part.get("extrapolated", {}):
            marked |= {f"sample_{which}_ttt_step_s", f"sample_{which}_ttt_part_s", f"sample_ratio_{which}"}
            if which == "long":
                marked.add("sample_long_video_min")
        if "off" in part.get("extrapolated", {}):
            marked |= {f"sample_{which}_off_step_s", f"sample_ratio_{which}"}
    return marked


def target_rows(result: dict) -> list[dict[str, Any]]:
    figs, marked = figures(result), extrapolated_figures(result)
    rows = []
    for key, (what, target, sense) in TARGETS.items():
        value = figs.get(key)
        met = None if value is None else (value <= target if sense == "<=" else value >= target)
        rows.append({"figure": key, "what": what, "measured": value, "target": f"{sense} {target:g}", "met": met,
                     "extrapolated": key in marked})
    return rows


def fmt(value: Any) -> str:
    if value is None:
        return "not run"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def print_tables(result: dict) -> None:
    print(f"\nspeed targets (issue 36) on {result['device']}, torch {result['torch']}, commit {result['git_commit']}; "
          f"short = {result['short_s']} s, long = {result['long_s']} s")
    print(f"{'figure':<58} {'measured':>10} {'target':>8} {'met':>5}")
    for r in result["targets"]:
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        mark = " (extrapolated)" if r["extrapolated"] else ""
        print(f"{r['what']:<58} {fmt(r['measured']):>10} {r['target']:>8} {met:>5}{mark}")
    figs, marked = figures(result), extrapolated_figures(result)
    print("\nbeside them")
    for key, what in INFO.items():
        if key in figs:
            print(f"{what:<72} {fmt(figs[key]):>10}{' (extrapolated)' if key in marked else ''}")
    for name, part in result["parts"].items():
        if "error" in part:
            print(f"  part {name} failed: {part['error']}")
        for k, how in part.get("extrapolated", {}).items():
            print(f"  {name} TTT {'on' if k == 'ttt' else 'off'}: {how}, the rest at the timed blocks' mean")
        for k, row in part.get("rows", {}).items():
            counts = row.get("allocator_per_step") if isinstance(row, dict) else None
            if counts and (counts.get("num_alloc_retries") or counts.get("num_sync_all_streams")):
                print(f"  {name} {k}: the allocator stalled the step: "
                      + ", ".join(f"{c} {v:g}" for c, v in counts.items()) + " a step")


def profile_markdown(profile: dict) -> str:
    from tttvideo.memory.profile.trace import kind_table

    lines = ["# Where the time goes (benchmarks/speed.py --profile)", ""]
    for entry in profile.values():
        commit = f" (commit {entry['git_commit']})" if entry.get("git_commit") else ""
        lines += [f"## {entry['what']}{commit}", ""]
        if entry.get("by_kind"):
            lines += kind_table(entry["by_kind"], "device time by kind of kernel")
        lines += [f"top operators by own {entry['clock']} time", "", "| operator | calls | ms |", "|---|---|---|"]
        lines += [f"| `{r['operator'][:90]}` | {r['calls']} | {r['self_time_ms']:.2f} |" for r in entry["by_time"]]
        lines.append("")
    return "\n".join(lines)


def write(result: dict, path: Path) -> None:
    """The JSON, and the profile beside it as JSON and markdown (`tttvideo.results`: atomic, copied to $OUT)."""
    profile = result.get("profile")
    save_json(path, {k: v for k, v in result.items() if k != "profile"})
    if profile:
        save_json(profile_path(path).with_suffix(".json"), profile)
        save_text(profile_path(path).with_suffix(".md"), profile_markdown(profile))


def profile_path(path: Path) -> Path:
    """speed_profile_<gpu> beside speed_<gpu>.json (without suffix)."""
    name = path.stem
    return path.with_name(name.replace("speed_", "speed_profile_", 1) if name.startswith("speed_") else
                          f"profile_{name}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    path = Path(args.out or f"benchmarks/results/speed_{model_step.card_tag(device)}.json")
    env = sample.environment(device)
    result: dict[str, Any] = {"benchmark": "speed", "device": env["device"], "torch": env["torch"],
                              "triton": env["triton"], "cuda": torch.version.cuda, "git_commit": env["git_commit"],
                              "preset": args.preset, "dtype": args.dtype, "short_s": args.short, "long_s": args.long,
                              "parts": {}}
    if path.exists():  # keep the parts this run does not measure
        old = json.loads(path.read_text())
        if (old.get("device"), old.get("preset"), old.get("short_s"), old.get("long_s")) == \
                (result["device"], args.preset, args.short, args.long):
            result["parts"] = {k: v for k, v in old.get("parts", {}).items() if k not in args.parts}
    if args.profile:
        result["profile"] = {}
        old = profile_path(path).with_suffix(".json")
        if old.exists() and result["parts"]:  # the same device's earlier parts are kept: so is their profile
            result["profile"] = json.loads(old.read_text())
    started = time.perf_counter()
    sampled = [w for w, p in (("short", "sample3"), ("long", "sample63")) if p in args.parts]
    steps = [("train", lambda: train_part(args, device, result)),
             ("sample", lambda: sample_part(args, device, result, sampled) if sampled else None),
             ("ttt63", lambda: ttt_long_part(args, device, result)),
             ("train63", lambda: train_long_part(args, device, result)),
             ("train2", lambda: train_batch2_part(args, device, result))]
    for name, run in steps:
        if name in args.parts or (name == "sample" and sampled):
            t0 = time.perf_counter()
            try:
                run()
            except Exception as err:  # noqa: BLE001 - a part that fails must not cost the other parts' device time
                failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500]
                print(f"part {name} failed: {failed}", flush=True)
                for part in (["sample3", "sample63"] if name == "sample" else [name]):
                    if part in args.parts and part not in result["parts"]:
                        result["parts"][part] = {"error": failed, "figures": {}, "git_commit": result["git_commit"]}
                free(device)
            result.setdefault("part_s", {})[name] = time.perf_counter() - t0  # wall time, for planning GPU runs
            write(result, path)
    result["targets"] = target_rows(result)
    result["figures"] = figures(result)
    result["run_s"] = time.perf_counter() - started
    result["command"] = "python3 benchmarks/speed.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write(result, path)
    print_tables(result)
    print(f"\nwrote {path}" + (" and its profile" if result.get("profile") else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
