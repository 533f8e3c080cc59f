"""Backward kernels of the Triton TTT-MLP scan, one checkpoint group at a time (host side: triton_mlp.mlp_backward).

Given the group's recomputed states S_0..S_cnt (S_j before mini-batch j) and what the recompute saved of each
mini-batch (X2 = gelu(Z1), gelu'(Z1), gelu''(Z1), Z2 and G2), the gradient w.r.t. the state after mini-batch j is

    dS_j+1 = dOut_j / dS_j+1 (output path)  +  J_j+1^T dS_j+2 (the next mini-batch's update path).

The first term does not depend on the chain, so `output_path` prepares it for all mini-batches of the group at
once, one program per (stream, mini-batch), as the factors of its rank-M products (dW1' = dZq1^T Q,
dW2' = Xq^T dZq2), together with d Q and the chain-free factor of the reverse's second-order term. `reverse` then
walks the chain backwards, split over cooperating programs like the forward (`triton_exchange`), with the state
gradient of its hidden rows in registers; every per-step operand it reads is a bf16 matrix-instruction operand or
a small fp32 tile, so nothing but the exchange and the products sits on the serial path. `grad_k` finishes d K in
parallel afterwards. The step's backward, written untransposed (derived by hand, checked against autograd of the
reference in tests/test_ttt_triton.py):

    output path   O = Q + LN(gelu(Q W1' + b1') W2' + b2')            -> dQ, and d W1', b1', W2', b2'
    update path   W1' = W1 - K^T G1, b1' = b1 - sum G1, W2' = W2 - X2^T G2, b2' = b2 - sum G2
                  dG1 = -(K dW1' + db1'), dK = -G1 dW1'^T, dG2 = -(X2 dW2' + db2'), dX2 = -G2 dW2'^T
    inner grad    G1 = P * gelu'(Z1), P = G2 W2^T, G2 = eta * lnl2(Z2, V - K), Z2 = X2 W2 + b2, X2 = gelu(Z1),
                  Z1 = K W1 + b1        -> backpropagated term by term (gelu'' and the LN-L2 second derivative)

Buffers of a group (per stream and mini-batch j; E x M and E x D tiles are transposed, hidden rows first;
"op" is the matrix-instruction operand dtype, bf16 on the fast path):
    states   W1^T, W2 [E, D] op; b1 [E], b2 [D] fp32                 (slot j = before mini-batch j)
    acts     X2^T, gelu'(Z1)^T, gelu''(Z1)^T [E, M] op; Z2 [M, D] fp32; G2 [M, D] op       (the recompute)
    outs     dZq1^T, Xq^T, S1^T = (W2 G2^T) gelu''(Z1)^T [E, M] op; dZq2 [M, D] op; sums of dZq1 [E], dZq2 [D]
    dk_ops   dW1'^T [E, D] op, dZ1^T [E, M] op                        (the reverse, for grad_k)
"""

from __future__ import annotations

import triton
import triton.language as tl

from tttvideo.ttt.triton_carveout import fit_carveout
from tttvideo.ttt.triton_common import (
    LN_EPS, dot, dot_acc, dot_mode, gelu_fwd, ln_bwd, ln_l2_bwd, ln_l2_fwd, ln_stats, op,
)
from tttvideo.ttt.triton_exchange import exchange_buffers, gather, raise_flag, stage, take_ticket, wait_all


@triton.jit
def _ld(PTR, R: tl.constexpr, C: tl.constexpr):
    """Load a contiguous row-major [R, C] tile."""
    return tl.load(PTR + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :])


@triton.jit
def _st(PTR, x, R: tl.constexpr, C: tl.constexpr):
    tl.store(PTR + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :], x.to(PTR.dtype.element_ty))


