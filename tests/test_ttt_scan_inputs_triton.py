"""The fused Triton glue between the TTT layer's q/k/v projection and its scan (`tttvideo.ttt.triton_scan_inputs`)
against the PyTorch reference (`tttvideo.ttt.scan_inputs.scan_inputs`), forward and every gradient, on CPU in the
Triton interpreter (switched on before triton is imported, so the comparison runs in a subprocess with
TRITON_INTERPRET=1, TTT_TRITON_POISON=1 and every memory access bounds-checked: tests/test_ttt_triton.py).

Also the whole bidirectional TTT layer with backend "triton" (these kernels and the scan's) against backend
"reference", through the layer's gathers, padding and gates. Fresh random inputs each run (the seed is in the
failure message). fp32 inputs: the kernels compute in fp32 like
the reference, in a different order, so they agree to ~1e-7; the bound is 1e-5 relative (||a-b|| / ||b||). bf16
inputs and outputs: 1e-2 (one bf16 rounding is 4e-3).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tttvideo.ttt.scan_inputs import use_kernel

NAMES = ["out", "qkv", "norm_w", "norm_b"]
# B, L, H, D, pad, dtype
CASES = [
    (2, 100, 3, 16, 28, "float32"),  # padding past a partial last block, batch 2
    (1, 130, 2, 64, 0, "float32"),  # the model's head dim, three blocks, no padding
    (1, 5, 1, 32, 3, "float32"),  # fewer tokens than one block
    (2, 70, 2, 64, 10, "bfloat16"),  # the model's dtype
]


def _case(B, L, H, D, pad, dtype, seed):
    """Relative errors of the kernel's output and gradients against the reference's (computed in fp32)."""
    from tttvideo.ttt.scan_inputs import prepare_scan_inputs, scan_inputs

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    qkv = torch.randn(B, L, 3, H, D, generator=g).to(dt)
    angle = 3 * torch.randn(L, 1, D, generator=g)
    cos, sin = angle.cos(), angle.sin()
    nw, nb = 1 + 0.2 * torch.randn(H, D, generator=g), 0.2 * torch.randn(H, D, generator=g)
    grad = torch.randn(3, B, H, L + pad, D, generator=g)
    ins = [t.requires_grad_() for t in (qkv, nw, nb)]
    out = prepare_scan_inputs(ins[0], cos, sin, ins[1], ins[2], pad, dt, backend="triton")
    got = [out, *torch.autograd.grad((out.float() * grad).sum(), ins)]
    ref_ins = [t.detach().float().requires_grad_() for t in ins]
    ref = scan_inputs(ref_ins[0], cos, sin, ref_ins[1], ref_ins[2], pad, torch.float32)
    want = [ref, *torch.autograd.grad((ref * grad).sum(), ref_ins)]
    padding_zero = bool((out[:, :, :, L:] == 0).all())
    return {n: float((a.float() - b).norm() / b.norm()) for n, a, b in zip(NAMES, got, want)}, padding_zero


def _layer_case(seed):
    """The bidirectional TTT layer (TTT-MLP, batch 2, fp32) with backend "triton" (these kernels and the scan's)
    against backend "reference": relative errors of the output and of the gradients of the input and every
    parameter."""
    from tttvideo.config.schema import TTTConfig
    from tttvideo.layout import VideoLayout
    from tttvideo.ttt.layer import BidirectionalTTT

    lay = VideoLayout.create("3s", height=32, width=48, text_tokens=5, mini_batch_size=16)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, lay.total_tokens, 32, generator=g)
    w = torch.randn(2, lay.total_tokens, 32, generator=g)
    results = []
    for backend in ("triton", "reference"):
        torch.manual_seed(seed)
        layer = BidirectionalTTT(32, 2, TTTConfig(kind="mlp", scan_checkpoint_group_size=0, backend=backend))
        xi = x.clone().requires_grad_()
        out = layer(xi, lay)
        params = [p for _, p in sorted(layer.named_parameters())]
        results.append([out, *torch.autograd.grad((out * w).sum(), [xi, *params])])
    return {f"layer {i}": float((a - b).norm() / b.norm()) for i, (a, b) in enumerate(zip(*results)) if b.norm() > 0}


def _interpreter_main() -> None:
    """Entry point of the subprocess: TRITON_INTERPRET=1 is already in its environment."""
    from tests.test_ttt_triton import _install_bounds_check

    seed = int(sys.argv[1])
    _install_bounds_check()
    results = []
    for i, c in enumerate(CASES):
        try:
            (errors, padding_zero), fault = _case(*c, seed + i), None
        except Exception as e:  # an out-of-bounds access is this case's result
            errors, padding_zero, fault = {}, False, f"{type(e).__name__}: {e}"[:2000]
        results.append({"errors": errors, "padding_zero": padding_zero, "fault": fault})
    try:
        errors, fault = _layer_case(seed + 50), None
    except Exception as e:
        errors, fault = {}, f"{type(e).__name__}: {e}"[:2000]
    results.append({"errors": errors, "fault": fault})
    try:
        (error, untouched), fault = _slice_case(seed + 60), None
    except Exception as e:
        error, untouched, fault = None, False, f"{type(e).__name__}: {e}"[:2000]
    results.append({"error": error, "untouched": untouched, "fault": fault})
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results():
    from tests.test_ttt_triton import run_in_interpreter

    return run_in_interpreter("tests.test_ttt_scan_inputs_triton", timeout=300)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"B{c[0]}L{c[1]}H{c[2]}D{c[3]}p{c[4]}-{c[5]}" for c in CASES])
def test_kernels_match_reference(interpreter_results, index):
    seed, results = interpreter_results
    r = results[index]
    assert r["fault"] is None, f"seed {seed}, case {CASES[index]}: {r['fault']}"
    bound = 1e-5 if CASES[index][5] == "float32" else 1e-2
    bad = {n: e for n, e in r["errors"].items() if not e <= bound}  # NaN fails too
    assert not bad, f"seed {seed}, case {CASES[index]}: relative errors over {bound}: {bad}"
    assert r["padding_zero"], f"seed {seed}, case {CASES[index]}: padding rows are not zero"


def test_layer_with_the_kernels_matches_the_reference(interpreter_results):
    """The whole TTT layer, glue and scan in the kernels, against the PyTorch reference (fp32, bound 1e-4 relative,
    tests/test_ttt_triton.py's bound for the scan)."""
    seed, results = interpreter_results
    r = results[len(CASES)]
    assert r["fault"] is None, f"seed {seed}: {r['fault']}"
    bad = {n: e for n, e in r["errors"].items() if not e <= 1e-4}
    assert len(r["errors"]) > 10 and not bad, f"seed {seed}: relative errors over 1e-4: {bad}"


def test_kernel_writes_into_a_token_slice(interpreter_results):
    """out= (the chunked inference pass's scan-input buffer): the kernel writes the slice as the reference computes
    it (fp32, 1e-5 relative) and leaves every row outside it as it was."""
    seed, results = interpreter_results
    r = results[len(CASES) + 1]
    assert r["fault"] is None, f"seed {seed}: {r['fault']}"
    assert r["error"] <= 1e-5 and r["untouched"], f"seed {seed}: {r}"


def test_out_is_refused_with_gradients():
    from tttvideo.ttt.scan_inputs import prepare_scan_inputs

    qkv = torch.zeros(1, 4, 3, 2, 16, requires_grad=True)
    table = torch.zeros(4, 1, 16)
    with pytest.raises(ValueError, match="without gradients"):
        prepare_scan_inputs(qkv, table, table, torch.ones(2, 16), torch.zeros(2, 16), 0, torch.float32,
                            out=torch.empty(3, 1, 2, 4, 16))


def test_dispatch():
    """The kernels run on CUDA (backend auto / triton) or in the interpreter with backend triton; the reference
    everywhere else, and always with backend "reference"."""
    qkv = torch.zeros(1, 4, 3, 2, 16)
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    assert not use_kernel(qkv, "auto")
    assert use_kernel(qkv, "triton") == interpreting
    assert not use_kernel(qkv, "reference")
    assert not use_kernel(torch.zeros(1, 4, 3, 2, 24), "triton")  # head dim not a power of two


def _slice_case(seed):
    """The forward kernel writing into a token slice of a longer buffer (out=, as the chunked inference pass does)
    against the reference: relative error of the slice, and whether the rows outside it kept their values."""
    from tttvideo.ttt.scan_inputs import prepare_scan_inputs, scan_inputs

    g = torch.Generator().manual_seed(seed)
    B, L, H, D, s = 2, 70, 3, 16, 37
    qkv = torch.randn(B, L, 3, H, D, generator=g)
    angle = 3 * torch.randn(L, 1, D, generator=g)
    cos, sin = angle.cos(), angle.sin()
    nw, nb = 1 + 0.2 * torch.randn(H, D, generator=g), 0.2 * torch.randn(H, D, generator=g)
    buffer = torch.randn(3, B, H, 150, D, generator=g)
    before = buffer.clone()
    with torch.no_grad():
        prepare_scan_inputs(qkv, cos, sin, nw, nb, 0, torch.float32, backend="triton", out=buffer[:, :, :, s:s + L])
    want = scan_inputs(qkv, cos, sin, nw, nb, 0, torch.float32)
    got = buffer[:, :, :, s:s + L]
    outside = torch.cat([buffer[:, :, :, :s], buffer[:, :, :, s + L:]], 3)
    untouched = torch.equal(outside, torch.cat([before[:, :, :, :s], before[:, :, :, s + L:]], 3))
    return float((got - want).norm() / want.norm()), untouched
