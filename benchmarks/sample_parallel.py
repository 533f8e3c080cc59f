"""One guided denoising step of CogVideoX-5B + TTT-MLP under torchrun on 1, 2 and 4 GPUs, in one run: the speedup of
sequence parallelism and of splitting classifier-free guidance across ranks (`tttv sample`'s multi-process step).

    PYTHONPATH=src python3 benchmarks/sample_parallel.py --duration 63s --layouts 1,1b,sp2,sp2b,cfg2 \\
        --out benchmarks/results/sample_parallel_h200.json

Each layout is one `torchrun --standalone` launch of this file in worker mode, so every GPU count starts from a
fresh process group and CUDA context:

- `1`: one process (the baseline);
- `spN`: N ranks, `parallel.sp = N` (Ulysses: each rank holds 1/N of the tokens; every rank gets the whole
  prediction);
- `cfg2`: 2 ranks, `sample.split_guidance` (one rank the unconditional pass, the other the conditional one, one
  all-gather);
- `spNcfg2`: 2N ranks, both;
- a trailing `b` (`1b`, `spNb`): without a guidance split, both guided passes in one forward at batch 2
  (`sample.cfg_batched`) instead of two passes of batch 1, so one run times both beside the same baseline.

The step is the sampler's (`tttvideo.sample.guidance.GuidedPrediction` at guidance 4 over the ranks' groups, as
`tttv sample` builds them with `tttvideo.sample.distributed.start_sample_ranks`): random-init weights (bf16, the
same on every rank), random latents and text features, one warm-up step (it compiles and autotunes the kernels),
then `--steps` timed steps; a step's time is the slowest rank's, the median is reported. Per layout: step time,
speedup and efficiency against `1` (two passes of batch 1 on one GPU), the peak allocated memory of the busiest rank,
and how far its prediction is from layout `1`'s (relative max difference: bf16 summation order). The JSON is
rewritten after every layout and a rerun skips the layouts it holds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = re.compile(r"^(?:(?:1|sp(?P<sp>\d+))(?P<batched>b)?|sp(?P<both_sp>\d+)cfg2|(?P<cfg>cfg2))$")


def parse_layout(name: str) -> tuple[int, int, bool, bool]:
    """(ranks, sp, split guidance, batch-2 guidance) of a layout name."""
    m = LAYOUT.match(name)
    if not m:
        raise SystemExit(f"--layouts: {name!r} is not a layout; use 1, spN, cfg2 or spNcfg2, with a trailing b for "
                         "batch-2 guidance without a split (1b, spNb; e.g. 1,1b,sp2,sp2b,cfg2)")
    sp = int(m["sp"] or m["both_sp"] or 1)
    split = bool(m["both_sp"] or m["cfg"])
    return sp * (2 if split else 1), sp, split, bool(m["batched"])


def config_overrides(args, sp: int, split: bool, batched: bool) -> list[str]:
    return [f'model.preset="{args.preset}"', f'model.dtype="{args.dtype}"', f"layout.duration={args.duration}",
            f"layout.height={args.height}", f"layout.width={args.width}", "ttt.scan_checkpoint_group_size=0",
            f"parallel.sp={sp}", f"sample.split_guidance={'true' if split else 'false'}",
            f"sample.cfg_batched={'true' if batched else 'false'}", f'sample.device="{args.device}"',
            *args.overrides]


def worker(args) -> int:
    """One layout, on every rank of this torchrun launch; rank 0 writes the row to --row. A rank that fails leaves
    its traceback beside it (--row + .rank<N>.err): torchrun's own summary, the end of the log, does not hold it."""
    try:
        return run_layout(args)
    except BaseException:
        import traceback

        Path(f"{args.row}.rank{os.environ.get('RANK', '0')}.err").write_text(traceback.format_exc())
        raise


