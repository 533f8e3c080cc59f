"""`tttv profile`: where every GiB goes, per component, phase and block; or a matrix of variants side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

from tttvideo.cli.common import add_config_arguments, config_from_args
from tttvideo.errors import UserError
from tttvideo.memory.studies.pipeline_config import PIPELINE_NAMES, is_pipeline_profile
from tttvideo.outputs import check_writable_dir


def register(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(
        name,
        help="profile memory of training or sampling (report folder with tables, plots, HTML)",
        description="Run the pipeline under the memory profiler and write a report folder (events.json, "
        "summary.md/.csv/.json, timeline/components/blocks PNGs, report.html). With --matrix, run each variant of "
        "a matrix file in its own process and print one table.",
    )
    add_config_arguments(p, config_required=False)
    p.add_argument("--phase", choices=("train", "sample"), default=None,
                   help="what to profile (default train; a diffusers pipeline is always inference)")
    p.add_argument("--pipeline", choices=PIPELINE_NAMES, default=None,
                   help="profile this diffusers pipeline at its published sizes instead of our own (random weights "
                        "unless --set pipeline.weights=FOLDER); a CONFIG with a [pipeline] table does the same")
    p.add_argument("--steps", type=int, default=1, help="training or denoising steps to run (default 1)")
    p.add_argument("--out", default=None, help="report folder (default runs/profile/<phase> or runs/profile/<matrix>)")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda or cuda:N")
    p.add_argument("--snapshot", action="store_true",
                   help="also save torch's allocator history as snapshot.pickle (CUDA; open at pytorch.org/memory_viz)")
    p.add_argument("--trace", action="store_true", help="also save a torch.profiler trace with memory events "
                   "(trace.json, for ui.perfetto.dev); slows the run")
    p.add_argument("--matrix", metavar="FILE", default=None,
                   help="TOML file of variants (see configs/profile/matrix-example.toml)")
    p.add_argument("--gpus", default=None, metavar="IDS",
                   help="with --matrix: CUDA devices to spread the variants over, e.g. 0,1 (as many variants at "
                        "once, one GPU each; default: one variant at a time on what is visible)")
    p.add_argument("--resume", action="store_true",
                   help="with --matrix: keep the rows of variants an earlier run into the same --out finished")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if (args.gpus is not None or args.resume) and not args.matrix:
        raise UserError("--gpus and --resume go with --matrix FILE")
    if args.matrix:
        if args.config or args.overrides:
            raise UserError("--matrix takes its base config and overrides from the matrix file; "
                            "drop CONFIG and --set (or put them into the file)")
        return _run_matrix(args)
    if args.pipeline or (args.config and is_pipeline_profile(args.config)):
        return _run_pipeline(args)
    args.phase = args.phase or "train"
    cfg = config_from_args(args)
    out = check_writable_dir(args.out or f"runs/profile/{args.phase}", "--out")
    from tttvideo.memory.profile.drivers import profile

    summary, code = profile(cfg, args.phase, args.steps, out, device=args.device, snapshot=args.snapshot,
                            trace=args.trace, meta={"config": args.config or "(defaults)",
                                                    "overrides": list(args.overrides or [])})
    _print_summary(summary, out)
    return code


def _run_pipeline(args: argparse.Namespace) -> int:
    from tttvideo.memory.studies.pipelines import profile_pipeline
    from tttvideo.memory.studies.pipeline_config import load_pipeline_profile

    if args.phase == "train":
        raise UserError("a diffusers pipeline is profiled for inference only; drop --phase train")
    overrides = ([f"pipeline.name={args.pipeline}"] if args.pipeline else []) + list(args.overrides or [])
    from tttvideo.parallel.launch import SharedError, exit_on_rank, launch_rank

    rank = launch_rank()
    try:
        try:  # every rank reads the same file: its mistakes are everyone's
            pc = load_pipeline_profile(args.config, overrides)
            out = check_writable_dir(args.out or f"runs/profile/{pc.name}", "--out")
        except UserError as err:
            raise SharedError(str(err)) from None
        summary, code = profile_pipeline(pc, args.steps, out, device=args.device, snapshot=args.snapshot,
                                         trace=args.trace, meta={"config": args.config or f"--pipeline {pc.name}",
                                                                 "overrides": overrides})
    except UserError as err:  # under torchrun (context parallelism): rank 0 alone says a shared sentence
        return exit_on_rank(err, "profile")
    if rank == 0:
        _print_summary(summary, out)
    return code


def _run_matrix(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tttvideo.memory.studies.matrix import load_matrix, print_matrix, run_matrix

    m = load_matrix(args.matrix)
    if args.device != "auto":
        m.device = args.device
    out = check_writable_dir(args.out or f"runs/profile/{Path(args.matrix).stem}", "--out")
    console = Console(stderr=True)
    gpus = None
    if args.gpus is not None:
        gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
        if not gpus or not all(g.isdigit() for g in gpus) or len(set(gpus)) != len(gpus):
            raise UserError(f"--gpus {args.gpus!r}: give distinct CUDA device numbers separated by commas, e.g. 0,1")
    rows = run_matrix(m, out, progress=lambda text: console.print(f"profile: {text}"), gpus=gpus,
                      resume=args.resume)
    print_matrix(rows, title=f"memory matrix: {m.path.name} ({len(rows)} variants)")
    console.print(f"profile: reports under {out}/<variant>/, side by side in {out}/matrix.html (and matrix.md)")
    return 0


def _print_summary(s: dict, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from tttvideo.memory.profile.report import fmt_bytes

    console = Console()
    t = Table(title=f"memory ({s.get('labels', {}).get('unit', s.get('backend'))})", show_header=True)
    t.add_column("")
    t.add_column("activation peak", justify="right")
    t.add_column("peak allocated / base delta", justify="right")
    for p in s.get("phases", []):
        t.add_row(f"phase: {p['name']}", fmt_bytes(p["activation_peak"]), fmt_bytes(p["peak_allocated"]))
    for c in s.get("components", []):
        counted = "" if c.get("counted") is None else f" (counted {fmt_bytes(c['counted'])})"
        sign = "+" if c["measured"] >= 0 else ""
        t.add_row(f"component: {c['name']}", "", f"{sign}{fmt_bytes(c['measured'])}{counted}")
    tot = s.get("totals", {})
    t.add_row("total", "", fmt_bytes(tot.get("peak_allocated")))
    console.print(t)
    if s.get("status") == "oom":
        oom = s.get("oom") or {}
        console.print(f"[bold red]OOM in {oom.get('location')}[/] (step {oom.get('step')}): {oom.get('error')}")
    console.print(f"report: {out}/report.html (tables: {out}/summary.md)")
