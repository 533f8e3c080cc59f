"""How far a per-token e4m3 quantisation (codes, scales) is from `fp8_storage.quantize_tokens` on the same input:
the comparison tests/test_fp8_quantize.py (Triton interpreter, CPU) and tests/gpu/test_fp8_quantize_gpu.py make.
No pytest here: the GPU test also runs as a script.

The tolerance, and why: the kernel divides with IEEE round-to-nearest like the reference, so codes and scales are
expected bit for bit the same. A code may still differ by one e4m3 step where an fp32 division rounding differently
in its last bit would move the quotient across an e4m3 rounding boundary: such a code is "explained" when the
reference's quotient one fp32 ulp up or down rounds to it. Any other difference is a bug. NaN equals NaN (a NaN in a
row makes its scale and codes NaN in both).
"""

from __future__ import annotations

import torch

from tttvideo.models.fp8_storage import FP8, FP8_MAX, quantize_tokens


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a == b) | (a.isnan() & b.isnan())


def compare_with_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> dict:
    """{"scale_rel": largest relative scale difference (0 where equal, NaN = NaN), "code_diffs": codes that differ,
    "unexplained": those not one fp32 ulp of the quotient away (see the module docstring), "shape_ok"}."""
    # the reference runs on the CPU, where both of its divisions are IEEE: on CUDA, PyTorch divides a tensor by a
    # Python scalar as a multiplication by its reciprocal (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu), so
    # `amax / 448` there can be one ulp off the kernel's exact scale (an H200 run: scales 1.19e-7 apart, and codes
    # near e4m3 ties with them)
    x, codes, scales = x.cpu(), codes.cpu(), scales.cpu()
    ref_codes, ref_scales = quantize_tokens(x)
    shape_ok = (codes.shape == ref_codes.shape and scales.shape == ref_scales.shape and codes.dtype == FP8
                and scales.dtype == torch.float32)
    if not shape_ok:
        return {"scale_rel": float("inf"), "code_diffs": -1, "unexplained": -1, "shape_ok": False}
    both_nan = scales.isnan() & ref_scales.isnan()
    rel = ((scales - ref_scales).abs() / ref_scales.abs()).masked_fill(both_nan | (scales == ref_scales), 0)
    got, want = codes.float(), ref_codes.float()
    differ = ~_same(got, want)
    unexplained = 0
    if differ.any():
        quotient = (x.float() / ref_scales)[differ]
        got = got[differ]
        explained = torch.zeros_like(got, dtype=torch.bool)
        for towards in (float("-inf"), float("inf")):
            neighbour = torch.nextafter(quotient, torch.full_like(quotient, towards))
            explained |= _same(got, neighbour.clamp(-FP8_MAX, FP8_MAX).to(FP8).float())
        unexplained = int((~explained).sum())
    return {"scale_rel": float(rel.max()) if rel.numel() else 0.0, "code_diffs": int(differ.sum()),
            "unexplained": unexplained, "shape_ok": True}
