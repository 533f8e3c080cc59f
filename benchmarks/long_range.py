"""Long-range consistency: does the layer beside local attention carry what the first scene said into later scenes?

Each variant (the long-range layer: TTT-MLP, TTT-Linear, none, full attention, Mamba 2, Gated DeltaNet) is trained
with the same data, steps and seeds (configs/long-range.toml: the tiny model on the long-range demo set, where only
the first scene's caption names the shape's colour and every later 3-s segment cuts to a new scene in that colour),
then samples a fixed set of held-out stories of the same kind. The probe (`tttvideo.data.demo_score.
score_persistence`) reads the colour of the shape back from every later scene of every sampled video; chance is 1/6.
Local attention sees only its own segment's caption, so without a long-range layer the colour of a later scene is a
guess.

Per duration and variant: the accuracy per scene distance (+1 = the scene right after the first, ...) as mean and
spread over the seeds, the overall accuracy, the control (how often the first scene, whose caption names the colour,
shows it: a model that has not learned to follow its captions at all makes the other scores meaningless), the median
training step time and the peak GPU memory of training.
Before training anything it checks that the probe is live on the held-out stories themselves: their own latents
score 1.0 and the same stories with every later scene recoloured score 0.0. The results JSON is rewritten after each
run and a rerun skips the runs it holds (resume after a time limit; runs of other settings need another --out); a
table is printed and a plot written beside the JSON (`--report` rebuilds both from a results file without training).
3-s videos have one scene, so nothing to carry: durations start at 6 s.

    PYTHONPATH=src python3 benchmarks/long_range.py --jobs 6 --out benchmarks/results/long_range_h100.json  # GPU
    PYTHONPATH=src python3 benchmarks/long_range.py --durations 6s --seeds 0 --steps 3 --eval-videos 2 \\
        --set sample.steps=2 --out /tmp/lr.json                      # a CPU smoke run of the same code
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the layer each variant puts after local attention; TTT-Linear takes the original's inner learning rate
VARIANTS = {
    "ttt-mlp": ["model.sequence_layer=ttt", "ttt.kind=mlp"],
    "ttt-linear": ["model.sequence_layer=ttt", "ttt.kind=linear", "ttt.base_lr=1.0"],
    "none": ["model.sequence_layer=none"],
    "full-attention": ["model.sequence_layer=full-attention"],
    "mamba2": ["model.sequence_layer=mamba2"],
    "gated-deltanet": ["model.sequence_layer=gated-deltanet"],
}
EVAL_SEED = 9_000  # the held-out stories: another generator stream than any training set's


def eval_stories(segments: int, count: int):
    """`count` long-range stories of `segments` scenes, the same for every variant and seed."""
    import numpy as np

    from tttvideo.data.demo import long_range_video
    from tttvideo.sample.scenes import Scene, Story

    rng = np.random.Generator(np.random.PCG64(EVAL_SEED + segments))
    videos = [long_range_video(rng, segments) for _ in range(count)]
    # each story its own noise: with one seed for all, a model that knows nothing of the colour draws the same ones
    # in every story, and every such variant scores the same
    stories = [Story(name=f"eval-{i:03d}", source="benchmarks/long_range.py",
                     scenes=[Scene(**scene) for scene in v.story()], seed=EVAL_SEED + i) for i, v in enumerate(videos)]
    return videos, stories


def probe_check(cfg, videos) -> dict:
    """The probe on the held-out stories' own latents (kept) and on the same stories with every later scene in
    another colour (forgotten): 1.0 and 0.0 when it reads what it should."""
    import torch

    from tttvideo.data.demo import forgotten_colour, render_video
    from tttvideo.data.demo_score import latent_frames, score_persistence
    from tttvideo.layout import VideoLayout
    from tttvideo.models.backbone import get_preset

    layout = VideoLayout.from_config(cfg.layout, cfg.ttt)
    channels = get_preset(cfg.model.preset).in_channels
    kept, lost = [], []
    for v in videos:
        captions = [s.caption for s in v.scenes]
        for video, into in ((v, kept), (forgotten_colour(v), lost)):
            frames = latent_frames(torch.from_numpy(render_video(video, layout, channels)).permute(1, 0, 2, 3))
            into.append(score_persistence(frames, captions).accuracy)
    return {"kept": statistics.mean(kept), "forgotten": statistics.mean(lost)}


def train_and_score(base: Path, variant: str, duration: str, seed: int, args, work: Path) -> dict:
    """One run: train, sample the held-out stories from its checkpoint, score them."""
    import torch
    from rich.console import Console
    from safetensors.torch import load_file

    from tttvideo.api import train
    from tttvideo.config.loader import load_config
    from tttvideo.data.demo_score import latent_frames, score_persistence
    from tttvideo.runs import find_model_file
    from tttvideo.sample.pipeline import sample_stories

    out = work / duration / variant / f"seed{seed}"
    overrides = VARIANTS[variant] + [f"layout.duration={duration}", f"train.seed={seed}",
                                     f"train.output_dir={out}",
                                     f"data.demo_dir={work / 'data' / f'{duration}-seed{seed}'}"]
    if args.steps:
        overrides.append(f"train.steps={args.steps}")
    overrides += args.overrides
    cfg = load_config(base, overrides)
    cuda = torch.cuda.is_available() and cfg.train.device != "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = train(cfg, quiet=True)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    step_s = step_times(result.output_dir)
    videos, stories = eval_stories(num_segments(cfg), args.eval_videos)
    samples = sample_stories(cfg, stories, out / "eval", checkpoint=result.output_dir, console=Console(quiet=True),
                             progress=False)
    distances: list[list[bool]] = []
    first: list[bool] = []  # the control: the first scene, whose caption names the colour
    for video, sample in zip(videos, samples):
        frames = latent_frames(load_file(str(sample.latents))["latents"][0])
        score = score_persistence(frames, [s.caption for s in video.scenes])
        distances.append(score.by_distance())
        first.append(score.first.colour_ok)
    per_distance = [statistics.mean(float(d[i]) for d in distances) for i in range(len(distances[0]))]
    params = sum(p.numel() for n, p in load_file(str(find_model_file(result.output_dir))).items() if ".ttt." in n)
    return {"variant": variant, "duration": duration, "seed": seed, "steps": result.steps_done,
            "first_loss": result.first_loss, "last_loss": result.last_loss, "train_s": result.seconds,
            "median_step_s": statistics.median(step_s) if step_s else result.seconds / max(result.steps_done, 1),
            "peak_allocated": peak, "long_range_params": params, "accuracy_by_distance": per_distance,
            "accuracy": statistics.mean(per_distance), "first_scene_colour": statistics.mean(map(float, first)),
            "eval_videos": len(samples), "recurrence": recurrence_kernels(variant, cfg.ttt.backend, cuda)}


def recurrence_kernels(variant: str, backend: str, cuda: bool) -> str | None:
    """What computed Mamba 2's / Gated DeltaNet's recurrence in this run (None for the other layers): their step
    times compare kernels only where both ran on fla."""
    if variant not in ("mamba2", "gated-deltanet"):
        return None
    from tttvideo.sequence import ops

    if backend == "reference" or not cuda:
        return "PyTorch reference"
    if ops.fla_missing():
        return f"PyTorch reference: {ops.fla_missing()}"
    refused = ops.fla_backward_refused()
    return f"fla to sample, PyTorch reference to train: {refused}" if refused else "fla"


def num_segments(cfg) -> int:
    from tttvideo.layout import VideoLayout

    return VideoLayout.from_config(cfg.layout, cfg.ttt).num_segments


def step_times(run: Path) -> list[float]:
    """Seconds per optimizer step from the run's metrics log (the trainer's `metrics.jsonl`), when it has them."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step_time"] for r in rows if isinstance(r.get("step_time"), (int, float))]


