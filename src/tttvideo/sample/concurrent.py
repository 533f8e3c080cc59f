"""Two independent forwards at once on one GPU: each on a CUDA stream of its own, issued from a thread of its own.

Why: a guided step's conditional and unconditional passes share nothing until the guidance arithmetic. Within one
pass the TTT scans (a serial chain per head, bound by latency, 48 heads filling few of the card's SMs) and the
attention and linear layers (bound by throughput) run one after the other; two passes on two streams let one pass's
scan run beside the other's matrix work. Why threads: one thread issuing both passes would issue the first pass's
whole forward before the second's first kernel, and at 63 s that is more kernels than CUDA's launch queue holds, so
the second pass would start when the first is nearly done. Each thread issues its own pass; a thread blocked on a
full queue does not stop the other (PyTorch's and Triton's launches release the GIL).

Thread-local state is carried into the worker: the current device, grad mode and inference mode. A forward's first
call may compile (torch.compile, Triton autotuning), which is not safe from two threads at once, so `PassPair` runs
its first call's two forwards one after the other (`warm`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Callable

import torch


class PassPair:
    """`run(first, second)` -> (first(), second()), the two callables' tensors, computed concurrently on two CUDA
    streams of `device` after the work already queued on the calling stream, which waits for both. On the first call
    they run one after the other on the calling stream, and off CUDA always, unless `threads` (tests: the thread
    hand-over without streams)."""

    def __init__(self, device: torch.device | str, threads: bool | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.threads = self.cuda if threads is None else threads
        self.warm = False
        self._streams: list[torch.cuda.Stream | None] = []
        self._pool: ThreadPoolExecutor | None = None

    def run(self, first: Callable[[], torch.Tensor],
            second: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.threads or not self.warm:
            out = first(), second()
            self.warm = True
            return out
        if self._pool is None:
            self._streams = [torch.cuda.Stream(self.device) if self.cuda else None for _ in range(2)]
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tttv-pass")
        entry = torch.cuda.current_stream(self.device) if self.cuda else None
        if entry is not None:
            for stream in self._streams:
                stream.wait_stream(entry)
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def on(stream: torch.cuda.Stream | None, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
            if stream is not None:
                torch.cuda.set_device(self.device)
            with (torch.inference_mode(inference), torch.set_grad_enabled(grad),
                  torch.cuda.stream(stream) if stream is not None else nullcontext()):
                return fn()

        later = self._pool.submit(on, self._streams[1], second)
        try:
            a = on(self._streams[0], first)
        finally:
            b = later.result()  # waits for the worker even when this thread's pass failed; re-raises its error
        if entry is not None:
            for stream, out in zip(self._streams, (a, b)):
                entry.wait_stream(stream)
                out.record_stream(entry)  # made on its pass's stream, used on the calling one
        return a, b

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
