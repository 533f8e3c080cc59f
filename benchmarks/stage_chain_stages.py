"""benchmarks/stage_chain.py's stages as configured: each stage's config file and resolved config, its optimizer
steps and checkpoint interval, and the disk its checkpoints take (as `tttv plan` counts them), stage by stage and
for the chain at its fullest."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tttvideo.train.checkpoint import folder_bytes

REPO = Path(__file__).resolve().parents[1]
STAGES = {3: "stage1-3s", 9: "stage2-9s", 18: "stage3-18s", 30: "stage4-30s", 63: "stage5-63s"}
# each stage's config: {stage} is a value of STAGES, {gpus} the launch's GPU count
COGVIDEOX_CONFIGS = "configs/cogvideox-5b/{stage}-{gpus}gpu.toml"


def stage_config(duration: int, gpus: int = 1, patterns: tuple[str, ...] | list[str] = (COGVIDEOX_CONFIGS,)) -> Path:
    """The `gpus`-GPU config of the stage of `duration` seconds (a stage outside the recipe uses the 63-s one): the
    first of `patterns` (--configs) whose file exists, else the first (whose loading then names the missing file)."""
    paths = [REPO / p.format(stage=STAGES.get(duration, "stage5-63s"), gpus=gpus) for p in patterns]
    return next((p for p in paths if p.is_file()), paths[0])


def resolved(duration: int, args: argparse.Namespace, *sets: str) -> Any:
    """The stage's config for this launch's GPUs (--gpus), as `tttv train` will read it, with `sets` before the
    chain's own --set overrides (as the launch orders them)."""
    from tttvideo.config.loader import load_config

    return load_config(stage_config(duration, args.gpus, args.configs),
                       [f"model.preset={args.preset}", f"layout.duration={duration}s", *sets, *args.overrides])


def data_parallel(duration: int, args: argparse.Namespace) -> int:
    """How many videos one optimizer step of the stage takes at one micro-batch per rank: its global batch."""
    return args.gpus // max(1, resolved(duration, args).parallel.sp)


def chain_batch(duration: int, args: argparse.Namespace) -> list[str]:
    """The batch every launch of the chain trains at: one micro-batch a rank, so each step is one optimizer step."""
    return ["train.grad_accum=0", f"train.global_batch={data_parallel(duration, args)}", "train.batch_size=1"]


def base_read_later(args: argparse.Namespace) -> bool:
    """Whether anything after stage 1 reads the chain's base weights folder: a later stage whose
    config names model.pretrained_path (Wan's recipe), every stage with --from-base, the sample with
    --sample-config, or a first stage with fp8-stored frozen weights (its partial checkpoints take them from the
    base). Else the folder (10.4 GiB for CogVideoX-5B in bf16) goes once stage 2 runs: beside the stages the fp8 ones
    read their frozen layers from (18 s, 19.6 GiB; 30 s, 12.2) and the killed 63-s stage's two checkpoints (2 x 12.2),
    the one-GPU chain then needs 56 GiB of disk, not 67, which a 64-GiB disk holds."""
    first = resolved(args.durations[0], args)
    return (args.from_base or bool(args.sample_config) or first.model.frozen_weights == "fp8"
            or any(resolved(d, args).model.pretrained_path for d in args.durations[1:]))


def reads_previous(args: argparse.Namespace, duration: int) -> bool:
    """Whether the stage's checkpoints read the previous stage's: it stores its frozen weights in fp8, so it saves
    only what it trains and takes the frozen layers from where it started, which must stay."""
    return resolved(duration, args).model.frozen_weights == "fp8" and not args.from_base


def stage_disk(args: argparse.Namespace, duration: int, steps: int, every: int) -> Any:
    """A stage's checkpoints as `tttv plan` counts them (`memory.guard.disk.CheckpointDisk`), with the chain's own
    steps, interval and one kept checkpoint."""
    from tttvideo.memory.plan.disk import planned_disk

    cfg = resolved(duration, args)
    cfg.train.steps, cfg.train.checkpoint_every, cfg.train.keep_checkpoints = steps, every, 1
    return planned_disk(cfg, args.gpus)


