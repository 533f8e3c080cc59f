"""model.fp8_matmul on CUDA with fp8 tensor cores (skipped elsewhere): fp8_linear at the 5B model's layer sizes
against its plain fp32 reference (the input rounded to e4m3 per token, times the stored weight), forward and the
input's gradient; a layer the kernel cannot take (sizes not multiples of 16) keeps upcasting; the sentence for a
GPU without fp8 tensor cores is not reached here.

Tolerances: the reference is exact fp32 arithmetic on the same rounded values, so only the accumulation order and
the bf16 output differ: relative L2 error below 1e-2 (bf16's 2^-8 per element, averaged).

Run: `pytest tests/gpu/test_fp8_matmul_gpu.py`, or `python tests/gpu/test_fp8_matmul_gpu.py`.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

try:
    import pytest
except ImportError:  # the device image may lack pytest: the module also runs as a script
    pytest = None

SHAPES = ((3072, 3072), (3072, 12288), (12288, 3072))
TOKENS = 4099  # not a multiple of any tile


def has_fp8_cores() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def compare() -> dict:
    from tttvideo.models.fp8_storage import FP8, Fp8Linear, use_fp8_matmul

    rows = {}
    torch.manual_seed(0)
    for fan_in, fan_out in SHAPES:
        linear = nn.Linear(fan_in, fan_out, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
        holder = nn.Sequential(Fp8Linear(linear))
        assert use_fp8_matmul(holder, "cuda") == (1, 1)
        layer = holder[0]
        x = torch.randn(2, TOKENS, fan_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = layer(x)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        # the reference: fp32 arithmetic on the same e4m3 values
        xs = x.detach().float().reshape(-1, fan_in)
        scale = xs.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        w = layer.weight_fp8.float() * layer.weight_scale[:, None]
        ref = ((xs / scale).to(FP8).float() * scale) @ w.T + layer.bias.float()
        grad_ref = grad_out.float() @ w.to(torch.bfloat16).float()
        rows[f"{fan_in}->{fan_out}"] = {"out": rel(out.reshape(-1, fan_out), ref),
                                        "grad_x": rel(x.grad, grad_ref)}
    odd = nn.Sequential(Fp8Linear(nn.Linear(24, 40, device="cuda", dtype=torch.bfloat16).requires_grad_(False)))
    rows["odd_sizes_on"] = use_fp8_matmul(odd, "cuda")[0]
    return rows


def test_fp8_linear_matches_its_reference_at_full_size():
    if not has_fp8_cores():
        pytest.skip("needs a CUDA GPU with fp8 tensor cores (compute capability 8.9+)")
    rows = compare()
    assert rows.pop("odd_sizes_on") == 0
    for shape, errors in rows.items():
        assert errors["out"] < 1e-2 and errors["grad_x"] < 1e-2, (shape, errors)


if __name__ == "__main__":
    if not has_fp8_cores():
        print("no CUDA GPU with fp8 tensor cores")
        sys.exit(0)
    print(compare())
