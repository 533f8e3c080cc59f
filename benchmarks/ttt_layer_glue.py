"""Time the TTT layer around the scan: the plain composition vs the scan-order forward, its glue between the q/k/v
projection and the scan (`tttvideo.ttt.scan_inputs`) eager, torch.compile'd or the fused Triton kernels.

One CogVideoX-5B-sized TTT layer (3072 wide, 48 heads of 64, TTT-MLP, mini-batch 64, scan checkpoint group 16,
bf16, the dispatching scan backend) at 3 s and 63 s, batch 1 (and 2: guided sampling's batch): forward (inference)
and, under 100k tokens, forward+backward. Checks that every variant matches the plain composition (relative error
of the output, bf16). Prints a table; writes JSON.

    PYTHONPATH=src python3 benchmarks/ttt_layer_glue.py --out benchmarks/results/ttt_layer_glue_h100.json

(PYTHONPATH=src is not needed with the package installed.) The plain composition is
tttvideo.ttt.plain_layer.plain_ttt_layer; the timer is benchmarks/ttt_kernel.py's `bench`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
from unittest import mock

import torch

try:  # python -m benchmarks.ttt_layer_glue
    from benchmarks.ttt_kernel import bench, git_commit
except ImportError:  # python benchmarks/ttt_layer_glue.py: this script's folder is first on sys.path
    from ttt_kernel import bench, git_commit

from tttvideo.config.schema import TTTConfig
from tttvideo.layout import VideoLayout
from tttvideo.results import save_json
from tttvideo.ttt import scan_inputs
from tttvideo.ttt.layer import TTTLayer
from tttvideo.ttt.plain_layer import plain_ttt_layer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--durations", nargs="+", default=["3s", "63s"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/ttt_layer_glue.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    # all parameters in bf16, as the model loads them (the scan keeps its inner state in fp32)
    layer = TTTLayer(3072, 48, TTTConfig(kind="mlp", scan_checkpoint_group_size=16)).to(dev, torch.bfloat16)

    def plain(x, lay):
        return plain_ttt_layer(layer, x, lay, backend="auto")

    def scan_order(glue):
        def run(x, lay):
            layer.compile_glue = glue == "compiled"
            # the reference glue although the kernels could run
            reference = mock.patch.object(scan_inputs, "use_kernel", lambda qkv, backend: False)
            with contextlib.nullcontext() if glue == "triton" else reference:
                return layer(x, lay)
        return run

    variants = {"plain": plain, **{f"scan-order {glue}": scan_order(glue) for glue in ("eager", "compiled", "triton")}}
    rows = []
    for duration, batch in ((d, b) for d in args.durations for b in args.batches):
        lay = VideoLayout.create(duration)
        x = torch.randn(batch, lay.total_tokens, 3072, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            ref = plain(x, lay).float()
        for name, fn in variants.items():
            with torch.no_grad():
                out = fn(x, lay).float()  # warm-up (and compile)
                rel = ((out - ref).norm() / ref.norm()).item()
                torch.cuda.reset_peak_memory_stats()
                fwd, _ = bench(lambda: fn(x, lay), min_runs=args.reps)
                peak = torch.cuda.max_memory_allocated() / 2**30
            row = {"duration": duration, "batch": batch, "tokens": lay.total_tokens, "variant": name, "forward_ms": fwd,
                   "forward_peak_gib": peak, "rel_err_vs_plain": rel}
            if lay.total_tokens < 100_000:
                xg = x.clone().requires_grad_()

                def step():
                    fn(xg, lay).float().square().mean().backward()

                row["forward_backward_ms"], _ = bench(step, min_runs=args.reps)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del out
        x = ref = None  # free before the next length (a rebinding: the closures above read x)
        torch.cuda.empty_cache()

    commit = git_commit()[:7]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "git_commit": commit or "unknown (no .git on the device copy)", "rows": rows}
    save_json(args.out, result)
    print(f"\nTTT layer (3072 wide, 48 heads, TTT-MLP, bf16) on {result['device']}")
    print(f"{'duration':>8} {'batch':>5} {'variant':>20} {'fwd ms':>9} {'fwd+bwd ms':>11} {'peak GiB':>9} "
          f"{'rel err':>9}")
    for r in rows:
        fb = f"{r['forward_backward_ms']:.2f}" if "forward_backward_ms" in r else "-"
        print(f"{r['duration']:>8} {r['batch']:>5} {r['variant']:>20} {r['forward_ms']:9.2f} {fb:>11} "
              f"{r['forward_peak_gib']:9.2f} {r['rel_err_vs_plain']:9.2e}")


if __name__ == "__main__":
    main()
