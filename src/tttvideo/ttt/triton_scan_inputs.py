"""Fused Triton kernels of the glue between the TTT layer's q/k/v projection and the scan (`scan_inputs.scan_inputs` is
the reference they match): forward and backward, one pass over the sequence each.

Per token and head (rows of D, math in fp32): q, k L2-normalised (`F.normalize`, eps 1e-12) and rotated by RoPE
(adjacent pairs), v replaced by the reconstruction target LN_ttt(v - k) + k with the original's (unbiased std + eps)
normalisation, written as [3, B, H, L + pad, D] (heads before tokens, the scan's layout) with zero padding.

A program takes BL tokens of one (batch, head): it reads their q/k/v rows ([B, L, 3, H, D] rows of D contiguous
elements, one cache line each in bf16 at D = 64) and writes BL x D contiguous elements of each output, so both sides
stay coalesced across the transpose that torch.compile's fused kernels did at about 550 GB/s on an H100. The RoPE
partner of a column (d xor 1) is taken in registers (`triton_common.pair_swap`), not loaded twice. The backward
recomputes the norms from q/k/v and writes per-program partial sums of the ttt_norm gradients (summed on the host:
no atomics, so the result does not depend on the order programs run in).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tttvideo.ttt.scan_inputs import TARGET_LN_EPS
from tttvideo.ttt.triton_common import check_device, new_output, rope_rotate, rope_rotate_t

NORMALIZE_EPS = 1e-12  # F.normalize's default
TOKENS_PER_PROGRAM = 64
WARPS = 4


@triton.jit
def _program_rows(QKV, COS, SIN, L, NH, NBH, s_b, s_l, s_i, s_h, s_cl, D: tl.constexpr, BL: tl.constexpr):
    """This program's (batch b, head h, their index bh), tokens rl, columns rd and RoPE signs; the q, k, v rows of
    those tokens in fp32 (zeros past L), their cos / sin, and the mask of tokens before L. Offsets are 64-bit: at
    63 s a token's row (351,168 x 3 x 3,072) starts past element 2^31.

    The grid is one dimension, (batch, head) varying fastest: the NBH programs of one block of tokens run together,
    so the block's RoPE rows (fp32, more bytes than its q/k/v) come from L2 for all but the first, and the rows of q/k/v
    they read are adjacent in memory. With the tokens fastest, every (batch, head) streamed the whole table again."""
    pid = tl.program_id(0).to(tl.int64)
    bh = pid % NBH
    b, h = bh // NH, bh % NH
    rl = (pid // NBH) * BL + tl.arange(0, BL)
    rd = tl.arange(0, D)
    sgn = tl.where(rd % 2 == 0, -1.0, 1.0)[None, :]
    m = (rl < L)[:, None] & (rd >= 0)[None, :]
    base = QKV + b * s_b + rl[:, None] * s_l + h * s_h + rd[None, :]
    q = tl.load(base, mask=m, other=0.0).to(tl.float32)
    k = tl.load(base + s_i, mask=m, other=0.0).to(tl.float32)
    v = tl.load(base + 2 * s_i, mask=m, other=0.0).to(tl.float32)
    cs = tl.load(COS + rl[:, None] * s_cl + rd[None, :], mask=m, other=0.0).to(tl.float32)
    sn = tl.load(SIN + rl[:, None] * s_cl + rd[None, :], mask=m, other=0.0).to(tl.float32)
    return b, h, bh, rl, rd, sgn, q, k, v, cs, sn, m


@triton.jit
def _target_stats(d, D: tl.constexpr, EPS: tl.constexpr):
    """Centred rows c = d - mean, their unbiased std, and y = c / (std + eps)."""
    c = d - (tl.sum(d, 1) / D)[:, None]
    std = tl.sqrt(tl.sum(c * c, 1) / (D - 1))
    return c, std, c / (std + EPS)[:, None]


@triton.jit
def _scan_inputs_fwd_kernel(
    QKV, COS, SIN, NW, NB, OUT, L, LP, NH, NBH, s_b, s_l, s_i, s_h, s_cl, s_out, s_bh,
    D: tl.constexpr, BL: tl.constexpr, EPS: tl.constexpr, NEPS: tl.constexpr,
):
    b, h, bh, rl, rd, sgn, q, k, v, cs, sn, m = _program_rows(QKV, COS, SIN, L, NH, NBH, s_b, s_l, s_i, s_h, s_cl, D,
                                                              BL)
    q = rope_rotate(q / tl.maximum(tl.sqrt(tl.sum(q * q, 1)), NEPS)[:, None], cs, sn, sgn, BL, D)
    k = rope_rotate(k / tl.maximum(tl.sqrt(tl.sum(k * k, 1)), NEPS)[:, None], cs, sn, sgn, BL, D)
    _c, _std, y = _target_stats(v - k, D, EPS)
    nw = tl.load(NW + h * D + rd).to(tl.float32)[None, :]
    nb = tl.load(NB + h * D + rd).to(tl.float32)[None, :]
    v = nw * y + nb + k
    # padding rows (L <= token < LP) are written as zeros
    # s_bh: a (batch, head)'s rows apart, LP x D in a fresh output, more in a token slice of a longer buffer
    dst = OUT + bh * s_bh.to(tl.int64) + rl[:, None] * D + rd[None, :]
    s_out = s_out.to(tl.int64)  # 2 x [B, H, L + pad, D] passes 2^31 at 63 s
    keep = (rl < LP)[:, None] & (rd >= 0)[None, :]
    ty = OUT.dtype.element_ty
    tl.store(dst, tl.where(m, q, 0.0).to(ty), mask=keep)
    tl.store(dst + s_out, tl.where(m, k, 0.0).to(ty), mask=keep)
    tl.store(dst + 2 * s_out, tl.where(m, v, 0.0).to(ty), mask=keep)


@triton.jit
def _normalize_t(g, x, NEPS: tl.constexpr):
    """Gradient of x / max(||x||, eps) w.r.t. x, given the gradient g of the normalised rows."""
    norm = tl.sqrt(tl.sum(x * x, 1))
    inv = 1.0 / tl.maximum(norm, NEPS)
    n = x * inv[:, None]
    proj = tl.where(norm > NEPS, tl.sum(n * g, 1), 0.0)
    return (g - n * proj[:, None]) * inv[:, None], n


@triton.jit
def _scan_inputs_bwd_kernel(
    G, QKV, COS, SIN, NW, DQKV, DNW, DNB, L, LP, NH, NBH, s_b, s_l, s_i, s_h, s_cl, s_g,
    D: tl.constexpr, BL: tl.constexpr, EPS: tl.constexpr, NEPS: tl.constexpr,
):
    b, h, bh, rl, rd, sgn, q, k, v, cs, sn, m = _program_rows(QKV, COS, SIN, L, NH, NBH, s_b, s_l, s_i, s_h, s_cl, D,
                                                              BL)
    src = G + bh * LP * D + rl[:, None] * D + rd[None, :]
    s_g = s_g.to(tl.int64)
    gq = tl.load(src, mask=m, other=0.0).to(tl.float32)
    gk = tl.load(src + s_g, mask=m, other=0.0).to(tl.float32)
    gv = tl.load(src + 2 * s_g, mask=m, other=0.0).to(tl.float32)
    # the forward again, up to the target's statistics
    kn = k / tl.maximum(tl.sqrt(tl.sum(k * k, 1)), NEPS)[:, None]
    kr = rope_rotate(kn, cs, sn, sgn, BL, D)
    c, std, y = _target_stats(v - kr, D, EPS)
    s = std + EPS
    # v = nw y + nb + kr: the ttt_norm gradients (this program's partial sums) and the LayerNorm's backward
    nw = tl.load(NW + h * D + rd).to(tl.float32)[None, :]
    pid = tl.program_id(0)  # = token block x NBH + bh: the partial sums' row
    tl.store(DNW + pid * D + rd, tl.sum(tl.where(m, gv * y, 0.0), 0))
    tl.store(DNB + pid * D + rd, tl.sum(gv, 0))
    gy = gv * nw
    # a constant row (std 0; every padding row) has no spread to scale: its term is 0, not 0 / 0
    coef = tl.where(std > 0, tl.sum(gy * c, 1) / (s * s * (D - 1) * tl.where(std > 0, std, 1.0)), 0.0)
    dd = (gy - (tl.sum(gy, 1) / D)[:, None]) / s[:, None] - c * coef[:, None]
    dq, _n = _normalize_t(rope_rotate_t(gq, cs, sn, sgn, BL, D), q, NEPS)
    dk, _n = _normalize_t(rope_rotate_t(gk + gv - dd, cs, sn, sgn, BL, D), k, NEPS)
    dst = DQKV + b * s_b + rl[:, None] * s_l + h * s_h + rd[None, :]
    ty = DQKV.dtype.element_ty
    tl.store(dst, dq.to(ty), mask=m)
    tl.store(dst + s_i, dk.to(ty), mask=m)
    tl.store(dst + 2 * s_i, dd.to(ty), mask=m)


def _geometry(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Sizes of qkv [B, L, 3, H, D], and qkv and the RoPE tables ([L, D]) contiguous."""
    B, L, three, H, D = qkv.shape
    if three != 3 or D & (D - 1) or D < 2:
        raise ValueError(f"scan_inputs kernel: qkv must be [B, L, 3, H, D] with D a power of two, got "
                         f"{tuple(qkv.shape)}")
    cos, sin = (t.reshape(-1, D).contiguous() for t in (cos, sin))
    if cos.shape[0] != L or sin.shape[0] != L:
        raise ValueError(f"scan_inputs kernel: RoPE tables of {cos.shape[0]} tokens for {L} tokens")
    return B, L, H, D, qkv.contiguous(), cos, sin


