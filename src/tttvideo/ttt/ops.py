"""TTT scan entry points that pick an implementation.

`backend`: "reference" (plain PyTorch, any device), "triton" (fused kernels: CUDA, or CPU tensors inside the Triton
interpreter, TRITON_INTERPRET=1, which is how CI tests them), "auto" (Triton on CUDA when the shape is covered, the
reference otherwise, with the reason logged once). Signatures match `tttvideo.ttt.reference`.

The kernels take one learning rate per token; the reference system's learning-rate matrices (`eta_rows`, from
ttt.eta_layout = "reference") run on the PyTorch reference, logged once like any other uncovered call.
"""

from __future__ import annotations

import logging
import os

import torch

from tttvideo.config.schema import TTTConfig
from tttvideo.errors import ConfigError
from tttvideo.ttt.reference import NO_SCAN_CHECKPOINT, ttt_linear_reference, ttt_mlp_reference

BACKENDS = ("auto", "triton", "reference")
# Sizes the kernels are built and tested for: power-of-two tiles (tl.arange), at least 16 (tl.dot), and small
# enough that one stream's state stays on-chip (MLP: W1 and W2 of D x E fp32 each).
KERNEL_HEAD_DIMS = (16, 32, 64)
KERNEL_MINI_BATCHES = (16, 32, 64)
KERNEL_MAX_HIDDEN = 256
# The kernels address q/k/v, the output and their gradients ([B, H, L, D] each) with 32-bit offsets: a call of more
# elements runs as several calls over samples or groups of heads, whose scans are independent (B = 2 at 63 s is past
# it; `by_head_groups`).
MAX_KERNEL_ELEMENTS = 2**31  # offsets up to 2^31 - 1

# Why the kernels do not take eta_rows (one sentence, logged once or raised with backend "triton").
ETA_ROWS_REASON = ("ttt.eta_layout = 'reference' needs a learning-rate matrix per mini-batch and the kernels take "
                   "one rate per token")

log = logging.getLogger(__name__)
_logged: set[str] = set()


def ttt_mlp(q, k, v, eta, norm_w, norm_b, w1, b1, w2, b2, mini_batch_size: int,
            checkpoint_group_size: int = NO_SCAN_CHECKPOINT, backend: str = "auto",
            eta_rows: torch.Tensor | None = None) -> torch.Tensor:
    if _use_triton("mlp", backend, q, w1.shape[-1], mini_batch_size, eta_rows is not None):
        from tttvideo.ttt.triton_mlp import TTTMLPFunction, mlp_forward

        return by_head_groups(lambda *t: TTTMLPFunction.apply(*t, mini_batch_size, checkpoint_group_size),
                              q, k, v, eta, norm_w, norm_b, w1, b1, w2, b2,
                              into=lambda out, *t: mlp_forward(*t, mini_batch_size, checkpoint_group_size, False,
                                                               out=out))
    return ttt_mlp_reference(q, k, v, eta, norm_w, norm_b, w1, b1, w2, b2, mini_batch_size, checkpoint_group_size,
                             eta_rows=eta_rows)


def ttt_linear(q, k, v, eta, norm_w, norm_b, w1, b1, mini_batch_size: int,
               checkpoint_group_size: int = NO_SCAN_CHECKPOINT, backend: str = "auto",
               eta_rows: torch.Tensor | None = None) -> torch.Tensor:
    if _use_triton("linear", backend, q, w1.shape[-1], mini_batch_size, eta_rows is not None):
        from tttvideo.ttt.triton_linear import TTTLinearFunction, linear_forward

        return by_head_groups(lambda *t: TTTLinearFunction.apply(*t, mini_batch_size, checkpoint_group_size),
                              q, k, v, eta, norm_w, norm_b, w1, b1,
                              into=lambda out, *t: linear_forward(*t, mini_batch_size, checkpoint_group_size, False,
                                                                  out=out))
    return ttt_linear_reference(q, k, v, eta, norm_w, norm_b, w1, b1, mini_batch_size, checkpoint_group_size,
                                eta_rows=eta_rows)