@triton.jit
def _output_path_kernel(
    Q, DO, NW, SW1, SB1, SW2, SB2, NSLOT, GPP, G2S, DQ1, XQ, S1, DQ2, OB1, OB2, GSLOT, DQ, DNW, DNB,
    H, L, I0, CNT,
    D: tl.constexpr, E: tl.constexpr, M: tl.constexpr, NC: tl.constexpr, DOT: tl.constexpr, EPS: tl.constexpr,
):
    """One program per (stream, mini-batch j of the group): O = Q + LN(gelu(Q W1' + b1') W2' + b2') at the state
    after j (slot j + 1). Writes d Q, the factors of the state gradient through this output (dZq1^T, Xq^T, dZq2
    and their row / column sums), and S1^T = (W2 G2^T) gelu''(Z1)^T at the state before j, which the reverse
    multiplies by its chain term; adds the norm gradients to DNW / DNB. The hidden dim in NC chunks of E / NC."""
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
    g = stream * GSLOT + j
    off = stream * L * D + (I0 + j) * (M * D) + rm[:, None] * D + rd[None, :]
    q = tl.load(Q + off)
    do = tl.load(DO + off).to(tl.float32)
    zq2 = tl.zeros([M, D], tl.float32) + tl.load(SB2 + s * D + rd)[None, :]
    gqs = ()
    for c in tl.static_range(NC):
        xq2t, gpqt = gelu_fwd(dot(_ld(n1 + c * EC * D, EC, D), tl.trans(q), DOT)
                              + tl.load(nb1 + c * EC + rc)[:, None], DOT)
        xq2t = op(xq2t, DOT)
        _st(XQ + g * (E * M) + c * EC * M, xq2t, EC, M)
        gqs = gqs + (gpqt,)
        zq2 = dot_acc(tl.trans(xq2t), _ld(n2 + c * EC * D, EC, D), zq2, DOT)
    xq, rq = ln_stats(zq2, D, EPS)
    tl.atomic_add(DNW + stream * D + rd, tl.sum(do * xq, 0))
    tl.atomic_add(DNB + stream * D + rd, tl.sum(do, 0))
    dzq2 = op(ln_bwd(do * nw, xq, rq, D), DOT)
    _st(DQ2 + g * (M * D), dzq2, M, D)
    tl.store(OB2 + g * D + rd, tl.sum(dzq2.to(tl.float32), 0))
    g2 = _ld(G2S + g * (M * D), M, D)
    w2_before = SW2 + (s - 1) * (E * D)
    dq = do
    for c in tl.static_range(NC):
        dzq1t = op(dot(_ld(n2 + c * EC * D, EC, D), tl.trans(dzq2), DOT) * gqs[c], DOT)
        _st(DQ1 + g * (E * M) + c * EC * M, dzq1t, EC, M)
        tl.store(OB1 + g * E + c * EC + rc, tl.sum(dzq1t.to(tl.float32), 1))
        dq = dot_acc(tl.trans(dzq1t), _ld(n1 + c * EC * D, EC, D), dq, DOT)
        s1t = dot(_ld(w2_before + c * EC * D, EC, D), tl.trans(g2), DOT) * _ld(GPP + g * (E * M) + c * EC * M, EC, M)
        _st(S1 + g * (E * M) + c * EC * M, s1t, EC, M)
    tl.store(DQ + off, dq.to(DQ.dtype.element_ty))


@triton.jit
def _add_output_grad(Q, DQ1, XQ, DQ2, OB1, OB2, g, off, rows, rd, zrows, tile, gw1, gb1, gw2, gb2, on,
                     D: tl.constexpr, E: tl.constexpr, M: tl.constexpr, DOT: tl.constexpr):
    """The state gradient through mini-batch g's output, added to this role's rows (nothing where `on` is 0):
    dW1'^T += dZq1^T Q, db1' += sum dZq1, dW2 += Xq^T dZq2, db2' += sum dZq2."""
    gw1 = dot_acc(tl.load(DQ1 + g * (E * M) + zrows, mask=on, other=0.0), tl.load(Q + off, mask=on, other=0.0),
                  gw1, DOT)
    gw2 = dot_acc(tl.load(XQ + g * (E * M) + zrows, mask=on, other=0.0),
                  tl.load(DQ2 + g * (M * D) + tile, mask=on, other=0.0), gw2, DOT)
    gb1 += tl.load(OB1 + g * E + rows, mask=on, other=0.0)
    gb2 += tl.load(OB2 + g * D + rd, mask=on, other=0.0)
    return gw1, gb1, gw2, gb2


