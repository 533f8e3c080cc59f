"""What one optimizer step costs for the trainable parameters of a CogVideoX-5B setup: AdamW against 8-bit AdamW
(torchao's, as `train.optimizer = "adamw8bit"` builds it), timed alone, without a forward or backward.

The planner's step time comes from two-step profiles of one micro-batch a step, so each measured step holds one
optimizer step; a config that accumulates (the stage configs: 64 micro-batches a step) pays it once per 64. This
measures that share by itself: per setup, the model is built on the meta device, only its trainable parameters are
made real (random, in the config's dtype) with random gradients, and `tttvideo.train.optim.build_optimizer` builds
the optimizer over them with the trainer's parameter groups. Warm-up steps first (torchao compiles one update per
parameter shape), then the median of the timed steps, each between two device synchronisations. The frozen weights
stay on the meta device, so a setup needs only its trainable parameters, their gradients and the optimizer state.
Run from the repository root:

    PYTHONPATH=src python3 benchmarks/optimizer_step.py --out benchmarks/results/optimizer_step_h100.json
    PYTHONPATH=src python3 benchmarks/optimizer_step.py --preset tiny --device cpu --out /tmp/opt.json  # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from tttvideo.config.loader import load_config
from tttvideo.memory.techniques import quantised_by_adamw8bit
from tttvideo.memory.profile.profiler import git_commit
from tttvideo.models import build_model
from tttvideo.results import save_json
from tttvideo.train.optim import build_optimizer
from tttvideo.train.step import synchronize

# (name, config): the trainable sets the configs train, at the dtypes they train them in
SETUPS = [
    ("lora, bf16", "configs/cogvideox-5b/24gb-3s.toml"),
    ("qkvo, bf16", "configs/cogvideox-5b/stage2-9s-1gpu.toml"),
    ("sft, bf16", "configs/cogvideox-5b/stage1-3s-1gpu.toml"),
]
OPTIMIZERS = {
    "adamw": ["train.optimizer=adamw", "train.bf16_stochastic_round=false"],
    "adamw8bit": ["train.optimizer=adamw8bit"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="", help="another model preset (tiny: the CPU smoke run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--setups", default=",".join(s[0].split(",")[0] for s in SETUPS),
                    help="comma-separated: " + ", ".join(s[0].split(",")[0] for s in SETUPS))
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--commit", default=git_commit())
    ap.add_argument("--out", default="benchmarks/results/optimizer_step.json")
    return ap.parse_args(argv)


def trainable_on(model: nn.Module, device: torch.device) -> list[nn.Parameter]:
    """Make `model`'s trainable parameters real on `device` (random, with random gradients), in place; the frozen
    ones stay where they were built (the meta device)."""
    made = []
    torch.manual_seed(0)
    for module in model.modules():
        for leaf, p in list(module.named_parameters(recurse=False)):
            if not p.requires_grad:
                continue
            real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device).normal_(0, 0.02))
            real.grad = torch.empty(p.shape, dtype=p.dtype, device=device).normal_(0, 1e-3)
            module._parameters[leaf] = real
            made.append(real)
    return made


def time_steps(optimizer: torch.optim.Optimizer, device: torch.device, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        optimizer.step()
    synchronize(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def measure(config: str, optimizer: str, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    preset = [f"model.preset={args.preset}"] if args.preset else []
    cfg = load_config(config, [*OPTIMIZERS[optimizer], *preset, 'model.pretrained_path=""',
                               "train.init_from="])
    model = build_model(cfg, device="meta")
    params = trainable_on(model, device)
    opt = build_optimizer(model, cfg.train)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = params[-1].detach().clone()
    times = time_steps(opt, device, args.warmup, args.steps)
    updated = not torch.equal(before, params[-1].detach())  # the steps timed did update (a check, not a figure)
    eligible = sum(quantised_by_adamw8bit(p.numel()) for p in params)
    row = {"optimizer": optimizer, "adapter": cfg.model.adapter, "dtype": str(params[0].dtype).split(".")[-1],
           "tensors": len(params), "tensors_8bit_eligible": eligible, "params": sum(p.numel() for p in params),
           "median_step_s": statistics.median(times), "step_s": times, "updated": updated,
           "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    del opt, params, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wanted = {s.strip() for s in args.setups.split(",") if s.strip()}
    known = {s[0].split(",")[0] for s in SETUPS}
    if wanted - known or not wanted:
        raise SystemExit(f"--setups: {', '.join(sorted(wanted - known)) or 'none given'}; choose from "
                         f"{', '.join(sorted(known))}")
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    if not optimizers or set(optimizers) - set(OPTIMIZERS):
        raise SystemExit(f"--optimizers: choose from {', '.join(OPTIMIZERS)}")
    rows = []
    for name, config in SETUPS:
        if name.split(",")[0] not in wanted:
            continue
        for optimizer in optimizers:
            row = {"setup": name, "config": config, **measure(config, optimizer, args)}
            rows.append(row)
            print(f"  {name} {optimizer}: {row['median_step_s'] * 1e3:.1f} ms", flush=True)
    device = torch.device(args.device)
    result = {"benchmark": "optimizer_step",
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "gpus": 1 if device.type == "cuda" else 0, "torch": torch.__version__, "git_commit": args.commit,
              "preset": args.preset or "cogvideox-5b",
              "warmup": args.warmup, "steps": args.steps, "rows": rows}
    save_json(args.out, result)
    print(f"\noptimizer step alone ({result['device']}, torch {result['torch']}, median of {args.steps})\n")
    print("| setup | optimizer | trainable tensors (8-bit eligible) | parameters | step ms | ms per tensor |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setup']} | {r['optimizer']} | {r['tensors']} ({r['tensors_8bit_eligible']}) | "
              f"{r['params'] / 1e6:,.1f} M | {r['median_step_s'] * 1e3:.1f} | "
              f"{r['median_step_s'] * 1e3 / r['tensors']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
