"""Local attention's overlap merge, the gathers it runs against the index_add scatter it replaced.

For the CogVideoX-5B layout (48 heads of 64, bf16) at each --durations length, the attention output of every window
[n, H, W, D] goes back to the residual stream [1, L, H D], each position the mean of the windows covering it
(`tttvideo.models.attention.merge_windows`: a gather of each position's first window, a second window's output added
where two overlap; backward a gather by the window index). The scatter is what torch.compile left to ATen's bf16
atomics (an index_add into zeros, scaled by 1/count). Both run on the same random output and output gradient: the
table says whether they are equal bit for bit (forward and gradient) and gives median CUDA-event milliseconds of the
forward and of forward + backward.

    PYTHONPATH=src python3 benchmarks/window_merge.py --out benchmarks/results/window_merge_h200.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttt_kernel import bench  # noqa: E402

from tttvideo.layout import VideoLayout  # noqa: E402
from tttvideo.memory.profile.profiler import git_commit  # noqa: E402
from tttvideo.models import attention  # noqa: E402
from tttvideo.results import save_json  # noqa: E402

HEADS, HEAD_DIM = 48, 64


def scatter_merge(out: torch.Tensor, flat: torch.Tensor, n: int, inv_count: torch.Tensor, length: int) -> torch.Tensor:
    """The merge as it was: SDPA's output [B n, H, W, D], every window index_added into zeros [B, L, H D], scaled by
    1/count (tests/test_window_merge.py holds merge_windows to it on the CPU)."""
    Bn, H, W, D = out.shape
    out = out.transpose(1, 2).reshape(Bn // n, n * W, H * D)
    summed = torch.zeros(Bn // n, length, H * D, dtype=out.dtype, device=out.device).index_add(1, flat, out)
    return summed * inv_count.to(out.dtype)


def measure(duration: int) -> list[dict]:
    layout = VideoLayout.create(duration, 480, 720)
    device = torch.device("cuda")
    index, _, _, inv_count = attention.window_tensors(layout, HEAD_DIM, 10000.0, device)
    n, flat, length = index.shape[0], index.reshape(-1), layout.total_tokens
    covers = attention.window_covers(layout, device)
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = torch.randn(n, HEADS, index.shape[1], HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad = torch.randn(1, length, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    merges = {"scatter (index_add)": lambda o: scatter_merge(o, flat, n, inv_count, length),
              "gathers (merge_windows)": lambda o: attention.merge_windows(o, flat, n, inv_count, length, covers)}
    rows, results = [], []
    for name, merge in merges.items():
        o = out.clone().requires_grad_()
        merged = merge(o)
        merged.backward(grad)
        results.append((merged.detach(), o.grad))
        leaf = out.clone().requires_grad_()
        rows.append({"duration_s": duration, "tokens": length, "windows": n, "merge": name,
                     "forward_ms": bench(lambda: merge(out), min_runs=20)[0],
                     "forward_backward_ms": bench(lambda: merge(leaf).backward(grad), min_runs=20)[0]})
    equal = all(torch.equal(a, b) for a, b in zip(results[0], results[1]))
    for row in rows:
        row["equal_to_scatter"] = equal
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--durations", type=int, nargs="+", default=[9, 63])
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("window_merge: needs a CUDA GPU (the merge it replaced was slow in CUDA's atomics)", file=sys.stderr)
        return 2
    rows = [row for d in args.durations for row in measure(d)]
    result = {"benchmark": "window_merge", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "git_commit": git_commit(), "rows": rows}
    if args.out:
        save_json(args.out, result)
    print(f"{'length':>6} {'tokens':>8} {'merge':24} {'forward ms':>11} {'fwd+bwd ms':>11} equal")
    for r in rows:
        print(f"{r['duration_s']:>5}s {r['tokens']:>8} {r['merge']:24} {r['forward_ms']:>11.2f} "
              f"{r['forward_backward_ms']:>11.2f} {r['equal_to_scatter']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
