"""What the sampling TTT mini-batch costs: one block's bidirectional TTT (both passes and their gates) of the
CogVideoX-5B (3072 wide, 48 heads of 64) in a guided sampling step (batch 2: conditional and unconditional),
without gradients, in bf16, at mini-batch 16 and 64, for TTT-MLP and TTT-Linear, at 3 s and 63 s.

    PYTHONPATH=src python3 benchmarks/ttt_sample_minibatch.py --out benchmarks/results/ttt_sample_minibatch_h100.json

(PYTHONPATH=src is not needed with the package installed.) The layout is the sampler's
(`VideoLayout.from_config(..., phase="sample")` with `ttt.sample_mini_batch_size` set), so the text length is the
training one and only the TTT padding and the scan's mini-batch change. The scan runs on the dispatching backend
("auto": the Triton kernels, which take mini-batches 16, 32 and 64). "step s" is the block's time times the 42
blocks: the TTT share of one guided step (`benchmarks/sample.py` times the whole step). Medians of CUDA-event
timings (benchmarks/ttt_kernel.py's `bench`). "scans ms" is the block's two scans alone (the layer's `scan` on
drawn inputs of its shapes, twice): the rest of "block ms" is the projections, the glue and the gates. Prints a
table last; writes JSON with device, torch and commit.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks, run as a script or with -m
from ttt_kernel import bench, git_commit  # noqa: E402 - benchmarks/ttt_kernel.py

from tttvideo.config.loader import load_config
from tttvideo.layout import VideoLayout
from tttvideo.results import save_json
from tttvideo.ttt.layer import BidirectionalTTT

LAYERS_5B = 42


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", nargs="+", default=["mlp", "linear"])
    ap.add_argument("--durations", nargs="+", default=["3s", "63s"])
    ap.add_argument("--mini-batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--batch", type=int, default=2, help="2: guided sampling's conditional + unconditional batch")
    ap.add_argument("--dim", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--layers", type=int, default=LAYERS_5B, help="blocks per step, for the per-step estimate")
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=720)
    ap.add_argument("--text-tokens", type=int, default=0, help="0: the original's length per duration")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results/ttt_sample_minibatch.json")
    return ap.parse_args(argv)


def timed(fn, device: torch.device, reps: int) -> float:
    """Median ms: CUDA events on a GPU, wall clock elsewhere (the CPU run is a smoke test, not a measurement)."""
    if device.type == "cuda":
        return bench(fn, min_runs=reps)[0]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def measure(args, kind: str, duration: str, mini_batch: int, device: torch.device, dtype: torch.dtype,
            overrides: tuple[str, ...] = ()) -> dict:
    """One block's TTT (`overrides`: further config settings, e.g. ttt.compile_glue=false)."""
    cfg = load_config(None, [f'ttt.kind="{kind}"', f"ttt.sample_mini_batch_size={mini_batch}",
                             f"layout.height={args.height}", f"layout.width={args.width}",
                             f"layout.text_tokens={args.text_tokens}", "ttt.scan_checkpoint_group_size=0",
                             *overrides])
    layout = VideoLayout.from_config(cfg.layout, cfg.ttt, duration, phase="sample")
    torch.manual_seed(0)
    block = BidirectionalTTT(args.dim, args.heads, cfg.ttt).to(device, dtype).requires_grad_(False)
    x = torch.randn(args.batch, layout.total_tokens, args.dim, device=device, dtype=dtype)
    row = {"kind": kind, "duration": duration, "duration_s": layout.duration_s, "tokens": layout.total_tokens,
           "mini_batch": mini_batch, "ttt_padding": layout.ttt_padding}
    try:
        with torch.no_grad():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            row["block_ms"] = timed(lambda: block(x, layout), device, args.reps)
            if device.type == "cuda":
                row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["step_s"] = row["block_ms"] * args.layers / 1e3
        x = None  # the block input's memory back before the scans' inputs are drawn
        row["scans_ms"] = scans_ms(block.ttt, kind, args.batch, layout, device, dtype, args.reps)
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    block = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


@torch.no_grad()
def scans_ms(layer, kind: str, batch: int, layout: VideoLayout, device: torch.device, dtype: torch.dtype,
             reps: int) -> float:
    """The block's two scans alone (the forward and the reverse pass scan sequences of one shape): twice one scan,
    by the layer's `scan` on q, k, v and eta drawn at its shapes (`tttvideo.ttt.testing.make_inputs`); the rest of
    `block_ms` is the projections, the glue and the gates."""
    from tttvideo.ttt.testing import make_inputs

    L = layout.total_tokens + layout.ttt_padding
    q, k, v, eta = (t.detach() for t in make_inputs(kind, batch, layer.num_heads, L, layer.head_dim,
                                                     layout.mini_batch_size, dtype, seed=0, device=device)[:4])
    return 2 * timed(lambda: layer.scan(q, k, v, eta, layout), device, reps)


def print_table(result: dict) -> None:
    print(f"\nTTT of one block in a guided sampling step (batch {result['batch']}, {result['dim']} wide, "
          f"{result['heads']} heads, {result['dtype']}) on {result['device']}, commit {result['git_commit'][:10]}")
    print(f"{'kind':>6} {'duration':>8} {'tokens':>8} {'mini-batch':>10} {'block ms':>9} {'scans ms':>9} "
          f"{'step s':>7} {'x vs 64':>8}")
    rows = result["rows"]
    for r in rows:
        if "block_ms" not in r:
            print(f"{r['kind']:>6} {r['duration']:>8} {r['tokens']:>8} {r['mini_batch']:>10} {r.get('error')}")
            continue
        base = next((b for b in rows if b["kind"] == r["kind"] and b["duration"] == r["duration"]
                     and b["mini_batch"] == 64 and "block_ms" in b), None)
        ratio = f"{r['block_ms'] / base['block_ms']:.2f}" if base else "-"
        scans = f"{r['scans_ms']:.2f}" if "scans_ms" in r else "-"
        print(f"{r['kind']:>6} {r['duration']:>8} {r['tokens']:>8} {r['mini_batch']:>10} {r['block_ms']:>9.2f} "
              f"{scans:>9} {r['step_s']:>7.2f} {ratio:>8}")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result = {"benchmark": "ttt_sample_minibatch", "device": torch.cuda.get_device_name(device)
              if device.type == "cuda" else platform.processor() or "cpu", "torch": torch.__version__,
              "python": platform.python_version(), "git_commit": git_commit() or "unknown (no .git on the device copy)",
              "batch": args.batch, "dim": args.dim, "heads": args.heads, "dtype": str(dtype).split(".")[-1],
              "layers": args.layers, "rows": []}
    for kind in args.kinds:
        for duration in args.durations:
            for mini_batch in args.mini_batches:
                row = measure(args, kind, duration, mini_batch, device, dtype)
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
    save_json(args.out, result)
    print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