def summarize(runs: list[dict]) -> list[dict]:
    """Mean and spread (sample standard deviation) over seeds, per duration and variant."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["duration"], r["variant"]), []).append(r)
    rows = []
    for (duration, variant), rs in groups.items():
        acc = [r["accuracy"] for r in rs]
        by = list(zip(*(r["accuracy_by_distance"] for r in rs)))
        peaks = [r["peak_allocated"] for r in rs if r["peak_allocated"] is not None]
        rows.append({"duration": duration, "variant": variant, "seeds": sorted(r["seed"] for r in rs),
                     "accuracy": statistics.mean(acc), "accuracy_sd": statistics.stdev(acc) if len(acc) > 1 else 0.0,
                     "accuracy_by_distance": [statistics.mean(d) for d in by],
                     "accuracy_by_distance_sd": [statistics.stdev(d) if len(d) > 1 else 0.0 for d in by],
                     "first_scene_colour": statistics.mean(r.get("first_scene_colour", float("nan")) for r in rs),
                     "median_step_s": statistics.median(r["median_step_s"] for r in rs),
                     "peak_allocated": max(peaks) if peaks else None,
                     "long_range_params": rs[0]["long_range_params"], "recurrence": rs[0].get("recurrence")})
    return rows


def table(rows: list[dict], chance: float) -> str:
    lines = [f"chance = {chance:.2f}", "",
             "| duration | layer | accuracy (mean +- sd over seeds) | by scene distance +1, +2, ... | first scene "
             "(captioned) | step (s) | peak GiB | layer params |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        by = ", ".join(f"{a:.2f}" for a in r["accuracy_by_distance"])
        peak = f"{r['peak_allocated'] / 2**30:.2f}" if r["peak_allocated"] else "-"
        lines.append(f"| {r['duration']} | {r['variant']} | {r['accuracy']:.2f} +- {r['accuracy_sd']:.2f} "
                     f"(seeds {r['seeds']}) | {by} | {r['first_scene_colour']:.2f} | {r['median_step_s']:.3f} | "
                     f"{peak} | {r['long_range_params']:,} |")
    notes = {r["variant"]: r["recurrence"] for r in rows if r.get("recurrence") not in (None, "fla")}
    lines += [""] + [f"{variant}'s recurrence: {how}" for variant, how in notes.items()] if notes else []
    return "\n".join(lines)


def plot(rows: list[dict], chance: float, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'tttvideo[report]'): no plot", file=sys.stderr)
        return None
    durations = sorted({r["duration"] for r in rows}, key=lambda d: int(d.rstrip("s")))
    fig, axes = plt.subplots(1, len(durations), figsize=(5 * len(durations), 4), squeeze=False)
    for ax, duration in zip(axes[0], durations):
        for r in (r for r in rows if r["duration"] == duration):
            x = list(range(1, len(r["accuracy_by_distance"]) + 1))
            ax.errorbar(x, r["accuracy_by_distance"], yerr=r["accuracy_by_distance_sd"], marker="o", capsize=3,
                        label=r["variant"])
            ax.set_xticks(x)
        ax.axhline(chance, color="grey", linestyle="--", label="chance")
        ax.set(title=f"{duration}: first scene's colour kept", xlabel="scenes after the first (3 s each)",
               ylabel="accuracy", ylim=(-0.05, 1.05))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "long-range.toml"))
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--durations", default="9s,18s", help="comma separated, 6 s and longer")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=0, help="training steps per run (0: the config's train.steps)")
    ap.add_argument("--eval-videos", type=int, default=64, help="held-out stories sampled per run")
    ap.add_argument("--work", default="runs/long-range-benchmark", help="run folders")
    ap.add_argument("--out", default="benchmarks/results/long_range.json")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override for every run")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once, each in its own process (the tiny model leaves a GPU mostly idle; step "
                         "times are then measured side by side, recorded as concurrent_jobs)")
    ap.add_argument("--no-report", action="store_true",
                    help="write the results file only, no table or plot (what --jobs passes to each run's process)")
    ap.add_argument("--report", action="store_true",
                    help="train nothing: rebuild the summary, table and plot of the --out file from its runs")
    args = ap.parse_args(argv)
    if args.report:
        return rebuild_report(Path(args.out))

    import torch

    from tttvideo.config.loader import load_config

    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    if torch.cuda.is_available() and not any(o.startswith("train.cpu_threads=") for o in args.overrides):
        # the tiny model leaves the CPU launching kernels: on an H100 its step took 0.063 s with one CPU thread and
        # 0.26 s with PyTorch's default of one per core (alone, before any concurrent job)
        args.overrides.append("train.cpu_threads=1")
    work, out = Path(args.work), Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    held = json.loads(out.read_text()) if out.is_file() else {}
    mine = run_settings(args)
    if held.get("runs") and held_settings(held) != mine:
        raise SystemExit(f"{out} holds runs made with {held_settings(held)}, not {mine}; a rerun only adds to runs "
                         f"of the same settings: give another --out, or delete it to start over")
    runs = held.get("runs", [])
    done = {(r["variant"], r["duration"], r["seed"]) for r in runs}
    probes = held.get("probe", {})
    for duration in args.durations.split(","):
        cfg = load_config(args.config, [f"layout.duration={duration}"] + args.overrides)
        segments = num_segments(cfg)
        if segments < 2:
            ap.error(f"--durations {duration}: one 3-s segment has no later scene to score; use 6s or longer")
        videos, _ = eval_stories(segments, args.eval_videos)
        probes[duration] = probe_check(cfg, videos)
        if probes[duration] != {"kept": 1.0, "forgotten": 0.0}:
            raise SystemExit(f"the probe is not live at {duration}: {probes[duration]} (want kept 1.0, forgotten "
                             f"0.0); fix tttvideo.data.demo_score before trusting any score")
    # seed by seed, every variant: a run cut short by a time limit leaves whole comparisons, not whole variants
    pending = [(v, d, int(s)) for d in args.durations.split(",") for s in args.seeds.split(",") for v in variants
               if (v, d, int(s)) not in done]
    for row in (run_parallel(pending, args, work) if args.jobs > 1 else run_serial(pending, args, work)):
        runs.append(row)
        print(f"{row['duration']} {row['variant']} seed {row['seed']}: accuracy {row['accuracy']:.2f} "
              f"{[round(a, 2) for a in row['accuracy_by_distance']]} ({row['wall_s']:.0f} s)", flush=True)
        write(out, runs, probes, args, torch)
    rows = summarize(runs)  # every run the file holds: one setting, so all comparable
    write(out, runs, probes, args, torch, rows)
    return 0 if args.no_report else report(out, rows)


def report(out: Path, rows: list[dict]) -> int:
    """The table on stdout and the plot beside the results file."""
    from tttvideo.data.demo_score import CHANCE

    chance = CHANCE["colour"]
    print(table(rows, chance))
    png = plot(rows, chance, out.with_suffix(".png"))
    if png:
        print(f"plot: {png}")
    print(f"results: {out} ({sum(len(r['seeds']) for r in rows)} runs)")
    return 0


def rebuild_report(out: Path) -> int:
    """--report: the summary, table and plot of a results file again, from its runs (no training; the file's
    device, versions and settings stay as they are)."""
    if not out.is_file():
        raise SystemExit(f"--report: {out} does not exist; give the results file of a run with --out")
    held = json.loads(out.read_text())
    rows = summarize(held.get("runs", []))
    if not rows:
        raise SystemExit(f"--report: {out} holds no runs")
    held["summary"] = rows
    from tttvideo.data.cache import atomic_write_text

    atomic_write_text(out, json.dumps(held, indent=1))
    return report(out, rows)


def run_settings(args) -> dict:
    """What makes runs comparable: a results file holds runs of one setting only."""
    from tttvideo.config.loader import load_config

    steps = args.steps or load_config(args.config, args.overrides).train.steps
    return {"config": config_name(args.config), "overrides": list(args.overrides), "steps": steps,
            "eval_videos": args.eval_videos}


def config_name(config: str) -> str:
    """The config as the results file records it: relative to the repository when inside it, so that a file
    written on another machine compares equal."""
    path = Path(config).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def held_settings(held: dict) -> dict:
    """The settings of a results file's runs (files written before it recorded them: from their fields)."""
    if "settings" in held:
        return held["settings"]
    return {"config": held.get("config"), "overrides": held.get("overrides", []),
            "steps": held["runs"][0]["steps"], "eval_videos": held.get("eval_videos")}


