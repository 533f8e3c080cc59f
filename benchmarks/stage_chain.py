"""The five training stages one after another, through the command line, on one GPU: random-weight CogVideoX-5B in
diffusers' layout -> `tttv train` stage 1 (3 s) -> 2 (9 s) -> 3 (18 s) -> 4 (30 s) -> 5 (63 s), each stage starting
from the previous stage's final checkpoint through `train.init_from`, a few optimizer steps each; in the last stage a
`kill -9` in mid-step, then `--resume` from the last checkpoint; then `tttv sample` of a multi-scene story of the
last stage's length from its checkpoint. Prints a table per stage: seconds per micro-batch, peak allocated and
reserved GPU memory, peak host memory, checkpoint size and save time; writes benchmarks/results/stage_chain_<gpu>.json.

What it makes first, in --workdir, once (reused by later runs):
  weights/transformer/   a random-weight CogVideoXTransformer3DModel folder (models.cogvideox.weights.save_diffusers_folder)
  cache-<D>s/            a latent cache of --videos random clips of each stage's shapes (data.cache's format); the
                         same files `tttv precompute` writes, so `--make-cache-only` is the documented way to make one

    PYTHONPATH=src python3 -m benchmarks.stage_chain --workdir /tmp/chain              # the GPU run (full size)
    PYTHONPATH=src python3 -m benchmarks.stage_chain --workdir /tmp/chain --make-cache-only --durations 63
    PYTHONPATH=src python3 -m benchmarks.stage_chain --workdir /tmp/c --preset tiny --device cpu \\
        --set layout.height=64 --set layout.width=96 --set layout.text_tokens=8 --set model.dtype=fp32 \\
        --set train.precision=fp32 --set model.adapter=qkvo --durations 3 6 --steps 2   # a CPU smoke run

Every stage reads configs/cogvideox-5b/stage<N>-*-1gpu.toml, with the step count, accumulation, checkpoint interval,
data and weights overridden on the command line (`--set` adds more overrides to every stage).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tttvideo.memory.profile.profiler import git_commit

REPO = Path(__file__).resolve().parents[1]
STAGES = {3: "stage1-3s", 9: "stage2-9s", 18: "stage3-18s", 30: "stage4-30s", 63: "stage5-63s"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--preset", default="cogvideox-5b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--durations", type=int, nargs="+", default=list(STAGES))
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per stage (one micro-batch each)")
    ap.add_argument("--last-steps", type=int, default=3,
                    help="optimizer steps of the last stage: it is killed in step 2 and resumed, so 3 gives one step "
                         "of a process that neither compiles nor loads (its steady state)")
    ap.add_argument("--videos", type=int, default=2, help="clips in each stage's random latent cache")
    ap.add_argument("--sample-steps", type=int, default=2)
    ap.add_argument("--no-kill", action="store_true", help="skip the kill -9 and --resume of the last stage")
    ap.add_argument("--keep-stages", action="store_true",
                    help="keep every stage's checkpoints (by default a stage's go once the next one has started)")
    ap.add_argument("--make-cache-only", action="store_true", help="make the weights folder and caches, then stop")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--commit", default=git_commit())
    ap.add_argument("--out", default="")
    return ap.parse_args(argv)


def stage_config(duration: int, preset: str) -> Path:
    """The one-GPU config of the stage of `duration` seconds (a stage outside the recipe uses the 63-s one)."""
    name = STAGES.get(duration, "stage5-63s")
    return next((REPO / "configs" / "cogvideox-5b").glob(f"{name}-1gpu.toml"))


def resolved(duration: int, args: argparse.Namespace) -> Any:
    from tttvideo.config.loader import load_config

    return load_config(stage_config(duration, args.preset), [f"model.preset={args.preset}",
                                                             f"layout.duration={duration}s", *args.overrides])


# ------------------------------------------------------------------------------------------ inputs, made once
def make_weights(args: argparse.Namespace, work: Path) -> Path:
    from tttvideo.models import build_model
    from tttvideo.models.cogvideox.weights import save_diffusers_folder

    folder = work / "weights" / "transformer"
    if (folder / "config.json").is_file():
        return folder.parent
    cfg = resolved(args.durations[0], args)
    cfg.model.pretrained_path = ""
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build_model(cfg, torch.device(args.device))
    save_diffusers_folder(model, folder)
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


# ------------------------------------------------------------------------------------------------- the stages
class Watched:
    """A `tttv` child process whose peak resident memory (VmHWM) is read while it runs."""

    def __init__(self, cmd: list[str], log: Path):
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        self.host_peak = 0.0

    def poll(self) -> int | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    self.host_peak = max(self.host_peak, int(line.split()[1]) / 2**20)
        except OSError:
            pass
        return self.proc.poll()

    def wait(self, until: Any = None) -> int | None:
        """Wait for the process to end, or for `until()` to be true (then None)."""
        while (code := self.poll()) is None:
            if until is not None and until():
                return None
            time.sleep(0.5)
        self.log.close()
        return code


def tttv(*args: str) -> list[str]:
    return [sys.executable, "-m", "tttvideo", *args]


def train_command(args: argparse.Namespace, duration: int, out: Path, manifest: Path, start: str, every_step: bool,
                  *flags: str) -> list[str]:
    # a full-size sft checkpoint is 27 GiB: the stages before the last save only their final step, the last one every
    # step (the kill -9 needs a checkpoint before the step it interrupts)
    steps = args.last_steps if every_step else args.steps
    every, keep = (1, 2) if every_step else (steps, 1)
    sets = [f"model.preset={args.preset}", f"layout.duration={duration}s", f"data.manifest={manifest}",
            f"train.output_dir={out}", f"train.steps={steps}", "train.grad_accum=1", "train.global_batch=1",
            "train.batch_size=1", f"train.checkpoint_every={every}", f"train.keep_checkpoints={keep}",
            "train.sample_at_end=false",
            "train.validate_every=0", "train.tensorboard=false", "data.num_workers=0", f"train.device={args.device}",
            start, *args.overrides]
    return tttv("train", str(stage_config(duration, args.preset)), *flags, *sum((["--set", s] for s in sets), []))


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def checkpoint_figures(folder: Path, log: Path) -> dict[str, Any]:
    ckpts = sorted((folder / "checkpoints").glob("step-*"))
    size = sum(f.stat().st_size for f in ckpts[-1].rglob("*") if f.is_file()) / 2**30 if ckpts else None
    saves = [float(line.rsplit("(", 1)[1].split(" s)")[0]) for line in log.read_text().splitlines()
             if line.startswith("checkpoint ") and line.endswith(" s)")]
    return {"checkpoint_gib": size, "checkpoint_save_s": max(saves) if saves else None}


def predicted(args: argparse.Namespace, duration: int) -> dict[str, Any]:
    """What `tttv plan` predicts for the stage's setup as configured (the steady state: optimizer state live)."""
    from tttvideo.memory.plan.costs import known_gpus, load_costs
    from tttvideo.memory.plan.planner import Candidate, gpu_kind, predict

    kind = gpu_kind(torch.cuda.get_device_name()) if torch.cuda.is_available() else "h100"
    if kind not in known_gpus():
        return {}
    p = predict(resolved(duration, args), "train", Candidate("as configured", ()), load_costs(kind))
    gib = 2**30
    return {"predicted_allocated_gib": p.peak / gib if p.peak is not None else None,
            "predicted_reserved_gib": p.reserved / gib if p.reserved is not None else None,
            "predicted_host_gib": p.host / gib if p.host else 0.0, "predicted_step_s": p.step_s,
            "predicted_basis": p.basis}


