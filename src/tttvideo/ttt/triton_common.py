"""Pieces shared by the Triton TTT kernels: element-wise math, LayerNorm pieces, dot precision, launch checks.

Everything here is written once and inlined into the TTT-MLP and TTT-Linear kernels (`triton_mlp.py`,
`triton_linear.py`) and the glue kernels around them (RoPE: `triton_scan_inputs.py`, and local attention's
`models/triton_window_gather.py`). Row vectors are [rows, cols] tiles reduced along axis 1; the inner LayerNorm
epsilon and the tanh-GELU constants are those of `tttvideo.ttt.reference`, which is the ground truth.

Dot precision (`DOT` constexpr): the inner state and every accumulation are fp32 whatever the mode.
    DOT_IEEE  fp32 operands, full-precision products (fp32 inputs; the CPU interpreter)
    DOT_TF32  fp32 operands on tf32 tensor cores
    DOT_BF16  operands rounded to bf16 (bf16/fp16 inputs: the fast path). bf16 rather than fp16 because the
              inner gradients scale with eta ~ 1e-5 and would fall into fp16's subnormal range.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from tttvideo.ttt.reference import INNER_LN_EPS

DOT_IEEE, DOT_TF32, DOT_BF16 = 0, 1, 2

_GELU_C = tl.constexpr(math.sqrt(2.0 / math.pi))
_GELU_A = tl.constexpr(0.044715)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 set before triton was imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar into an int with int(array of shape (1,)), which numpy >= 2.4
    refuses, so every loop with a run-time bound fails there. Read the one element instead (interpreter only)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_tttvideo_index_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._tttvideo_index_fix = True
    interpreter._patch_lang_tensor = patched


if interpreting():
    _patch_interpreter_index()


def dot_mode(dtype: torch.dtype) -> int:
    """Tensor-core operand precision for inputs of `dtype` (see the module docstring)."""
    if interpreting() or dtype == torch.float32:
        return DOT_IEEE
    return DOT_BF16


def warp_cap(M: int, D: int) -> int:
    """Most warps for a TTT kernel whose products have [M, D] results (mini-batch M, head dim D): 4 where M >= 64
    and D < 64, else 8 (issue 13, "kernel memory safety"; docs/kernels.md).

    At 8 warps Triton 3.6 lays a [64, D] wgmma result over two warpgroups side by side (warpsPerCTA [4, 2]). For
    D < 64 the TTT-MLP d K kernel built that way read shared memory past its own allocation on an H100
    (compute-sanitizer memcheck: "Invalid __shared__ read of size 1024 bytes ... out of bounds" at its product
    with a transposed shared-memory operand, 14,336 B allocated, 0x5000 read): an illegal address at B=1, H=1,
    L=2048, D=32, and where the read stayed inside the SM's shared memory, another block's data (the NaN seen once
    in d K). The kernel's own index arithmetic is in bounds (tests/test_ttt_triton.py checks every load and store of
    every kernel in the interpreter). At 4 warps a [64, D] result sits in one warpgroup and memcheck is clean; D = 64
    (32 columns per warpgroup) and M < 64 ran clean at 8 (the GPU fuzz, tests/gpu/ttt_fuzz.py, and memcheck) and
    stay there: the H100/H200 timings are of D = 64, M = 64."""
    return 4 if M >= 64 and D < 64 else 8


def output_for(like: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A kernel's output of `like`'s shape, dtype and device: `new_output(like)`, or the caller's buffer `out`, which
    must be what that would make (the kernels address it as contiguous)."""
    if out is None:
        return new_output(like)
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device or not out.is_contiguous():
        raise ValueError(f"kernel output buffer {tuple(out.shape)} {out.dtype} on {out.device} (contiguous: "
                         f"{out.is_contiguous()}) does not match the input {tuple(like.shape)} {like.dtype} on "
                         f"{like.device}")
    return out


def new_output(like: torch.Tensor | None, shape=None, dtype=None, device=None) -> torch.Tensor:
    """Allocate a kernel output. With TTT_TRITON_POISON=1 (the tests) it starts as NaN, so an element the kernel
    fails to write shows up in the comparison instead of passing on whatever memory held."""
    t = torch.empty(like.shape if shape is None else shape, device=device or like.device, dtype=dtype or like.dtype)
    if os.environ.get("TTT_TRITON_POISON", "0") == "1":
        t.fill_(float("nan"))
    return t


