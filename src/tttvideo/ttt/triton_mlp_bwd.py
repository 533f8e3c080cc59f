"""Backward kernels of the Triton TTT-MLP scan, one checkpoint group at a time (host loop: triton_mlp.mlp_backward).

Given the group's recomputed states S_0..S_cnt (S_j before mini-batch j) and activations (Z1, Z2 of each
mini-batch), the gradient w.r.t. the state after mini-batch j is

    dS_j+1 = dOut_j / dS_j+1 (output path)  +  J_j+1^T dS_j+2 (the next mini-batch's update path).

The first term does not depend on the chain, so `output_path` computes it for all mini-batches of the group at once,
one program per (stream, mini-batch), together with d q; `reverse` then walks the chain backwards, split over
cooperating programs like the forward (`triton_exchange`), with the state gradient of its hidden rows in
registers. The step's backward, written untransposed (derived by hand, checked against autograd of the reference
in tests/test_ttt_triton.py):

    output path   O = Q + LN(gelu(Q W1' + b1') W2' + b2')            -> dQ, and d W1', b1', W2', b2'
    update path   W1' = W1 - K^T G1, b1' = b1 - sum G1, W2' = W2 - X2^T G2, b2' = b2 - sum G2
                  dG1 = -(K dW1' + db1'), dK = -G1 dW1'^T, dG2 = -(X2 dW2' + db2'), dX2 = -G2 dW2'^T
    inner grad    G1 = P * gelu'(Z1), P = G2 W2^T, G2 = eta * lnl2(Z2, V - K), Z2 = X2 W2 + b2, X2 = gelu(Z1),
                  Z1 = K W1 + b1        -> backpropagated term by term (gelu'' and the LN-L2 second derivative)
"""

from __future__ import annotations

import triton
import triton.language as tl

from tttvideo.ttt.triton_common import (
    LN_EPS, dot, dot_acc, dot_mode, gelu_fwd, gelu_fwd2, ln_bwd, ln_l2_bwd, ln_l2_fwd, ln_stats, op,
)
from tttvideo.ttt.triton_exchange import exchange_buffers, gather, raise_flag, stage, take_ticket, wait_all


@triton.jit
def _ld(PTR, R: tl.constexpr, C: tl.constexpr):
    """Load a contiguous row-major [R, C] fp32 tile."""
    return tl.load(PTR + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :])


@triton.jit
def _st(PTR, x, R: tl.constexpr, C: tl.constexpr):
    tl.store(PTR + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :], x)


@triton.jit
def _output_path_kernel(
    Q, DO, NW, SW1, SB1, SW2, SB2, NSLOT, GW1, GB1, GW2, GB2, GSLOT, DQ, DNW, DNB,
    H, L, I0, CNT,
    D: tl.constexpr, E: tl.constexpr, M: tl.constexpr, NC: tl.constexpr, DOT: tl.constexpr, EPS: tl.constexpr,
):
    """One program per (stream, mini-batch j of the group): O = Q + LN(gelu(Q W1' + b1') W2' + b2') at the state
    after j (slot j + 1). Writes d Q, the state gradient through this output into slot j of GW*, and adds the norm
    gradients to DNW / DNB. The hidden dim in NC chunks of E / NC rows."""
    EC: tl.constexpr = E // NC
    p = tl.program_id(0).to(tl.int64)
    stream = p // CNT
    j = p % CNT
    h = stream % H
    rm = tl.arange(0, M)
    rd = tl.arange(0, D)
    rc = tl.arange(0, EC)
    nw = tl.load(NW + h * D + rd).to(tl.float32)[None, :]
    s = stream * NSLOT + j + 1
    n1, n2, nb1 = SW1 + s * (E * D), SW2 + s * (E * D), SB1 + s * E
    off = stream * L * D + (I0 + j) * (M * D) + rm[:, None] * D + rd[None, :]
    q = tl.load(Q + off)
    do = tl.load(DO + off).to(tl.float32)
    zq2 = tl.zeros([M, D], tl.float32) + tl.load(SB2 + s * D + rd)[None, :]
    xqs = ()
    gqs = ()
    for c in tl.static_range(NC):
        xq2t, gpqt = gelu_fwd(dot(op(_ld(n1 + c * EC * D, EC, D), DOT), tl.trans(q), DOT)
                              + tl.load(nb1 + c * EC + rc)[:, None])
        xqs = xqs + (op(xq2t, DOT),)
        gqs = gqs + (op(gpqt, DOT),)
        zq2 = dot_acc(tl.trans(xqs[c]), op(_ld(n2 + c * EC * D, EC, D), DOT), zq2, DOT)
    xq, rq = ln_stats(zq2, D, EPS)
    tl.atomic_add(DNW + stream * D + rd, tl.sum(do * xq, 0))
    tl.atomic_add(DNB + stream * D + rd, tl.sum(do, 0))
    dzq2 = op(ln_bwd(do * nw, xq, rq, D), DOT)
    g = stream * GSLOT + j
    tl.store(GB2 + g * D + rd, tl.sum(dzq2.to(tl.float32), 0))
    dq = do
    for c in tl.static_range(NC):
        _st(GW2 + g * (E * D) + c * EC * D, dot(xqs[c], dzq2, DOT), EC, D)
        dzq1t = op(dot(op(_ld(n2 + c * EC * D, EC, D), DOT), tl.trans(dzq2), DOT) * gqs[c], DOT)
        _st(GW1 + g * (E * D) + c * EC * D, dot(dzq1t, q, DOT), EC, D)
        tl.store(GB1 + g * E + c * EC + rc, tl.sum(dzq1t.to(tl.float32), 1))
        dq = dot_acc(tl.trans(dzq1t), op(_ld(n1 + c * EC * D, EC, D), DOT), dq, DOT)
    tl.store(DQ + off, dq.to(DQ.dtype.element_ty))