@triton.jit
def _reverse_kernel(
    Q, K, V, ETA, NW, NB, SW2, NSLOT, XS, GPS, Z2S, G2S, DQ1, XQ, S1, DQ2, OB1, OB2, GSLOT,
    CW1, CB1, CW2, CB2, GK1, DZ1, DV, DETA, DNW, DNB, XB, SYNC,
    H, L, I0, CNT,
    D: tl.constexpr, E: tl.constexpr, M: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr, EPS: tl.constexpr,
):
    """The update path of the group's mini-batches in reverse, per (stream, role). C* holds the gradient w.r.t.
    the state after the group on entry and w.r.t. the state before it on exit (fp32, one slot per stream).
    d K is left to `_dk_kernel`, which runs in parallel over mini-batches: this kernel stores its operands, the
    state gradient dW1' (GK1) and dZ1 (DZ1). The output path's contribution for mini-batch j - 1 is added at the
    end of step j, off the chain's critical products."""
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
    tok = stream * L * D
    last = stream * GSLOT + CNT - 1
    gw1, gb1, gw2, gb2 = _add_output_grad(
        Q, DQ1, XQ, DQ2, OB1, OB2, last, tok + (I0 + CNT - 1) * (M * D) + tile, rows, rd, zrows, tile,
        tl.load(CW1 + stream * (E * D) + wrows), tl.load(CB1 + stream * E + rows),
        tl.load(CW2 + stream * (E * D) + wrows), tl.load(CB2 + stream * D + rd), True, D, E, M, DOT)
    dnw = tl.zeros([D], tl.float32)
    dnb = tl.zeros([D], tl.float32)
    seq = 0
    for jj in range(CNT):
        j = CNT - 1 - jj
        ib = I0 + j
        g = stream * GSLOT + j
        off = tok + ib * (M * D) + tile
        k = tl.load(K + off)
        w2 = tl.load(SW2 + (stream * NSLOT + j) * (E * D) + wrows)  # the state before j
        x2t = tl.load(XS + g * (E * M) + zrows)
        gp1t = tl.load(GPS + g * (E * M) + zrows)
        # through G1 = P * gelu'(Z1) and the updates' use of G1, G2, X2; what crosses the exchange is kept in the
        # operand dtype (registers: the kernel sits at the cap)
        gw1o = op(gw1, DOT)
        tl.store(GK1 + g * (E * D) + wrows, gw1o)  # for the d K kernel
        dg1t = -(dot(gw1o, tl.trans(k), DOT) + gb1[:, None])
        dpt = op(dg1t * gp1t.to(tl.float32), DOT)
        dg2p = dot(tl.trans(dpt), w2, DOT)
        dg2p = dot_acc(tl.trans(-x2t), op(gw2, DOT), dg2p, DOT)
        seq += 1
        stage(XB, stream, role, seq, 0, dg2p, M, D, SPLIT)
        raise_flag(SYNC, stream, role, seq, SPLIT)
        s1 = op(dg1t * tl.load(S1 + g * (E * M) + zrows).to(tl.float32), DOT)
        v = tl.load(V + off)
        eta = tl.load(ETA + stream * L + ib * M + rm).to(tl.float32)
        wait_all(SYNC, stream, role, seq, SPLIT)
        dg2 = gather(XB, stream, seq, 0, 0, M, M, D, SPLIT) - gb2[None, :]
        # the LN-L2 gradient (every role computes the same; role 0 writes)
        target = v.to(tl.float32) - k.to(tl.float32)
        lg, xh, rstd, y, gh, la, lc = ln_l2_fwd(tl.load(Z2S + g * (M * D) + tile), target, nw, nb, D, EPS)
        deta = tl.sum(dg2 * lg, 1)
        dz2, dy, dnw_rows = ln_l2_bwd(eta[:, None] * dg2, xh, rstd, y, gh, la, lc, nw, D)
        tl.store(DV + off, (-dy).to(DV.dtype.element_ty), mask=(tile >= 0) & (role == 0))
        tl.store(DETA + stream * L + ib * M + rm, deta.to(DETA.dtype.element_ty), mask=(rm >= 0) & (role == 0))
        dnw += tl.sum(dnw_rows, 0)
        dnb += tl.sum(dy, 0)
        dz2 = op(dz2, DOT)
        # through X2 into Z1 and K; the state gradient before j
        g2 = tl.load(G2S + g * (M * D) + tile)
        dx2t = dot(w2, tl.trans(dz2), DOT) - dot(op(gw2, DOT), tl.trans(g2), DOT)
        dz1t = op(s1.to(tl.float32) + dx2t * gp1t.to(tl.float32), DOT)
        tl.store(DZ1 + g * (E * M) + zrows, dz1t)  # for the d K kernel
        gw1 = dot_acc(dz1t, k, gw1, DOT)
        gb1 = gb1 + tl.sum(dz1t.to(tl.float32), 1)
        gw2 = dot_acc(dpt, g2, gw2, DOT)
        gw2 = dot_acc(x2t, dz2, gw2, DOT)
        gb2 = gb2 + tl.sum(dz2.to(tl.float32), 0)
        gw1, gb1, gw2, gb2 = _add_output_grad(Q, DQ1, XQ, DQ2, OB1, OB2, g - 1, off - M * D, rows, rd, zrows, tile,
                                              gw1, gb1, gw2, gb2, j > 0, D, E, M, DOT)
    tl.store(CW1 + stream * (E * D) + wrows, gw1)
    tl.store(CB1 + stream * E + rows, gb1)
    tl.store(CW2 + stream * (E * D) + wrows, gw2)
    first = (rd >= 0) & (role == 0)
    tl.store(CB2 + stream * D + rd, gb2, mask=first)
    tl.atomic_add(DNW + stream * D + rd, dnw, mask=first)  # atomics: the output path may run at the same time
    tl.atomic_add(DNB + stream * D + rd, dnb, mask=first)