def by_head_groups(scan, q, k, v, eta, *per_head, into=None):
    """scan(q, k, v, eta, *per_head) as kernel calls of at most MAX_KERNEL_ELEMENTS elements of q each (one call
    where the whole fits), the results concatenated. per_head: the tensors indexed by head first (ttt_norm weight and
    bias, the inner weights). `into(out, q, k, v, eta, *per_head)`: the forward without gradients writing into `out`
    (contiguous, q's shape); given, a call without gradients makes its output once, on the calling stream, and each
    part writes its samples and heads of it in place: no per-part outputs to concatenate (at 63 s, B = 2: 4.3 GB
    less at the peak) and no memory cached for the side streams, which a stream other than the one that made a
    block cannot reuse.

    A call past the limit (B = 2 at 63 s: guided sampling's conditional and unconditional halves) is cut into parts
    of equal size (`kernel_parts`: whole samples first, then equal groups of heads), and without gradients on a GPU
    the parts run concurrently, each on a CUDA stream of its own (`_concurrent`). A kernel's time is that of one
    (sample, head) stream's serial chain per wave of programs, whatever the number of streams up to a wave, so parts
    run one after another cost a chain each: the 47 + 1 head groups this function used to run in sequence at 63 s
    took two chains' time at the sampling mini-batch 16 (one program per stream: 94 programs on 132 SMs, then 2),
    where the same 96 programs side by side take one (at mini-batch 64, two programs per stream: three against two).
    TTT_KERNEL_GROUPS=serial restores that schedule (the A/B of benchmarks/speed.py's part ttt63).
    TTT_KERNEL_GROUPS=one runs the whole call as one launch, for the same A/B only: the forward kernels' per-stream
    offsets are 64-bit (their stream index is); tests/gpu/test_ttt_triton_gpu.py holds one launch at 63 s, B = 2 to
    the per-sample calls bit for bit, and benchmarks/speed.py's part ttt63 measured it no faster. The backward
    kernels are not checked past the limit."""
    B, H, L, D = q.shape
    if B * H * L * D <= MAX_KERNEL_ELEMENTS or os.environ.get("TTT_KERNEL_GROUPS") == "one":
        return scan(q, k, v, eta, *per_head)
    if os.environ.get("TTT_KERNEL_GROUPS", "concurrent") == "serial":
        parts = serial_head_groups(B, H, L, D, MAX_KERNEL_ELEMENTS)
    else:
        parts = kernel_parts(B, H, L, D, MAX_KERNEL_ELEMENTS)

    def inputs(p):
        s, h = p
        return q[s, h], k[s, h], v[s, h], eta[s, h], *(t[h] for t in per_head)

    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, eta, *per_head))
    concurrent = q.device.type == "cuda" and not grads and os.environ.get("TTT_KERNEL_GROUPS") != "serial"
    run = lambda fn: _concurrent(fn, parts, q.device) if concurrent else [fn(p) for p in parts]  # noqa: E731
    if into is None or grads:
        return _assemble(parts, run(lambda p: scan(*inputs(p))))
    from tttvideo.ttt.triton_common import new_output

    out = new_output(q)

    def write(p):
        target = out[p]
        if target.is_contiguous():
            into(target, *(t.contiguous() for t in inputs(p)))
        else:  # the serial schedule's every-sample head groups
            target.copy_(scan(*inputs(p)))

    run(write)
    return out


