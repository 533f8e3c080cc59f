"""A backbone + TTT-MLP on an emulated 24 GB (and 12 GB) card: the project's own commands under `memory.max_gpu_gib`,
each in its own process, with one table at the end. `--backbone` picks the suite: CogVideoX-5B (the default) or
Wan2.1-T2V-1.3B.

    PYTHONPATH=src python3 benchmarks/fit_24gb.py --parts sample train-profile train-run \\
        --out benchmarks/results/fit_24gb_h100.json
    PYTHONPATH=src python3 benchmarks/fit_24gb.py --backbone wan --out benchmarks/results/fit_24gb_wan_h100.json

CogVideoX parts (each replaces its own key in --out, so the parts can run in separate calls):
- `sample`: one guided 63-s denoising step (`tttv profile configs/cogvideox-5b/24gb-sample-63s.toml --phase sample
  --steps 2`, random init, two passes of batch 1) with the plain forward, uncapped, against `memory.chunked_inference`
  uncapped, capped at 24 GiB (fp8 frozen weights, blocks streamed from host memory) and capped at 12 GiB (the same
  with the TTT heads in groups). The step time is the second step's (the first compiles the kernels), from the
  profiler's synchronised step marks (its summary's step_seconds); the peaks are the profiler's.
- `train-profile`: one 3-s and one 9-s training step of the 24 GB configs under `tttv profile --phase train`:
  peak per phase.
- `train-run`: `tttv train configs/cogvideox-5b/24gb-9s.toml` for 20 steps on the built-in demo set's latents under
  the 24 GiB cap: loss, step time and memory per step from the run's metrics.jsonl.

Wan parts (random weights, the demo text encoder and the identity decode: nothing to download; one list of rows,
`runs`, in --out, rewritten after every row):
- `train-profile`: the training micro-batch of configs/wan2.1-1.3b/stage1-3s-24gb.toml, stage3-18s-24gb.toml and
  stage5-63s-24gb.toml under their 23 GiB cap, one warm-up step and one timed (`--steps 2`);
- `sample`: a 63-s guided denoising step of sample-63s-24gb.toml (chunked inference, two passes) under its 12 GiB cap,
  one warm-up and one timed.

Every row runs in its own process; a row that runs out of memory, fails or times out is recorded as that row's result
and the next one runs. Each row has median_step_s (the steps after the first: the first compiles the kernels),
peak_allocated_gib / peak_reserved_gib (the profiler's) and peak_host_gib (the process's peak resident set, as a small
launcher reads it: `run_child`). Every subprocess gets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (docs/memory.md
says why). A 24 GB card is emulated: the cap is torch's per-process memory fraction, and the CUDA context (about 0.5-0.8
GiB) is outside it. A CPU rehearsal of the Wan suite: --set model.preset=wan-tiny --set layout.height=32 --set
layout.width=32 --set layout.text_tokens=16 --set train.device=cpu --set sample.device=cpu --set train.precision=fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs" / "cogvideox-5b"
GIB = 2**30
NO_WEIGHTS = ["model.pretrained_path=", "train.init_from="]
EXTRA: list[str] = []  # --set: overrides for every subprocess (a CPU rehearsal with the tiny model)

SAMPLE_VARIANTS = [
    ("uncapped, plain forward, bf16 resident, guidance batched",
     ["memory.max_gpu_gib=0", "memory.chunked_inference=false", "model.frozen_weights=dtype",
      "sample.offload_blocks=false", "sample.cfg_batched=true"]),
    ("uncapped, chunked, bf16 resident, two passes",
     ["memory.max_gpu_gib=0", "memory.chunked_inference=true", "model.frozen_weights=dtype",
      "sample.offload_blocks=false"]),
    ("24 GiB: chunked, fp8, streamed (24gb-sample-63s.toml)", []),
    ("12 GiB: chunked, 2 TTT head groups, fp8, streamed",
     ["memory.max_gpu_gib=12", "memory.ttt_head_groups=2"]),
    ("12 GiB: chunked, 4 TTT head groups, fp8, streamed",
     ["memory.max_gpu_gib=12", "memory.ttt_head_groups=4"]),
]


def use_environment() -> None:
    """What every subprocess inherits: the package from this checkout and the allocator setting `tttv` uses (set here,
    not left to each command's default, so that a value from the shell does not change what is measured)."""
    from tttvideo.memory.guard.allocator import ALLOC_CONF

    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    os.environ["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")


def run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            code = -9
    return code, time.perf_counter() - t0


def tail(log: Path, lines: int = 3) -> str:
    return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])[-600:]


