"""Triton kernel of local attention's glue before SDPA when nothing needs gradients (sampling): q, k, v [B, L, H, D]
gathered into the windows, q and k through their per-head LayerNorm and RoPE (`attention.gather_windows` is the
reference it matches; `attention.window_glue` picks which runs).

The windows are gathered into the batch dim: window position p (of n W) of sample b is token flat[p], and its output
row is b n W + p of a [B n W, H, D] buffer, i.e. [B n, W, H, D], handed on transposed as the reference's [B n, H, W,
D] view. A program takes TOKENS window positions of one sample. For each it reads the token's H rows of D contiguous
elements of q, k and v (one 128-byte line per head in bf16 at D = 64; heads padded to a power of two are masked);
for q and k it normalises each head's row in fp32 (mean, then the biased variance of the centred values, as
F.layer_norm, with its weight and bias) and rotates adjacent pairs by the window-local RoPE row of the position
(`triton_common.rope_rotate`; the table holds the identity on the text prefix); it writes each row once, rounded
once. So q, k and v are each read once and written once (v not at all with one window: nothing to gather, it goes on
as its view, as in the reference). Offsets are 64-bit: at 63 s two samples' windows hold more than 2^31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tttvideo.ttt.triton_common import check_device, new_output, rope_rotate

TOKENS_PER_PROGRAM = 4
WARPS = 4


@triton.jit
def _norm_rope(x, W_, B_, eps, cs, sn, sgn, rd, NORM: tl.constexpr, HP: tl.constexpr, D: tl.constexpr):
    """Each head's row LayerNorm'd over D (fp32, as F.layer_norm) when NORM, then rotated by RoPE."""
    if NORM:
        mean = tl.sum(x, 1) / D
        xc = x - mean[:, None]
        x = xc * tl.rsqrt(tl.sum(xc * xc, 1) / D + eps)[:, None]
        x = x * tl.load(W_ + rd).to(tl.float32)[None, :] + tl.load(B_ + rd).to(tl.float32)[None, :]
    return rope_rotate(x, cs, sn, sgn, HP, D)


@triton.jit
def _window_gather_kernel(Q, K, V, FLAT, COS, SIN, WQ, BQ, WK, BK, OQ, OK, OV, NW, W, s_b, s_l, s_h,
                          eps_q, eps_k, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, TOKENS: tl.constexpr,
                          NORM_Q: tl.constexpr, NORM_K: tl.constexpr, COPY_V: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    rh = tl.arange(0, HP)
    rd = tl.arange(0, D)
    m = (rh < H)[:, None] & (rd >= 0)[None, :]
    sgn = tl.where(rd % 2 == 0, -1.0, 1.0)[None, :]
    head_off = rh[:, None].to(tl.int64) * s_h + rd[None, :]
    out_col = rh[:, None] * D + rd[None, :]
    for i in tl.static_range(TOKENS):
        p = tl.program_id(0).to(tl.int64) * TOKENS + i
        live = p < NW
        mask = m & live
        src = b * s_b + tl.load(FLAT + p, mask=live, other=0).to(tl.int64) * s_l + head_off
        dst = (b * NW + p) * (H * D) + out_col
        w = p % W
        cs = tl.load(COS + w * D + rd, mask=live, other=1.0)[None, :]
        sn = tl.load(SIN + w * D + rd, mask=live, other=0.0)[None, :]
        q = tl.load(Q + src, mask=mask, other=0.0).to(tl.float32)
        tl.store(OQ + dst, _norm_rope(q, WQ, BQ, eps_q, cs, sn, sgn, rd, NORM_Q, HP, D).to(OQ.dtype.element_ty),
                 mask=mask)
        k = tl.load(K + src, mask=mask, other=0.0).to(tl.float32)
        tl.store(OK + dst, _norm_rope(k, WK, BK, eps_k, cs, sn, sgn, rd, NORM_K, HP, D).to(OK.dtype.element_ty),
                 mask=mask)
        if COPY_V:
            tl.store(OV + dst, tl.load(V + src, mask=mask, other=0.0), mask=mask)


def window_gather(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flat: torch.Tensor, n: int, cos: torch.Tensor,
                  sin: torch.Tensor, norm_q, norm_k) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attention.gather_windows` without gradients: q, k, v [B, L, H, D] (rows of D contiguous elements, one
    stride set for the three), `flat` the window gather index [n W] (an arange with one window), cos/sin [W, D] fp32,
    norm_q / norm_k (weight, bias, eps) with weight and bias [D], or None -> [B n, H, W, D] each (views of [B n, W,
    H, D] buffers) in q's dtype."""
    check_device(q, k, v, flat, cos, sin)
    B, L, H, D = q.shape
    NW = flat.numel()
    W = NW // n
    if (k.shape != q.shape or v.shape != q.shape or k.stride() != q.stride() or v.stride() != q.stride()
            or q.stride(3) != 1 or D & (D - 1) or NW != n * W or cos.shape != (W, D) or sin.shape != (W, D)):
        raise ValueError(f"window gather kernel: q, k, v of one shape and strides with rows of a power-of-two D "
                         f"contiguous elements and RoPE tables [W, D], got {tuple(q.shape)} strides {q.stride()}, "
                         f"{n} windows of {NW} positions, tables {tuple(cos.shape)}")
    # one window gathers nothing: v goes on as its transposed view, as in the reference
    outs = [new_output(None, (B * n, W, H, D), q.dtype, q.device) for _ in range(3 if n > 1 else 2)]

    def affine(norm):  # (weight, bias, eps) as the kernel reads them; a norm's missing affine part is the identity
        if norm is None:
            return q, q, 0.0  # not read: the kernel skips the norm
        weight, bias, eps = norm
        weight = torch.ones(D, device=q.device) if weight is None else weight.contiguous()
        return weight, torch.zeros(D, device=q.device) if bias is None else bias.contiguous(), eps

    (wq, bq, eps_q), (wk, bk, eps_k) = affine(norm_q), affine(norm_k)
    grid = (triton.cdiv(NW, TOKENS_PER_PROGRAM), B)
    _window_gather_kernel[grid](
        q, k, v, flat.contiguous(), cos.float().contiguous(), sin.float().contiguous(), wq, bq, wk, bk, *outs[:2],
        outs[2] if n > 1 else q, NW, W,
        q.stride(0), q.stride(1), q.stride(2), eps_q, eps_k,
        H=H, HP=triton.next_power_of_2(H), D=D, TOKENS=TOKENS_PER_PROGRAM, NORM_Q=norm_q is not None,
        NORM_K=norm_k is not None, COPY_V=n > 1, num_warps=WARPS,
    )
    return tuple(t.transpose(1, 2) for t in (*outs[:2], outs[2] if n > 1 else v))