def kernel_parts(B: int, H: int, L: int, D: int, limit: int) -> list[tuple[slice, slice]]:
    """(samples, heads) of each kernel call of a [B, H, L, D] scan, at most `limit` elements each, in order (samples
    outer, heads inner), the parts of equal size: whole samples where one sample fits, else each sample in equal
    groups of heads (one head's L x D elements must fit)."""
    per_sample = H * L * D
    if per_sample <= limit:
        n = -(-B // (limit // per_sample))  # calls over the samples, as few as fit
        return [(slice(int(s[0]), int(s[-1]) + 1), slice(None)) for s in torch.arange(B).tensor_split(n)]
    if L * D > limit:
        raise ValueError(f"TTT scan of {L} tokens is over the kernels' 2^31-element limit for one head")
    n = -(-H // (limit // (L * D)))  # groups of heads per sample
    heads = [slice(int(h[0]), int(h[-1]) + 1) for h in torch.arange(H).tensor_split(n)]
    return [(slice(b, b + 1), h) for b in range(B) for h in heads]


def serial_head_groups(B: int, H: int, L: int, D: int, limit: int) -> list[tuple[slice, slice]]:
    """The earlier cut: every sample in each call, heads in groups as large as fit (47 + 1 at 63 s, B = 2)."""
    heads = limit // (B * L * D)
    if heads == 0:
        raise ValueError(f"TTT scan of {B} x {L} tokens is over the kernels' 2^31-element limit for one head; "
                         f"split the batch")
    return [(slice(None), slice(h, min(h + heads, H))) for h in range(0, H, heads)]


def _assemble(parts: list[tuple[slice, slice]], outs: list[torch.Tensor]) -> torch.Tensor:
    """The parts' outputs back into one [B, H, ...] tensor: heads concatenated within a run of parts of the same
    samples, then those runs over samples."""
    rows: list[list[torch.Tensor]] = []
    last = None
    for (s, _), o in zip(parts, outs):
        key = (s.start, s.stop)
        if key != last:
            rows.append([])
            last = key
        rows[-1].append(o)
    cat = lambda ts, dim: ts[0] if len(ts) == 1 else torch.cat(ts, dim)  # noqa: E731
    return cat([cat(r, 1) for r in rows], 0)


_side_streams: dict = {}


def _concurrent(run, parts: list, device: torch.device) -> list[torch.Tensor | None]:
    """run(part) for every part, each on its own CUDA stream, all after the work already queued on the current
    stream; the current stream waits for all of them. An output (None: the part wrote into a tensor of the current
    stream) is made on its part's stream and used on the current one, so it is recorded there (the allocator keeps
    its memory until the current stream's uses are done). The kernels' cooperating programs cannot deadlock across
    launches: each launch hands out its roles to running programs (triton_exchange), so at most one program per
    launch waits for a partner not yet started."""
    entry = torch.cuda.current_stream(device)
    streams = _side_streams.setdefault(device, [])
    while len(streams) < len(parts):
        streams.append(torch.cuda.Stream(device))
    outs = []
    for p, stream in zip(parts, streams):
        stream.wait_stream(entry)
        with torch.cuda.stream(stream):
            out = run(p)
        if out is not None:
            out.record_stream(entry)
        outs.append(out)
    for stream in streams[:len(parts)]:
        entry.wait_stream(stream)
    return outs


def uncovered_reason(kind: str, q: torch.Tensor, hidden: int, mini_batch_size: int) -> str | None:
    """Why the Triton kernels do not take this call (None when they do)."""
    B, H, L, D = q.shape
    if D not in KERNEL_HEAD_DIMS:
        return f"head dim {D} is not one of {KERNEL_HEAD_DIMS}"
    if mini_batch_size not in KERNEL_MINI_BATCHES:
        return f"mini-batch {mini_batch_size} is not one of {KERNEL_MINI_BATCHES}"
    if L % mini_batch_size:
        return f"sequence length {L} is not a multiple of the mini-batch {mini_batch_size}"
    if kind == "mlp" and (hidden & (hidden - 1) or not 16 <= hidden <= KERNEL_MAX_HIDDEN):
        return f"MLP hidden size {hidden} is not a power of two in [16, {KERNEL_MAX_HIDDEN}]"
    if kind == "linear" and hidden != D:
        return f"TTT-Linear weight is {D} x {hidden}, not square"
    return None


def check_backend_config(ttt: TTTConfig, head_dim: int, hidden: int, device: torch.device | str) -> None:
    """Fail before any work when `ttt.backend = "triton"` cannot run the model on `device` (one sentence naming
    the key), instead of at the first TTT call of the first step."""
    if ttt.backend != "triton":
        return
    device = torch.device(device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        reason = f"it needs a CUDA GPU and this run is on {device.type}"
    else:
        reason = ETA_ROWS_REASON if ttt.eta_layout == "reference" else None
        for mini_batch in sorted({ttt.train_mini_batch(), ttt.sample_mini_batch()}):
            probe = torch.empty(1, 1, mini_batch, head_dim, device="meta")
            reason = reason or uncovered_reason(ttt.kind, probe, hidden, mini_batch)
    if reason is not None:
        raise ConfigError(f"ttt.backend = 'triton' cannot run this model: {reason}; set ttt.backend = 'auto' (the "
                          f"kernels where they apply, the PyTorch reference elsewhere) or 'reference'")


def _use_triton(kind: str, backend: str, q: torch.Tensor, hidden: int, mini_batch_size: int,
                eta_matrices: bool = False) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"unknown TTT backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "reference":
        return False
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if q.device.type != "cuda" and not interpreting:
        if backend == "triton":
            raise RuntimeError(
                f"TTT backend 'triton' needs CUDA tensors, got {q.device.type} (set backend 'auto' or 'reference'; "
                "CPU runs the kernels only in the Triton interpreter, TRITON_INTERPRET=1 set before importing triton)"
            )
        return False  # auto on CPU: the reference is the CPU path, nothing to log
    reason = ETA_ROWS_REASON if eta_matrices else uncovered_reason(kind, q, hidden, mini_batch_size)
    if reason is None and q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) < (8, 0):
        # bf16 matrix instructions start at Ampere; the kernels are built and checked for sm_80, sm_89, sm_90
        reason = f"GPU compute capability {torch.cuda.get_device_capability(q.device)} is below 8.0"
    if reason is None:
        try:
            import triton  # noqa: F401
        except ImportError:
            reason = "triton is not installed"
    if reason is None:
        return True
    if backend == "triton":
        raise ValueError(
            f"TTT-{kind} Triton kernels do not cover this call: {reason}; use backend 'auto' or 'reference'"
        )
    if reason not in _logged:
        _logged.add(reason)
        log.warning("TTT-%s falls back to the PyTorch reference: %s", kind, reason)
    return False
