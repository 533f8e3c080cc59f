"""Triton kernel of the sampling TTT output's post-norm: the scan output [B, H, L + pad, D] in scan order, gathered
to residual order and LayerNorm'd over its H x D features, written as [B, n, H D] rows in one pass
(`ttt.layer.post_norm_rows` is the reference it matches; `ttt.layer.sampling_post_norm` picks between them).

A program takes TOKENS residual positions of one sample. For each it reads the H rows of D contiguous elements at
the position's scan index (one 128-byte line per head in bf16 at D = 64), normalises the H D values in fp32 in
registers (mean, then the biased variance of the centred values, as F.layer_norm; the heads padded to a power of two
are masked out), applies the affine weight and bias and writes the row contiguously. Forward only: it serves the
forward without gradients (sampling). torch.compile's fused gather and norm ran at about 1.3 TB/s on an H100 at
63 s (6.7 ms a pass), where this reads and writes each element once. Offsets are 64-bit: a guided 63-s pass's
output holds more than 2^31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tttvideo.ttt.triton_common import check_device, new_output

TOKENS_PER_PROGRAM = 4
WARPS = 4


@triton.jit
def _post_norm_kernel(X, IDX, W, BIAS, OUT, n, s_b, s_h, s_l, s_ob, eps,
                      H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, TOKENS: tl.constexpr,
                      HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    rh = tl.arange(0, HP)
    rd = tl.arange(0, D)
    m = (rh < H)[:, None] & (rd >= 0)[None, :]
    col = rh[:, None] * D + rd[None, :]
    if HAS_W:
        w = tl.load(W + col, mask=m, other=0.0).to(tl.float32)
    if HAS_B:
        bias = tl.load(BIAS + col, mask=m, other=0.0).to(tl.float32)
    src = X + b * s_b + rh[:, None].to(tl.int64) * s_h + rd[None, :]
    for i in tl.static_range(TOKENS):
        t = tl.program_id(0).to(tl.int64) * TOKENS + i
        live = t < n
        pos = tl.load(IDX + t, mask=live, other=0).to(tl.int64)
        x = tl.load(src + pos * s_l, mask=m & live, other=0.0).to(tl.float32)
        mean = tl.sum(tl.sum(x, 1), 0) / (H * D)
        xc = tl.where(m, x - mean, 0.0)
        y = xc * tl.rsqrt(tl.sum(tl.sum(xc * xc, 1), 0) / (H * D) + eps)
        if HAS_W:
            y = y * w
        if HAS_B:
            y = y + bias
        tl.store(OUT + b * s_ob + t * (H * D) + col, y.to(OUT.dtype.element_ty), mask=m & live)


def post_norm_rows_forward(scanned: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None,
                           bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """scanned [B, H, L + pad, D] (rows of D contiguous elements), index [n] (scan positions, residual order) ->
    LayerNorm over H D of the rows at `index`, [B, n, H D] in scanned's dtype; weight and bias [H D] or None."""
    check_device(scanned, index, *(t for t in (weight, bias) if t is not None))
    B, H, _, D = scanned.shape
    if scanned.stride(3) != 1 or D & (D - 1):
        raise ValueError(f"post-norm kernel: rows of a power-of-two D contiguous elements, got shape "
                         f"{tuple(scanned.shape)} strides {scanned.stride()}")
    n = index.numel()
    out = new_output(None, (B, n, H * D), scanned.dtype, scanned.device)
    dummy = scanned
    grid = (triton.cdiv(n, TOKENS_PER_PROGRAM), B)
    _post_norm_kernel[grid](
        scanned, index.contiguous(), weight.contiguous() if weight is not None else dummy,
        bias.contiguous() if bias is not None else dummy, out, n, scanned.stride(0), scanned.stride(1),
        scanned.stride(2), out.stride(0), eps,
        H=H, HP=triton.next_power_of_2(H), D=D, TOKENS=TOKENS_PER_PROGRAM, HAS_W=weight is not None,
        HAS_B=bias is not None, num_warps=WARPS,
    )
    return out
