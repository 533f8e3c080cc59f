"""Can the TTT scan share the GPU with the matrix work around it? The sampling scan timed alone, a background of the
step's compute-bound work timed alone, and the two side by side on two CUDA streams.

    PYTHONPATH=src python3 benchmarks/scan_overlap.py --out benchmarks/results/scan_overlap_h100.json
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/scan_overlap.py --length 64 --heads 2 --tokens 64 \
        --window 64 --rounds 1                                          # CPU smoke run (Triton's interpreter)

(PYTHONPATH=src is not needed with the package installed.) Why: a 63-s guided step spends about 10.2 s in the
scans, a serial chain of 21,948 mini-batch steps a direction that is bound by latency and leaves most of the card's
tensor throughput unused, and about 32 s in attention and linear layers, which are bound by throughput. A scan emits
its output in token order, and local attention and every linear layer work window by window or token by token, so
a pipelined block could run the products of the windows a scan has already passed (and the next block's attention
of the windows the reverse scan has finished) beside the scan. Whether that pays depends on how much each slows the
other on shared SMs, which this measures before any such schedule is built.

Scans (`triton_mlp.mlp_forward`, output, no saves, mini-batch 16: the sampling launch, 2 roles at 4 warps): a
guided step's 2 x 48 heads (192 programs) and one sample's 48. Backgrounds: a 3072 x 3072 bf16 linear layer over
--tokens tokens (cuBLAS, the shape of every projection of the 5B block), and SDPA over one window of --window
tokens at batch 2 (the guided step's attention). Per (scan, background): the scan alone, the background alone
(repeated so its time is about the scan's), both launched together on two streams (the scan's at high priority);
medians over --rounds of CUDA-event times. "overlap" is the time saved against running them one after the other,
as a share of the shorter of the two: 1.0 would hide the shorter entirely, 0 is no gain, below 0 a loss. Prints a
table last; writes JSON with device, torch and commit.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from tttvideo.memory.profile.profiler import git_commit
from tttvideo.results import save_json

D, M = 64, 16


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=18048, help="tokens a scan stream runs over (cut to the mini-batch)")
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of the linear-layer background")
    ap.add_argument("--window", type=int, default=18048, help="tokens of the attention background's window")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="")
    return ap.parse_args(argv)


class Timer:
    """ms between two points on a stream: CUDA events on a GPU, wall clock elsewhere (the interpreter)."""

    def __init__(self, cuda: bool, stream=None):
        self.cuda, self.stream = cuda, stream
        if cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self):
        if self.cuda:
            self.a.record(self.stream)
        else:
            self.t0 = time.perf_counter()

    def stop(self):
        if self.cuda:
            self.b.record(self.stream)
        else:
            self.t1 = time.perf_counter()

    def ms(self) -> float:
        return self.a.elapsed_time(self.b) if self.cuda else (self.t1 - self.t0) * 1e3


def backgrounds(args, device, dtype) -> dict:
    """name -> one call of the background work."""
    x = torch.randn(args.tokens, 3072, device=device, dtype=dtype)
    w = torch.randn(3072, 3072, device=device, dtype=dtype) / 3072 ** 0.5
    q, k, v = (torch.randn(2, args.heads, args.window, D, device=device, dtype=dtype) for _ in range(3))
    return {"linear 3072x3072": lambda: F.linear(x, w),
            "attention, one window": lambda: F.scaled_dot_product_attention(q, k, v)}


def run_pair(scan, work, reps: int, cuda: bool, streams) -> tuple[float, float, float]:
    """(scan ms, background ms, wall ms) with both launched together: the scan on streams[0], `reps` background
    calls on streams[1], each stream waiting for the other's start only."""
    t_scan, t_work = Timer(cuda, streams[0]), Timer(cuda, streams[1])
    wall = Timer(cuda, torch.cuda.current_stream() if cuda else None)
    if cuda:
        torch.cuda.synchronize()
    wall.start()
    for s in streams if cuda else ():
        s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(streams[0]) if cuda else contextlib.nullcontext():
        t_scan.start()
        scan()
        t_scan.stop()
    with torch.cuda.stream(streams[1]) if cuda else contextlib.nullcontext():
        t_work.start()
        for _ in range(reps):
            work()
        t_work.stop()
    for s in streams if cuda else ():
        torch.cuda.current_stream().wait_stream(s)
    wall.stop()
    if cuda:
        torch.cuda.synchronize()
    return t_scan.ms(), t_work.ms(), wall.ms()


def alone(fn, cuda: bool) -> float:
    t = Timer(cuda, torch.cuda.current_stream() if cuda else None)
    if cuda:
        torch.cuda.synchronize()
    t.start()
    fn()
    t.stop()
    if cuda:
        torch.cuda.synchronize()
    return t.ms()


def measure(args) -> list[dict]:
    from tttvideo.ttt import triton_mlp
    from tttvideo.ttt.testing import make_inputs

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter's products take fp32
    streams = (torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)) if cuda else (None, None)
    L = args.length - args.length % M
    work = backgrounds(args, device, dtype)
    rows = []
    for samples in (2, 1):
        ins = [t.detach() for t in make_inputs("mlp", samples, args.heads, L, D, M, dtype=dtype, seed=0,
                                               device=device)]
        scan = lambda ins=ins: triton_mlp.mlp_forward(*ins, M, 16, False, output=True)  # noqa: E731
        scan()
        for name, fn in work.items():
            fn()
            scan_ms = statistics.median(alone(scan, cuda) for _ in range(args.rounds))
            one_ms = statistics.median(alone(fn, cuda) for _ in range(args.rounds))
            reps = max(1, round(scan_ms / one_ms))
            work_ms = statistics.median(alone(lambda: [fn() for _ in range(reps)], cuda) for _ in range(args.rounds))
            pairs = [run_pair(scan, fn, reps, cuda, streams) for _ in range(args.rounds)]
            both_scan, both_work, wall = (statistics.median(p[i] for p in pairs) for i in range(3))
            saved = scan_ms + work_ms - wall
            rows.append(dict(scan_streams=samples * args.heads, background=name, reps=reps, scan_alone_ms=scan_ms,
                             background_alone_ms=work_ms, scan_beside_ms=both_scan, background_beside_ms=both_work,
                             wall_ms=wall, scan_slowdown=both_scan / scan_ms, background_slowdown=both_work / work_ms,
                             overlap=saved / min(scan_ms, work_ms)))
        del ins
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    cuda = torch.cuda.is_available()
    result = {"benchmark": "scan_overlap", "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "git_commit": git_commit(), "length": args.length, "heads": args.heads,
              "mini_batch": M, "tokens": args.tokens, "window": args.window, "rounds": args.rounds,
              "command": " ".join(sys.argv), "rows": rows}
    if args.out:
        save_json(args.out, result)
    print(f"\n{result['device']}, commit {result['git_commit']}: scan (mini-batch {M}, {args.length} tokens) beside "
          f"background work, medians of {args.rounds}")
    print(f"{'streams':>7} {'background':<24} {'reps':>4} {'scan ms':>8} {'beside':>8} {'bg ms':>8} {'beside':>8} "
          f"{'wall':>8} {'overlap':>7}")
    for r in rows:
        print(f"{r['scan_streams']:>7} {r['background']:<24} {r['reps']:>4} {r['scan_alone_ms']:>8.2f} "
              f"{r['scan_beside_ms']:>8.2f} {r['background_alone_ms']:>8.2f} {r['background_beside_ms']:>8.2f} "
              f"{r['wall_ms']:>8.2f} {r['overlap']:>7.2f}")
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
