"""model.fp8_matmul's per-token e4m3 quantisation on CUDA with fp8 support (skipped elsewhere): the Triton kernel
(`triton_fp8_quantize`) against its reference `quantize_tokens` (eager, on the CPU) at the 5B model's sizes, 4099
(not a multiple of any tile) and 36096 tokens (batch 2 at 3 s) times rows of 3072 and 12288, bf16 (the model's
dtype) and fp32; the two-pass path for long rows, forced at 4099 x 12288 and taken by itself at 20000 elements a
row; the rounding in fp32 Ada needs (`rounds_in_fp32`), forced on this GPU; rows of zeros, a huge value, a NaN and
an inf, where the GPU's max and clamp would drop NaN unless told not to; and fp8_linear dispatching to the kernel.

Tolerances (tests/fp8_quantize_check.py): scales to 1e-6 relative, codes equal or one e4m3 step apart only where an
fp32 quotient one ulp away rounds to the kernel's code. Expected bit for bit equal (IEEE division, round to nearest
even in both); the number of differing codes is printed.

Run: `pytest tests/gpu/test_fp8_quantize_gpu.py -s`, or `python -m tests.gpu.test_fp8_quantize_gpu`.
"""

from __future__ import annotations

import sys

import torch

from tests.fp8_quantize_check import compare_with_reference

try:
    import pytest
except ImportError:  # the device image may lack pytest: the module also runs as a script
    pytest = None

TOKENS = (4099, 36096)
ROW_LENGTHS = (3072, 12288)
SCALE_TOL = 1e-6


def has_fp8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def with_special_rows(x: torch.Tensor) -> torch.Tensor:
    x[0] = 0
    x[1, 5] = 1e30
    x[2, 7] = float("nan")
    x[3, 11] = float("inf")
    return x


def compare() -> dict:
    from tttvideo.models.fp8_storage import use_quantize_kernel
    from tttvideo.models.triton_fp8_quantize import quantize_tokens_triton

    torch.manual_seed(0)
    rows = {}
    # tokens, row length, dtype, two-pass bound (None: the default), round in fp32 first (None: as on this GPU)
    cases = [(t, k, torch.bfloat16, None, None) for t in TOKENS for k in ROW_LENGTHS]
    cases += [(4099, 3072, torch.float32, None, None), (4099, 12288, torch.bfloat16, 4096, None),
              (513, 20000, torch.bfloat16, None, None), (4099, 12288, torch.bfloat16, None, True)]
    for tokens, K, dtype, bound, round_in_fp32 in cases:
        x = torch.randn(tokens, K, device="cuda") * torch.logspace(-3, 3, tokens, device="cuda")[:, None]
        x = with_special_rows(x.to(dtype))
        codes, scales = quantize_tokens_triton(x, **({"max_one_pass": bound} if bound else {}),
                                               round_in_fp32=round_in_fp32)
        name = (f"{tokens}x{K} {str(dtype).removeprefix('torch.')}" + (f" two-pass {bound}" if bound else "")
                + (" rounded in fp32" if round_in_fp32 else ""))
        rows[name] = compare_with_reference(x, codes, scales)
        del x, codes, scales
        torch.cuda.empty_cache()
    rows["dispatch"] = use_quantize_kernel(torch.zeros(2, 3072, device="cuda", dtype=torch.bfloat16))
    return rows


def check(rows: dict) -> None:
    assert rows.pop("dispatch"), "quantize_tokens_fast does not pick the kernel on this GPU"
    for name, r in rows.items():
        assert r["shape_ok"], (name, r)
        assert r["scale_rel"] <= SCALE_TOL and r["unexplained"] == 0, (name, r)


def test_kernel_matches_reference_at_full_size():
    if not has_fp8():
        pytest.skip("needs a CUDA GPU with fp8 support (compute capability 8.9+)")
    rows = compare()
    print(rows)
    check(rows)


if __name__ == "__main__":
    if not has_fp8():
        print("no CUDA GPU with fp8 support")
        sys.exit(0)
    rows = compare()
    print(rows)
    check(rows)
    print("ok")
