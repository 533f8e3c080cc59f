"""Triton kernel of the per-token e4m3 quantisation `model.fp8_matmul` runs before torch._scaled_mm
(`fp8_storage.quantize_tokens` is the reference it matches; `fp8_storage.quantize_tokens_fast` picks which runs).

Per row of a 2-d activation [rows, K]: scale = max(amax |x|, 1e-12) / 448 in fp32, codes = e4m3(clamp(x / scale,
±448)). The operation reads 2 bytes (bf16) and writes 1 byte per element, so it is bound by memory bandwidth;
torch.compile's version ran at about a seventh of it (0.53 ms for 36096 x 3072 on an H200, ~0.08 ms expected).

A program holds a whole row in registers when K <= `MAX_ONE_PASS` (one read, one write per element: amax, then
scale and store from the same registers); several rows per program when rows are short, so that each program
moves at least `TILE` elements. Longer rows are read twice in chunks of at most `CHUNK` elements: one pass for the
amax, one for the codes (the second read may come from L2).

Matching the reference bit for bit: both divisions are IEEE round-to-nearest (`tl.math.div_rn`: Triton's `/` on
fp32 compiles to the approximate div.full.f32), the fp32 -> e4m3 conversion rounds to nearest even as torch's does
(on Hopper and later in one instruction, cvt.rn.satfinite; on Ada the kernel rounds in fp32 first,
`rounds_in_fp32`), and NaN propagates through the amax and the clamp as through torch's (Triton's max and clamp
drop NaN by default).

Offsets are 64-bit: at 63 s, two samples' tokens times K = 12288 pass 2^31 elements.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from tttvideo.models.fp8_storage import _MIN_AMAX, FP8, FP8_MAX
from tttvideo.ttt.triton_common import interpreting, new_output

MAX_ONE_PASS = 16384  # longest row a program holds at once: 16 warps x 32 values per thread
TILE = 4096  # fewest elements per program: short rows are grouped, or a program's launch outweighs its work
CHUNK = 4096  # elements per step of the two-pass loop over a long row


@triton.jit
def _max_with_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _round_to_e4m3(q):
    """q (|q| <= 448 or NaN) rounded to the nearest e4m3 value, ties to even, in fp32: adding and subtracting
    1.5 * 2^(23 + s) rounds to a multiple of 2^s, the e4m3 spacing at q (2^(e - 3), 2^-9 below e4m3's normals).
    The sign goes back on by its bit, so that -0 stays -0 as in the conversion."""
    bits = q.to(tl.int32, bitcast=True)
    magnitude = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    spacing_exp = tl.minimum(tl.maximum(((bits >> 23) & 0xFF), 127 - 6), 127 + 8) - 3
    magic = (((spacing_exp + 23) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (magnitude + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _code_values(x, scale, FP8_MAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.clamp(q, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if ROUND_IN_FP32:
        q = _round_to_e4m3(q)
    return q


@triton.jit
def _quantize_tokens_kernel(X, CODES, SCALES, n_rows, K, stride_x, stride_c, ROWS: tl.constexpr,
                            BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, FP8_MAX: tl.constexpr,
                            MIN_AMAX: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    cols = tl.arange(0, BLOCK_K)
    x_rows = X + rows[:, None] * stride_x
    c_rows = CODES + rows[:, None] * stride_c
    if ONE_PASS:
        m = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
        amax = tl.reduce(tl.abs(x), 1, _max_with_nan)
    else:
        amax = tl.zeros((ROWS,), tl.float32)
        for k in range(0, K, BLOCK_K):
            m = row_ok[:, None] & (k + cols < K)[None, :]
            x = tl.load(x_rows + k + cols[None, :], mask=m, other=0.0).to(tl.float32)
            amax = _max_with_nan(amax, tl.reduce(tl.abs(x), 1, _max_with_nan))
    # the reference's clamp(min=1e-12) keeps a NaN amax NaN
    scale = tl.math.div_rn(tl.maximum(amax, MIN_AMAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX)
    tl.store(SCALES + rows, scale, mask=row_ok)
    if ONE_PASS:
        values = _code_values(x, scale, FP8_MAX, ROUND_IN_FP32)
        tl.store(c_rows + cols[None, :], values.to(CODES.dtype.element_ty), mask=m)
    else:
        for k in range(0, K, BLOCK_K):
            m = row_ok[:, None] & (k + cols < K)[None, :]
            x = tl.load(x_rows + k + cols[None, :], mask=m, other=0.0).to(tl.float32)
            values = _code_values(x, scale, FP8_MAX, ROUND_IN_FP32)
            tl.store(c_rows + k + cols[None, :], values.to(CODES.dtype.element_ty), mask=m)


def launch_config(K: int, max_one_pass: int = MAX_ONE_PASS) -> dict:
    """Rows per program, block width, one pass or two, and warps for rows of K elements: one place, so that the
    tests see what a GPU launch would use."""
    if K <= max_one_pass:
        block = triton.next_power_of_2(K)
        rows = max(1, TILE // block)
        one_pass = True
    else:
        block = 1 << (min(max_one_pass, CHUNK).bit_length() - 1)  # a power of two within both bounds
        rows, one_pass = 1, False
    return {"ROWS": rows, "BLOCK_K": block, "ONE_PASS": one_pass,
            "num_warps": max(1, min(16, rows * block // 1024))}


def rounds_in_fp32(device: torch.device) -> bool:
    """Whether the kernel rounds to the e4m3 grid itself before the cast: below compute capability 9.0 (Ada) Triton
    3.6 converts fp32 to e4m3 through fp16 rounded toward zero, which loses the bits that tell a value just above a
    tie from the tie (1.0625001 -> 1.0 instead of 1.125; triton-lang/triton#11753). Hopper and later convert in one
    correctly rounded instruction (cvt.rn.satfinite.e4m3x2.f32)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0)


def quantize_tokens_triton(x: torch.Tensor, max_one_pass: int = MAX_ONE_PASS,
                           round_in_fp32: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [rows, K], fp32 scales [rows, 1]) of a 2-d activation: what `quantize_tokens` returns.
    `max_one_pass` lowers the row length past which rows are read in two passes, `round_in_fp32` (None: as
    `rounds_in_fp32` says for the device) picks the rounding Ada needs: the tests force both paths."""
    if x.dim() != 2:
        raise ValueError(f"quantize_tokens_triton takes a 2-d activation, got shape {tuple(x.shape)}")
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError("the fp8 quantisation kernel needs a CUDA tensor (or TRITON_INTERPRET=1 set before "
                           "importing triton, for testing on CPU)")
    if x.stride(1) != 1:
        x = x.contiguous()
    n_rows, K = x.shape
    codes = new_output(None, (n_rows, K), FP8, x.device)
    scales = new_output(None, (n_rows, 1), torch.float32, x.device)
    if n_rows:
        cfg = launch_config(K, max_one_pass)
        _quantize_tokens_kernel[(triton.cdiv(n_rows, cfg["ROWS"]),)](
            x, codes, scales, n_rows, K, x.stride(0), codes.stride(0), FP8_MAX=FP8_MAX, MIN_AMAX=_MIN_AMAX,
            ROUND_IN_FP32=rounds_in_fp32(x.device) if round_in_fp32 is None else round_in_fp32, **cfg)
    return codes, scales


_TORCH_FP8 = {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}


def _patch_interpreter_fp8_cast() -> None:
    """Triton 3.6's interpreter rounds fp32 to fp8 by adding the first dropped mantissa bit: ties go away from zero
    instead of to even (e4m3: 168 -> 176 where torch gives 160), and where the addition carries, the carry is lost
    instead of raising the exponent (31.2 -> 16). Convert as the GPU's cvt.rn.satfinite does instead (interpreter
    only): finite values saturate at the format's largest, NaN stays NaN, then round to nearest even, which is
    torch's own conversion (the one the reference uses)."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_fp_to_fp
    if getattr(original, "_tttvideo_fp8_fix", False):
        return

    def patched(self, src, dst_type, rounding_mode):
        target = _TORCH_FP8.get(dst_type.scalar.name)
        if target is None or src.dtype.scalar != tl.float32 or rounding_mode != ir.ROUNDING_MODE.RTNE:
            return original(self, src, dst_type, rounding_mode)
        top = torch.finfo(target).max
        values = torch.from_numpy(np.clip(np.asarray(src.data, dtype=np.float32), -top, top))
        return interpreter.TensorHandle(values.to(target).view(torch.uint8).numpy(), dst_type.scalar)

    patched._tttvideo_fp8_fix = True
    interpreter.InterpreterBuilder.create_fp_to_fp = patched


if interpreting():
    _patch_interpreter_fp8_cast()
