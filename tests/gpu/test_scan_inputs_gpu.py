"""The TTT layer's scan-input glue on CUDA (skipped without it): the Triton kernels (`tttvideo.ttt.triton_scan_inputs`)
and the torch.compile'd reference against the fp32 reference, at 3 s (18,048 tokens, 5B shapes: 48 heads of 64),
batch 2, bf16, the output and the gradients of q/k/v and the ttt_norm weight and bias. Error relative to each
tensor's largest value; the kernels must be within 1.5x the compiled reference's error plus 1e-3 (both compute in
fp32 and round once to bf16, so they land at about one bf16 rounding, 4e-3; a wrong index is off by far more).
The padding rows must be zeros.

Run: `pytest tests/gpu/test_scan_inputs_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_kernels_match_reference_at_full_size():
    from tttvideo.layout import VideoLayout
    from tttvideo.ttt.layer import layout_tensors
    from tttvideo.ttt.scan_inputs import prepare_scan_inputs, scan_inputs

    layout = VideoLayout.create("3s")
    L, pad, dev = layout.total_tokens, layout.ttt_padding, torch.device("cuda")
    _, _, cos, sin = layout_tensors(layout, 64, 10000.0, dev)
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(2, L, 3, 48, 64, device=dev, dtype=torch.bfloat16, generator=gen)
    nw = 1 + 0.1 * torch.randn(48, 64, device=dev, generator=gen)
    nb = 0.1 * torch.randn(48, 64, device=dev, generator=gen)
    grad = torch.randn(3, 2, 48, L + pad, 64, device=dev, generator=gen)

    def run(kind: str):
        dtype = torch.float32 if kind == "exact" else torch.bfloat16
        ins = [t.detach().to(dtype if t is qkv else torch.float32).clone().requires_grad_() for t in (qkv, nw, nb)]
        if kind == "exact":
            out = scan_inputs(*ins[:1], cos, sin, *ins[1:], pad, torch.float32)
        else:
            out = prepare_scan_inputs(ins[0], cos, sin, ins[1], ins[2], pad, dtype,
                                      backend="auto" if kind == "kernel" else "reference", compile_glue=True)
        return [out, *torch.autograd.grad((out.float() * grad).sum(), ins)]

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.float() - want).abs().max() / want.abs().max()).item()

    kernel, compiled, exact = run("kernel"), run("compiled"), run("exact")
    assert (kernel[0][:, :, :, L:] == 0).all()
    for name, fast, ref, want in zip(["output", "d qkv", "d norm weight", "d norm bias"], kernel, compiled, exact):
        assert error(fast, want) <= 1.5 * error(ref, want) + 1e-3, (name, error(fast, want), error(ref, want))


def test_kernels_address_past_2_31_elements():
    """At 63 s a token's q/k/v row starts past element 2^31 (351,168 x 3 x 48 x 64), and so does the output's v
    (2 x 48 x 351,232 x 64): the kernels use 64-bit offsets. Every token's glue is its own, so the last tokens of a
    360,000-token call are checked against the reference run on those tokens alone, forward and the q/k/v
    gradient."""
    from tttvideo.ttt.scan_inputs import prepare_scan_inputs, scan_inputs

    L, tail, dev = 360_000, 512, torch.device("cuda")
    assert 2 * 48 * L * 64 > 2**31
    gen = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn(1, L, 3, 48, 64, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
    angle = torch.randn(L, 1, 64, device=dev, generator=gen)
    cos, sin = angle.cos(), angle.sin()
    nw, nb = torch.ones(48, 64, device=dev), torch.zeros(48, 64, device=dev)
    out = prepare_scan_inputs(qkv, cos, sin, nw, nb, 0, torch.bfloat16, backend="auto")
    grad = torch.zeros_like(out)
    grad[:, :, :, -tail:] = torch.randn(3, 1, 48, tail, 64, device=dev, generator=gen, dtype=out.dtype)
    dqkv = torch.autograd.grad(out, qkv, grad)[0]
    part = qkv.detach()[:, -tail:].float().requires_grad_()
    ref = scan_inputs(part, cos[-tail:], sin[-tail:], nw, nb, 0, torch.float32)
    dref = torch.autograd.grad(ref, part, grad[:, :, :, -tail:].float())[0]
    for got, want in ((out[:, :, :, -tail:], ref), (dqkv[:, -tail:], dref)):
        assert ((got.float() - want).abs().max() / want.abs().max()).item() < 1e-2
    assert not dqkv[:, :-tail].any()
