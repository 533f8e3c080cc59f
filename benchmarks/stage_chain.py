"""The five training stages one after another, through the command line, on one GPU or under torchrun on several:
random-weight CogVideoX-5B in diffusers' layout -> `tttv train` stage 1 (3 s) -> 2 (9 s) -> 3 (18 s) -> 4 (30 s) ->
5 (63 s), each stage starting from the previous stage's final checkpoint through `train.init_from`, a few optimizer
steps each; in one stage (--kill-at, default the last) a `kill -9` in mid-step (of rank 1's process under torchrun:
the other ranks must stop by themselves), then `--resume` from the last checkpoint, and with --reshard-gpus M one
more step resumed on M GPUs (a sharded checkpoint read by another world size); then `tttv sample` of a multi-scene
story of the last stage's length from its checkpoint (with --gpus N > 1 also under torchrun with parallel.sp = N and
with split guidance, each layout's latents compared with the one-process ones). Prints a table per stage: seconds per
micro-batch, peak allocated and reserved GPU memory (the largest rank's), the GPUs' peak use as nvidia-smi reads it,
peak host memory (the JSON also has it by process: the launcher, each rank, compile workers, with when each
was at its highest), checkpoint size and save time, and the planner's prediction; writes
benchmarks/results/stage_chain_<gpu>.json (stage_chain_<N>gpu_<gpu>.json with --gpus N > 1).

What it makes first, in --workdir, once (reused by later runs), in a child process (so that this one never holds
GPU memory beside the stages):
  weights/transformer/   a random-weight CogVideoXTransformer3DModel folder
                         (models.cogvideox.weights.save_diffusers_folder)
  cache-<D>s/            a latent cache of --videos random clips of each stage's shapes (data.cache's format); the
                         same files `tttv precompute` writes, so `--make-cache-only` is the documented way to make one

A stage's checkpoints go once the next stage has run a step, unless that stage stores its frozen weights in fp8 (its
partial checkpoints take them from the stage before); the weights folder goes once stage 2 has run a step when
nothing after stage 1 reads it (`base_read_later`); --keep-stages keeps both. Each row gives the disk free before the
stage and its checkpoints as `tttv plan` counts them (`predicted_checkpoint_gib`, `predicted_disk_gib`) beside the
size written; before the first launch the chain checks that the disk holds it at its fullest (`chain_disk`: 56.2 GiB
for the one-GPU whole-block chain with one step a stage) and stops with a sentence if not (--ignore-disk).

    PYTHONPATH=src python3 -m benchmarks.stage_chain --workdir /tmp/chain              # the GPU run (full size)
    PYTHONPATH=src python3 -m benchmarks.stage_chain --workdir /tmp/chain --gpus 2 --kill-at 3 --reshard-gpus 1 \
        --sample-steps 1                                                                   # two GPUs
    PYTHONPATH=src python3 -m benchmarks.stage_chain --workdir /tmp/chain --gpus 4 --no-kill --no-sample \
        --steps 2 --cap-at-plan 0.05 --from-base       # each stage from the base weights under its predicted reserved
                                                       # peak + 5 %, past one that runs out of memory
                                                       # (stage_chain_capped_4gpu_<gpu>.json)
    PYTHONPATH=src python3 -m benchmarks.stage_chain --workdir /tmp/chain --make-cache-only --durations 63
    PYTHONPATH=src python3 -m benchmarks.stage_chain --workdir /tmp/chain --configs \
        'configs/cogvideox-5b/{stage}-{gpus}gpu-wholeblock.toml' 'configs/cogvideox-5b/{stage}-{gpus}gpu.toml'
                                                           # the fastest on 80 GB: whole blocks where a stage ships them
    PYTHONPATH=src python3 -m benchmarks.stage_chain --workdir /tmp/c --preset tiny --device cpu \\
        --set layout.height=64 --set layout.width=96 --set layout.text_tokens=8 --set model.dtype=fp32 \\
        --set train.precision=fp32 --set model.adapter=qkvo --durations 3 6 --steps 2   # a CPU smoke run

Every stage reads configs/cogvideox-5b/stage<N>-*-<gpus>gpu.toml (`--configs` names another recipe's), with the
step count, accumulation, checkpoint interval, data and weights overridden on the command line (`--set` adds more
overrides to every stage). Wan2.1-T2V-1.3B's 24 GB recipe (random base written by the backbone's save_pretrained;
its later stages read the base too), into benchmarks/results/stage_chain_wan_24gb_<gpu>.json:

    PYTHONPATH=src python3 -m benchmarks.stage_chain --workdir /tmp/wan --preset wan2.1-t2v-1.3b \
        --configs 'configs/wan2.1-1.3b/{stage}-24gb.toml' --no-kill --sample-steps 1 \
        --set memory.chunked_inference=true
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its neighbours in benchmarks/, as a script or module
from launch_watch import Watched, failure, gpu_name, gpu_total_gib, tttv, worker_of_rank  # noqa: E402
from stage_chain_report import merged, print_table  # noqa: E402
from stage_chain_sample import compare_latents, run_sample, sample_layouts  # noqa: E402
from stage_chain_stages import (  # noqa: E402
    COGVIDEOX_CONFIGS, REPO, STAGES, base_read_later, chain_batch, check_chain_disk, data_parallel, disk_figures,
    killed_stage, reads_previous, resolved, stage_config, stage_schedule)

from tttvideo.memory.profile.profiler import git_commit  # noqa: E402
from tttvideo.results import save_json  # noqa: E402
from tttvideo.train.checkpoint import folder_bytes  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--preset", default="cogvideox-5b")
    ap.add_argument("--configs", nargs="+", default=[COGVIDEOX_CONFIGS], metavar="PATTERN",
                    help="each stage's config, {stage} (stage1-3s ... stage5-63s) and {gpus} filled in; with several "
                         "patterns the first whose file exists (e.g. '{stage}-{gpus}gpu-wholeblock.toml' then "
                         "'{stage}-{gpus}gpu.toml': whole blocks where a config ships them); Wan2.1 on a 24 GB card: "
                         "configs/wan2.1-1.3b/{stage}-24gb.toml with --preset wan2.1-t2v-1.3b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--durations", type=int, nargs="+", default=list(STAGES))
    ap.add_argument("--gpus", type=int, default=1,
                    help="GPUs of each stage's launch (torchrun with more than one; stage<N>-*-<gpus>gpu.toml)")
    ap.add_argument("--kill-at", type=int, default=0,
                    help="the stage (its length in s) killed in mid-step and resumed (default: the last)")
    ap.add_argument("--reshard-gpus", type=int, default=0,
                    help="after the killed stage's resume, one more step resumed on this many GPUs (another world "
                         "size reading the sharded checkpoint; 0: none)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per stage (one micro-batch each)")
    ap.add_argument("--last-steps", type=int, default=3,
                    help="optimizer steps of the killed stage: it is killed in step 2 and resumed, so 3 gives one "
                         "step of a process that neither compiles nor loads (its steady state)")
    ap.add_argument("--videos", type=int, default=2, help="clips in each stage's random latent cache")
    ap.add_argument("--sample-steps", type=int, default=2)
    ap.add_argument("--sample-config", default="",
                    help="config of the closing `tttv sample` (default: the one saved with stage 5's checkpoint, "
                         "its memory caps the training's); Wan2.1 on a 24 GB card: "
                         "configs/wan2.1-1.3b/sample-63s-24gb.toml (chunked, two passes, 12 GiB cap)")
    ap.add_argument("--no-kill", action="store_true", help="skip the kill -9 and --resume")
    ap.add_argument("--no-sample", action="store_true", help="skip `tttv sample` after the last stage")
    ap.add_argument("--keep-stages", action="store_true",
                    help="keep every stage's checkpoints (by default a stage's go once the next one has started)")
    ap.add_argument("--make-cache-only", action="store_true", help="make the weights folder and caches, then stop")
    ap.add_argument("--ignore-disk", action="store_true",
                    help="start even when the disk cannot hold the chain's checkpoints at its fullest (counted as "
                         "`tttv plan` counts them)")
    ap.add_argument("--cap-at-plan", type=float, default=None, metavar="MARGIN",
                    help="run each stage's launches under memory.max_gpu_gib = the planner's predicted reserved peak "
                         "x (1 + MARGIN), e.g. 0.05 (tttv plan's default margin): a stage that runs shows the "
                         "prediction is memory enough, one that runs out shows it is not, on a card that would "
                         "otherwise let the allocator keep more cached than the run needs")
    ap.add_argument("--from-base", action="store_true",
                    help="every stage starts from the base weights (no train.init_from) and the chain goes on past a "
                         "stage that fails: each stage measured apart, e.g. every length under --cap-at-plan in one "
                         "command (without the cap its default --out is stage_chain_from_base_<gpu>.json, not the "
                         "chain's file)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--commit", default=git_commit())
    ap.add_argument("--out", default="")
    ap.add_argument("--note", default="", help="kept in each row, e.g. what else ran on the host meanwhile")
    args = ap.parse_args(argv)
    if args.cap_at_plan is not None and any(o.startswith("memory.max_gpu_gib=") for o in args.overrides):
        ap.error("--cap-at-plan sets memory.max_gpu_gib itself, from each stage's prediction; drop the --set")
    if args.cap_at_plan is not None and args.cap_at_plan < 0:
        ap.error("--cap-at-plan: the margin is a share of the predicted peak, 0 or more (0.05 = 5 %)")
    return args


# ------------------------------------------------------------------------------------------ inputs, made once
def make_weights(args: argparse.Namespace, work: Path) -> Path:
    from tttvideo.models import build_model
    from tttvideo.models.backbone import backbone_of

    folder = work / "weights" / "transformer"
    if (folder / "config.json").is_file():
        return folder.parent
    cfg = resolved(args.durations[0], args)
    cfg.model.pretrained_path = ""
    # the folder holds the plain backbone, whatever the first stage stores its frozen weights as (the one-GPU 63-s
    # config's fp8 storage renames them), so without fp8 products either
    cfg.model.frozen_weights = "dtype"
    cfg.model.fp8_matmul = False
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build_model(cfg, torch.device(args.device))
    backbone_of(cfg.model.preset).save_pretrained(model, folder)
    print(f"random-weight {args.preset} written to {folder} in {time.perf_counter() - t0:.0f} s", flush=True)
    del model
    return folder.parent


def make_cache(args: argparse.Namespace, work: Path, duration: int) -> Path:
    """--videos random clips of the stage's shapes, in the latent cache's format (manifest.jsonl, latents/, text/)."""
    from tttvideo.data.cache import CacheEntry, save_latent, save_text, write_manifest
    from tttvideo.models.backbone import get_preset, layout_of

    root = work / f"cache-{duration}s"
    manifest = root / "manifest.jsonl"
    if manifest.is_file():
        return manifest
    cfg = resolved(duration, args)
    layout = layout_of(cfg)
    spec = get_preset(cfg.model.preset)
    g = torch.Generator().manual_seed(duration)
    entries = []
    for i in range(args.videos):
        (root / "latents").mkdir(parents=True, exist_ok=True)
        (root / "text").mkdir(parents=True, exist_ok=True)
        shape = (spec.in_channels, layout.latent_frames, layout.latent_height, layout.latent_width)
        save_latent(root / "latents" / f"{i:04d}.safetensors", torch.randn(shape, generator=g).to(torch.bfloat16),
                    torch.full(shape, -4.0).to(torch.bfloat16), 0.7)
        texts = []
        for s in range(layout.num_segments):
            rel = f"text/{i:04d}-{s:02d}.safetensors"
            emb = torch.randn(layout.text_tokens, spec.text_embed_dim, generator=g).to(torch.bfloat16)
            save_text(root / rel, emb, f"random clip {i} scene {s}", layout.text_tokens)
            texts.append(rel)
        entries.append(CacheEntry(id=f"{i:04d}", latent=f"latents/{i:04d}.safetensors", text=texts,
                                  captions=[f"random clip {i} scene {s}" for s in range(layout.num_segments)],
                                  scene_start=[True] * layout.num_segments, scene_end=[True] * layout.num_segments))
    write_manifest(manifest, entries)
    print(f"random latent cache of {args.videos} clips of {duration} s written to {root}", flush=True)
    return manifest


def inputs_made_apart(args: argparse.Namespace, work: Path) -> Path:
    """The weights folder and caches, made by a child process (this mode with --make-cache-only): building the
    random 5B model on the GPU here would leave this process's CUDA context and the allocator's cached blocks (the
    model's 10.5 GB) on GPU 0 for the whole chain, beside rank 0."""
    cmd = [sys.executable, "-m", "benchmarks.stage_chain", "--workdir", str(work), "--make-cache-only",
           "--preset", args.preset, "--configs", *args.configs, "--gpus", str(args.gpus), "--device", args.device,
           "--videos", str(args.videos), "--durations", *map(str, args.durations),
           *sum((["--set", s] for s in args.overrides), [])]
    subprocess.run(cmd, cwd=REPO, check=True)
    return work / "weights"


# ------------------------------------------------------------------------------------------------- the stages
def train_command(args: argparse.Namespace, duration: int, out: Path, manifest: Path, start: list[str], steps: int,
                  every: int, gpus: int, *flags: str) -> list[str]:
    # a full-size sft checkpoint is 27 GiB (two GPUs wrote 40.6 while the model went into dcp/ too), and the disk of
    # a two-GPU machine held 110-128 GiB: the stages save only their final step, the killed one every step (the
    # kill -9 needs a checkpoint before the step it interrupts), and one checkpoint is kept
    sets = [f"model.preset={args.preset}", f"layout.duration={duration}s", f"data.manifest={manifest}",
            f"train.output_dir={out}", f"train.steps={steps}", *chain_batch(duration, args),
            f"train.checkpoint_every={every}", "train.keep_checkpoints=1",
            "train.sample_at_end=false", "train.validate_every=0", "train.tensorboard=false", "data.num_workers=0",
            f"train.device={args.device}", *start, *args.overrides]
    return tttv("train", str(stage_config(duration, gpus, args.configs)), *flags,
                *sum((["--set", s] for s in sets), []), gpus=gpus)


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def checkpoint_figures(folder: Path, log: Path) -> dict[str, Any]:
    ckpts = sorted((folder / "checkpoints").glob("step-*"))
    size = folder_bytes(ckpts[-1]) / 2**30 if ckpts else None
    saves = [float(line.rsplit("(", 1)[1].split(" s)")[0]) for line in log.read_text().splitlines()
             if line.startswith("checkpoint ") and line.endswith(" s)")]
    return {"checkpoint_gib": size, "checkpoint_save_s": max(saves) if saves else None}


def ran_out_of_memory(said: list[str]) -> bool:
    """Whether a failed launch's sentences (`failure`) say it ran out of GPU memory: tttv's own sentence, or the
    exception line of a process that died of it."""
    from tttvideo.memory.guard.oom import OUT_OF_GPU_MEMORY

    return any(OUT_OF_GPU_MEMORY in line or "CUDA out of memory" in line for line in said)


def predicted(args: argparse.Namespace, duration: int) -> dict[str, Any]:
    """What `tttv plan` predicts for the stage's setup as configured (the steady state: optimizer state live), at
    the chain's batch (`train_command`: one micro-batch a rank, so every step holds an optimizer step). A GPU kind
    without measured costs is predicted from the H100's: its memory (the same kernels allocate the same bytes), not
    its step time."""
    from tttvideo.memory.plan.costs import gpu_kind, known_gpus, load_costs
    from tttvideo.memory.plan.planner import Candidate, predict

    kind = gpu_kind(gpu_name() or "H100")
    measured = kind in known_gpus()
    if not measured and "h100" not in known_gpus():
        return {}
    cfg = resolved(duration, args, *chain_batch(duration, args))
    p = predict(cfg, "train", Candidate("as configured", ()), load_costs(kind if measured else "h100"),
                gpus=args.gpus)
    gib = 2**30
    return {"predicted_allocated_gib": p.peak / gib if p.peak is not None else None,
            "predicted_reserved_gib": p.reserved / gib if p.reserved is not None else None,
            # the launch's processes together, as peak_host_gib sums them
            "predicted_host_gib": p.host_total * args.gpus / gib,
            "predicted_step_s": p.step_s if measured else None,
            # what times the kill on a GPU kind without its own step costs (an H200 steps about as fast)
            **({} if measured else {"h100_step_s": p.step_s}),
            "predicted_basis": p.basis + ("" if measured else f" (H100 costs; no {kind} step time)")}


def plan_cap(row: dict[str, Any], margin: float, config: str) -> float:
    """--cap-at-plan's allocator cap for a stage: its predicted reserved peak plus `margin` of it, in GiB (two
    decimals, as the config key is written)."""
    reserved = row.get("predicted_reserved_gib")
    if not reserved:
        raise SystemExit(f"--cap-at-plan: the planner predicts no reserved peak for {config} here "
                         f"({row.get('predicted_basis') or 'no costs for this device'}); run it on a GPU the planner "
                         f"has costs for, or without --cap-at-plan")
    return round(reserved * (1 + margin), 2)


def prune_when_started(child: "Watched", out: Path, previous: Path | None, base: Path | None = None) -> Any:
    """A wait condition that deletes the previous stage's checkpoints once this stage has run a step (its
    `train.init_from` has been read by then), so the disk holds one stage's checkpoints at a time; and `base`, the
    chain's base weights folder, when nothing from this stage on reads it (`base_read_later`)."""
    def until() -> bool:
        if not read_metrics(out):
            return False
        for gone in ([previous / "checkpoints"] if previous is not None else []) + ([base] if base else []):
            if gone.is_dir():
                shutil.rmtree(gone)
        return False

    return until


def kill_in_mid_step(args: argparse.Namespace, child: Watched, out: Path, prune: Any,
                     step_s: float | None) -> dict[str, Any] | None:
    """Wait for the first checkpoint, then kill -9 in the middle of the next step: the whole process (one GPU) or
    rank 1's worker alone (torchrun: the other ranks must stop by themselves). None if the run ended first.
    `step_s`: the planner's step time; the first step's own (compiling: 145 s against 8 s at 3 s on two GPUs)
    would put the kill past the next step, inside its checkpoint save."""
    code = child.wait(until=lambda: prune() or (len(read_metrics(out)) >= 1
                                                and any((out / "checkpoints").glob("step-*"))))
    if code is not None:
        return None
    time.sleep(min(read_metrics(out)[-1]["step_time"], step_s or 4.0) / 2)
    if child.poll() is not None:
        return None
    victim = worker_of_rank(child.proc.pid, 1) if args.gpus > 1 else None
    done = len(read_metrics(out))
    killed_at = time.perf_counter()
    if victim is not None:
        os.kill(victim, signal.SIGKILL)
    else:
        os.killpg(child.proc.pid, signal.SIGKILL)
    code = child.wait()
    lines = Path(child.log.name).read_text(errors="replace").splitlines()
    return {"killed_after_step": done, "killed": "rank 1" if victim is not None else "the process",
            "launch_exit_s": time.perf_counter() - killed_at, "launch_exit_code": code,
            # what the surviving ranks said (tttv's one sentence), and whether a Python traceback reached the log
            "sentences": [line for line in lines if "tttv train: error:" in line][:4],
            "tracebacks_in_log": sum("Traceback (most recent call last)" in line for line in lines)}


def steady_steps(metrics: list[dict[str, Any]], resume_log: Path | None) -> list[dict[str, Any]]:
    """The steps that were not the first of their launch (a launch's first step compiles): after step 1, and for a
    resumed stage (`resume_log`, the resumed launch's log) after the step it resumed at too. [] when every step was
    a first one (--last-steps 2: the killed launch's step 1, the resumed launch's step 2)."""
    firsts = {1}
    if resume_log is not None:
        said = re.search(r"resumed from .* at step (\d+)", resume_log.read_text(errors="replace"))
        firsts.add(int(said.group(1)) + 1 if said else 1)
    return [m for m in metrics if m["step"] not in firsts]


def stage_row(metrics: list[dict[str, Any]], steady: list[dict[str, Any]], watched: list[Watched]) -> dict[str, Any]:
    """A finished stage's figures: its metrics', and the host and GPU peaks of every launch it took; no steady step
    time (None) when every step was the first of its launch."""
    return {"median_step_s": sorted(m["step_time"] for m in steady)[len(steady) // 2] if steady else None,
            "first_step_s": metrics[0]["step_time"],
            "peak_allocated_gib": max(m["memory_gib"] for m in metrics),
            "peak_reserved_gib": max(m.get("memory_reserved_gib", 0.0) for m in metrics),
            # each step's process peaks so far (torch's peak statistics are a process's whole run): which launch and
            # step set the stage's peak (a killed stage's rows come from two processes)
            "memory_by_step": [{"step": m["step"], "allocated_gib": m["memory_gib"],
                                "reserved_gib": m.get("memory_reserved_gib", 0.0)} for m in metrics],
            "peak_host_gib": max(w.host_peak for w in watched),
            # by process (rank, launcher, compile workers), each launch of the stage in turn
            "host_by_process": [w.host_by_role for w in watched],
            "peak_gpu_used_gib": [max(v) for v in zip(*(w.gpu_peak for w in watched if w.gpu_peak))],
            "losses": [m["loss"] for m in metrics],
            # each step's wall time beside the model's forward and backward (metrics.jsonl from 2026-12-06 on)
            "time_by_step": [{"step": m["step"], "step_s": m["step_time"],
                              **{k: m[k] for k in ("data_s", "optimizer_s", "ema_s") if k in m}} for m in metrics]}


def run_stage(args: argparse.Namespace, work: Path, duration: int, start: list[str], kill: bool,
              previous: Path | None = None, base: Path | None = None) -> dict[str, Any]:
    """One stage's launches (with `kill`, killed in mid-step and resumed) and its row. `previous`'s checkpoints and
    the base weights folder `base` go once this stage has run a step (`prune_when_started`)."""
    out = work / f"stage-{duration}s"
    manifest = make_cache(args, work, duration)
    log = work / f"stage-{duration}s.log"
    config = stage_config(duration, args.gpus, args.configs)
    print(f"=== {duration} s: tttv train {config.name}" + (f" on {args.gpus} GPUs" if args.gpus > 1 else ""),
          flush=True)
    if out.exists():  # an earlier chain's run: gone before the new one starts, so its files are not mistaken for new
        shutil.rmtree(out)
    steps, every = stage_schedule(args, kill)
    # the steps asked of this stage: a chain run in parts merges rows of invocations with different --steps
    row: dict[str, Any] = {"duration_s": duration, "config": config.name, "gpus": args.gpus, "steps_asked": steps,
                           "global_batch": data_parallel(duration, args), **predicted(args, duration),
                           **disk_figures(args, work, duration, steps, every)}
    launch = start  # the stage's own launches (not a reshard's: another GPU count, another prediction)
    if args.cap_at_plan is not None:
        row["cap_gib"] = plan_cap(row, args.cap_at_plan, config.name)
        launch = [*start, f"memory.max_gpu_gib={row['cap_gib']}"]
    t0 = time.perf_counter()
    child = Watched(train_command(args, duration, out, manifest, launch, steps, every, args.gpus), log, REPO)
    prune = prune_when_started(child, out, None if args.keep_stages or reads_previous(args, duration) else previous,
                               base)
    watched = [child]
    if kill:
        killed = kill_in_mid_step(args, child, out, prune, row.get("predicted_step_s") or row.get("h100_step_s"))
        if killed is None:
            raise SystemExit(f"stage {duration} s finished before the kill: use more --last-steps")
        row.update(killed)
        print(f"killed (kill -9, {killed['killed']}) in step {killed['killed_after_step'] + 1}; the launch exited "
              f"{killed['launch_exit_s']:.1f} s later; resuming", flush=True)
        log = work / f"stage-{duration}s-resume.log"
        child = Watched(train_command(args, duration, out, manifest, launch, steps, every, args.gpus, "--resume"),
                        log, REPO)
        watched.append(child)
    code = child.wait(until=prune)
    row["wall_s"] = time.perf_counter() - t0
    row["exit_code"] = code
    metrics = read_metrics(out)
    row["steps"] = [m["step"] for m in metrics]
    if code != 0 or not metrics:
        row["error"] = failure(log)
        # as benchmarks/fit_24gb.py's rows: a stage that ran out of GPU memory (under --cap-at-plan, a plan that
        # said "fits" wrongly) apart from one that failed otherwise
        row["status"] = "oom" if ran_out_of_memory(row["error"]) else "failed"
        return row
    row["status"] = "ok"
    row.update(stage_row(metrics, steady_steps(metrics, log if kill else None), watched))
    row.update(checkpoint_figures(out, log))
    if kill and "killed_after_step" in row:  # resumed: each step once, counting on from the checkpoint
        row["resumed_steps_once"] = row["steps"] == list(range(1, steps + 1))
    if kill and args.reshard_gpus:
        row["reshard"] = reshard(args, work, duration, out, manifest, start, steps)
    return row


def reshard(args: argparse.Namespace, work: Path, duration: int, out: Path, manifest: Path, start: list[str],
            steps: int) -> dict[str, Any]:
    """One more step of the stage, resumed from its last checkpoint on --reshard-gpus GPUs (that count's config,
    the same global batch): the sharded checkpoint read by another world size."""
    gpus = args.reshard_gpus
    log = work / f"stage-{duration}s-reshard.log"
    print(f"=== {duration} s: --resume on {gpus} GPU(s), one more step", flush=True)
    child = Watched(train_command(args, duration, out, manifest, start, steps + 1, steps + 1, gpus, "--resume"), log,
                    REPO)
    code = child.wait()
    metrics = read_metrics(out)
    row: dict[str, Any] = {"gpus": gpus, "exit_code": code, "steps": [m["step"] for m in metrics]}
    if code != 0 or len(metrics) != steps + 1:
        row["error"] = failure(log)
        return row
    row.update({"step_s": metrics[-1]["step_time"], "loss": metrics[-1]["loss"],
                "resumed_steps_once": row["steps"] == list(range(1, steps + 2)),
                "resumed_line": next((line for line in log.read_text().splitlines() if "resumed from" in line), "")})
    return row


def cpu_label() -> str:
    """The results' device on a CPU run (the processor's name where the platform gives one)."""
    return platform.processor() or "cpu"


def results_name(args: argparse.Namespace, device: str) -> str:
    """The default results file's name (no suffix): stage_chain[_capped|_from_base][_<backbone>_<card>][_<gpus>gpu]_
    <gpu>. A run under --cap-at-plan goes to a file of its own: its reserved peaks are held under the plan, not free;
    so does a free --from-base run, whose stages start from the base weights instead of the stage before."""
    from tttvideo.memory.plan.costs import gpu_kind

    gpu = "cpu" if device == cpu_label() else gpu_kind(device)
    name = f"stage_chain_{args.gpus}gpu_{gpu}" if args.gpus > 1 else f"stage_chain_{gpu}"
    if args.configs != [COGVIDEOX_CONFIGS]:  # another recipe (Wan2.1's 24 GB stages: stage_chain_wan_24gb_<gpu>)
        from tttvideo.models.backbone import backbone_of

        card = Path(args.configs[0].format(stage="", gpus=args.gpus)).stem.strip("-")
        name = name.replace("stage_chain", f"stage_chain_{backbone_of(args.preset).name}_{card}")
    if args.cap_at_plan is not None:
        name = name.replace("stage_chain", "stage_chain_capped")
    elif args.from_base:
        name = name.replace("stage_chain", "stage_chain_from_base")
    return name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.make_cache_only:
        make_weights(args, work)
        for d in args.durations:
            make_cache(args, work, d)
        return 0
    weights = inputs_made_apart(args, work)
    disk = check_chain_disk(args, work)
    device = (gpu_name() or "cuda") if args.device.startswith("cuda") else cpu_label()
    card = gpu_total_gib() if args.device.startswith("cuda") else None
    out = Path(args.out or REPO / "benchmarks" / "results" / f"{results_name(args, device)}.json")
    result = {"benchmark": "stage_chain", "device": device, "torch": torch.__version__, "git_commit": args.commit,
              **({"gpu_total_gib": card} if card else {}),
              "gpus": args.gpus, "use_ttt": True, "preset": args.preset, "configs": args.configs,
              "steps_per_stage": args.steps,
              "last_stage_steps": args.last_steps, "overrides": args.overrides, **disk, "stages": [], "samples": []}
    rows, samples = result["stages"], result["samples"]
    run = {"git_commit": args.commit, "overrides": args.overrides, **({"note": args.note} if args.note else {}),
           **({"from_base": True} if args.from_base else {})}

    def save() -> None:  # after each stage and sample, in case the machine goes
        save_json(out, merged(out, result))

    # the first stage starts from the base weights whatever its config's init_from says (the 63-s config names stage 4)
    start = [f"model.pretrained_path={weights}", 'train.init_from=""']
    for i, duration in enumerate(args.durations):
        previous = work / f"stage-{args.durations[i - 1]}s" if i else None
        # the base weights go once stage 2 runs: stage 1's resume and reshard launches read them
        base = work / "weights" if i == 1 and not args.keep_stages and not base_read_later(args) else None
        row = run_stage(args, work, duration, start, kill=killed_stage(args, duration),
                        previous=previous, base=base)
        rows.append({**run, **row})
        print(json.dumps(row), flush=True)
        save()
        if args.from_base:
            continue
        if "error" in row:
            break
        start = [f"train.init_from={work / f'stage-{duration}s'}"]
        if i + 1 < len(args.durations) and resolved(args.durations[i + 1], args).model.pretrained_path:
            # a recipe whose later stages read the base weights too (Wan's): this chain's base folder
            start.append(f"model.pretrained_path={weights}")
    if "error" not in rows[-1] and not args.no_sample:
        from tttvideo.models.backbone import get_preset

        for layout, gpus, sets in sample_layouts(args.gpus, get_preset(args.preset).num_attention_heads):
            samples.append({**run, **run_sample(args, work, args.durations[-1], layout, gpus, sets)})
            compare_latents(samples)
            save()
    print_table(merged(out, result))
    ok = all("error" not in r and "error" not in r.get("reshard", {}) for r in rows)
    return 0 if ok and (args.no_sample or samples) and all(s["exit_code"] == 0 for s in samples) else 1


if __name__ == "__main__":
    raise SystemExit(main())
