"""`tttv plan`: predicted peak memory and step time of every candidate setup, best first; the fastest that fits is
written as a config file that includes yours (docs/memory.md, "Planner")."""

from __future__ import annotations

import argparse
import copy
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
        "activations: counted block by block for the stage configs' checkpointing, else from measured per-token "
        "costs) and the step time of every candidate setup for CONFIG, print them best first, and write the fastest "
        "one that fits as a config file (--out) that `tttv train` / `tttv sample` read.",
    )
    add_config_arguments(p)
    p.add_argument("--gpu-mem", default=None, metavar="SIZE",
                   help="memory of one GPU: 24GiB, 80GB, 24 (GiB); default: this machine's first CUDA GPU (its CUDA "
                        "context is counted apart); required without one")
    p.add_argument("--host-mem", default=None, metavar="SIZE",
                   help="host memory available to the launch's processes on one machine (the --gpus processes "
                        "share it): offload pools are sized as the trainer sizes them there, and a setup whose "
                        "processes need more does not fit; default: this machine's available memory when planning "
                        "for this machine's GPU (no --gpu-mem), else not checked")
    p.add_argument("--margin", type=float, default=None, metavar="SHARE",
                   help="share of the card the chosen setup leaves free (default 0.05)")
    p.add_argument("--explain", action="store_true",
                   help="print the counted parts of the chosen setup's peak (or of the first candidate's)")
    p.add_argument("--trace", action="store_true",
                   help="training of a backbone whose blocks were not measured (Wan): take each setup's working sets "
                        "from a fake-tensor trace of its block unit at full size (python -m "
                        "tttvideo.memory.trace.fake_trace; seconds a setup) instead of constants measured on "
                        "CogVideoX-5B")
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
    from tttvideo.memory.plan.planner import MARGIN, best, parse_size, plan, plan_toml

    if args.gpus < 1:
        raise UserError(f"--gpus must be at least 1, got {args.gpus}")
    margin = MARGIN if args.margin is None else args.margin
    if not 0 <= margin < 1:
        raise UserError(f"--margin {args.margin} must be a share of the card from 0 to below 1, e.g. 0.05")
    gpu_mem = parse_size(args.gpu_mem, "--gpu-mem") if args.gpu_mem else this_gpu()
    host_mem = parse_size(args.host_mem, "--host-mem") if args.host_mem else None
    if host_mem is None and not args.gpu_mem:  # planning for this machine: its host memory too
        from tttvideo.models.activation_offload import available_host_bytes

        host_mem = available_host_bytes()
    cfg = config_from_args(args)
    out = check_plan_out(args.out, args.config) if args.out else None
    extra = {}
    if args.duration:
        cfg.layout.duration = args.duration
        extra["layout.duration"] = args.duration
    costs = load_costs(args.gpu_kind, *([Path(args.costs)] if args.costs else []))
    preds = plan(cfg, args.phase, gpu_mem, costs, args.gpus, margin, trace=args.trace, host_mem=host_mem)
    print_plan(preds, gpu_mem, args, costs.device or costs.gpu, margin, host_mem)
    chosen = best(preds)
    if args.explain and preds:
        print_parts(chosen or preds[0], gpu_mem, margin, host_mem, args.gpus)
    if args.phase == "train" and preds:
        from tttvideo.memory.plan.disk import describe, planned_disk

        shown = chosen or preds[0]
        print(describe(planned_disk(shown.config, args.gpus), shown.config, shown.candidate.label))
    if chosen is None and preds and all(p.fits is None for p in preds):
        print(f"tttv plan: no candidate setup of this config (model.preset {cfg.model.preset!r}) has measured costs "
              f"for a {args.phase} step on {args.gpu_kind} (every row: not measured), so nothing can be said to fit; "
              f"measure its setups with benchmarks/plan_calibration.py, or plan a config whose setups are measured",
              file=sys.stderr)
        return 1
    if chosen is None:
        host = f" and {host_mem / 2**30:.1f} GiB of host memory" if host_mem is not None else ""

        def fit(c):
            return best(plan(c, args.phase, gpu_mem, costs, args.gpus, margin, host_mem=host_mem))

        print(f"tttv plan: nothing measured fits {gpu_mem / 2**30:.1f} GiB per GPU{host} for this {args.phase} "
              f"setup; {what_fits_instead(cfg, args.phase, fit)}", file=sys.stderr)
        return 1
    if out is not None:
        command = "tttv " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else "tttv plan"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(plan_toml(chosen, args.config, out, command, extra))
        verb = "train" if args.phase == "train" else "sample"
        print(f"wrote {out}: tttv {verb} {out}")
    return 0