def killed_stage(args: argparse.Namespace, duration: int) -> bool:
    """Whether the stage is the one killed in mid-step and resumed (--kill-at, default the last; not --no-kill)."""
    return duration == (args.kill_at or args.durations[-1]) and not args.no_kill


def stage_schedule(args: argparse.Namespace, kill: bool) -> tuple[int, int]:
    """A stage's optimizer steps and checkpoint interval: the killed one saves every step (the kill -9 needs a
    checkpoint before the step it interrupts), the others their last step only."""
    steps = args.last_steps if kill else args.steps
    return steps, 1 if kill else steps


def chain_disk(args: argparse.Namespace, base_bytes: int) -> list[tuple[int, int]]:
    """(stage, bytes on the disk at its checkpoints' peak) for every stage: its own checkpoints at once, the earlier
    stages' final checkpoints still kept (a stage followed by one with fp8-stored frozen weights, which reads them;
    every one with --keep-stages) and the base weights (`base_bytes`) until stage 2 has run a step when nothing
    later reads them. The chain's latent caches and samples are small and left out."""
    disks = [stage_disk(args, d, *stage_schedule(args, killed_stage(args, d))) for d in args.durations]
    keep_base = args.keep_stages or base_read_later(args)
    held = []
    for i, d in enumerate(args.durations):
        kept = sum(disks[j].each for j in range(i) if args.keep_stages or reads_previous(args, args.durations[j + 1]))
        held.append((d, disks[i].peak + kept + (base_bytes if i == 0 or keep_base else 0)))
    return held


def check_chain_disk(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Before the first launch: the disk the chain needs at its fullest against what it has (free, and what it
    deletes itself: an earlier run's stage folders); a SystemExit naming both when it would fill the disk in its
    last stage's save, unless --ignore-disk."""
    from tttvideo.outputs import free_bytes

    weights = work / "weights"
    base = folder_bytes(weights) if weights.is_dir() else 0
    held = chain_disk(args, base)
    stage, need = max(held, key=lambda h: h[1])
    free = free_bytes(work)
    if free is None:
        return {}
    have = free + base + sum(folder_bytes(work / f"stage-{d}s") for d in args.durations
                             if (work / f"stage-{d}s").is_dir())
    print(f"disk: {have / 2**30:.1f} GiB for the chain in {work}; it holds up to {need / 2**30:.1f} GiB, at the "
          f"{stage}-s stage's checkpoints", flush=True)
    if need > have and not args.ignore_disk:
        raise SystemExit(f"stage_chain: the chain needs up to {need / 2**30:.1f} GiB of disk (the {stage}-s stage's "
                         f"checkpoints and those kept for it), {work} has {have / 2**30:.1f} GiB: make room, give "
                         f"another --workdir, or --ignore-disk to run until it fills")
    return {"disk_gib": have / 2**30, "disk_needed_gib": need / 2**30,
            "disk_needed_by_stage_gib": {str(d): b / 2**30 for d, b in held}}


def disk_figures(args: argparse.Namespace, work: Path, duration: int, steps: int, every: int) -> dict[str, Any]:
    """The disk before a stage: free, and what its checkpoints take as `tttv plan` counts them (a checkpoint, and
    at the peak the kept one beside the one being written), with a line when it will not fit."""
    from tttvideo.outputs import free_bytes

    disk = stage_disk(args, duration, steps, every)
    free = free_bytes(work)
    row = {"predicted_checkpoint_gib": disk.each / 2**30, "predicted_disk_gib": disk.peak / 2**30,
           "disk_free_gib": free / 2**30 if free is not None else None}
    if free is not None and free < disk.peak:
        print(f"warning: {free / 2**30:.1f} GiB free in {work}, and this stage's checkpoints take up to "
              f"{disk.peak / 2**30:.1f} GiB ({disk.at_once} of {disk.each / 2**30:.1f})", flush=True)
    return row
