"""`tttv plan`: predicted peak memory and step time of every candidate setup, best first; the fastest that fits is
written as a config file that includes yours (docs/memory.md, "Planner")."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from tttvideo.cli.common import add_config_arguments, config_from_args
from tttvideo.errors import UserError


def register(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(
        name,
        help="predict peak memory and step time of each setup and write the fastest that fits",
        description="Predict, on the CPU, the peak GPU memory (counted weights, gradients and optimizer state plus "
        "activations from measured per-token costs) and the step time of every candidate setup for CONFIG, print "
        "them best first, and write the fastest one that fits as a config file (--out) that `tttv train` / "
        "`tttv sample` read.",
    )
    add_config_arguments(p)
    p.add_argument("--gpu-mem", required=True, metavar="SIZE", help="memory of one GPU: 24GiB, 80GB, 24 (GiB)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs of the launch (default 1)")
    p.add_argument("--phase", choices=("train", "sample"), default="train", help="what to plan (default train)")
    p.add_argument("--duration", default=None, help="video length to plan for (default: layout.duration)")
    p.add_argument("--gpu-kind", default="h100", help="whose measured costs to use (default h100)")
    p.add_argument("--costs", default=None, metavar="FILE",
                   help="measured costs JSON (default: the table shipped with tttvideo; benchmarks/"
                        "plan_calibration.py writes one)")
    p.add_argument("--out", default=None, help="write the chosen setup here (a TOML config including CONFIG)")
    p.add_argument("--all", action="store_true", help="list every candidate (default: the 12 best and a count)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tttvideo.memory.plan.costs import load_costs
    from tttvideo.memory.plan.planner import best, parse_size, plan, plan_toml

    if args.gpus < 1:
        raise UserError(f"--gpus must be at least 1, got {args.gpus}")
    gpu_mem = parse_size(args.gpu_mem)
    cfg = config_from_args(args)
    from tttvideo.models.backbone import backbone_of

    if backbone_of(cfg.model.preset).name != "cogvideox":  # its costs are measured on CogVideoX's blocks
        raise UserError(f"the planner covers CogVideoX only so far; model.preset {cfg.model.preset!r} is not a "
                        f"CogVideoX model, so write its memory settings by hand (configs/wan2.1-1.3b/ for Wan)")
    extra = {}
    if args.duration:
        cfg.layout.duration = args.duration
        extra["layout.duration"] = args.duration
    costs = load_costs(args.gpu_kind, *([Path(args.costs)] if args.costs else []))
    preds = plan(cfg, args.phase, gpu_mem, costs, args.gpus)
    print_plan(preds, gpu_mem, args, costs.device or costs.gpu)
    chosen = best(preds)
    if chosen is None:
        print(f"tttv plan: nothing measured fits {args.gpu_mem} per GPU for this {args.phase} setup; use more "
              f"GPUs (--gpus), a shorter --duration, or a larger card", file=sys.stderr)
        return 1
    if args.out:
        out = Path(args.out)
        command = "tttv " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else "tttv plan"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(plan_toml(chosen, args.config, out, command, extra))
        verb = "train" if args.phase == "train" else "sample"
        print(f"wrote {out}: tttv {verb} {out}")
    return 0


def print_plan(preds, gpu_mem: int, args: argparse.Namespace, device: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from tttvideo.memory.plan.planner import GIB

    shown = preds if args.all else preds[:12]
    first = preds[0].config if preds else None
    title = (f"{args.phase} plan: {first.model.preset if first else ''}, {first.layout.duration if first else ''}, "
             f"{args.gpus} GPU(s) of {gpu_mem / GIB:.1f} GiB (costs measured on {device})")
    t = Table(title=title)
    for col in ("#", "setup", "weights+grads+optim", "activations", "peak / GPU", "step s", "fits", "note"):
        t.add_column(col, justify="left" if col in ("setup", "note", "fits") else "right",
                     overflow="fold" if col in ("setup", "note") else None)
    for i, p in enumerate(shown, 1):
        fits = {True: "yes", False: "no", None: "?"}[p.fits]
        t.add_row(str(i), p.candidate.label, f"{p.counted.total / GIB:.1f} GiB",
                  "" if p.activation is None else f"{p.activation / GIB:.1f} GiB",
                  "" if p.peak is None else f"{p.peak / GIB:.1f} GiB",
                  "" if p.step_s is None else f"{p.step_s:.2f}", fits, "; ".join(p.notes),
                  style=None if p.fits else ("yellow" if p.fits is False else "dim"))
    console = Console()
    if not console.is_terminal:
        console = Console(width=180)
    console.print(t)
    if len(preds) > len(shown):
        console.print(f"({len(preds) - len(shown)} more candidates: --all lists them)")
