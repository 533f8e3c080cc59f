"""What bounding the saved block inputs costs: one 5B training step (TTT-MLP, qkvo, every block and sub-module
checkpointed, 8-bit AdamW) with the block inputs kept on the GPU, nested-checkpointed (checkpointing.nested_span) or
offloaded to the host pool (checkpointing.offload_activations), in one process on one model, each after a warm-up
step of its own. Prints seconds per step, peak allocated / reserved GPU memory, host memory and the time ratio to
keeping the inputs (or, without that variant, to the first one run); writes
benchmarks/results/memory_techniques_<gpu>.json.

The `offloaded-*` variants also stop checkpointing some of a block's parts (the block itself stays checkpointed, its
input offloaded): their outputs are then kept while that block's backward runs instead of recomputed a second time,
which is what the sub-module checkpoints cost. `offloaded-attn`: attention's part runs unchecked;
`offloaded-attn-mlp`: attention and the MLP; `offloaded-block`: none of the four parts (whole-block checkpointing);
`kept-block`: whole blocks with their inputs kept on the GPU.
A variant that runs out of memory is a row with its error. `--merge` keeps the rows of variants not run now from the
existing output file (same duration), each row naming its commit.

    PYTHONPATH=src python3 benchmarks/memory_techniques.py --duration 9      # one H100 or H200
    PYTHONPATH=src python3 benchmarks/memory_techniques.py --preset tiny --device cpu --dtype fp32 --height 64 \
        --width 96 --text-tokens 8 --duration 3 --out /tmp/x.json            # a CPU smoke run of the same code
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

from tttvideo.memory.guard.allocator import use_tttv_allocator

# the allocator `tttv train` runs with, so the reserved peaks are the trainer's; set before CUDA starts
use_tttv_allocator()

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks, run as a script or with -m
import model_step  # noqa: E402 - the trainer's model and step, shared
import torch

from tttvideo.config.schema import CHECKPOINT_PARTS, Config
from tttvideo.layout import VideoLayout
from tttvideo.models.backbone import get_preset
from tttvideo.models.checkpointing import apply_checkpointing
from tttvideo.results import save_json
from tttvideo.train.distributed import TrainRanks

OFFLOADED = {"offload_activations": True}
VARIANTS = {
    "kept": {}, "nested": {"nested_span": 6}, "offloaded": OFFLOADED,
    # the block's parts left unchecked (their outputs kept through the block's backward instead of recomputed)
    "offloaded-attn": {**OFFLOADED, "unchecked": ("attention",)},
    "offloaded-attn-mlp": {**OFFLOADED, "unchecked": ("attention", "mlp")},
    "offloaded-block": {**OFFLOADED, "unchecked": CHECKPOINT_PARTS},
    "kept-block": {"unchecked": CHECKPOINT_PARTS},
}
SWITCHES = [*(f"checkpointing.{part}=true" for part in CHECKPOINT_PARTS), "train.optimizer=adamw8bit"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cogvideox-5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--duration", type=int, default=9)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=720)
    ap.add_argument("--text-tokens", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default="")
    ap.add_argument("--merge", action="store_true", help="keep the output file's rows of the variants not run now")
    args = ap.parse_args(argv)
    margs = model_step.parse_args(["--preset", args.preset, "--device", args.device, "--dtype", args.dtype,
                                   "--height", str(args.height), "--width", str(args.width),
                                   "--text-tokens", str(args.text_tokens), *sum((["--set", s] for s in SWITCHES), [])])
    cfg = model_step.bench_config(margs)
    device = torch.device(args.device)
    layout = VideoLayout.from_config(cfg.layout, cfg.ttt, f"{args.duration}s")
    model, _, _ = model_step.build(cfg, device)
    ranks = TrainRanks.start(cfg, get_preset(cfg.model.preset).num_attention_heads, device)
    batch = model_step.random_batch(model, layout, model.embed.patch.weight.dtype, device)
    rows = []
    for name in args.variants:
        variant = VARIANTS[name]
        cfg.checkpointing.nested_span = variant.get("nested_span", 0)
        cfg.checkpointing.offload_activations = variant.get("offload_activations", False)
        for part in CHECKPOINT_PARTS:
            setattr(cfg.checkpointing, part, part not in variant.get("unchecked", ()))
        apply_checkpointing(model, cfg.checkpointing)  # the part switches and nested_span
        rows.append(_run_variant(name, cfg, model, layout, ranks, batch, device, args.commit))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    device_label = model_step.device_name(device)
    out = args.out or f"benchmarks/results/memory_techniques_{model_step.card_tag(device)}.json"
    # the ratio's base: keeping the inputs, else the first variant, of this run (merged rows may be older code)
    timed = [r for r in rows if "step_s" in r]
    base = next((r for r in timed if r["variant"] == "kept"), timed[0] if timed else None)
    if args.merge:
        rows = _merged(out, rows, args.duration)
    result = {"benchmark": "memory_techniques", "device": device_label, "torch": torch.__version__,
              "python": platform.python_version(), "git_commit": args.commit, "gpus": 1, "use_ttt": True,
              "preset": args.preset, "duration_s": args.duration, "tokens": layout.total_tokens, "switches": SWITCHES,
              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "results": rows}
    save_json(out, result)
    print(f"\n{result['device']}, torch {torch.__version__}, {args.preset} at {args.duration} s "
          f"({layout.total_tokens} tokens), {', '.join(SWITCHES)}")
    print(f"time ratios against {base['variant'] if base else '-'} (this run)")
    print(f"{'variant':>18} {'step s':>8} {'ratio':>8} {'alloc GiB':>9} {'resv GiB':>9} {'host GiB':>8}  commit")
    for r in rows:
        if "step_s" not in r:
            print(f"{r['variant']:>18}  {r['error']}")
            continue
        ratio = f"{r['step_s'] / base['step_s']:.3f}x" if base else "-"
        print(f"{r['variant']:>18} {r['step_s']:>8.2f} {ratio:>8} {r.get('peak_allocated_gib', 0):>9.1f} "
              f"{r.get('peak_reserved_gib', 0):>9.1f} {r['peak_host_gib']:>8.1f}  {r.get('git_commit', '')}")
    return 0


def _run_variant(name: str, cfg: Config, model: torch.nn.Module, layout: VideoLayout, ranks: TrainRanks,
                 batch: dict[str, torch.Tensor], device: torch.device, commit: str) -> dict[str, Any]:
    """A warm-up step and a timed one of the trainer's step under the variant's settings (already applied)."""
    step = model_step.make_step(cfg, model, device, layout, ranks)
    row: dict[str, Any] = {"variant": name, "git_commit": commit,
                           "unchecked_parts": list(VARIANTS[name].get("unchecked", ()))}
    times = []
    try:
        for i in range(2):  # a warm-up step, then the timed one
            if i == 1 and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            model_step.sync(device)
            start = time.perf_counter()
            step(iter((batch,)), i)
            model_step.sync(device)
            times.append(time.perf_counter() - start)
    except torch.cuda.OutOfMemoryError as e:
        row["error"] = f"OOM in step {len(times) + 1}: {str(e).splitlines()[0]}"
    else:
        row.update(step_s=times[1], warmup_s=times[0], offloaded_gib=step.offloaded_bytes / 2**30)
    row["peak_host_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if device.type == "cuda":
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    step.optimizer.zero_grad(set_to_none=True)
    return row


def _merged(out: str, rows: list[dict[str, Any]], duration: int) -> list[dict[str, Any]]:
    """The existing file's rows of other variants (the same duration only), in VARIANTS order, with `rows`."""
    path = Path(out)
    if not path.exists():
        return rows
    old = json.loads(path.read_text())
    if old.get("duration_s") != duration:
        raise SystemExit(f"--merge: {out} holds {old.get('duration_s')} s rows, this run is at {duration} s; "
                         "use another --out or leave out --merge")
    fresh = {r["variant"] for r in rows}
    kept = [{"git_commit": old.get("git_commit", "unknown"), **r} for r in old["results"] if r["variant"] not in fresh]
    order = list(VARIANTS)
    return sorted(kept + rows, key=lambda r: order.index(r["variant"]) if r["variant"] in order else len(order))


if __name__ == "__main__":
    raise SystemExit(main())