def run_layout(args) -> int:
    import torch
    import torch.distributed as dist

    from tttvideo.config.loader import load_config
    from tttvideo.layout import VideoLayout
    from tttvideo.models import build_model
    from tttvideo.models.backbone import get_preset
    from tttvideo.sample.distributed import start_sample_ranks
    from tttvideo.sample.guidance import GuidedPrediction

    _, sp, split, batched = parse_layout(args.worker)
    cfg = load_config(None, config_overrides(args, sp, split, batched))
    spec = get_preset(cfg.model.preset)
    ranks = start_sample_ranks(cfg, spec.num_attention_heads)
    device = ranks.device
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    row = {"layout": args.worker, "gpus": ranks.degrees.world_size, "sp": sp, "split_guidance": split,
           "cfg_batched": batched}
    try:
        torch.manual_seed(0)
        model = build_model(cfg, device=device).eval().requires_grad_(False)
        layout = VideoLayout.from_config(cfg.layout, cfg.ttt, phase="sample")
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(1, layout.latent_frames, spec.in_channels, layout.latent_height, layout.latent_width,
                        generator=gen).to(device, dtype)
        text = torch.randn(1, layout.num_segments, layout.text_tokens, spec.text_embed_dim,
                           generator=gen).to(device, dtype)
        step = GuidedPrediction(model, layout, text, torch.zeros_like(text), batched=batched,
                                fall_back_on_oom=False, sp=ranks.sequence, split=ranks.split)
        seconds = []
        for _ in range(1 + args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            with torch.no_grad():
                v = step(x, 999, 4.0)
            if cuda:
                torch.cuda.synchronize(device)
            # on the rank's device: a torchrun default group on a GPU host is NCCL only (CPU tensors have no backend)
            slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            seconds.append(float(slowest))
        peak = torch.tensor([torch.cuda.max_memory_allocated(device) if cuda else 0], dtype=torch.float64,
                            device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        row.update(status="ok", tokens=layout.total_tokens, warmup_s=seconds[0], step_s=seconds[1:],
                   median_step_s=statistics.median(seconds[1:]),
                   peak_allocated_gib=float(peak) / 2**30 if cuda else None)
        if ranks.is_main and args.prediction:
            torch.save(v.to("cpu", torch.float32), args.prediction)
    except torch.OutOfMemoryError as err:
        row.update(status="oom", error=str(err).splitlines()[0][:300])
    if ranks.is_main:
        Path(args.row).write_text(json.dumps(row))
    ranks.close()
    return 0


def launch(layout: str, args, work: Path) -> dict:
    """Run one layout under torchrun; its row, or a failed row with the log's tail."""
    ranks = parse_layout(layout)[0]
    row_path, log = work / f"{layout}.json", work / f"{layout}.log"
    for stale in [row_path, *work.glob(f"{layout}.json.rank*.err")]:
        stale.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           str(Path(__file__).resolve()), "--worker", layout, "--row", str(row_path),
           "--prediction", str(work / f"{layout}.pt"), "--preset", args.preset, "--dtype", args.dtype,
           "--duration", args.duration, "--height", str(args.height), "--width", str(args.width),
           "--steps", str(args.steps), "--device", args.device, *[x for s in args.overrides for x in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    print(f"{layout}: {ranks} process(es)", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code == 0 and row_path.is_file():
        row = json.loads(row_path.read_text())
    else:
        failed = sorted(work.glob(f"{layout}.json.rank*.err"))
        tail = (failed[0] if failed else log).read_text(errors="replace").strip()[-1500:]
        row = {"layout": layout, "gpus": ranks, "status": "failed", "error": f"exit {code}: {tail}"}
    row["command"] = " ".join(cmd[1:])
    row["process_s"] = round(time.perf_counter() - t0, 1)
    return row


def compare(rows: list[dict], work: Path) -> None:
    """Speedup and efficiency against layout `1`, and each prediction's distance from its prediction."""
    import torch

    base = next((r for r in rows if r["layout"] == "1" and r.get("status") == "ok"), None)
    reference = work / "1.pt"
    ref = torch.load(reference) if reference.is_file() else None
    for r in rows:
        if base is None or r.get("status") != "ok":
            continue
        r["speedup"] = base["median_step_s"] / r["median_step_s"]
        r["efficiency"] = r["speedup"] / r["gpus"]
        mine = work / f"{r['layout']}.pt"
        if ref is not None and mine.is_file():
            v = torch.load(mine)
            r["max_rel_diff_vs_1"] = float((v - ref).abs().max() / ref.abs().max())


def guidance(row: dict) -> str:
    """How a row runs its two guided passes."""
    return "split" if row["split_guidance"] else "batch 2" if row["cfg_batched"] else "2 passes"


def table(rows: list[dict]) -> str:
    lines = ["| layout | GPUs | sp | guidance | step s (median) | speedup | efficiency | peak / GPU GiB | "
             "max rel. diff vs 1 GPU |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['layout']} | {r['gpus']} | | | {r.get('status')}: "
                         f"{r.get('error', '').splitlines()[-1] if r.get('error') else ''} | | | | |")
            continue
        peak = f"{r['peak_allocated_gib']:.1f}" if r.get("peak_allocated_gib") else "-"
        lines.append(f"| {r['layout']} | {r['gpus']} | {r['sp']} | {guidance(r)} | "
                     f"{r['median_step_s']:.3f} | {r.get('speedup', float('nan')):.2f}x | "
                     f"{100 * r.get('efficiency', float('nan')):.0f}% | {peak} | "
                     f"{r.get('max_rel_diff_vs_1', float('nan')):.1e} |")
    return "\n".join(lines)


def environment(device: str) -> dict:
    import torch

    from tttvideo.memory.profile.profiler import git_commit

    commit = git_commit()
    gpu = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else "cpu"
    return {"device": gpu, "gpus_on_host": torch.cuda.device_count() if device == "cuda" else 0,
            "torch": torch.__version__, "git_commit": os.environ.get("GIT_COMMIT", commit)}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="1,1b,sp2,sp2b,cfg2,sp4,sp2cfg2",
                    help="comma separated: 1, spN, cfg2, spNcfg2; a trailing b (1b, spNb): batch-2 guidance")
    ap.add_argument("--duration", default="63s")
    ap.add_argument("--preset", default="cogvideox-5b")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=720)
    ap.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up step")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override for every rank")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per layout")
    ap.add_argument("--work", default="runs/sample_parallel")
    ap.add_argument("--out", default="benchmarks/results/sample_parallel.json")
    # worker mode (what each launch runs)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prediction", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    layouts = args.layouts.split(",")
    for name in layouts:
        parse_layout(name)
    from tttvideo.layout import parse_duration
    from tttvideo.results import save_json

    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    held = json.loads(out.read_text()) if out.is_file() else {}
    rows = [r for r in held.get("rows", []) if r.get("status") == "ok" and r["layout"] in layouts]
    for name in layouts:
        if any(r["layout"] == name for r in rows):
            continue
        rows.append(launch(name, args, work))
        rows.sort(key=lambda r: layouts.index(r["layout"]))
        compare(rows, work)
        save_json(out, {"benchmark": "sample_parallel", **environment(args.device),
                        "duration": args.duration, "duration_s": parse_duration(args.duration),
                        "preset": args.preset, "dtype": args.dtype,
                        "resolution": [args.height, args.width], "timed_steps": args.steps, "rows": rows})
    print(table(rows))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