@triton.jit
def _reverse_kernel(
    K, V, ETA, NW, NB, SW2, NSLOT, ZS, Z2S, GW1, GB1, GW2, GB2, GSLOT,
    CW1, CB1, CW2, CB2, GK1, DZ1, DV, DETA, DNW, DNB, XB, SYNC,
    H, L, I0, CNT,
    D: tl.constexpr, E: tl.constexpr, M: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr, EPS: tl.constexpr,
    DIAG: tl.constexpr = 0,
):
    """The update path of the group's mini-batches in reverse, per (stream, role). C* holds the gradient w.r.t.
    the state after the group on entry and w.r.t. the state before it on exit (fp32, one slot per stream).
    d K is left to `_dk_kernel`, which runs in parallel over mini-batches: this kernel stores its operands, the
    state gradient dW1' (GK1) and dZ1 (DZ1), in the operand dtype. (Computed here, its products and its exchange
    cost 6.8 of 21.3 ms at L = 18,048 on an H200, benchmarks/NOTES-ttt-kernel.md.)
    DIAG, for timing only (the results are then wrong): bit 2 drops the loads of the output-path gradients."""
    stream, role = take_ticket(SYNC, SPLIT)
    EC: tl.constexpr = E // SPLIT
    h = stream % H
    rm = tl.arange(0, M)
    rd = tl.arange(0, D)
    rows = role * EC + tl.arange(0, EC)
    wrows = rows[:, None] * D + rd[None, :]
    tile = rm[:, None] * D + rd[None, :]
    zrows = rows[:, None] * M + rm[None, :]
    nw = tl.load(NW + h * D + rd).to(tl.float32)[None, :]
    nb = tl.load(NB + h * D + rd).to(tl.float32)[None, :]
    gw1 = tl.load(CW1 + stream * (E * D) + wrows)
    gb1 = tl.load(CB1 + stream * E + rows)
    gw2 = tl.load(CW2 + stream * (E * D) + wrows)
    gb2 = tl.load(CB2 + stream * D + rd)
    dnw = tl.zeros([D], tl.float32)
    dnb = tl.zeros([D], tl.float32)
    tok = stream * L * D
    seq = 0
    for jj in range(CNT):
        j = CNT - 1 - jj
        ib = I0 + j
        g = stream * GSLOT + j
        # the gradient w.r.t. the state after j: through later updates (carried) + through j's own output
        if DIAG & 2 == 0:
            gw1 += tl.load(GW1 + g * (E * D) + wrows)
            gb1 += tl.load(GB1 + g * E + rows)
            gw2 += tl.load(GW2 + g * (E * D) + wrows)
            gb2 += tl.load(GB2 + g * D + rd)
        off = tok + ib * (M * D) + tile
        k = tl.load(K + off)
        v = tl.load(V + off)
        eta = tl.load(ETA + stream * L + ib * M + rm).to(tl.float32)
        x2t, gp1t, gpp1t = gelu_fwd2(tl.load(ZS + g * (E * M) + zrows))
        x2t = op(x2t, DOT)
        target = v.to(tl.float32) - k.to(tl.float32)
        lg, _xh, _rs, _y, _gh, _la, _lc = ln_l2_fwd(tl.load(Z2S + g * (M * D) + tile), target, nw, nb, D, EPS)
        g2 = op(eta[:, None] * lg, DOT)
        ps = stream * NSLOT + j  # the state before j
        w2c = op(tl.load(SW2 + ps * (E * D) + wrows), DOT)
        # through G1 = P * gelu'(Z1) and the updates' use of G1, G2, X2; what crosses the exchange is kept in the
        # operand dtype and the rest is reloaded or recomputed after it (registers: the kernel sits at the cap)
        pt = dot(w2c, tl.trans(g2), DOT)
        gw1o = op(gw1, DOT)
        tl.store(GK1 + g * (E * D) + wrows, gw1o)  # for the d K kernel
        dg1t = -(dot(gw1o, tl.trans(k), DOT) + gb1[:, None])
        dpt = op(dg1t * gp1t, DOT)
        s1 = op(dg1t * pt * gpp1t, DOT)
        gp1t = op(gp1t, DOT)
        dg2p = dot(tl.trans(dpt), w2c, DOT)
        dg2p = dot_acc(tl.trans(-x2t), op(gw2, DOT), dg2p, DOT)
        seq += 1
        stage(XB, stream, role, seq, 0, dg2p, M, D, SPLIT)
        raise_flag(SYNC, stream, role, seq, SPLIT)
        wait_all(SYNC, stream, seq, SPLIT)
        dg2 = gather(XB, stream, seq, 0, 0, M, M, D, SPLIT) - gb2[None, :]
        # the LN-L2 gradient (every role computes the same; role 0 writes)
        lg, xh, rstd, y, gh, la, lc = ln_l2_fwd(tl.load(Z2S + g * (M * D) + tile), target, nw, nb, D, EPS)
        deta = tl.sum(dg2 * lg, 1)
        dz2, dy, dnw_rows = ln_l2_bwd(eta[:, None] * dg2, xh, rstd, y, gh, la, lc, nw, D)
        tl.store(DV + off, (-dy).to(DV.dtype.element_ty), mask=(tile >= 0) & (role == 0))
        tl.store(DETA + stream * L + ib * M + rm, deta.to(DETA.dtype.element_ty), mask=(rm >= 0) & (role == 0))
        dnw += tl.sum(dnw_rows, 0)
        dnb += tl.sum(dy, 0)
        dz2 = op(dz2, DOT)
        # through X2 into Z1 and K; the state gradient before j
        w2c = op(tl.load(SW2 + ps * (E * D) + wrows), DOT)
        dx2t = dot(w2c, tl.trans(dz2), DOT) - dot(op(gw2, DOT), tl.trans(g2), DOT)
        dz1t = op(s1.to(tl.float32) + dx2t * gp1t.to(tl.float32), DOT)
        tl.store(DZ1 + g * (E * M) + zrows, dz1t)  # for the d K kernel
        gw1 = dot_acc(dz1t, k, gw1, DOT)
        gb1 = gb1 + tl.sum(dz1t.to(tl.float32), 1)
        gw2 = dot_acc(dpt, g2, gw2, DOT)
        gw2 = dot_acc(x2t, dz2, gw2, DOT)
        gb2 = gb2 + tl.sum(dz2.to(tl.float32), 0)
    tl.store(CW1 + stream * (E * D) + wrows, gw1)
    tl.store(CB1 + stream * E + rows, gb1)
    tl.store(CW2 + stream * (E * D) + wrows, gw2)
    first = (rd >= 0) & (role == 0)
    tl.store(CB2 + stream * D + rd, gb2, mask=first)
    tl.store(DNW + stream * D + rd, tl.load(DNW + stream * D + rd) + dnw, mask=first)
    tl.store(DNB + stream * D + rd, tl.load(DNB + stream * D + rd) + dnb, mask=first)