def check_device(*tensors: torch.Tensor) -> None:
    """The kernels run on CUDA, or on CPU tensors only inside the Triton interpreter."""
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        raise ValueError("TTT Triton kernels need every input on one device")
    if dev.type != "cuda" and not interpreting():
        raise RuntimeError(
            "the Triton TTT backend needs CUDA tensors (or TRITON_INTERPRET=1 set before importing triton, "
            "for testing on CPU); use backend='reference' or 'auto' on this machine"
        )


@triton.jit
def dot(a, b, DOT: tl.constexpr):
    """a @ b with fp32 accumulation at the precision chosen by DOT."""
    if DOT == 2:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif DOT == 1:
        return tl.dot(a, b, input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def op(x, DOT: tl.constexpr):
    """x in the dtype the matrix instruction reads (bf16 when DOT is DOT_BF16): long-lived operands are cast once,
    early, so they hold half the registers."""
    if DOT == 2:
        return x.to(tl.bfloat16)
    else:
        return x


@triton.jit
def dot_acc(a, b, acc, DOT: tl.constexpr):
    """acc + a @ b (acc fp32), fused into the matrix instruction's accumulator."""
    if DOT == 2:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif DOT == 1:
        return tl.dot(a, b, acc, input_precision="tf32")
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _gelu_parts(z):
    """sigmoid(2 s) = 0.5 (1 + tanh(s)) with s = C (z + A z^3), which needs one exp and no tanh, and ds/dz."""
    sig = 1.0 / (1.0 + tl.exp(tl.minimum(-2.0 * _GELU_C * (z + _GELU_A * z * z * z), 80.0)))  # no inf: sig -> 0
    return sig, _GELU_C * (1.0 + 3.0 * _GELU_A * z * z)


@triton.jit
def _gelu_value_slope(z, sig, sp):
    """gelu_tanh(z) and its derivative from `_gelu_parts`."""
    return z * sig, sig + 2.0 * z * sig * (1.0 - sig) * sp


@triton.jit
def tanh_approx(x):
    """tanh on the special-function unit (PTX tanh.approx.f32, sm_75 on: relative error about 2^-11), one
    instruction where the exact sigmoid form takes an exponential, a reciprocal and their range checks. GPU only
    (inline PTX), so only in DOT_BF16 code, which the interpreter never runs (`dot_mode`)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _gelu_tanh_parts(z):
    """tanh(s), gelu_tanh(z) = z h with h = (1 + tanh(s)) / 2, and half of ds/dz, from `tanh_approx`."""
    zz = z * z
    t = tanh_approx(z * (_GELU_C + (_GELU_C * _GELU_A) * zz))
    return t, 0.5 + 0.5 * t, (0.5 * _GELU_C) + (1.5 * _GELU_C * _GELU_A) * zz


@triton.jit
def _gelu_tanh_value_slope(z, t, h, hsp):
    """gelu_tanh(z) and its derivative from `_gelu_tanh_parts`."""
    return z * h, h + z * (1.0 - t * t) * hsp


@triton.jit
def gelu_fwd(z, DOT: tl.constexpr = 0):
    """gelu_tanh(z) and its derivative. With DOT_BF16 operands (both are rounded to bf16 next, or feed products
    of such) through `tanh_approx`, so the scan's step runs fewer instructions: measured on an H100 within 5.5e-6
    (value) and 1.6e-5 (slope) of fp64 over [-4, 4], far below that rounding (2e-3 to 8e-3 there;
    tests/gpu/test_gelu_fast_gpu.py, which checks it on the GPU at hand: PTX guarantees only a relative 2^-11 for
    the tanh, not enough for that by itself)."""
    if DOT == 2:
        t, h, hsp = _gelu_tanh_parts(z)
        return _gelu_tanh_value_slope(z, t, h, hsp)
    else:
        sig, sp = _gelu_parts(z)
        return _gelu_value_slope(z, sig, sp)


@triton.jit
def gelu_fwd2(z, DOT: tl.constexpr = 0):
    """gelu_fwd(z) and the second derivative (the backward of the inner gradient needs gelu''), from one
    `_gelu_parts` (or `_gelu_tanh_parts`)."""
    if DOT == 2:
        t, h, hsp = _gelu_tanh_parts(z)
        sp = 2.0 * hsp
        x, g1 = _gelu_tanh_value_slope(z, t, h, hsp)
        return x, g1, (1.0 - t * t) * (sp + 0.5 * z * (6.0 * _GELU_C * _GELU_A * z - 2.0 * t * sp * sp))
    else:
        sig, sp = _gelu_parts(z)
        t = 2.0 * sig - 1.0  # tanh(s)
        sech2 = 4.0 * sig * (1.0 - sig)  # 1 - tanh(s)^2
        x, g1 = _gelu_value_slope(z, sig, sp)
        return x, g1, sech2 * (sp + 0.5 * z * (6.0 * _GELU_C * _GELU_A * z - 2.0 * t * sp * sp))


@triton.jit
def ln_stats(x, D: tl.constexpr, EPS: tl.constexpr):
    """Per-row normalised x and 1/std (biased variance + EPS), as in reference.ln_fwd."""
    mu = tl.sum(x, 1) / D
    xc = x - mu[:, None]
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / D + EPS)
    return xc * rstd[:, None], rstd


@triton.jit
def ln_l2_fwd(z, target, nw, nb, D: tl.constexpr, EPS: tl.constexpr):
    """reference.ln_l2_grad(z, target, nw, nb) plus what its backward needs.

    Returns (grad, xhat, rstd, y, ghat, a, c) with y = nw xhat + nb - target, ghat = nw y,
    a = mean(ghat), c = mean(ghat xhat), grad = rstd (ghat - a - xhat c)."""
    xh, rstd = ln_stats(z, D, EPS)
    y = nw * xh + nb - target
    gh = y * nw
    a = tl.sum(gh, 1) / D
    c = tl.sum(gh * xh, 1) / D
    grad = rstd[:, None] * (gh - a[:, None] - xh * c[:, None])
    return grad, xh, rstd, y, gh, a, c


@triton.jit
def ln_bwd(dy_hat, xh, rstd, D: tl.constexpr):
    """d/dx of a LayerNorm (no affine) given d/dxhat."""
    m1 = tl.sum(dy_hat, 1) / D
    m2 = tl.sum(dy_hat * xh, 1) / D
    return rstd[:, None] * (dy_hat - m1[:, None] - xh * m2[:, None])


@triton.jit
def ln_l2_bwd(u, xh, rstd, y, gh, a, c, nw, D: tl.constexpr):
    """Backward of grad = ln_l2_fwd(z, target, nw, nb)[0] given u = d/dgrad.

    Returns (dz, dy, dnw_rows): d/dtarget = -dy, d/dnb = sum of dy over rows, d/dnw = sum of dnw_rows over rows.
    Derivation: grad = r P(ghat) with P the projection ghat - mean(ghat) - xhat mean(ghat xhat), which is symmetric,
    so d/dghat = r P(u); the explicit xhat in P gives -r (c u + mean(u xhat) ghat); the explicit r gives
    dr = sum(u (ghat - a - xhat c)), and r depends on z as dr/dz = -r^2 xhat / D."""
    ub = tl.sum(u, 1) / D
    ux = tl.sum(u * xh, 1) / D
    dgh = rstd[:, None] * (u - ub[:, None] - xh * ux[:, None])
    dy = dgh * nw
    dnw_rows = dgh * y + dy * xh
    dxh = dy * nw - rstd[:, None] * (c[:, None] * u + ux[:, None] * gh)
    dr = tl.sum(u * (gh - a[:, None] - xh * c[:, None]), 1)
    dz = ln_bwd(dxh, xh, rstd, D) - (rstd * rstd * dr / D)[:, None] * xh
    return dz, dy, dnw_rows


LN_EPS = INNER_LN_EPS


@triton.jit
def pair_swap(x, BL: tl.constexpr, D: tl.constexpr):
    """x[:, d xor 1]: the RoPE partner of every column."""
    even, odd = tl.split(tl.reshape(x, (BL, D // 2, 2)))
    return tl.reshape(tl.join(odd, even), (BL, D))


@triton.jit
def rope_rotate(x, cs, sn, sgn, BL: tl.constexpr, D: tl.constexpr):
    """x cos + rotate(x) sin, rotate(x)[2i] = -x[2i+1], rotate(x)[2i+1] = x[2i] (tttvideo.rope.apply_rope)."""
    return x * cs + sgn * pair_swap(x, BL, D) * sn


@triton.jit
def rope_rotate_t(g, cs, sn, sgn, BL: tl.constexpr, D: tl.constexpr):
    """The transpose of `rope_rotate` applied to a gradient."""
    return g * cs - sgn * pair_swap(g * sn, BL, D)
