"""TTT-MLP forward scan by launch shape: how a chain's step time moves with the streams in one launch (one program per
SM or two), the programs per stream (split) and the warps per program, on one GPU.

    PYTHONPATH=src python3 benchmarks/ttt_launch_shape.py --out benchmarks/results/ttt_launch_shape_h100.json

(PYTHONPATH=src is not needed with the package installed.) Each row is one `triton_mlp.mlp_forward` with output and
no saving (the sampling forward), on bf16 inputs of heads of 64 and an inner MLP of 256 drawn as the layer makes
them (`tttvideo.ttt.testing.make_inputs`), at L = 18,048 tokens cut to the mini-batch, with the split and warps
forced (`tune`), so the default (`triton_mlp.forward_shape`) is one of the rows, not what runs. "us / step" is the
launch's median time over its mini-batches: one step of every chain, the serial unit the 63-s scan repeats 21,948
times at mini-batch 16. Each row's output is compared with the first row of its (mini-batch, streams) group, split
1 at 8 warps (relative max error: bf16 outputs, so launch shapes differ at the 1e-3 level). Two sweeps: `streams`
(a shape at 24-264 streams: where a second wave starts) and `shapes` (the (mini-batch, streams) of training and
guided sampling at each split and warp count). Needs a CUDA GPU. Prints a table last; writes JSON with device,
torch and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ttt_kernel import bench, git_commit, write_json  # noqa: E402 - this script's folder: ttt_kernel.py

D, E = 64, 256
# (mini-batch, split, warps) swept over streams; (mini-batch, streams, split, warps...) compared at fixed streams
STREAM_SWEEP = [(64, 1, 8), (64, 2, 8), (16, 1, 8)]
STREAMS = [24, 48, 66, 96, 132, 192, 264]
SHAPES = [(16, 96, 1, (4, 8, 16)), (64, 48, 2, (4, 8, 16)), (64, 24, 4, (4, 8, 16)), (16, 48, 2, (4, 8, 16)),
          (16, 96, 2, (4, 8)), (16, 132, 2, (4, 8)), (16, 192, 2, (4, 8)), (64, 96, 2, (4, 8)), (64, 48, 4, (4, 8)),
          # four roles at the sampling mini-batch: 384 programs of 2 or 4 warps, three or more to an SM
          (16, 96, 4, (2, 4)), (16, 48, 4, (2, 4))]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweeps", nargs="+", default=["streams", "shapes"], choices=["streams", "shapes"])
    ap.add_argument("--length", type=int, default=18048, help="tokens per stream (cut to the mini-batch)")
    ap.add_argument("--reps", type=int, default=7, help="timed runs at least (benchmarks/ttt_kernel.py's bench)")
    ap.add_argument("--out", default="benchmarks/results/ttt_launch_shape.json")
    return ap.parse_args(argv)


def measure(M: int, streams: int, split: int, warps: int, L: int, reps: int, ins,
            ref) -> tuple[dict, torch.Tensor | None]:
    """(row, output): the launch's timing, registers and error against `ref`; output None where it failed."""
    from tttvideo.ttt import triton_mlp

    row = dict(mini_batch=M, streams=streams, split=split, programs=streams * split, warps=warps)
    fn = lambda: triton_mlp.mlp_forward(*ins, M, 16, False, output=True, split=split, num_warps=warps)[0]  # noqa: E731
    try:
        out = fn().float()
        kernel = triton_mlp.LAUNCHED["fwd"]
        ms = bench(fn, min_runs=reps)[0]
    except Exception as e:  # a shape Triton cannot build (registers, shared memory) is a row, not the end of the run
        return {**row, "error": f"{type(e).__name__}: {str(e)[:300]}"}, None
    row.update(ms=ms, us_per_step=ms * 1e3 / (L // M), regs=kernel.n_regs, spills=kernel.n_spills)
    if ref is not None:
        row["max_rel_err_vs_first"] = float((out - ref).abs().max() / ref.abs().max())
    return row, out


def sweep(args) -> list[dict]:
    rows = []

    def run(M, streams, shapes):
        L = args.length - args.length % M
        from tttvideo.ttt.testing import make_inputs

        ins, ref = [t.detach() for t in make_inputs("mlp", 1, streams, L, D, M, seed=0)], None
        for split, warps in shapes:
            row, out = measure(M, streams, split, warps, L, args.reps, ins, ref)
            ref = out if ref is None else ref
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ins

    if "streams" in args.sweeps:
        for M, split, warps in STREAM_SWEEP:
            for streams in STREAMS:
                run(M, streams, [(split, warps)])
    if "shapes" in args.sweeps:
        for M, streams, split, warp_list in SHAPES:
            # the first row of each group, the error's reference: one program a stream at 8 warps
            run(M, streams, [(1, 8)] + [(split, w) for w in warp_list if (split, w) != (1, 8)])
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ttt_launch_shape.py times Triton launches on a CUDA GPU; none is available here")
    rows = sweep(args)
    result = {"benchmark": "ttt_launch_shape", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "git_commit": git_commit(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
              "head_dim": D, "hidden": E, "length": args.length, "command": " ".join(sys.argv), "rows": rows}
    write_json(os.path.dirname(os.path.abspath(args.out)), os.path.basename(args.out), result)
    print(f"\n{result['device']}, {result['sms']} SMs, L = {args.length}, heads of {D}, inner {E}, bf16")
    print(f"{'M':>3} {'streams':>7} {'split':>5} {'programs':>8} {'warps':>5} {'ms':>7} {'us/step':>7} {'regs':>4} "
          f"{'spills':>6} {'err':>7}")
    for r in rows:
        head = f"{r['mini_batch']:>3} {r['streams']:>7} {r['split']:>5} {r['programs']:>8} {r['warps']:>5}"
        if "error" in r:
            print(f"{head} {r['error']}")
            continue
        err = r.get("max_rel_err_vs_first")
        print(f"{head} {r['ms']:>7.2f} {r['us_per_step']:>7.2f} {r['regs']:>4} {r['spills']:>6} "
              f"{'' if err is None else f'{err:.1e}':>7}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