@triton.jit
def _dk_kernel(
    K, V, ETA, NW, NB, SW1, SW2, NSLOT, ZS, Z2S, GK1, DZ1, GSLOT, DV, DK,
    H, L, I0, CNT,
    D: tl.constexpr, E: tl.constexpr, M: tl.constexpr, NC: tl.constexpr, DOT: tl.constexpr, EPS: tl.constexpr,
):
    """One program per (stream, mini-batch j of the group), after the reverse pass:
    d K = -G1 dW1'^T + dZ1 W1^T + dy, with G1 = (G2 W2^T) gelu'(Z1) recomputed, dW1' and dZ1 from the reverse pass,
    and dy = -d V (the target is V - K). The hidden dim in NC chunks of E / NC rows."""
    EC: tl.constexpr = E // NC
    p = tl.program_id(0).to(tl.int64)
    stream = p // CNT
    j = p % CNT
    h = stream % H
    rm = tl.arange(0, M)
    rd = tl.arange(0, D)
    ib = I0 + j
    g = stream * GSLOT + j
    ps = stream * NSLOT + j
    off = stream * L * D + ib * (M * D) + rm[:, None] * D + rd[None, :]
    nw = tl.load(NW + h * D + rd).to(tl.float32)[None, :]
    nb = tl.load(NB + h * D + rd).to(tl.float32)[None, :]
    k = tl.load(K + off)
    target = tl.load(V + off).to(tl.float32) - k.to(tl.float32)
    eta = tl.load(ETA + stream * L + ib * M + rm).to(tl.float32)
    lg, _xh, _rs, _y, _gh, _a, _c = ln_l2_fwd(_ld(Z2S + g * (M * D), M, D), target, nw, nb, D, EPS)
    g2 = op(eta[:, None] * lg, DOT)
    dk = -tl.load(DV + off).to(tl.float32)
    for c in tl.static_range(NC):
        _x, gpt = gelu_fwd(_ld(ZS + g * (E * M) + c * EC * M, EC, M))
        g1t = op(dot(op(_ld(SW2 + ps * (E * D) + c * EC * D, EC, D), DOT), tl.trans(g2), DOT) * gpt, DOT)
        dk = dot_acc(tl.trans(-g1t), _ld(GK1 + g * (E * D) + c * EC * D, EC, D), dk, DOT)
        dk = dot_acc(tl.trans(_ld(DZ1 + g * (E * M) + c * EC * M, EC, M)),
                     op(_ld(SW1 + ps * (E * D) + c * EC * D, EC, D), DOT), dk, DOT)
    tl.store(DK + off, dk.to(DK.dtype.element_ty))


