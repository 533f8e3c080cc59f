"""Inputs and error measures for checking the TTT scans against each other: used by the device tests, the GPU fuzz
and the kernel benchmarks (benchmarks/ttt_kernel.py, benchmarks/ttt_accuracy.py).

`make_inputs` draws scan inputs of the sizes the TTT layer produces, under one of three `REGIMES` of slow weights:

* "spec-init": the layer's initialisation (W ~ N(0, 0.02), zero biases, ttt_norm (1, 0)), eta as the layer computes
  it. Full-size draws from it are well conditioned; the full-size device test and the fuzz use it.
* "drawn-norm": ttt_norm drawn around (1, 0) as (1 + 0.1 N, 0.1 N), zero biases.
* "biased-eta16": biases N(0, 0.01) and eta x16 (8x above the largest eta the layer can produce).

On long chains the last two are ill-conditioned: some heads go through an unstable transient of the inner updates,
and the fp32 reference itself moves by 10-50% when its slow weights get a perturbation of one bf16 rounding's size
(2^-9 relative). No computation with bf16 (or fp16 / tf32) products can be held to the fp32 answer there, so only
short chains draw from them (they stay well conditioned and cover non-zero initial biases and norms).

Errors are relative, ||a - b|| / ||b||, per named tensor (`NAMES`: the output, then the gradient of every input).
Nothing here imports triton: the Triton path is reached through `ops` with backend "triton", which imports it on
first use.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch

from tttvideo.ttt import ops
from tttvideo.ttt.reference import ttt_linear_reference, ttt_mlp_reference

# The bound the bf16 kernels are held to against the fp32 reference (device tests, fuzz, accuracy study).
TOLERANCE = 2e-2
# The scan's output, then its inputs in argument order (TTT-Linear has no W2, b2).
NAMES = ["out", "q", "k", "v", "eta", "norm_w", "norm_b", "W1", "b1", "W2", "b2"]
REGIMES = ("spec-init", "drawn-norm", "biased-eta16")


def default_mini_batch(kind: str) -> int:
    """The mini-batch the kernels are measured at: 64 for TTT-MLP, 16 for TTT-Linear (the configs' sizes)."""
    return 64 if kind == "mlp" else 16


def make_inputs(kind: str, B: int, H: int, L: int, D: int, m: int, dtype: torch.dtype = torch.bfloat16,
                seed: int | None = None, device: str | torch.device = "cuda", regime: str = "spec-init",
                hidden: int | None = None) -> list[torch.Tensor]:
    """Scan inputs (q, k, v, eta, norm_w, norm_b, W1, b1[, W2, b2]) of the sizes the TTT layer produces, each
    requiring grad: L2-normalised q/k, v of unit spread, eta = base_lr sigmoid(.) / (D m) as the layer computes it;
    slow weights per `regime` (module docstring). `hidden`: the MLP's hidden size (default 4 D, the layer's).
    `seed` None draws a fresh seed."""
    if regime not in REGIMES:
        raise ValueError(f"unknown input regime {regime!r}; use one of {REGIMES}")
    g = torch.Generator(device=device).manual_seed(seed if seed is not None else int(torch.seed() % 2**31))
    r = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    biased = regime == "biased-eta16"
    q = torch.nn.functional.normalize(r(B, H, L, D), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(r(B, H, L, D), dim=-1).to(dtype)
    v = r(B, H, L, D).to(dtype)
    base_lr = 0.1 if kind == "mlp" else 1.0
    eta = (16 if biased else 1) * base_lr * torch.sigmoid(r(B, H, L)) / (D * m)
    if regime == "spec-init":
        norm_w, norm_b = torch.ones(H, D, device=device), torch.zeros(H, D, device=device)
    else:
        norm_w, norm_b = 1 + 0.1 * r(H, D), 0.1 * r(H, D)
    E = (hidden or 4 * D) if kind == "mlp" else D
    bias = (lambda *s: 0.01 * r(*s)) if biased else (lambda *s: torch.zeros(*s, device=device))  # noqa: E731
    params = [0.02 * r(H, D, E), bias(H, E)]
    if kind == "mlp":
        params += [0.02 * r(H, E, D), bias(H, D)]
    return [t.requires_grad_() for t in (q, k, v, eta, norm_w, norm_b, *params)]


def scan_with_grads(kind: str, ins: list[torch.Tensor], dout: torch.Tensor, m: int, group: int,
                    **kw) -> list[torch.Tensor]:
    """(output, *gradients w.r.t. every input) of one scan, as fp32. With `backend` in kw the scan goes through
    `ops` (which picks the implementation), otherwise straight to the reference; kw goes to the scan (backend,
    operand_dtype)."""
    if "backend" in kw:
        fn = ops.ttt_mlp if kind == "mlp" else ops.ttt_linear
    else:
        fn = ttt_mlp_reference if kind == "mlp" else ttt_linear_reference
    xs = [t.detach().requires_grad_() for t in ins]
    out = fn(*xs, mini_batch_size=m, checkpoint_group_size=group, **kw)
    grads = torch.autograd.grad((out.float() * dout).sum(), xs)
    return [out.detach().float(), *(x.float() for x in grads)]


def errors_between(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, float]:
    """Relative error ||a-b|| / ||b|| per named tensor; NaN when `got` has a non-finite element."""
    return {name: float((a - b).norm() / b.norm()) if torch.isfinite(a).all() else float("nan")
            for name, a, b in zip(NAMES, got, want)}


@contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Kernel outputs and scratch buffers start as NaN inside (TTT_TRITON_POISON=1), so an element a kernel never
    writes, or reads before writing, shows in the result."""
    old = os.environ.get("TTT_TRITON_POISON")
    os.environ["TTT_TRITON_POISON"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TTT_TRITON_POISON")
        else:
            os.environ["TTT_TRITON_POISON"] = old


def kernel_and_reference(kind: str, B: int = 1, H: int = 48, L: int = 18048, D: int = 64, m: int | None = None,
                         group: int = 16, seed: int | None = None, regime: str = "spec-init",
                         device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16
                         ) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(fp32 inputs, dout, fp32 reference results, Triton results) of one fresh draw. The kernels get the inputs in
    `dtype` and run with every output and scratch buffer NaN-poisoned; the reference gets them upcast."""
    m = m or default_mini_batch(kind)
    ins = make_inputs(kind, B, H, L, D, m, dtype, seed, device, regime)
    ref_ins = [t.detach().float() for t in ins]
    # the upstream gradient from its own generator: seeding the global one with the inputs' seed would make it
    # equal to q's raw draw
    dout = torch.randn(ref_ins[0].shape, device=ref_ins[0].device,
                       generator=torch.Generator(device=ref_ins[0].device).manual_seed(int(torch.seed() % 2**31)))
    ref = scan_with_grads(kind, ref_ins, dout, m, group)
    with poisoned_outputs():
        fast = scan_with_grads(kind, ins, dout, m, group, backend="triton")
    return ref_ins, dout, ref, fast


def relative_errors(kind: str, B: int = 1, H: int = 48, L: int = 18048, D: int = 64, m: int | None = None,
                    group: int = 16, seed: int | None = None, regime: str = "spec-init") -> dict[str, float]:
    """Output and gradient errors of the Triton path (bf16 inputs, CUDA) against the fp32 reference on the same
    inputs; defaults: the full-size shape (B=1, 48 heads of 64, 18,048 tokens, checkpoint group 16)."""
    _, _, ref, fast = kernel_and_reference(kind, B, H, L, D, m, group, seed, regime)
    return errors_between(fast, ref)
