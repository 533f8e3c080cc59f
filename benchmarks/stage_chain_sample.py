"""benchmarks/stage_chain.py's closing `tttv sample`: the layouts it samples in (one process; sp, split guidance or
both on several GPUs), one sampling launch, and each layout's latents against the one-process run's."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks, run as a script or with -m
from launch_watch import Watched, failure, tttv  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def sample_layouts(gpus: int, heads: int) -> list[tuple[str, int, list[str]]]:
    """(name, processes, overrides) of each sampling layout: one process; with several GPUs also parallel.sp over
    as many of them as divide the model's `heads`, split guidance on two and, on four or more, both (sp over half
    the GPUs, each half one of guidance's two passes)."""
    if gpus == 1:
        return [("1", 1, [])]
    sp = max(n for n in range(1, gpus + 1) if heads % n == 0)
    layouts = [("1", 1, ["parallel.sp=1"]), (f"sp{sp}", sp, [f"parallel.sp={sp}"]),
               ("cfg2", 2, ["parallel.sp=1", "sample.split_guidance=true"])]
    half = max((n for n in range(2, gpus // 2 + 1) if heads % n == 0), default=0)
    if half:
        layouts.append((f"sp{half}cfg2", 2 * half, [f"parallel.sp={half}", "sample.split_guidance=true"]))
    return layouts


def run_sample(args: argparse.Namespace, work: Path, duration: int, layout: str, gpus: int,
               sets: list[str]) -> dict[str, Any]:
    segments = duration // 3
    story = work / f"story-{duration}s.json"
    story.write_text(json.dumps([{"text": f"a red ball, scene {i}"} for i in range(segments)]))
    suffix = "" if layout == "1" and args.gpus == 1 else f"-{layout}"
    out = work / f"sample-{duration}s{suffix}.mp4"
    log = work / f"sample-{duration}s{suffix}.log"
    print(f"=== tttv sample {duration} s, {segments} scenes, {args.sample_steps} steps, layout {layout}", flush=True)
    t0 = time.perf_counter()
    # random weights: the demo text encoder and no decoder, whatever encoder and VAE the recipe names (Wan's do)
    sets = [f"sample.steps={args.sample_steps}", "sample.write_video=false", "sample.save_latents=true",
            "sample.text_encoder_path=", "data.text_encoder_path=", "sample.vae_path=", "data.vae_path=",
            f"sample.device={args.device}", "parallel.dp_shard=-1", *sets,
            *(s for s in args.overrides if s.startswith(("memory.", "sample.")))]
    config = [str(REPO / args.sample_config)] if args.sample_config else []
    if config:  # the model the chain trained, from this chain's random base folder, not the recipe's real weights
        sets += [f"model.preset={args.preset}", f"model.pretrained_path={work / 'weights'}",
                 *(s for s in args.overrides if not s.startswith(("memory.", "sample.")))]
    cmd = tttv("sample", *config, "--checkpoint", str(work / f"stage-{duration}s"), "--scenes", str(story), "--out",
               str(out), *sum((["--set", s] for s in sets), []), gpus=gpus)
    child = Watched(cmd, log, REPO)
    code = child.wait()
    row = {"duration_s": duration, "layout": layout, "gpus": gpus, "config": args.sample_config or "checkpoint's",
           "wall_s": time.perf_counter() - t0,
           "exit_code": code, "peak_host_gib": child.host_peak, "host_by_process": child.host_by_role,
           "peak_gpu_used_gib": child.gpu_peak,
           "latents": str(out.with_suffix(".latents.safetensors"))}
    if code != 0:
        row["error"] = failure(log)
    denoise = [line.split("denoise ", 1)[1].split(" s", 1)[0] for line in log.read_text(errors="replace").splitlines()
               if "frames (" in line and "denoise " in line]
    if denoise:  # the sampler's own time, without loading; the first step's compiling and tuning are in it
        row["denoise_s"] = float(denoise[-1])
    return row


def compare_latents(rows: list[dict[str, Any]]) -> None:
    """Each layout's final latents against the one-process layout's: largest difference, absolute and relative
    to the largest latent."""
    from safetensors.torch import load_file

    ref_row = rows[0]
    if ref_row["exit_code"] != 0:
        return
    ref = load_file(ref_row["latents"])["latents"]
    for r in rows[1:]:
        if r["exit_code"] == 0:
            x = load_file(r["latents"])["latents"]
            diff = (x - ref).abs().max().item()
            r.update({"max_abs_diff_vs_1": diff, "max_rel_diff_vs_1": diff / ref.abs().max().item(),
                      "mean_abs_diff_vs_1": (x - ref).abs().mean().item(),
                      "rms_rel_diff_vs_1": ((x - ref).float().norm() / ref.float().norm()).item()})