@triton.jit
def _dk_kernel(
    DV, SW1, SW2, NSLOT, GPS, G2S, GK1, DZ1, GSLOT, DK,
    L, I0, CNT,
    D: tl.constexpr, E: tl.constexpr, M: tl.constexpr, NC: tl.constexpr, DOT: tl.constexpr,
):
    """One program per (stream, mini-batch j of the group), after the reverse pass:
    d K = -G1 dW1'^T + dZ1 W1^T + dy, with G1^T = (W2 G2^T) gelu'(Z1)^T recomputed, dW1' and dZ1 from the reverse
    pass, and dy = -d V (the target is V - K). The hidden dim in NC chunks of E / NC rows."""
    EC: tl.constexpr = E // NC
    p = tl.program_id(0).to(tl.int64)
    stream = p // CNT
    j = p % CNT
    rm = tl.arange(0, M)
    rd = tl.arange(0, D)
    g = stream * GSLOT + j
    ps = stream * NSLOT + j
    off = stream * L * D + (I0 + j) * (M * D) + rm[:, None] * D + rd[None, :]
    g2 = _ld(G2S + g * (M * D), M, D)
    dk = -tl.load(DV + off).to(tl.float32)
    for c in tl.static_range(NC):
        g1t = op(dot(_ld(SW2 + ps * (E * D) + c * EC * D, EC, D), tl.trans(g2), DOT)
                 * _ld(GPS + g * (E * M) + c * EC * M, EC, M).to(tl.float32), DOT)
        dk = dot_acc(tl.trans(-g1t), _ld(GK1 + g * (E * D) + c * EC * D, EC, D), dk, DOT)
        dk = dot_acc(tl.trans(_ld(DZ1 + g * (E * M) + c * EC * M, EC, M)), _ld(SW1 + ps * (E * D) + c * EC * D, EC, D),
                     dk, DOT)
    tl.store(DK + off, dk.to(DK.dtype.element_ty))


def chunks_for(E: int, warps: int) -> int:
    """Hidden-dim chunks of the parallel kernels (full hidden dim per program): 16 rows per warp in a chunk."""
    return max(1, E // (16 * warps))


def output_path(dout, q, norm_w, states, nslot, acts, outs, gslot, dq, dnw, dnb, i0, cnt, M, warps, launched):
    B, H, L, D = q.shape
    E = states[1].shape[-1]
    launched["bwd_output"] = _output_path_kernel[(B * H * cnt,)](
        q, dout, norm_w, *states, nslot, acts[2], acts[4], *outs, gslot, dq, dnw, dnb,
        H, L, i0, cnt,
        D=D, E=E, M=M, NC=chunks_for(E, warps), DOT=dot_mode(q.dtype), EPS=LN_EPS,
        num_warps=warps, num_stages=1,
    )


def reverse(q, k, v, eta, norm_w, norm_b, states, nslot, acts, outs, carried, dk_ops, dv, deta, dnw, dnb,
            i0, cnt, M, split, warps, launched):
    B, H, L, D = k.shape
    E = states[1].shape[-1]
    sync, xb = exchange_buffers(B * H, split, M, D, k.device)
    x2, gp, _gpp, z2, g2 = acts
    launched["bwd_reverse"] = _reverse_kernel[(B * H * split,)](
        q, k, v, eta, norm_w, norm_b, states[2], nslot, x2, gp, z2, g2, *outs, nslot - 1,
        *carried, *dk_ops, dv, deta, dnw, dnb, xb, sync,
        H, L, i0, cnt,
        D=D, E=E, M=M, SPLIT=split, DOT=dot_mode(k.dtype), EPS=LN_EPS,
        num_warps=warps, num_stages=1,
    )
    fit_carveout(launched["bwd_reverse"])


def grad_k(states, nslot, acts, dk_ops, dv, dk, i0, cnt, M, warps, launched):
    B, H, L, D = dk.shape
    E = states[1].shape[-1]
    launched["bwd_dk"] = _dk_kernel[(B * H * cnt,)](
        dv, states[0], states[2], nslot, acts[1], acts[4], *dk_ops, nslot - 1, dk,
        L, i0, cnt,
        D=D, E=E, M=M, NC=chunks_for(E, warps), DOT=dot_mode(dk.dtype),
        num_warps=warps, num_stages=1,
    )