def run_serial(pending: list[tuple[str, str, int]], args, work: Path):
    for variant, duration, seed in pending:
        t0 = time.perf_counter()
        row = train_and_score(Path(args.config), variant, duration, seed, args, work)
        yield {**row, "wall_s": time.perf_counter() - t0, "concurrent_jobs": 1}


def run_parallel(pending: list[tuple[str, str, int]], args, work: Path):
    """Each run as `long_range.py` of that one run in a subprocess (its JSON and log in <work>/parts), at most
    `args.jobs` at once; yields each run's row as it finishes."""
    import torch

    parts = work / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    queue, active = list(pending), {}
    threads = []
    if not torch.cuda.is_available() and not any(o.startswith("train.cpu_threads=") for o in args.overrides):
        # on the CPU the jobs share the cores: each its share, not all of them (oversubscribed, every job crawls)
        threads = ["--set", f"train.cpu_threads={max(1, (os.cpu_count() or 1) // args.jobs)}"]
    while queue or active:
        while queue and len(active) < args.jobs:
            variant, duration, seed = queue.pop(0)
            name = f"{duration}-{variant}-seed{seed}"
            cmd = [sys.executable, __file__, "--config", args.config, "--variants", variant, "--durations", duration,
                   "--seeds", str(seed), "--steps", str(args.steps), "--eval-videos", str(args.eval_videos),
                   "--work", str(work), "--out", str(parts / f"{name}.json"), "--no-report"]
            for o in args.overrides:
                cmd += ["--set", o]
            cmd += threads
            (parts / f"{name}.json").unlink(missing_ok=True)  # scratch: an earlier part may have other settings
            log = open(parts / f"{name}.log", "w")
            active[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log, time.perf_counter())
        time.sleep(1.0)
        for name, (proc, log, t0) in list(active.items()):
            if proc.poll() is None:
                continue
            log.close()
            del active[name]
            if proc.returncode != 0:
                raise SystemExit(f"run {name} failed (exit {proc.returncode}); its log: {parts / f'{name}.log'}")
            (row,) = json.loads((parts / f"{name}.json").read_text())["runs"]
            yield {**row, "wall_s": time.perf_counter() - t0, "concurrent_jobs": args.jobs}


def write(out: Path, runs: list[dict], probes: dict, args, torch, rows: list[dict] | None = None) -> dict:
    from tttvideo.data.cache import atomic_write_text

    # GIT_COMMIT first: a copied work tree (a lent GPU machine's) may carry another checkout's .git
    commit = os.environ.get("GIT_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                            capture_output=True, text=True, cwd=ROOT).stdout.strip()
    result = {"benchmark": "long_range", "device": torch.cuda.get_device_name() if torch.cuda.is_available()
              else platform.processor() or "cpu", "torch": torch.__version__, "git_commit": commit,
              "config": config_name(args.config), "overrides": args.overrides, "eval_videos": args.eval_videos,
              "settings": run_settings(args),
              "chance": 1 / 6, "probe": probes, "runs": runs, "summary": rows or summarize(runs)}
    atomic_write_text(out, json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(main())