def scan_inputs_forward(qkv, cos, sin, norm_w, norm_b, pad: int, dtype: torch.dtype,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """[3, B, H, L + pad, D] in `dtype`: what `scan_inputs.scan_inputs` returns. `out`: where to write it instead of
    a new tensor, e.g. a token slice buffer[:, :, :, s:e] of a longer scan-input buffer (rows of D contiguous, heads
    and batches evenly apart)."""
    check_device(qkv, cos, sin, norm_w, norm_b)
    B, L, H, D, qkv, cos, sin = _geometry(qkv, cos, sin)
    LP = L + pad
    if out is None:
        out = new_output(None, (3, B, H, LP, D), dtype, qkv.device)
    elif (tuple(out.shape) != (3, B, H, LP, D) or out.dtype != dtype or out.device != qkv.device
          or out.stride(4) != 1 or out.stride(3) != D or out.stride(1) != H * out.stride(2)):
        raise ValueError(f"scan_inputs kernel: out must be [3, {B}, {H}, {LP}, {D}] {dtype} on {qkv.device} with rows "
                         f"of {D} contiguous elements, got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    grid = (triton.cdiv(LP, TOKENS_PER_PROGRAM) * B * H,)
    _scan_inputs_fwd_kernel[grid](
        qkv, cos, sin, norm_w.contiguous(), norm_b.contiguous(), out, L, LP, H, B * H, *qkv.stride()[:2], qkv.stride(2),
        qkv.stride(3), D, out.stride(0), out.stride(2),
        D=D, BL=TOKENS_PER_PROGRAM, EPS=TARGET_LN_EPS, NEPS=NORMALIZE_EPS, num_warps=WARPS,
    )
    return out


def scan_inputs_backward(grad, qkv, cos, sin, norm_w):
    """Gradients of qkv (its dtype), norm_w and norm_b ([H, D], fp32) given the gradient of the output."""
    B, L, H, D, qkv, cos, sin = _geometry(qkv, cos, sin)
    grad = grad.contiguous()
    LP = grad.shape[3]
    nblk = triton.cdiv(L, TOKENS_PER_PROGRAM)
    dqkv = new_output(None, qkv.shape, qkv.dtype, qkv.device)
    dnw = new_output(None, (nblk, B * H, D), torch.float32, qkv.device)
    dnb = new_output(None, (nblk, B * H, D), torch.float32, qkv.device)
    _scan_inputs_bwd_kernel[(nblk * B * H,)](
        grad, qkv, cos, sin, norm_w.contiguous(), dqkv, dnw, dnb, L, LP, H, B * H,
        qkv.stride(0), qkv.stride(1), qkv.stride(2), qkv.stride(3), D, grad.stride(0),
        D=D, BL=TOKENS_PER_PROGRAM, EPS=TARGET_LN_EPS, NEPS=NORMALIZE_EPS, num_warps=WARPS,
    )
    per_head = lambda t: t.view(nblk, B, H, D).sum((0, 1))  # noqa: E731
    return dqkv, per_head(dnw), per_head(dnb)


class ScanInputsFunction(torch.autograd.Function):
    """Autograd wrapper of the two kernels; saves q/k/v (the projection's output) and recomputes the rest."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, norm_w, norm_b, pad, dtype):
        out = scan_inputs_forward(qkv, cos, sin, norm_w, norm_b, pad, dtype)
        ctx.save_for_backward(qkv, cos, sin, norm_w)
        ctx.norm_dtypes = (norm_w.dtype, norm_b.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        qkv, cos, sin, norm_w = ctx.saved_tensors
        dqkv, dnw, dnb = scan_inputs_backward(grad, qkv, cos, sin, norm_w)
        return dqkv, None, None, dnw.to(ctx.norm_dtypes[0]), dnb.to(ctx.norm_dtypes[1]), None, None