def chunks_for(E: int, warps: int) -> int:
    """Hidden-dim chunks of the parallel kernels (full hidden dim per program): 16 rows per warp in a chunk."""
    return max(1, E // (16 * warps))


def output_path(dout, q, norm_w, norm_b, states, nslot, out_grads, gslot, dq, dnw, dnb, i0, cnt, M, warps,
                launched):
    B, H, L, D = q.shape
    E = states[1].shape[-1]
    launched["bwd_output"] = _output_path_kernel[(B * H * cnt,)](
        q, dout, norm_w, *states, nslot, *out_grads, gslot, dq, dnw, dnb,
        H, L, i0, cnt,
        D=D, E=E, M=M, NC=chunks_for(E, warps), DOT=dot_mode(q.dtype), EPS=LN_EPS,
        num_warps=warps, num_stages=1,
    )


def reverse(k, v, eta, norm_w, norm_b, states, nslot, acts, out_grads, carried, dk_operands, dv, deta, dnw, dnb,
            i0, cnt, M, split, warps, launched, diag=0):
    B, H, L, D = k.shape
    E = states[1].shape[-1]
    sync, xb = exchange_buffers(B * H, split, M, D, k.device)
    launched["bwd_reverse"] = _reverse_kernel[(B * H * split,)](
        k, v, eta, norm_w, norm_b, states[2], nslot, *acts, *out_grads, nslot - 1,
        *carried, *dk_operands, dv, deta, dnw, dnb, xb, sync,
        H, L, i0, cnt,
        D=D, E=E, M=M, SPLIT=split, DOT=dot_mode(k.dtype), EPS=LN_EPS, DIAG=diag,
        num_warps=warps, num_stages=1,
    )


def grad_k(k, v, eta, norm_w, norm_b, states, nslot, acts, dk_operands, dv, dk, i0, cnt, M, warps, launched):
    B, H, L, D = k.shape
    E = states[1].shape[-1]
    launched["bwd_dk"] = _dk_kernel[(B * H * cnt,)](
        k, v, eta, norm_w, norm_b, states[0], states[2], nslot, *acts, *dk_operands, nslot - 1, dv, dk,
        H, L, i0, cnt,
        D=D, E=E, M=M, NC=chunks_for(E, warps), DOT=dot_mode(k.dtype), EPS=LN_EPS,
        num_warps=warps, num_stages=1,
    )
