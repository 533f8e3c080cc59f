"""Why local attention runs slower per FLOP at 63 s than at 3 s: the same SDPA windows as one call at the 63-s batch
(2 samples x 21 windows = 42) against 21 calls at the 3-s batch (2), in the [B, H, L, D] layout the window glue
writes and in the transposed [B, L, H, D] view, on cuDNN and on flash, with the SM clock and power that nvidia-smi
logs during each case (clocks tell a hot card from a slow kernel choice).

    PYTHONPATH=src python3 benchmarks/attention_batch.py --out benchmarks/results/attention_batch_h100.json
    PYTHONPATH=src python3 benchmarks/attention_batch.py --device cpu --tokens 128 --heads 2 --windows 3  # smoke

(PYTHONPATH=src is not needed with the package installed.) CogVideoX-5B's shapes by default: 48 heads of 64, windows
of 18,048 tokens, bf16. Medians of CUDA-event timings (wall clock on the CPU, where only the math backend runs and
no clocks are logged). TFLOP/s counts 4 B H L^2 D per call. Prints a table last; writes JSON with device, torch and
commit.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tttvideo.memory.profile.profiler import git_commit
from tttvideo.results import save_json


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=18048, help="tokens per window")
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--dim", type=int, default=64, help="head dim")
    ap.add_argument("--windows", type=int, default=21, help="windows per sample at the long duration")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="")
    return ap.parse_args(argv)


def inputs(B: int, args, layout: str, device) -> list[torch.Tensor]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (B, args.heads, args.tokens, args.dim) if layout == "bhld" else (B, args.tokens, args.heads, args.dim)
    ts = [torch.randn(shape, device=device, dtype=dtype) for _ in range(3)]
    return ts if layout == "bhld" else [t.transpose(1, 2) for t in ts]


def timed(fn, reps: int, device) -> float:
    """Median ms of `reps` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def case(name: str, B: int, calls: int, layout: str, backend, args, device) -> dict:
    q, k, v = inputs(B, args, layout, device)

    def run():
        for _ in range(calls):
            F.scaled_dot_product_attention(q, k, v)

    with sdpa_kernel(backend):
        t0 = time.time()
        ms = timed(run, args.reps, device)
        t1 = time.time()
    flop = 4 * B * args.heads * args.tokens ** 2 * args.dim * calls
    return dict(case=name, batch=B, calls=calls, layout=layout, backend=backend.name, ms=ms,
                tflops=flop / ms / 1e9, t0=t0, t1=t1)


def clock_log(path: Path):
    """nvidia-smi sampling SM clock, power and temperature every 100 ms into `path` (None where it cannot run)."""
    try:
        return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                                 "--format=csv,noheader,nounits", "-lms", "100"], stdout=path.open("w"))
    except OSError:
        return None


def add_clocks(rows: list[dict], path: Path) -> None:
    """Mean SM clock and power, and the highest temperature, over each case's wall-clock span."""
    samples = []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            ts = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((ts, float(parts[1]), float(parts[2]), float(parts[3])))
        except (ValueError, IndexError):
            continue
    for r in rows:
        seg = [s for s in samples if r["t0"] <= s[0] <= r["t1"]]
        r["samples"] = len(seg)
        if seg:
            r["sm_mhz"] = statistics.mean(s[1] for s in seg)
            r["power_w"] = statistics.mean(s[2] for s in seg)
            r["temp_c"] = max(s[3] for s in seg)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION] if device.type == "cuda" else \
        [SDPBackend.MATH]
    long_batch = 2 * args.windows
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp, "clocks.csv")
        logger = clock_log(log_path) if device.type == "cuda" else None
        rows = []
        for backend in backends:
            rows.append(case("3 s batch, 1 call", 2, 1, "bhld", backend, args, device))
            rows.append(case(f"3 s batch, {args.windows} calls", 2, args.windows, "bhld", backend, args, device))
            rows.append(case("63 s batch, 1 call", long_batch, 1, "bhld", backend, args, device))
            rows.append(case("63 s batch, BLHD view", long_batch, 1, "blhd", backend, args, device))
            rows.append(case("3 s batch again", 2, 1, "bhld", backend, args, device))
        if logger is not None:
            time.sleep(0.3)
            logger.terminate()
            logger.wait()
            add_clocks(rows, log_path)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = dict(benchmark="attention_batch", device=name, torch=torch.__version__, git_commit=git_commit(),
                  tokens=args.tokens, heads=args.heads, dim=args.dim, windows=args.windows, rows=rows)
    if args.out:
        save_json(args.out, result)
    print(f"\n{name}  torch {torch.__version__}  commit {result['git_commit']}  "
          f"{args.heads} heads x {args.dim}, {args.tokens} tokens a window")
    print(f"{'case':24} {'backend':16} {'ms':>9} {'TFLOP/s':>8} {'SM MHz':>7} {'W':>5} {'C':>3}")
    for r in rows:
        print(f"{r['case']:24} {r['backend']:16} {r['ms']:9.2f} {r['tflops']:8.2f} {r.get('sm_mhz', 0):7.0f} "
              f"{r.get('power_w', 0):5.0f} {r.get('temp_c', 0):3.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
