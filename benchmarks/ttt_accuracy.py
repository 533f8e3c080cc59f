"""How accurate the Triton TTT scans are at full size, and how accurate they can be: one table over fresh draws.

    PYTHONPATH=src python3 benchmarks/ttt_accuracy.py [--draws 16] [--regimes spec-init drawn-norm] [--out DIR]
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/ttt_accuracy.py --length 256 --heads 2   # CPU smoke run

(PYTHONPATH=src is not needed with the package installed.)
Per fresh draw (inputs from tttvideo.ttt.testing.make_inputs, regimes as its docstring describes, a fresh upstream
gradient), the
largest relative error ||a-b|| / ||b|| over the output and every gradient, against the fp32 reference, of
  kernel     the Triton kernels (bf16 inputs, outputs and scratch NaN-poisoned);
  bf16 ref   the reference with both operands of every product rounded to bf16 (forward and backward), all else
             fp32: what bf16 tensor-core products alone cost, without any kernel;
  W +2^-9    the fp32 reference itself, with the slow weights (W1, b1, W2, b2) multiplied by 1 + 2^-9 N(0, 1):
             how far the exact answer moves under a perturbation of one bf16 rounding's size. Where this is large
             the draw is ill-conditioned, and no bf16 computation can be held to the fp32 answer there.
Writes ttt_accuracy.json (device, versions, commit, every draw) to --out and prints the table last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the interpreter

SLOW_WEIGHTS = slice(6, None)  # W1, b1 (, W2, b2) in the scan's argument order


def worst(errs):
    name = max(errs, key=lambda n: errs[n] if errs[n] == errs[n] else float("inf"))
    return errs[name], name


def one_draw(kind, regime, H, L, group):
    from tttvideo.ttt.testing import default_mini_batch, errors_between, kernel_and_reference, scan_with_grads

    m = default_mini_batch(kind)
    t0 = time.time()
    # the interpreter's bf16 products are broken: on the CPU the kernels get fp32 inputs (a smoke run only)
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    ins, dout, ref, fast = kernel_and_reference(kind, 1, H, L, 64, m, group, regime=regime, device=device,
                                                dtype=dtype)
    rounded = scan_with_grads(kind, ins, dout, m, group, operand_dtype=torch.bfloat16)
    g = torch.Generator(device=ins[0].device).manual_seed(int(torch.seed() % 2**31))
    nudged = [t * (1 + 2**-9 * torch.randn(t.shape, device=t.device, generator=g)) for t in ins[SLOW_WEIGHTS]]
    moved = scan_with_grads(kind, ins[:6] + nudged, dout, m, group)
    row = dict(kind=kind, regime=regime, H=H, L=L, kernel=errors_between(fast, ref),
               bf16_reference=errors_between(rounded, ref), sensitivity=errors_between(moved, ref),
               seconds=round(time.time() - t0, 2))
    del ins, dout, ref, fast, rounded, moved
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=16, help="fresh draws per regime and kind")
    ap.add_argument("--regimes", nargs="*", default=["spec-init", "drawn-norm", "biased-eta16"])
    ap.add_argument("--kinds", nargs="*", default=["mlp", "linear"])
    ap.add_argument("--linear-draws", type=int, default=4, help="draws per regime for TTT-Linear")
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--length", type=int, default=18048)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--commit", default=os.environ.get("TTT_COMMIT", ""))
    args = ap.parse_args()
    import triton

    try:  # python -m benchmarks.ttt_accuracy, or a test
        from benchmarks.ttt_kernel import git_commit, write_json
    except ImportError:  # python benchmarks/ttt_accuracy.py: this script's folder is first on sys.path
        from ttt_kernel import git_commit, write_json
    from tttvideo.ttt.testing import TOLERANCE

    meta = dict(torch=torch.__version__, triton=triton.__version__, git_commit=args.commit or git_commit(),
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)")
    rows = []
    for kind in args.kinds:
        for regime in args.regimes:
            for _ in range(args.draws if kind == "mlp" else args.linear_draws):
                rows.append(one_draw(kind, regime, args.heads, args.length, args.group))
                r = rows[-1]
                print(f"{kind} {regime}: kernel {worst(r['kernel'])}, bf16 ref {worst(r['bf16_reference'])}, "
                      f"W +2^-9 {worst(r['sensitivity'])} ({r['seconds']} s)", flush=True)
    res = dict(meta, tolerance=TOLERANCE, rows=rows)
    write_json(args.out, "ttt_accuracy.json", res)
    table(res)


def table(res):
    print(f"\n{res['device']}  torch {res['torch']}  triton {res['triton']}  commit {res['git_commit'][:10]}")
    print("largest relative error over the output and every gradient, per draw; against the fp32 reference")
    print(f"{'kind':7} {'regime':14} {'draws':>5} {'kernel median':>13} {'kernel worst':>12} {'> tol':>5} "
          f"{'bf16-ref worst':>14} {'> tol':>5} {'W+2^-9 worst':>12} {'> tol':>5}")
    groups = {}
    for r in res["rows"]:
        groups.setdefault((r["kind"], r["regime"]), []).append(r)
    for (kind, regime), rs in groups.items():
        k, b, s = ([worst(r[c])[0] for r in rs] for c in ("kernel", "bf16_reference", "sensitivity"))
        over = lambda xs: sum(not x <= res["tolerance"] for x in xs)  # noqa: E731  (NaN counts as over)
        print(f"{kind:7} {regime:14} {len(rs):>5} {statistics.median(k):>13.2e} {max(k):>12.2e} {over(k):>5} "
              f"{max(b):>14.2e} {over(b):>5} {max(s):>12.2e} {over(s):>5}")


if __name__ == "__main__":
    main()
