"""The CPU demo over several training seeds: its own video's score and the 20-scene score of each trained model.

    PYTHONPATH=src python3 benchmarks/demo_seeds.py --seeds 0 1 2 --out benchmarks/results/demo_seeds.json
    PYTHONPATH=src python3 benchmarks/demo_seeds.py --seeds 0 --set train.steps=300 ...   # a variant

Each seed trains `configs/demo.toml` as `make demo` does (`tttv train`, one CPU thread), with `train.seed` (which
also draws the demo set) set, its folders under `--work` and TensorBoard off; `--set` overrides go on top. Then:

- "its video": the end-of-run mp4 the demo writes, scored against its captions (`demo_score.score_video_file`);
- "20 scenes": the trained model samples the 8 training stories at sampling seed 0 and the first story (the demo's
  own) at sampling seeds 1 and 2, as the end-of-run video is sampled, and each is scored (`score_frames` on the
  decoded frames, pooled by 8): 10 videos of 2 scenes.

With `--set train.ema_decay=...` the trained run holds EMA weights, which its video and "20 scenes" sample with;
the same 20 scenes are then sampled with the last-step weights too ("20 scenes, raw": `sample.use_ema = false`),
so one training compares both, and the frames of the demo's own story from the raw weights go to
raw-frames.png beside the run's frames.png.

The CPU time of each training command (user + system of the child process) is recorded; on a shared machine it,
not the wall time, is comparable between runs. Prints a table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tttvideo.data.demo_score import CHANCE, score_frames, score_video_file
from tttvideo.results import save_json

ATTRIBUTES = tuple(CHANCE)


def _child_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def train_seed(seed: int, work: Path, overrides: list[str], config: str) -> tuple[Path, float, str]:
    out = work / f"seed-{seed}"
    sets = [f"train.seed={seed}", f"train.output_dir={out}", f"data.demo_dir={work}/data-{seed}",
            "train.tensorboard=false", *overrides]
    cmd = [sys.executable, "-m", "tttvideo", "train", config, "--overwrite"]
    for s in sets:
        cmd += ["--set", s]
    before = _child_cpu_s()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    cpu = _child_cpu_s() - before
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: training failed\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return out, cpu, proc.stdout


def twenty_scenes(run: Path, data: Path, overrides: tuple[str, ...] = (), first_png: Path | None = None) -> dict:
    from tttvideo.api import VideoPipeline
    from tttvideo.train.figures import frame_strip

    stories = json.loads((data / "stories.json").read_text())
    jobs = [(story, 0) for story in stories] + [(stories[0], 1), (stories[0], 2)]
    scenes = []
    with VideoPipeline.from_run(run, overrides=overrides) as pipe:
        for story, sample_seed in jobs:
            video = pipe(story, seed=sample_seed)
            captions = [s["text"] for s in story]
            if first_png is not None and story is stories[0] and sample_seed == 0:
                frame_strip(video.frames, captions, first_png)
            scenes += score_frames(video.frames, captions, pool=8).scenes
    acc = {a: float(np.mean([getattr(s, f"{a}_ok") for s in scenes])) for a in ATTRIBUTES}
    return {"scenes": len(scenes), "accuracy": acc, "overall": float(np.mean(list(acc.values()))),
            "fill": [s.fill for s in scenes], "aspect": [s.aspect for s in scenes],
            "shapes": [(s.caption, s.shape) for s in scenes]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override, repeatable")
    ap.add_argument("--config", default="configs/demo.toml")
    ap.add_argument("--work", default="runs/demo-seeds", help="folder of the runs and their demo sets")
    ap.add_argument("--out", default="", help="JSON file to write")
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(args.work)
    rows = []
    for seed in args.seeds:
        t0 = time.time()
        run, cpu, printed = train_seed(seed, work, args.overrides, args.config)
        (video,) = sorted((run / "samples").glob("*.mp4"))
        own = score_video_file(video)
        losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        row = {"seed": seed, "train_cpu_s": round(cpu, 1), "wall_s": None,
               "last_loss": float(np.mean(losses[-25:])),
               "video": {"overall": own.overall, "accuracy": {a: own.accuracy(a) for a in ATTRIBUTES},
                         "scenes": [(s.caption, s.colour, s.shape, s.direction, s.background) for s in own.scenes]},
               "twenty": twenty_scenes(run, work / f"data-{seed}")}
        if any((run / "checkpoints").glob("step-*/ema.safetensors")):
            row["twenty_raw"] = twenty_scenes(run, work / f"data-{seed}", ("sample.use_ema=false",),
                                              run / "raw-frames.png")
        row["wall_s"] = round(time.time() - t0, 1)
        rows.append(row)
        raw = f" (raw weights {row['twenty_raw']['overall']:.2f})" if "twenty_raw" in row else ""
        print(f"seed {seed}: video {own.overall:.2f}, 20 scenes {row['twenty']['overall']:.2f}{raw}, "
              f"training {cpu:.0f} s CPU", flush=True)
    print(f"\n{'train.seed':>10} | its video | 20 scenes: " + " / ".join(ATTRIBUTES) + " | overall | CPU s")
    for r in rows:
        acc = r["twenty"]["accuracy"]
        print(f"{r['seed']:>10} | {r['video']['overall']:.2f} | " + " / ".join(f"{acc[a]:.2f}" for a in ATTRIBUTES)
              + f" | {r['twenty']['overall']:.2f} | {r['train_cpu_s']:.0f}")
        if "twenty_raw" in r:
            acc = r["twenty_raw"]["accuracy"]
            print(f"{'raw':>10} | {'':>9} | " + " / ".join(f"{acc[a]:.2f}" for a in ATTRIBUTES)
                  + f" | {r['twenty_raw']['overall']:.2f} |")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        record = {"device": "cpu", "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                  "git_commit": commit, "config": args.config, "overrides": args.overrides, "runs": rows}
        save_json(args.out, record)


if __name__ == "__main__":
    main()