# Linux carries a process's peak resident set across exec (signal->maxrss), so a command forked from this process
# would report this process's peak if it was larger: the command is forked instead from a small launcher, which
# writes the peak of its own children (RUSAGE_CHILDREN, KiB on Linux) after the command ends or is killed.
_LAUNCHER = """import resource, subprocess, sys
try:
    code = subprocess.run(sys.argv[3:], timeout=float(sys.argv[2])).returncode
except subprocess.TimeoutExpired:
    code = None
with open(sys.argv[1], "w") as f:
    f.write(f"{code} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}")
"""


def run_child(cmd: list[str], out_dir: Path, timeout: float) -> tuple[int | None, float, float]:
    """`cmd` in its own process, its output in out_dir -> (exit code or None on timeout, seconds, its peak resident
    set in GiB: the host memory of that process alone, not this one's)."""
    t0 = time.perf_counter()
    peak_file = out_dir / "host_peak.txt"
    peak_file.unlink(missing_ok=True)
    with (out_dir / "stdout.log").open("w") as out, (out_dir / "stderr.log").open("w") as err:
        launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(peak_file), str(timeout), *cmd],
                                    stdout=out, stderr=err, cwd=ROOT, start_new_session=True)
        try:
            launcher.wait(timeout=timeout + 60)  # the launcher's own timeout ends the command first
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, 9)
            launcher.wait()
    seconds = time.perf_counter() - t0
    try:
        code_text, kib = peak_file.read_text().split()
    except (OSError, ValueError):
        return None, seconds, float("nan")
    return (None if code_text == "None" else int(code_text)), seconds, int(kib) / 2**20


def profile(name: str, config: Path, phase: str, steps: int, overrides: list[str], work: Path,
            timeout: float) -> dict:
    """One `tttv profile` run in its own process (the command of `tttvideo.memory.studies.matrix`) -> its status,
    peaks per phase, totals, out-of-memory location, step times and the process's host peak."""
    from tttvideo.memory.studies.matrix import Matrix, Variant, _row, _slug, child_command

    matrix = Matrix(Path(__file__), config, [], timeout_s=timeout)
    variant = Variant(name, NO_WEIGHTS + overrides + EXTRA, phase, steps)
    out_dir = work / _slug(name)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").unlink(missing_ok=True)  # a stale summary must not pass for this run's
    cmd = child_command(matrix, variant, out_dir)
    code, seconds, host = run_child(cmd, out_dir, timeout)
    r = _row(variant, code, seconds, out_dir, timeout)
    row = {"command": " ".join(cmd[1:]), "exit_code": r.exit_code, "process_s": round(r.seconds, 1),
           "status": r.status, "peak_host_gib": round(host, 2)}
    s = r.summary
    if s is None:
        row["error"] = r.note
        return row
    if r.status not in ("ok", "oom"):
        row["error"] = r.note
    row["oom"] = s.get("oom")
    row["totals"] = {k: s.get("totals", {}).get(k) for k in ("peak_allocated", "peak_reserved", "driver_peak")}
    row["peak_allocated_gib"] = _gib_or_none(row["totals"]["peak_allocated"])
    row["peak_reserved_gib"] = _gib_or_none(row["totals"]["peak_reserved"])
    row["phases"] = [{k: p.get(k) for k in ("name", "occurrences", "activation_peak", "peak_allocated",
                                            "peak_reserved", "seconds")} for p in s.get("phases", [])]
    row["step_s"] = [round(t, 3) for t in s.get("step_seconds", [])]
    timed = row["step_s"][1:] or row["step_s"]  # the first step compiles the kernels
    row["median_step_s"] = round(statistics.median(timed), 3) if timed and r.status == "ok" else None
    return row