def check_plan_out(path: str, config: str | None) -> Path:
    """--out, checked before the planning: a .toml file in a writable folder, not the config it includes, and not
    a file some other program wrote (only an earlier plan is replaced)."""
    from tttvideo.memory.plan.planner import PLAN_HEADER
    from tttvideo.outputs import check_writable_file

    out = check_writable_file(path, "--out")
    if out.suffix != ".toml":
        raise UserError(f"--out {path}: a plan is a TOML config; name a .toml file")
    if config and out.resolve() == Path(config).resolve():
        raise UserError(f"--out {path} is CONFIG itself, which the plan includes; write the plan to another file")
    if out.is_file() and not _starts_with(out, PLAN_HEADER):
        raise UserError(f"--out {path} exists and is not a plan tttv plan wrote; remove it or name another file")
    return out


def _starts_with(path: Path, header: str) -> bool:
    """Whether the file begins with `header` (only that many bytes read: --out may name any file)."""
    with open(path, "rb") as f:
        return f.read(len(header.encode())) == header.encode()


def what_fits_instead(cfg, phase: str, fit) -> str:
    """The advice when nothing fits: the longest shorter video that does, and for training with another adapter what
    a LoRA adapter fits; `fit(cfg)` is the planner's best setup for `cfg` (None when nothing fits)."""
    said = []
    longest = longest_that_fits(cfg, fit)
    if longest:
        said.append(f"the longest video that fits is {longest} s (--duration {longest}s)")
    if phase == "train" and cfg.model.adapter != "lora":
        lora = copy.deepcopy(cfg)
        lora.model.adapter = "lora"
        chosen = fit(lora)
        if chosen is not None:
            said.append(f"a LoRA adapter fits this video (--set model.adapter=lora: {chosen.candidate.label}, "
                        f"{chosen.reserved / 2**30:.1f} GiB reserved)")
        else:
            longest = longest_that_fits(lora, fit)
            if longest:
                said.append(f"with a LoRA adapter (--set model.adapter=lora) a video of {longest} s fits")
    return "; ".join(said + ["use more GPUs (--gpus) or a larger card"])


def longest_that_fits(cfg, fit) -> int:
    """The longest video shorter than `cfg`'s (seconds) that some setup fits; 0 when none does. A video of more
    segments never needs less memory, so halving finds it in a few plans."""
    from tttvideo.layout import SEGMENT_SECONDS, parse_duration

    low, high = 0, parse_duration(cfg.layout.duration) // SEGMENT_SECONDS  # segments: low fits (0: none), high not
    while high - low > 1:
        mid = (low + high) // 2
        shorter = copy.deepcopy(cfg)
        shorter.layout.duration = f"{mid * SEGMENT_SECONDS}s"
        if fit(shorter) is not None:
            low = mid
        else:
            high = mid
    return low * SEGMENT_SECONDS


def this_gpu() -> int:
    """The memory of this machine's first CUDA GPU; a UserError without one."""
    import torch

    if not torch.cuda.is_available():
        raise UserError("--gpu-mem is needed on a machine without a CUDA GPU: give the card's memory, e.g. "
                        "--gpu-mem 80GB")
    return torch.cuda.get_device_properties(0).total_memory


