"""Same-run A/B of the TTT-MLP forward kernel: the present `tttvideo.ttt.triton_mlp` against an earlier copy of the
file (`--baseline`), at the launches that matter, in alternating rounds.

    git show REV:src/tttvideo/ttt/triton_mlp.py > /tmp/triton_mlp_base.py
    PYTHONPATH=src python3 benchmarks/ttt_forward_ab.py --baseline /tmp/triton_mlp_base.py \\
        --out benchmarks/results/ttt_forward_ab_h100.json

Cases (heads of 64, inner MLP 256, bf16 inputs drawn as the layer makes them, `tttvideo.ttt.testing.make_inputs`):
the sampling forward at mini-batch 16 without saves (2 roles at 4 warps: `triton_mlp.forward_shape`) over a guided
step's 96 streams and one sample's 48, and the training forward at mini-batch 64 with checkpoints over 48 streams.
Each round times every kernel once (CUDA events, the median of several runs, `ttt_kernel.bench`), the order reversed
every other round; the table gives microseconds per mini-batch step (the serial unit of a chain), the medians over
rounds, the ratio, whether the present kernel's output (and checkpoints) equal the baseline's bit for bit, and each
output's relative error against the fp32 reference on the same inputs (`ttt_mlp_reference`), which shows what a
change of the products' order costs where the two differ.
On a CPU (TRITON_INTERPRET=1, a smoke run: `--length 64 --heads 2`) the times are wall-clock and mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ttt_kernel import bench, load_baseline  # noqa: E402 - this script's folder: ttt_kernel.py

from tttvideo.memory.profile.profiler import git_commit  # noqa: E402
from tttvideo.results import save_json  # noqa: E402

CASES = [("sampling, 96 streams", 2, 16, False), ("sampling, 48 streams", 1, 16, False),
         ("training forward, 48 streams", 1, 64, True)]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="an earlier triton_mlp.py (git show REV:src/... > FILE)")
    add_ab_arguments(ap)
    return ap.parse_args(argv)


def add_ab_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of the kernel A/B benchmarks (this one and ttt_carveout_ab.py)."""
    ap.add_argument("--length", type=int, default=18048, help="tokens per stream (cut to each case's mini-batch)")
    ap.add_argument("--heads", type=int, default=48, help="heads per sample (streams: batch x heads)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default="")


def ab_device(script: str) -> torch.device:
    """CUDA, or the CPU inside Triton's interpreter (a smoke run); anything else is refused."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit(f"{script} times Triton kernels: on a CUDA GPU, or in the interpreter with "
                         "TRITON_INTERPRET=1 (a smoke run: --length 64 --heads 2)")
    return device


def timed(fn, device: torch.device, min_runs: int = 7) -> float:
    """ms of one measurement: `ttt_kernel.bench` on CUDA; one wall-clock call elsewhere (the interpreter)."""
    if device.type == "cuda":
        return bench(fn, min_runs=min_runs, budget_s=1.0)[0]
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def run_case(name: str, B: int, M: int, save: bool, kernels: dict, args, device) -> dict:
    from tttvideo.ttt.reference import ttt_mlp_reference
    from tttvideo.ttt.testing import make_inputs

    L = args.length // M * M
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's products take fp32
    ins = [t.detach() for t in make_inputs("mlp", B, args.heads, L, 64, M, dtype=dtype, seed=1, device=device)]
    runs = {tag: (lambda mod=mod: mod.mlp_forward(*ins, M, 16, save, output=True)) for tag, mod in kernels.items()}
    base, present = runs["baseline"](), runs["present"]()
    equal = torch.equal(base[0], present[0]) and (not save or all(map(torch.equal, base[1], present[1])))
    with torch.no_grad():  # where the two differ, which is nearer the fp32 reference
        want = ttt_mlp_reference(*(t.float() for t in ins), mini_batch_size=M, checkpoint_group_size=16)
    error = {tag: float((out[0].float() - want).norm() / want.norm()) for tag, out in (("baseline", base),
                                                                                       ("present", present))}
    del want
    times = {tag: [] for tag in runs}
    for r in range(args.rounds):
        for tag in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            times[tag].append(timed(runs[tag], device))
    steps = L // M
    row = dict(case=name, streams=B * args.heads, mini_batch=M, save=save, tokens=L, equal=equal,
               **{f"{tag}_ms": [round(t, 4) for t in ts] for tag, ts in times.items()},
               **{f"{tag}_us_step": 1e3 * statistics.median(ts) / steps for tag, ts in times.items()},
               **{f"{tag}_error": e for tag, e in error.items()})
    for tag, mod in kernels.items():
        k = mod.LAUNCHED.get("fwd")
        if k is not None and hasattr(k, "n_regs"):
            row[f"{tag}_regs_spills"] = [k.n_regs, k.n_spills]
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    device = ab_device("ttt_forward_ab.py")
    if not os.path.isfile(args.baseline):
        raise SystemExit(f"--baseline {args.baseline}: no such file; write one with "
                         f"git show REV:src/tttvideo/ttt/triton_mlp.py > FILE")
    from tttvideo.ttt import triton_mlp

    kernels = {"baseline": load_baseline(args.baseline), "present": triton_mlp}
    rows = [run_case(*case, kernels, args, device) for case in CASES]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    result = dict(benchmark="ttt_forward_ab", device=name, torch=torch.__version__, git_commit=git_commit(),
                  baseline=os.path.basename(args.baseline), rounds=args.rounds, rows=rows)
    if args.out:
        save_json(args.out, result)
    print(f"\n{name}, commit {result['git_commit'][:7]} against {result['baseline']}: us per mini-batch step, "
          f"median of {args.rounds} alternating rounds")
    print(f"{'case':<30} {'baseline':>9} {'present':>9} {'ratio':>7}  bit-equal  error vs fp32 (base / present)")
    for r in rows:
        print(f"{r['case']:<30} {r['baseline_us_step']:>9.3f} {r['present_us_step']:>9.3f} "
              f"{r['present_us_step'] / r['baseline_us_step']:>7.3f}  {str(r['equal']):<9}  "
              f"{r['baseline_error']:.2e} / {r['present_error']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