def _gib_or_none(x) -> float | None:
    return None if x is None else round(x / GIB, 2)


def part_sample(args, work: Path) -> dict:
    rows = []
    config = CONFIGS / "24gb-sample-63s.toml"
    for name, overrides in SAMPLE_VARIANTS:
        if args.variants and args.variants not in name:
            continue
        print(f"sample: {name}", flush=True)
        row = profile(f"sample {name}", config, "sample", 2, [f"layout.duration={args.duration}"] + overrides, work,
                      args.timeout)
        row["variant"] = name
        rows.append(row)
    if args.variants:  # a re-run of some variants: keep the others' earlier rows
        kept = {r["variant"]: r for r in args.previous.get("sample", {}).get("variants", [])}
        kept.update({r["variant"]: r for r in rows})
        rows = [kept[name] for name, _ in SAMPLE_VARIANTS if name in kept]
    base = rows[0].get("step_s") or []
    for r in rows:
        if base and r.get("step_s") and r.get("status") == "ok":
            r["ratio_to_uncapped_plain"] = round(r["step_s"][-1] / base[-1], 3)
    return {"duration": args.duration, "variants": rows}


def part_train_profile(args, work: Path) -> dict:
    rows = []
    for config in ("24gb-3s.toml", "24gb-9s.toml"):
        print(f"train-profile: {config}", flush=True)
        row = profile(f"train {config}", CONFIGS / config, "train", 2, [], work, args.timeout)
        row["config"] = config
        rows.append(row)
    return {"runs": rows}


def part_train_run(args, work: Path) -> dict:
    out = work / "run-24gb-9s"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "tttvideo", "train", str(CONFIGS / "24gb-9s.toml"), "--overwrite"]
    for o in NO_WEIGHTS + ["data.manifest=", f"data.demo_videos={args.demo_videos}", f"train.steps={args.steps}",
                           "train.grad_accum=1", "train.global_batch=1", f"train.checkpoint_every={args.steps}",
                           "train.sample_at_end=false", "train.validate_every=0", "train.log_every=1",
                           f"train.output_dir={out}"] + EXTRA:
        cmd += ["--set", o]
    print("train-run: 24gb-9s.toml", flush=True)
    log = work / "run-24gb-9s.log"
    code, seconds = run(cmd, log, args.timeout)
    metrics = out / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    result = {"command": " ".join(cmd[1:]), "exit_code": code, "process_s": round(seconds, 1),
              "losses": [x["loss"] for x in lines], "step_time_s": [x["step_time"] for x in lines],
              "memory_gib": [x["memory_gib"] for x in lines]}
    if code != 0:
        result["error"] = tail(log)
    return result


# ------------------------------------------------------------------------------------------------ Wan2.1-T2V-1.3B
WAN_CONFIGS = ROOT / "configs" / "wan2.1-1.3b"
# random weights, the demo text encoder and the identity decode: nothing to download (the memory is the transformer's)
WAN_NO_ENCODERS = ["sample.vae_path=", "sample.text_encoder_path=", "data.vae_path=", "data.text_encoder_path="]
# (row name, config, phase): one warm-up step and one timed in every row
WAN_ROWS = {
    "train-profile": [("train 3 s (stage1-3s-24gb.toml, cap 23 GiB)", "stage1-3s-24gb.toml", "train"),
                      ("train 18 s (stage3-18s-24gb.toml, cap 23 GiB)", "stage3-18s-24gb.toml", "train"),
                      ("train 63 s (stage5-63s-24gb.toml, cap 23 GiB)", "stage5-63s-24gb.toml", "train")],
    "sample": [("sample 63 s, one guided step (sample-63s-24gb.toml, cap 12 GiB)", "sample-63s-24gb.toml", "sample")],
}