def print_parts(pred, gpu_mem: int, margin: float, host_mem: int | None = None, processes: int = 1) -> None:
    """The counted parts of one prediction, largest phase first: what `--explain` prints."""
    from tttvideo.memory.plan.planner import CUDA_CONTEXT, GIB

    print(f"\n{pred.candidate.label}: where the memory goes ({pred.basis})")
    c = pred.counted
    if pred.breakdown is not None:
        b = pred.breakdown
        print(f"  peak at: {b.phase}")
        for part in b.parts:
            print(f"  {part.nbytes / GIB:8.2f} GiB  {part.where:<4}  {part.name}  [{part.how}]")
    else:
        for name, nbytes in (("weights (storage dtypes)", c.weights), ("gradients", c.gradients),
                             ("optimizer state", c.optimizer)):
            print(f"  {nbytes / GIB:8.2f} GiB  gpu   {name}  [counted]")
        if pred.activation is not None:
            print(f"  {pred.activation / GIB:8.2f} GiB  gpu   activations at {pred.tokens_per_gpu} tokens per GPU  "
                  f"[{pred.basis}]")
            # the regime's measured share, at least the default (planner.predict)
            print(f"  {(pred.reserved - pred.peak) / GIB:8.2f} GiB  gpu   allocator: reserved over allocated "
                  f"({pred.reserved / pred.peak - 1:.1%})  [measured]")
    print(f"  {c.trainable_params / 1e9:8.2f} B    trainable parameters  [counted]")
    print(f"  {CUDA_CONTEXT / GIB:8.2f} GiB  gpu   CUDA context (outside PyTorch)  [measured]")
    if pred.reserved is not None:
        total = pred.reserved + CUDA_CONTEXT
        print(f"  {total / GIB:8.2f} GiB  of a card of {gpu_mem / GIB:.1f} GiB with {margin:.0%} left free "
              f"({gpu_mem * (1 - margin) / GIB:.1f} GiB): "
              f"{'fits' if pred.gpu_fits else 'does not fit'}")
    if host_mem is not None:
        print(f"  {pred.host_total * processes / GIB:8.2f} GiB  host  {processes} process(es) of this plan on a host "
              f"with {host_mem / GIB:.1f} GiB available: {'fits' if pred.host_fits else 'does not fit'}")


def print_plan(preds, gpu_mem: int, args: argparse.Namespace, device: str, margin: float = 0.0,
               host_mem: int | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from tttvideo.memory.plan.planner import GIB

    shown = preds if args.all else preds[:12]
    first = preds[0].config if preds else None
    title = (f"{args.phase} plan: {first.model.preset if first else ''}, {first.layout.duration if first else ''}, "
             f"{args.gpus} GPU(s) of {gpu_mem / GIB:.1f} GiB, {margin:.0%} left free, "
             + (f"{host_mem / GIB:.0f} GiB of host memory" if host_mem is not None else "host memory not checked")
             + f" (costs measured on {device})")
    t = Table(title=title)
    for col in ("#", "setup", "weights+grads+optim", "activations", "peak / GPU", "reserved", "host / process",
                "step s", "fits", "activations from", "note"):
        t.add_column(col, justify="left" if col in ("setup", "note", "fits", "activations from") else "right",
                     overflow="fold" if col in ("setup", "note", "activations from") else None)
    for i, p in enumerate(shown, 1):
        fits = "no (host)" if p.host_fits is False else {True: "yes", False: "no", None: "?"}[p.fits]
        t.add_row(str(i), p.candidate.label, f"{p.counted.total / GIB:.1f} GiB",
                  "" if p.activation is None else f"{p.activation / GIB:.1f} GiB",
                  "" if p.peak is None else f"{p.peak / GIB:.1f} GiB",
                  "" if p.reserved is None else f"{p.reserved / GIB:.1f} GiB",
                  f"{p.host_total / GIB:.1f} GiB" if p.host_total else "",
                  "" if p.step_s is None else f"{p.step_s:.2f}", fits, p.basis, "; ".join(p.notes),
                  style=None if p.fits else ("yellow" if p.fits is False else "dim"))
    console = Console()
    if not console.is_terminal:
        console = Console(width=220)
    console.print(t)
    if len(preds) > len(shown):
        console.print(f"({len(preds) - len(shown)} more candidates: --all lists them)")
