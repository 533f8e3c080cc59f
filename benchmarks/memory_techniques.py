"""What bounding the saved block inputs costs: one 5B training step (TTT-MLP, qkvo, every block and sub-module
checkpointed, 8-bit AdamW) with the block inputs kept on the GPU, nested-checkpointed (checkpointing.nested_span) or
offloaded to the host pool (checkpointing.offload_activations), in one process on one model, each after a warm-up
step of its own. Prints seconds per step, peak allocated / reserved GPU memory, host memory and the time ratio to
keeping the inputs; writes benchmarks/results/memory_techniques_<gpu>.json.

    PYTHONPATH=src python3 benchmarks/memory_techniques.py --duration 9      # one H100 or H200
    PYTHONPATH=src python3 benchmarks/memory_techniques.py --preset tiny --device cpu --dtype fp32 --height 64 \
        --width 96 --text-tokens 8 --duration 3 --out /tmp/x.json            # a CPU smoke run of the same code
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import resource
import time

from tttvideo.memory.guard.allocator import use_tttv_allocator

# the allocator `tttv train` runs with, so the reserved peaks are the trainer's; set before CUDA starts
use_tttv_allocator()

import model_step  # this script's folder is on sys.path when it runs: the trainer's model and step, shared
import torch

from tttvideo.layout import VideoLayout
from tttvideo.models.backbone import get_preset
from tttvideo.train.distributed import TrainRanks

VARIANTS = {"kept": {}, "nested": {"nested_span": 6}, "offloaded": {"offload_activations": True}}
SWITCHES = ["checkpointing.attention=true", "checkpointing.forward_ttt=true", "checkpointing.reverse_ttt=true",
            "checkpointing.mlp=true", "train.optimizer=adamw8bit"]


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
        model.nested_span = variant.get("nested_span", 0)
        cfg.checkpointing.offload_activations = variant.get("offload_activations", False)
        step = model_step.make_step(cfg, model, device, layout, ranks)
        times = []
        for i in range(2):  # a warm-up step, then the timed one
            if i == 1 and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            model_step.sync(device)
            start = time.perf_counter()
            step(iter((batch,)), i)
            model_step.sync(device)
            times.append(time.perf_counter() - start)
        row = {"variant": name, "step_s": times[1], "warmup_s": times[0],
               "peak_host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
               "offloaded_gib": step.offloaded_bytes / 2**30}
        if device.type == "cuda":
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        rows.append(row)
        step.optimizer.zero_grad(set_to_none=True)
        del step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = next((r["step_s"] for r in rows if r["variant"] == "kept"), None)
    result = {"benchmark": "memory_techniques", "device": model_step.device_name(device), "torch": torch.__version__,
              "python": platform.python_version(), "git_commit": args.commit, "gpus": 1, "use_ttt": True,
              "preset": args.preset, "duration_s": args.duration, "tokens": layout.total_tokens, "switches": SWITCHES,
              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "results": rows}
    out = args.out or f"benchmarks/results/memory_techniques_{_gpu(result['device'])}.json"
    model_step.write_result(result, out)
    print(f"\n{result['device']}, torch {torch.__version__}, {args.preset} at {args.duration} s "
          f"({layout.total_tokens} tokens), {', '.join(SWITCHES)}")
    print(f"{'block inputs':>12} {'step s':>8} {'vs kept':>8} {'alloc GiB':>9} {'resv GiB':>9} {'host GiB':>8}")
    for r in rows:
        ratio = f"{r['step_s'] / base:.2f}x" if base else "-"
        print(f"{r['variant']:>12} {r['step_s']:>8.2f} {ratio:>8} {r.get('peak_allocated_gib', 0):>9.1f} "
              f"{r.get('peak_reserved_gib', 0):>9.1f} {r['peak_host_gib']:>8.1f}")
    return 0


def _gpu(name: str) -> str:
    return "h200" if "H200" in name else "h100" if "H100" in name else "cpu"


if __name__ == "__main__":
    raise SystemExit(main())