def wan_suite(args, work: Path, data: dict, save) -> None:
    """Every row of the chosen Wan parts, each in its own process, `data["runs"]` rewritten (`save`) after each."""
    from tttvideo.config.loader import load_config
    from tttvideo.models.backbone import layout_of

    runs = {r["name"]: r for r in data.get("runs", [])}  # rows of parts not run this time are kept
    order = [name for part in WAN_ROWS for name, _, _ in WAN_ROWS[part]]
    for part in args.parts:
        for name, config, phase in WAN_ROWS[part]:
            print(f"{part}: {name}", flush=True)
            row = {"name": name, "config": f"configs/wan2.1-1.3b/{config}", "phase": phase}
            cfg = load_config(WAN_CONFIGS / config, EXTRA)
            row.update(preset=cfg.model.preset, duration_s=layout_of(cfg).duration_s, gpus=1,
                       use_ttt=cfg.model.use_ttt, cap_gib=cfg.memory.max_gpu_gib)
            row.update(profile(f"wan {name}", WAN_CONFIGS / config, phase, args.wan_steps, WAN_NO_ENCODERS, work,
                               args.timeout))
            runs[name] = row
            data["runs"] = [runs[n] for n in order if n in runs]
            save()


def print_wan_table(data: dict) -> None:
    preset = next((r["preset"] for r in data.get("runs", []) if r.get("preset")), "wan2.1-t2v-1.3b")
    print(f"\n{preset} + TTT-MLP, random weights, on {data.get('device')} (torch {data.get('torch')}, commit "
          f"{data.get('git_commit')}). A 24 GB card emulated: memory.max_gpu_gib caps PyTorch's allocator at the cap "
          "below; the CUDA context (~0.5-0.8 GiB) comes on top, as on a real card.")
    print("\n| row | cap GiB | status | s / step (median after warm-up) | peak alloc GiB | peak reserved GiB | "
          "peak host GiB | note |")
    print("|---|---|---|---|---|---|---|---|")
    for r in data.get("runs", []):
        note = (r.get("oom") or {}).get("location") or r.get("error", "")
        if r.get("status") == "oom":
            note = f"out of memory in {note}"
        print(f"| {r['name']} | {r.get('cap_gib')} | {r.get('status')} | {r.get('median_step_s') or ''} | "
              f"{r.get('peak_allocated_gib') or ''} | {r.get('peak_reserved_gib') or ''} | "
              f"{r.get('peak_host_gib') or ''} | {note} |")


def environment() -> dict:
    import torch

    from tttvideo.memory.profile.profiler import git_commit

    commit = git_commit()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "triton": triton_version, "git_commit": commit,
            "emulation": "memory.max_gpu_gib caps the CUDA caching allocator (torch.cuda.set_per_process_memory_"
                         "fraction); the CUDA context (~0.5-0.8 GiB) is outside the cap; every process runs with "
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"}


def gib(x) -> str:
    return "" if x is None else f"{x / GIB:.1f}"


