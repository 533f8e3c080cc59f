"""Long-range consistency: does the layer beside local attention carry what the first scene said into later scenes?

Each row is trained with the same data, steps and seeds, then samples a fixed set of held-out stories of the same
kind; the probe (`tttvideo.data.demo_score.score_persistence`) reads the colour of the shape back from every later
scene of every sampled video (chance 1/6). The data: the long-range demo set, where only the first scene's caption
names the shape's colour and every later 3-s segment cuts to a new scene in that colour. Local attention sees only
its own segment's caption, so without a long-range layer the colour of a later scene is a guess.

The rows: the main table, one per long-range layer (TTT-MLP, TTT-Linear, none, full attention, Mamba 2, Gated
DeltaNet), and the ablations of TTT-MLP, each changing one setting of the ttt-mlp row (its inner base learning rate,
mini-batch, gate init, an inner MLP with TTT-Linear's parameter count, the reference system's learning-rate layout;
TTT-Linear with that layout beside it). The default config, configs/long-range-d64.toml, is the `small` model: 4
blocks of 4 heads of 64, the paper's head size (configs/long-range.toml: the tiny model of the first results).

Per duration and row: the accuracy per scene distance (+1 = the scene right after the first, ...) and overall as
mean and 95 % t-interval over seeds, the control (how often the first scene, whose caption names the colour, shows
it: a model that has not learned to follow its captions makes the other scores meaningless), the loss curve (mean
loss per 50 steps, every run; the table gives its last window and the change from the one before, to show whether
the run converged), the median step time, the peak GPU memory of training and the long-range layer's parameters per
block (benchmarks/long_range_report.py).

Device time: the ablations run at 9 s with seeds 0-2 only (--ablation-durations, --ablation-seeds), the main table at
9 s and 18 s with seeds 0-4: 60 + 21 = 81 runs of 1000 steps of batch 16 (the config). Runs go seed by seed (main
rows and ablations of a seed, then the next seed), so that a table cut short holds whole comparisons with fewer
seeds. Each run samples its 64 held-out stories 32 per forward (benchmarks/long_range_eval.py), not one by one. Before
training it prints a run plan with an estimate of the wall time (benchmarks/long_range_plan.py: --plan-step-s, the
seconds of a run per training step with --jobs runs sharing the device, fitted with per-row factors to this config's
runs with 3 jobs on an H200; a row and duration the results file already holds runs of, made with as many jobs, is
priced at their median wall time instead; --plan prints it alone); after each run, the measured rate and the time left.
--budget-s starts no run that would end past that many seconds by its plan, scaled by how far the last finished runs
were off theirs: a freed slot takes the first run in order that fits, so a long run past the budget leaves its slot to
shorter ones behind it; the same command again continues from the results file (a run planned longer than the budget
never starts under it: the plan says which). --merge adds the runs of other results files of the same settings, device
and torch (a second command's, run beside the first on one GPU) to --out; --across-devices also those of another GPU
(accuracies join, step times stay per GPU). --gpus N spreads the runs over N GPUs of
the host, --jobs on each (a run's process sees its GPU alone). 3 jobs: the processes time-slice the GPU,
so 8 jobs finished no more runs an hour than 3 on the H200, and the tiny model's runs on the H100 were slower at 12
jobs than at 6; a batch-16 run of this model at 18 s held up to 11.4 GB (Gated DeltaNet on the PyTorch recurrence,
H200).

Before training anything it checks that the probe is live on the held-out stories themselves: their own latents
score 1.0 and the same stories with every later scene recoloured score 0.0. The results JSON is rewritten after each
run and a rerun skips the runs it holds (runs of other settings need another --out); a run that fails is recorded
with its error (`failed`) and the others go on; a rerun tries it again. A table is printed and the plots are written
beside the JSON: accuracy by scene distance (<out>.png) and the loss curves (<out>-loss.png); `--report` rebuilds
them from a results file without training, and its table is the markdown docs/long_range.md shows.
3-s videos have one scene, so nothing to carry: durations start at 6 s.

    TORCHINDUCTOR_COMPILE_THREADS=1 PYTHONPATH=src python3 benchmarks/long_range.py --jobs 3 --budget-s 1500 \\
        --out benchmarks/results/long_range_d64_h200.json                                      # GPU
    PYTHONPATH=src python3 benchmarks/long_range.py --config configs/long-range.toml --durations 6s --seeds 0 \\
        --ablations none --steps 3 --eval-videos 2 --set sample.steps=2 --out /tmp/lr.json    # a CPU smoke run
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
if str(ROOT) not in sys.path:  # run as a script: benchmarks.long_range_report from the repository
    sys.path.insert(0, str(ROOT))

from benchmarks.long_range_plan import (fits_budget, num_segments, plan_runs, print_plan,  # noqa: E402 - after the path
                                        slots)

# the main table: the layer each variant puts after local attention; TTT-Linear takes the original's inner rate
VARIANTS = {
    "ttt-mlp": ["model.sequence_layer=ttt", "ttt.kind=mlp"],
    "ttt-linear": ["model.sequence_layer=ttt", "ttt.kind=linear", "ttt.base_lr=1.0"],
    "none": ["model.sequence_layer=none"],
    "full-attention": ["model.sequence_layer=full-attention"],
    "mamba2": ["model.sequence_layer=mamba2"],
    "gated-deltanet": ["model.sequence_layer=gated-deltanet"],
}
# the ablations: the ttt-mlp row (base_lr 0.1, mini-batch 64, gate init 0.1, inner MLP 4 x the head dim, per-token
# learning rates) with one setting changed; "reference" learning rates run on the PyTorch scan ("auto" falls back to
# it: the Triton kernels take per-token rates only)
TTT_MLP = VARIANTS["ttt-mlp"]
ABLATIONS = {
    "ttt-mlp-lr0.01": [*TTT_MLP, "ttt.base_lr=0.01"],
    "ttt-mlp-lr1": [*TTT_MLP, "ttt.base_lr=1.0"],
    "ttt-mlp-mb16": [*TTT_MLP, "ttt.mini_batch_size=16", "ttt.sample_mini_batch_size=16"],
    "ttt-mlp-gate1": [*TTT_MLP, "ttt.gate_init=1.0"],
    # inner MLP D -> D/2 -> D: its inner weights hold H D^2 parameters, TTT-Linear's (plus H D/2 biases)
    "ttt-mlp-linear-params": [*TTT_MLP, "ttt.mlp_hidden={half_head_dim}"],
    "ttt-mlp-eta-reference": [*TTT_MLP, "ttt.eta_layout=reference"],
    "ttt-linear-eta-reference": [*VARIANTS["ttt-linear"], "ttt.eta_layout=reference"],
}
ROWS = {**VARIANTS, **ABLATIONS}
DESCRIBED = {
    "ttt-mlp": "TTT-MLP (inner MLP D -> 4D -> D, base lr 0.1, mini-batch 64)",
    "ttt-linear": "TTT-Linear (base lr 1.0)",
    "none": "local attention only",
    "full-attention": "attention over the whole video",
    "mamba2": "Mamba 2",
    "gated-deltanet": "Gated DeltaNet",
    "ttt-mlp-lr0.01": "TTT-MLP, inner base lr 0.01",
    "ttt-mlp-lr1": "TTT-MLP, inner base lr 1.0",
    "ttt-mlp-mb16": "TTT-MLP, mini-batch 16 (train and sample)",
    "ttt-mlp-gate1": "TTT-MLP, gate init 1.0 (tanh 0.76)",
    "ttt-mlp-linear-params": "TTT-MLP, inner MLP D -> D/2 -> D: TTT-Linear's parameters",
    "ttt-mlp-eta-reference": "TTT-MLP, the reference system's learning-rate layout",
    "ttt-linear-eta-reference": "TTT-Linear, the reference system's learning-rate layout",
}
LOSS_WINDOW = 50  # steps per point of a run's loss curve
def train_and_score(base: Path, variant: str, duration: str, seed: int, args, work: Path) -> dict:
    """One run: train, sample the held-out stories from its checkpoint, score them."""
    import torch
    from safetensors.torch import load_file

    from benchmarks.long_range_eval import eval_stories, sample_batched
    from tttvideo.api import train
    from tttvideo.config.loader import load_config
    from tttvideo.data.demo_score import latent_frames, score_persistence
    from tttvideo.device import resolve_device
    from tttvideo.layout import parse_duration
    from tttvideo.models.backbone import get_preset
    from tttvideo.runs import find_model_file

    out = work / duration / variant / f"seed{seed}"
    spec = get_preset(load_config(base, args.overrides).model.preset)
    overrides = row_overrides(variant, spec.attention_head_dim) + [
        f"layout.duration={duration}", f"train.seed={seed}", f"train.output_dir={out}"]
    if args.steps:
        overrides.append(f"train.steps={args.steps}")
    # the demo set's folder follows from the run's settings (a --set data.demo_dir still wins: it comes last)
    folder = demo_dir(work, load_config(base, overrides + args.overrides), duration, seed)
    cfg = load_config(base, [*overrides, f"data.demo_dir={folder}", *args.overrides])
    cuda = torch.cuda.is_available() and cfg.train.device != "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = train(cfg, quiet=True)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    metrics = read_metrics(result.output_dir)
    step_s = [r["step_time"] for r in metrics if isinstance(r.get("step_time"), (int, float))]
    videos, stories = eval_stories(num_segments(cfg), args.eval_videos)
    t0 = time.perf_counter()
    samples = sample_batched(cfg, stories, result.output_dir, resolve_device(cfg.sample.device, "sample.device"),
                             args.eval_batch)
    sample_s = time.perf_counter() - t0
    distances: list[list[bool]] = []
    first: list[bool] = []  # the control: the first scene, whose caption names the colour
    for video, latents in zip(videos, samples):
        frames = latent_frames(latents)
        score = score_persistence(frames, [s.caption for s in video.scenes])
        distances.append(score.by_distance())
        first.append(score.first.colour_ok)
    per_distance = [statistics.mean(float(d[i]) for d in distances) for i in range(len(distances[0]))]
    params = sum(p.numel() for n, p in load_file(str(find_model_file(result.output_dir))).items() if ".ttt." in n)
    return {"variant": variant, "duration": duration, "duration_s": parse_duration(duration), "seed": seed,
            "steps": result.steps_done,
            "first_loss": result.first_loss, "last_loss": result.last_loss, "train_s": result.seconds,
            "sample_s": sample_s,
            "median_step_s": statistics.median(step_s) if step_s else result.seconds / max(result.steps_done, 1),
            "peak_allocated_gib": peak / 2**30 if peak is not None else None, "long_range_params": params,
            "layer_params_per_block": params // spec.num_layers,
            "loss_curve": loss_curve(metrics), "accuracy_by_distance": per_distance,
            "accuracy": statistics.mean(per_distance), "first_scene_colour": statistics.mean(map(float, first)),
            "eval_videos": len(samples), "recurrence": recurrence_kernels(variant, cfg.ttt.backend, cuda)}


def demo_dir(work: Path, cfg, duration: str, seed: int) -> Path:
    """The demo set's folder of a run: one per demo set, named by the fingerprint of the settings that make the set
    (`tttvideo.train.runfolder.demo_settings`; the trainer checks the set's own stamp before it uses a folder). The
    runs of a (duration, seed) share one folder, so the set is built once, except a row whose settings make another
    set: ttt-mlp-mb16's mini-batch of 16 changes the layout's TTT padding, and in the folder of the others (held by
    their runs) it found a set of other settings and failed."""
    from tttvideo.data.demo import DemoSpec
    from tttvideo.models.backbone import get_preset, layout_of
    from tttvideo.train.runfolder import demo_settings

    demo = DemoSpec.of(**demo_settings(cfg, layout_of(cfg), get_preset(cfg.model.preset)))
    return work / "data" / f"{duration}-seed{seed}-{demo.fingerprint()[:8]}"


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


def row_overrides(variant: str, head_dim: int) -> list[str]:
    """The config overrides of a row at a model of this head dim."""
    return [o.format(half_head_dim=head_dim // 2) for o in ROWS[variant]]


def read_metrics(run: Path) -> list[dict]:
    """The rows of the run's metrics log (the trainer's `metrics.jsonl`: one per optimizer step), when it has one."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def loss_curve(metrics: list[dict], every: int = LOSS_WINDOW) -> dict:
    """Mean loss per window of `every` steps (the last window may be shorter; runs shorter than one window: one
    point)."""
    losses = [r["loss"] for r in metrics if isinstance(r.get("loss"), (int, float))]
    every = max(1, min(every, len(losses)))
    return {"every": every, "mean_loss": [statistics.mean(losses[i:i + every]) for i in range(0, len(losses), every)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "long-range-d64.toml"))
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"rows of the main table, comma separated, of {', '.join(VARIANTS)} ('none' is local "
                         "attention's row; an empty value runs no main row, only --ablations)")
    ap.add_argument("--durations", default="9s,18s", help="of the main table, comma separated, 6 s and longer")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="of the main table")
    ap.add_argument("--ablations", default=",".join(ABLATIONS),
                    help=f"ablation rows, comma separated ('none': no ablation), of {', '.join(ABLATIONS)}")
    ap.add_argument("--ablation-durations", default="9s")
    ap.add_argument("--ablation-seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=0, help="training steps per run (0: the config's train.steps)")
    ap.add_argument("--eval-videos", type=int, default=64, help="held-out stories sampled per run")
    ap.add_argument("--eval-batch", type=int, default=32,
                    help="held-out stories sampled per forward (one model call per solver step for all of them)")
    ap.add_argument("--work", default="runs/long-range-benchmark", help="run folders")
    ap.add_argument("--out", default="benchmarks/results/long_range.json")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override for every run")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once, each in its own process (the small models leave a GPU mostly idle; step "
                         "times are then measured side by side, recorded as concurrent_jobs)")
    ap.add_argument("--gpus", type=int, default=1,
                    help="GPUs of this host to spread the runs over, --jobs runs on each (each run's process sees "
                         "its GPU alone, CUDA_VISIBLE_DEVICES): the same step times as --jobs on one GPU, the runs "
                         "done that many times sooner")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no run that would end after this many seconds from the start: its planned time "
                         "scaled by how far the last finished runs were off their plan; a freed slot takes the "
                         "first run in order that fits; 0 = no limit. The same command again continues (a run "
                         "planned longer than the budget never starts under it: the plan names such runs)")
    ap.add_argument("--plan-step-s", type=float, default=0.18,
                    help="the run plan's seconds of a run's wall time per training step (start-up aside, warm-up "
                         "in), the mean of the main rows at 9 s with --jobs runs sharing the device; each row and "
                         "duration scales it (PLAN_ROW_STEP in benchmarks/long_range_plan.py). 0.18: the default "
                         "config with 3 jobs on an H200 (its 1000-step runs at 9 s: 107-472 s each); another config, "
                         "--jobs or device needs its own")
    ap.add_argument("--plan", action="store_true", help="print the run plan and stop (nothing trains)")
    ap.add_argument("--no-report", action="store_true",
                    help="write the results file only, no table or plot (what --jobs passes to each run's process)")
    ap.add_argument("--probe-checked", action="store_true",
                    help="skip the probe's live check (what --jobs passes to each run's process: it checked it)")
    ap.add_argument("--report", action="store_true",
                    help="train nothing: rebuild the summary, table and plots of the --out file from its runs")
    ap.add_argument("--merge", nargs="+", metavar="FILE", default=[],
                    help="train nothing: add to the --out file the runs of these results files that it lacks (same "
                         "settings, device and torch: e.g. a second command's runs beside the first on one GPU; "
                         "another device with --across-devices), "
                         "then rebuild its report as --report does")
    ap.add_argument("--across-devices", action="store_true",
                    help="with --merge: also join files made on another GPU (their accuracies join the table; each "
                         "row's step time stays the median of its runs on the --out file's device, where it has any)")
    args = ap.parse_args(argv)
    start = time.perf_counter()  # --budget-s counts from here: the probe check and the plan are in it
    if args.merge:
        return rebuild_report(Path(args.out), merge_files(Path(args.out), [Path(f) for f in args.merge],
                                                          args.across_devices))
    if args.report:
        return rebuild_report(Path(args.out))

    import torch

    from benchmarks.long_range_eval import eval_stories, probe_check
    from benchmarks.long_range_report import label_seconds
    from tttvideo.config.loader import load_config
    from tttvideo.memory.profile.profiler import git_commit

    variants = [v for v in args.variants.split(",") if v]
    ablations = [a for a in args.ablations.split(",") if a and a != "none"]
    unknown = [v for v in variants if v not in VARIANTS] + [a for a in ablations if a not in ABLATIONS]
    if unknown:
        ap.error(f"unknown row(s) {unknown}; --variants of {', '.join(VARIANTS)}; --ablations of "
                 f"{', '.join(ABLATIONS)} or none")
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
    device = device_name(torch)
    if held.get("runs") and held.get("device") != device and not args.plan:
        raise SystemExit(f"{out} holds runs made on {held.get('device')}, this is {device}: their step times are not "
                         f"one table; give another --out and join the files with --merge ... --across-devices")
    runs, failed = held.get("runs", []), []  # a failed run is tried again
    done = {(r["variant"], r["duration"], r["seed"]) for r in runs}
    pending = plan_runs(variants, args.durations, args.seeds, ablations, args.ablation_durations,
                        args.ablation_seeds, done)
    # the plan prices by this GPU's runs only (a run without a device ran on the file's)
    here = [r for r in runs if r.get("device", held.get("device")) == device]
    estimate = print_plan(pending, here, args, mine["steps"], load_config(args.config, args.overrides))
    if args.plan:
        return 0
    args.gpu_ids = check_gpus(args.gpus, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    probes = held.get("probe", {})
    for duration in sorted({d for _, d, _ in pending} | set(args.durations.split(",")), key=label_seconds):
        cfg = load_config(args.config, [f"layout.duration={duration}"] + args.overrides)
        segments = num_segments(cfg)
        if segments < 2:
            ap.error(f"--durations {duration}: one 3-s segment has no later scene to score; use 6s or longer")
        if args.probe_checked:
            continue
        videos, _ = eval_stories(segments, args.eval_videos)
        probes[duration] = probe_check(cfg, videos)
        if probes[duration] != {"kept": 1.0, "forgotten": 0.0}:
            raise SystemExit(f"the probe is not live at {duration}: {probes[duration]} (want kept 1.0, forgotten "
                             f"0.0); fix tttvideo.data.demo_score before trusting any score")
    ratios: list[float] = []  # each finished run's wall time over its planned time
    commit = git_commit()
    for row in (run_parallel(pending, args, work, start, estimate, ratios) if slots(args) > 1
                else run_serial(pending, args, work, start, estimate, ratios)):
        key = (row["variant"], row["duration"], row["seed"])
        if "error" in row:
            failed.append(row)
            print(f"{row['duration']} {row['variant']} seed {row['seed']}: FAILED: {row['error']}", flush=True)
        else:
            # the file's own commit is the last rerun's
            runs.append({**row, "git_commit": row.get("git_commit") or commit, "device": device})
            ratios.append(row["wall_s"] / estimate[key])
            print(f"{row['duration']} {row['variant']} seed {row['seed']}: accuracy {row['accuracy']:.2f} "
                  f"{[round(a, 2) for a in row['accuracy_by_distance']]}, loss {row['last_loss']:.4f} "
                  f"({row['wall_s']:.0f} s)", flush=True)
        finished = len(runs) - len(done) + len(failed)
        left = len(pending) - finished
        rate = (time.perf_counter() - start) / finished
        print(f"  {finished}/{len(pending)} runs in {time.perf_counter() - start:.0f} s; {left} left, about "
              f"{left * rate:.0f} s at this rate", flush=True)
        write(out, runs, probes, args, torch, failed=failed)
    rows = summarize(runs, list(ROWS), device)  # every run the file holds: one setting, so all comparable
    write(out, runs, probes, args, torch, rows, failed)
    return 0 if args.no_report else report(out, rows, runs, failed, device)


def report(out: Path, rows: list[dict], runs: list[dict], failed: list[dict] | None = None,
           device: str | None = None) -> int:
    """The table on stdout and the plots beside the results file."""
    from benchmarks.long_range_report import plot_accuracy, plot_losses, table
    from tttvideo.data.demo_score import CHANCE

    chance = CHANCE["colour"]
    print(table(rows, chance, DESCRIBED, failed, device))
    if not rows:
        print(f"results: {out} (no runs)")
        return 0
    groups = {"main table": (list(VARIANTS), []), "ablations of TTT-MLP": (list(ABLATIONS), ["ttt-mlp", "ttt-linear"])}
    for png in (plot_accuracy(rows, chance, groups, out.with_suffix(".png")),
                plot_losses(runs, out.with_name(out.stem + "-loss.png"))):
        if png:
            print(f"plot: {png}")
    print(f"results: {out} ({sum(len(r['seeds']) for r in rows)} runs)")
    return 0


def merge_files(out: Path, others: list[Path], across_devices: bool = False) -> dict:
    """--merge: `out`'s results with the runs of `others` that it lacks added (`rebuild_report` writes them)."""
    from benchmarks.long_range_report import merge_runs

    for path in [out, *others]:
        if not path.is_file():
            raise SystemExit(f"--merge: {path} does not exist; give results files written with --out")
    held = json.loads(out.read_text())
    for path in others:
        other = json.loads(path.read_text())
        try:
            added, kept = merge_runs(held, other, held_settings(held), held_settings(other), str(path), across_devices)
        except ValueError as err:
            raise SystemExit(f"--merge: {err}; merge only files of one setting") from None
        print(f"--merge: {path}: {added} run(s) added, {kept} held already (the ones in {out} kept)")
    return held


def rebuild_report(out: Path, held: dict | None = None) -> int:
    """--report: the summary, table and plots of a results file again, from its runs (no training; the file's
    device, versions and settings stay as they are); `held`: its results as --merge left them, written here."""
    if held is None:
        if not out.is_file():
            raise SystemExit(f"--report: {out} does not exist; give the results file of a run with --out")
        held = json.loads(out.read_text())
    runs = held.get("runs", [])
    rows = summarize(runs, list(ROWS), held.get("device"))
    if not rows:
        raise SystemExit(f"--report: {out} holds no runs")
    held["summary"] = rows
    from tttvideo.results import save_json

    save_json(out, held)
    return report(out, rows, runs, held.get("failed"), held.get("device"))


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


def run_serial(pending: list[tuple[str, str, int]], args, work: Path, start: float, estimate: dict,
               ratios: list[float]):
    """Each run in this process, one after the other; a run that raises is yielded as its error."""
    for variant, duration, seed in pending:
        if not fits_budget(args, start, estimate[(variant, duration, seed)], ratios):
            print(f"--budget-s {args.budget_s:.0f}: {variant} {duration} seed {seed} not started (planned "
                  f"{estimate[(variant, duration, seed)]:.0f} s); a rerun continues", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            row = train_and_score(Path(args.config), variant, duration, seed, args, work)
        except Exception as err:  # noqa: BLE001 - one run's failure is recorded; the table goes on
            yield {"variant": variant, "duration": duration, "seed": seed, "error": f"{type(err).__name__}: {err}"}
            continue
        yield {**row, "wall_s": time.perf_counter() - t0, "concurrent_jobs": 1}


def run_parallel(pending: list[tuple[str, str, int]], args, work: Path, start: float, estimate: dict,
                 ratios: list[float]):
    """Each run as `long_range.py` of that one run in a subprocess (its JSON and log in <work>/parts), at most
    `args.jobs` at once; yields each run's row as it finishes (a run that failed: its error and the end of its
    log)."""
    import torch

    parts = work / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    queue, active = list(pending), {}
    gpus = args.gpu_ids
    threads = []
    if not torch.cuda.is_available() and not any(o.startswith("train.cpu_threads=") for o in args.overrides):
        # on the CPU the jobs share the cores: each its share, not all of them (oversubscribed, every job crawls)
        threads = ["--set", f"train.cpu_threads={max(1, (os.cpu_count() or 1) // args.jobs)}"]
    while queue or active:
        while queue and len(active) < slots(args):
            # the first queued run that fits: a long run past the budget leaves its slot to shorter ones after it
            fit = next((i for i, run in enumerate(queue) if fits_budget(args, start, estimate[run], ratios)), None)
            if fit is None:
                if not active:  # nothing runs whose end could change the rate: none of them will fit
                    print(f"--budget-s {args.budget_s:.0f}: {len(queue)} run(s) not started; a rerun continues",
                          flush=True)
                    queue.clear()
                break
            variant, duration, seed = queue.pop(fit)
            name = f"{duration}-{variant}-seed{seed}"
            cmd = [sys.executable, __file__, "--config", args.config, "--variants", variant if variant in VARIANTS
                   else "", "--ablations", variant if variant in ABLATIONS else "none", "--durations", duration,
                   "--ablation-durations", duration, "--seeds", str(seed), "--ablation-seeds", str(seed),
                   "--steps", str(args.steps), "--eval-videos", str(args.eval_videos),
                   "--eval-batch", str(args.eval_batch),
                   "--work", str(work), "--out", str(parts / f"{name}.json"), "--no-report", "--probe-checked"]
            for o in args.overrides:
                cmd += ["--set", o]
            cmd += threads
            (parts / f"{name}.json").unlink(missing_ok=True)  # scratch: an earlier part may have other settings
            log = open(parts / f"{name}.log", "w")
            gpu = least_busy([run[4] for run in active.values()], len(gpus))
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus[gpu]} if len(gpus) > 1 else None
            active[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                             env=env), log, time.perf_counter(), (variant, duration, seed), gpu)
        time.sleep(1.0)
        for name, (proc, log, t0, (variant, duration, seed), _) in list(active.items()):
            if proc.poll() is None:
                continue
            log.close()
            del active[name]
            part = parts / f"{name}.json"
            held = json.loads(part.read_text()) if part.is_file() else {}
            if proc.returncode != 0 or not held.get("runs"):
                errors = [f["error"] for f in held.get("failed", [])]
                tail = (parts / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
                yield {"variant": variant, "duration": duration, "seed": seed,
                       "error": (errors[0] if errors else f"exit {proc.returncode}: " + " / ".join(tail)),
                       "log": str(parts / f"{name}.log")}
                continue
            (row,) = held["runs"]
            yield {**row, "wall_s": time.perf_counter() - t0, "concurrent_jobs": args.jobs}


def check_gpus(gpus: int, visible: int) -> list[str]:
    """The CUDA_VISIBLE_DEVICES value of each of --gpus GPUs (this process's own numbering mapped through its
    CUDA_VISIBLE_DEVICES, if set); one sentence when the host has fewer."""
    if gpus < 1 or gpus > max(visible, 1):
        raise SystemExit(f"--gpus {gpus}: this host has {visible} visible CUDA GPU(s); give 1 to {max(visible, 1)}")
    own = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return [own[i] if i < len(own) else str(i) for i in range(gpus)]


def least_busy(busy: list[int], gpus: int) -> int:
    """The GPU with the fewest runs on it (`busy`: the GPU of each active run), the lowest on a tie."""
    return min(range(gpus), key=lambda g: (busy.count(g), g))


def die_with_parent() -> None:
    """Run in each job's process before it starts (Linux): the kernel sends it SIGTERM when this process ends, also
    by SIGKILL or a `timeout`. Without it the jobs of a benchmark stopped by its caller trained on, orphans sharing
    the GPU with whatever ran next (an H200 run: a Wan profile's step measured 17.9 s instead of 3.6)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def write(out: Path, runs: list[dict], probes: dict, args, torch, rows: list[dict] | None = None,
          failed: list[dict] | None = None) -> dict:
    from tttvideo.memory.profile.profiler import git_commit
    from tttvideo.results import save_json

    commit, device = git_commit(), device_name(torch)
    result = {"benchmark": "long_range", "device": device, "gpus": 1 if torch.cuda.is_available() else 0,
              "torch": torch.__version__, "git_commit": commit,
              "config": config_name(args.config), "overrides": args.overrides, "eval_videos": args.eval_videos,
              "settings": run_settings(args), "chance": 1 / 6, "probe": probes, "runs": runs,
              "failed": failed or [], "summary": rows or summarize(runs, list(ROWS), device)}
    save_json(out, result)
    return result


def device_name(torch) -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def summarize(runs: list[dict], order: list[str], device: str | None) -> list[dict]:
    from benchmarks.long_range_report import summarize as by_row

    return by_row(runs, order, device)


if __name__ == "__main__":
    sys.exit(main())
