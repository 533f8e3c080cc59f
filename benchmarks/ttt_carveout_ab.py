"""Same-run A/B of the SMs' L1 / shared-memory split for the TTT scan kernels (`tttvideo.ttt.triton_carveout`):
the smallest shared-memory carveout that holds a kernel's resident programs ("fit", the default) against Triton's
own setting ("triton": the largest carveout for kernels over 48 KB of shared memory), in alternating rounds.

    PYTHONPATH=src python3 benchmarks/ttt_carveout_ab.py --out benchmarks/results/ttt_carveout_ab_h100.json

Cases (heads of 64, bf16 inputs as the layer makes them, `tttvideo.ttt.testing.make_inputs`, 18,048 tokens):
TTT-MLP forward + backward (mini-batch 64, checkpoint group 16: the training scan), its training forward alone, the
sampling forward at mini-batch 16 over a guided step's 96 streams and one sample's 48, and TTT-Linear forward +
backward (mini-batch 16). Both modes run the same compiled kernels, so their outputs and gradients must be equal bit
for bit, but for the norm gradients of a backward, which the TTT-MLP output path and reverse kernels add with
atomics from two CUDA streams (their order, and so their rounding, changes from run to run): the table says per case
whether the rest are equal and how far the norm gradients moved. Times are medians over rounds of `ttt_kernel.bench`
(CUDA events), the order reversed every other round. The modes apply where `fit_carveout` is called (the TTT-MLP
reverse and the TTT-Linear backward); the forward cases show that nothing else moved. On a CPU (TRITON_INTERPRET=1,
a smoke run: `--length 64 --heads 2`) there is no carveout to set and the times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ttt_forward_ab import ab_device, add_ab_arguments, timed  # noqa: E402 - this script's folder

from tttvideo.memory.profile.profiler import git_commit  # noqa: E402
from tttvideo.results import save_json  # noqa: E402

MODES = ("triton", "fit")
# (name, kind, batch, mini-batch, what runs: "fwd+bwd", "train fwd" or "sample fwd")
CASES = [("MLP forward + backward", "mlp", 1, 64, "fwd+bwd"),
         ("MLP training forward", "mlp", 1, 64, "train fwd"),
         ("MLP sampling forward", "mlp", 2, 16, "sample fwd"),
         ("MLP sampling forward", "mlp", 1, 16, "sample fwd"),
         ("Linear forward + backward", "linear", 1, 16, "fwd+bwd")]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_ab_arguments(ap)
    return ap.parse_args(argv)


def in_mode(mode: str, fn):
    """fn() with TTT_L1_CARVEOUT=mode (read by every launch)."""
    def run():
        os.environ["TTT_L1_CARVEOUT"] = mode
        return fn()
    return run


def scan(kind: str, M: int, what: str, ins: list[torch.Tensor], dout: torch.Tensor):
    from tttvideo.ttt import triton_linear, triton_mlp

    mod = triton_mlp if kind == "mlp" else triton_linear
    fwd = mod.mlp_forward if kind == "mlp" else mod.linear_forward
    bwd = mod.mlp_backward if kind == "mlp" else mod.linear_backward
    if what == "sample fwd":
        return lambda: fwd(*ins, M, 16, False)[0]

    def fwd_bwd():
        out, ck = fwd(*ins, M, 16, True)
        return (out, *bwd(dout, *ins[:6], ck, M, 16)) if what == "fwd+bwd" else (out, *ck)
    return fwd_bwd


def run_case(name: str, kind: str, B: int, M: int, what: str, args, device) -> dict:
    from tttvideo.ttt.testing import make_inputs

    L = args.length // M * M
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's products take fp32
    ins = [t.detach() for t in make_inputs(kind, B, args.heads, L, 64, M, dtype=dtype, seed=1, device=device)]
    dout = torch.randn_like(ins[0])
    fn = scan(kind, M, what, ins, dout)
    runs = {mode: in_mode(mode, fn) for mode in MODES}
    outs = {mode: run() for mode, run in runs.items()}
    a, b = (outs[m] if isinstance(outs[m], tuple) else (outs[m],) for m in MODES)
    # a backward returns out, dq, dk, dv, deta, d norm_w, d norm_b, ...: the norm gradients are summed by atomics
    norm = {5, 6} if what == "fwd+bwd" else set()
    equal = all(torch.equal(x, y) for i, (x, y) in enumerate(zip(a, b)) if i not in norm)
    norm_moved = max((float((a[i] - b[i]).norm() / b[i].norm().clamp_min(1e-30)) for i in norm), default=0.0)
    del outs, a, b
    times = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            times[mode].append(timed(runs[mode], device, min_runs=5))
    os.environ.pop("TTT_L1_CARVEOUT", None)
    return dict(case=f"{name}, {B * args.heads} streams", kind=kind, streams=B * args.heads, mini_batch=M,
                tokens=L, runs=what, equal=equal, norm_grad_moved=norm_moved,
                **{f"{m}_ms": [round(t, 4) for t in ts] for m, ts in times.items()},
                **{f"{m}_median_ms": statistics.median(ts) for m, ts in times.items()})


def main(argv=None) -> int:
    args = parse_args(argv)
    device = ab_device("ttt_carveout_ab.py")
    rows = [run_case(*case, args, device) for case in CASES]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    result = dict(benchmark="ttt_carveout_ab", device=name, torch=torch.__version__, git_commit=git_commit(),
                  rounds=args.rounds, modes={"triton": "Triton's setting (largest carveout above 48 KB)",
                                             "fit": "smallest carveout holding the resident programs"}, rows=rows)
    if args.out:
        save_json(args.out, result)
    print(f"\n{name}, commit {result['git_commit'][:7]}: ms, median of {args.rounds} alternating rounds")
    print(f"{'case':<40} {'triton':>9} {'fit':>9} {'fit/triton':>10}  bit-equal  norm grads moved")
    for r in rows:
        print(f"{r['case']:<40} {r['triton_median_ms']:>9.3f} {r['fit_median_ms']:>9.3f} "
              f"{r['fit_median_ms'] / r['triton_median_ms']:>10.3f}  {str(r['equal']):<9}  {r['norm_grad_moved']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