def print_table(data: dict) -> None:
    print("\n| part | setup | status | step s | ratio | peak alloc GiB | peak reserved GiB | note |")
    print("|---|---|---|---|---|---|---|---|")
    for r in data.get("sample", {}).get("variants", []):
        step = r.get("step_s") or []
        note = (r.get("oom") or {}).get("location") or r.get("error", "")
        print(f"| sample {data['sample']['duration']} | {r['variant']} | {r.get('status')} | "
              f"{step[-1] if step else ''} | {r.get('ratio_to_uncapped_plain', '')} | "
              f"{gib(r.get('totals', {}).get('peak_allocated'))} | {gib(r.get('totals', {}).get('peak_reserved'))} "
              f"| {note} |")
    for r in data.get("train_profile", {}).get("runs", []):
        step = r.get("step_s") or []
        phases = ", ".join(f"{p['name']} {gib(p['peak_allocated'])}" for p in r.get("phases", []))
        print(f"| train profile | {r['config']} | {r.get('status')} | {step[-1] if step else ''} | | "
              f"{gib(r.get('totals', {}).get('peak_allocated'))} | {gib(r.get('totals', {}).get('peak_reserved'))} "
              f"| {phases} |")
    tr = data.get("train_run_9s")
    if tr:
        losses, times = tr["losses"], tr["step_time_s"]
        if losses:
            k = min(5, len(losses))
            note = (f"{len(losses)} steps, loss {statistics.mean(losses[:k]):.3f} -> {statistics.mean(losses[-k:]):.3f}"
                    f" (mean of first / last {k})")
        else:
            note = tr.get("error", "")
        med = statistics.median(times[1:]) if len(times) > 1 else ""
        print(f"| train run | 24gb-9s.toml | exit {tr['exit_code']} | {med} | | {max(tr['memory_gib'], default='')} "
              f"| | {note} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backbone", choices=("cogvideox", "wan"), default="cogvideox",
                    help="the suite: CogVideoX-5B (configs/cogvideox-5b/) or Wan2.1-T2V-1.3B (configs/wan2.1-1.3b/)")
    ap.add_argument("--parts", nargs="+", default=None, choices=("sample", "train-profile", "train-run"),
                    help="default: sample train-profile train-run (cogvideox), train-profile sample (wan)")
    ap.add_argument("--duration", default="63s", help="cogvideox sample: duration (default 63s)")
    ap.add_argument("--steps", type=int, default=20, help="cogvideox train-run: optimizer steps")
    ap.add_argument("--wan-steps", type=int, default=2, help="wan: steps per row, the first a warm-up (default 2)")
    ap.add_argument("--demo-videos", type=int, default=4, help="train-run: videos in the demo set")
    ap.add_argument("--timeout", type=float, default=1500, help="seconds per subprocess")
    ap.add_argument("--work", default=None, help="folder for the reports and the run (default runs/fit_24gb, "
                                                 "runs/fit_24gb_wan)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/fit_24gb.json, "
                                                "fit_24gb_wan.json)")
    ap.add_argument("--variants", default=None, help="cogvideox sample: run only the variants whose name contains "
                                                     "this text (the others keep their rows in --out)")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="config override for every run (e.g. model.preset=tiny to rehearse on a CPU)")
    args = ap.parse_args(argv)
    wan = args.backbone == "wan"
    suffix = "_wan" if wan else ""
    args.parts = args.parts or (["train-profile", "sample"] if wan else ["sample", "train-profile", "train-run"])
    if wan and "train-run" in args.parts:
        ap.error("--backbone wan has the parts train-profile and sample")
    EXTRA[:] = args.overrides
    use_environment()
    from tttvideo.results import save_json

    work = Path(args.work or f"runs/fit_24gb{suffix}")
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or f"benchmarks/results/fit_24gb{suffix}.json")
    data = json.loads(out.read_text()) if out.is_file() else {}
    args.previous = dict(data)
    data.update({"benchmark": f"fit_24gb{suffix}", **environment()})

    def save() -> None:  # atomically, after every part (every row for Wan): a later failure keeps what was measured
        save_json(out, data)

    if wan:
        wan_suite(args, work, data, save)
        print_wan_table(data)
        return 0
    data.pop("sampling_63s", None)  # the earlier sampling figures, replaced by part "sample"
    for part in args.parts:
        key = {"train-run": "train_run_9s"}.get(part, part.replace("-", "_"))
        data[key] = {"sample": part_sample, "train-profile": part_train_profile, "train-run": part_train_run}[part](
            args, work)
        save()
    print_table(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