def prune_when_started(child: "Watched", out: Path, previous: Path | None) -> Any:
    """A wait condition that deletes the previous stage's checkpoints once this stage has run a step (its
    `train.init_from` has been read by then), so the disk holds one stage's checkpoints at a time."""
    def until() -> bool:
        if previous is not None and read_metrics(out) and (previous / "checkpoints").is_dir():
            shutil.rmtree(previous / "checkpoints")
        return False

    return until


def run_stage(args: argparse.Namespace, work: Path, duration: int, start: str, kill: bool,
              previous: Path | None = None) -> dict[str, Any]:
    out = work / f"stage-{duration}s"
    manifest = make_cache(args, work, duration)
    log = work / f"stage-{duration}s.log"
    print(f"=== {duration} s: tttv train {stage_config(duration, args.preset).name}", flush=True)
    if out.exists():  # an earlier chain's run: gone before the new one starts, so its files are not mistaken for new
        shutil.rmtree(out)
    t0 = time.perf_counter()
    child = Watched(train_command(args, duration, out, manifest, start, kill), log)
    row: dict[str, Any] = {"duration_s": duration, "config": stage_config(duration, args.preset).name,
                           **predicted(args, duration)}
    prune = prune_when_started(child, out, None if args.keep_stages else previous)
    if kill:
        # kill -9 in mid-step: after the first checkpoint, while the second step runs
        code = child.wait(until=lambda: prune() or (len(read_metrics(out)) >= 1
                                                    and any((out / "checkpoints").glob("step-*"))))
        if code is None:
            time.sleep(read_metrics(out)[-1]["step_time"] / 2)
            if child.poll() is not None:
                raise SystemExit(f"stage {duration} s finished before the kill: use more --steps")
            os.killpg(child.proc.pid, signal.SIGKILL)
            child.wait()
            before = read_metrics(out)
            row["killed_after_step"] = len(before)
            print(f"killed (kill -9) in step {len(before) + 1}; resuming", flush=True)
            child = Watched(train_command(args, duration, out, manifest, start, kill, "--resume"), work /
                            f"stage-{duration}s-resume.log")
            log = work / f"stage-{duration}s-resume.log"
    code = child.wait(until=prune)
    row["wall_s"] = time.perf_counter() - t0
    row["exit_code"] = code
    metrics = read_metrics(out)
    row["steps"] = [m["step"] for m in metrics]
    if code != 0 or not metrics:
        row["error"] = log.read_text().strip().splitlines()[-1:] if log.is_file() else ["no log"]
        return row
    steady = metrics[-1:] if kill else metrics[1:] or metrics  # a process's first step compiles
    row.update({
        "median_step_s": sorted(m["step_time"] for m in steady)[len(steady) // 2],
        "first_step_s": metrics[0]["step_time"],
        "peak_allocated_gib": max(m["memory_gib"] for m in metrics),
        "peak_reserved_gib": max(m.get("memory_reserved_gib", 0.0) for m in metrics),
        "peak_host_gib": child.host_peak,
        **checkpoint_figures(out, log),
    })
    if kill and "killed_after_step" in row:  # resumed: each step once, counting on from the checkpoint
        row["resumed_steps_once"] = row["steps"] == list(range(1, args.last_steps + 1))
    return row


def run_sample(args: argparse.Namespace, work: Path, duration: int) -> dict[str, Any]:
    segments = duration // 3
    story = work / f"story-{duration}s.json"
    story.write_text(json.dumps([{"text": f"a red ball, scene {i}"}
                                 for i in range(segments)]))
    out = work / f"sample-{duration}s.mp4"
    log = work / f"sample-{duration}s.log"
    print(f"=== tttv sample {duration} s, {segments} scenes, {args.sample_steps} steps", flush=True)
    t0 = time.perf_counter()
    cmd = tttv("sample", "--checkpoint", str(work / f"stage-{duration}s"), "--scenes", str(story), "--out", str(out),
               "--set", f"sample.steps={args.sample_steps}", "--set", "sample.write_video=false",
               "--set", "sample.save_latents=true", "--set", f"sample.device={args.device}",
               *sum((["--set", s] for s in args.overrides if s.startswith(("memory.", "sample."))), []))
    child = Watched(cmd, log)
    code = child.wait()
    row = {"duration_s": duration, "wall_s": time.perf_counter() - t0, "exit_code": code,
           "peak_host_gib": child.host_peak}
    if code != 0:
        row["error"] = log.read_text().strip().splitlines()[-1:]
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    weights = make_weights(args, work)
    if args.make_cache_only:
        for d in args.durations:
            make_cache(args, work, d)
        return 0
    rows = []
    start = f"model.pretrained_path={weights}"
    for i, duration in enumerate(args.durations):
        last = i == len(args.durations) - 1
        previous = work / f"stage-{args.durations[i - 1]}s" if i else None
        row = run_stage(args, work, duration, start, kill=last and not args.no_kill, previous=previous)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if "error" in row:
            break
        start = f"train.init_from={work / f'stage-{duration}s'}"
    sample = run_sample(args, work, args.durations[-1]) if "error" not in rows[-1] else None
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    result = {"benchmark": "stage_chain", "device": device, "torch": torch.__version__, "git_commit": args.commit,
              "gpus": 1, "use_ttt": True, "preset": args.preset, "steps_per_stage": args.steps, "last_stage_steps": args.last_steps, "overrides": args.overrides, "stages": rows,
              "sample": sample}
    gpu = "h200" if "H200" in device else "h100" if "H100" in device else "cpu"
    out = Path(args.out or REPO / "benchmarks" / "results" / f"stage_chain_{gpu}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{device}, torch {torch.__version__}, {args.preset}, {args.steps} steps per stage")
    print(f"{'stage':>6} {'s/micro-batch':>13} {'alloc GiB':>9} {'resv GiB':>9} {'host GiB':>8} {'ckpt GiB':>8} "
          f"{'save s':>7} {'plan resv':>9} {'plan s':>7}  notes")
    for r in rows:
        if "error" in r:
            print(f"{r['duration_s']:>5}s  failed (exit {r['exit_code']}): {r['error']}")
            continue
        note = (f"kill -9 after step {r['killed_after_step']}, resumed, each step once: {r['resumed_steps_once']}"
                if "killed_after_step" in r else "")
        print(f"{r['duration_s']:>5}s {r['median_step_s']:>13.2f} {r['peak_allocated_gib']:>9.1f} "
              f"{r['peak_reserved_gib']:>9.1f} {r['peak_host_gib']:>8.1f} {r['checkpoint_gib'] or 0:>8.2f} "
              f"{r['checkpoint_save_s'] or 0:>7.1f} {r.get('predicted_reserved_gib') or 0:>9.1f} "
              f"{r.get('predicted_step_s') or 0:>7.1f}  {note}")
    if sample is not None:
        print(f"sample {sample['duration_s']} s: exit {sample['exit_code']}, {sample['wall_s']:.0f} s"
              + (f": {sample['error']}" if "error" in sample else ""))
    return 0 if all("error" not in r for r in rows) and sample and sample["exit_code"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
