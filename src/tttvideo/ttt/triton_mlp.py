"""Fused Triton TTT-MLP scan, forward and backward (math: `tttvideo.ttt.reference._mlp_minibatch`).

One program per (batch, head) stream walks the serial chain of mini-batches. Layout: the state is kept transposed,
W1^T and W2 as [E, D] fp32, and the hidden activations as [E, M], so every product over the hidden dim has E rows
and spreads over the warps without replicating tiles; the hidden dim is handled in two chunks of E / 2 rows at
8 warps, so that one chunk's tiles sit in registers at a time. The fp32 state lives in per-stream working slots in
global memory (L1/L2-resident), read chunk by chunk as each product needs it: holding all of it in registers,
with the activations, spilled far more (benchmarks/NOTES-ttt-kernel.md has the measurements).

Forward: per mini-batch, the inner gradient at the old state, the update, and the output at the new state; the
state is copied out every `group` mini-batches (and once more at the end) when a backward will follow.

Backward: groups in reverse. For each group the program reloads its checkpoint, recomputes the group's states
into a per-stream scratch (group + 1 states), then walks the group's mini-batches in reverse, accumulating the
gradient w.r.t. the state (fp32, two working slots) and writing d q, d k, d v, d eta per token. The step's
backward is derived by hand (checked against autograd of the reference in tests/test_ttt_triton.py), written here
untransposed:

    output path   O = Q + LN(gelu(Q W1' + b1') W2' + b2')            -> dQ, and adds to dW1', db1', dW2', db2'
    update path   W1' = W1 - K^T G1, b1' = b1 - sum G1, W2' = W2 - X2^T G2, b2' = b2 - sum G2
                  dG1 = -(K dW1' + db1'), dK = -G1 dW1'^T, dG2 = -(X2 dW2' + db2'), dX2 = -G2 dW2'^T
    inner grad    G1 = P * gelu'(Z1), P = G2 W2^T, G2 = eta * lnl2(Z2, V - K), Z2 = X2 W2 + b2, X2 = gelu(Z1),
                  Z1 = K W1 + b1        -> backpropagated term by term (gelu'' and the LN-L2 second derivative)

Shapes covered: D and M powers of two >= 16, E = 4 D (ops.uncovered_reason). Shared memory at D = 64: 64 KiB
forward, 80 KiB backward on sm_90 (docs/kernels.md lists sm_80 / sm_89).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tttvideo.ttt.triton_common import (
    DOT_BF16, LN_EPS, check_device, dot, dot_acc, dot_mode, gelu_fwd, gelu_fwd2, ln_bwd, ln_l2_bwd, ln_l2_fwd,
    ln_stats, new_output, op,
)

# Warps of one stream's program (8 measured best against 4 and 16: benchmarks/NOTES-ttt-kernel.md).
WARPS = 8

# the last compiled kernel of each launcher (its n_regs / n_spills are read by the benchmark)
LAUNCHED: dict = {}


@triton.jit
def _ld(PTR, R: tl.constexpr, C: tl.constexpr):
    """Load a contiguous row-major [R, C] fp32 tile."""
    return tl.load(PTR + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :])


@triton.jit
def _st(PTR, x, R: tl.constexpr, C: tl.constexpr):
    tl.store(PTR + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :], x)


@triton.jit
def _st_state(W1T, B1, W2, B2, w1t, b1, w2, b2, D: tl.constexpr, E: tl.constexpr):
    """Write one state slot: W1^T [E, D], b1 [E], W2 [E, D], b2 [D] (fp32)."""
    _st(W1T, w1t, E, D)
    tl.store(B1 + tl.arange(0, E), b1)
    _st(W2, w2, E, D)
    tl.store(B2 + tl.arange(0, D), b2)


@triton.jit
def _step(SW1, SB1, SW2, SB2, r, w, k, v, q, eta, nw, nb,
          D: tl.constexpr, E: tl.constexpr, M: tl.constexpr, NC: tl.constexpr, DOT: tl.constexpr,
          EPS: tl.constexpr, OUTPUT: tl.constexpr):
    """One mini-batch of the scan: the state in slot r -> the updated state in slot w.

    Transposed layout: W1^T and W2 are [E, D], the hidden activations [E, M], so the products that carry the
    hidden dim have E rows, spread over the warps without replication. The hidden dim is processed in NC chunks of
    E / NC rows so that one chunk's tiles are in registers at a time. Returns Zq2 [M, D], the pre-LN output of the
    updated inner model on Q (b2 only, unless OUTPUT)."""
    EC: tl.constexpr = E // NC
    rc = tl.arange(0, EC)
    rd = tl.arange(0, D)
    r1, r2 = SW1 + r * (E * D), SW2 + r * (E * D)
    w1, w2 = SW1 + w * (E * D), SW2 + w * (E * D)
    # inner gradient at the old state: Z2 = b2 + sum_c gelu(W1_c^T K^T + b1_c)^T W2_c
    b2 = tl.load(SB2 + r * D + rd)
    z2 = tl.zeros([M, D], tl.float32) + b2[None, :]
    x2s = ()
    gps = ()
    for c in tl.static_range(NC):
        z1t = dot(op(_ld(r1 + c * EC * D, EC, D), DOT), tl.trans(k), DOT) + tl.load(SB1 + r * E + c * EC + rc)[:, None]
        x2t, gp1t = gelu_fwd(z1t)
        x2s = x2s + (op(x2t, DOT),)
        gps = gps + (op(gp1t, DOT),)
        z2 = dot_acc(tl.trans(x2s[c]), op(_ld(r2 + c * EC * D, EC, D), DOT), z2, DOT)
    lg, xh, rstd, y, gh, a, cc = ln_l2_fwd(z2, v.to(tl.float32) - k.to(tl.float32), nw, nb, D, EPS)
    g2 = op(eta[:, None] * lg, DOT)
    b2 = b2 - tl.sum(g2.to(tl.float32), 0)
    tl.store(SB2 + w * D + rd, b2)
    # update chunk by chunk, then the output at the new state
    zq2 = tl.zeros([M, D], tl.float32) + b2[None, :]
    for c in tl.static_range(NC):
        w2c = _ld(r2 + c * EC * D, EC, D)
        g1t = op(dot(op(w2c, DOT), tl.trans(g2), DOT) * gps[c], DOT)
        w1c = dot_acc(-g1t, k, _ld(r1 + c * EC * D, EC, D), DOT)
        b1c = tl.load(SB1 + r * E + c * EC + rc) - tl.sum(g1t.to(tl.float32), 1)
        w2c = dot_acc(-x2s[c], g2, w2c, DOT)
        _st(w1 + c * EC * D, w1c, EC, D)
        _st(w2 + c * EC * D, w2c, EC, D)
        tl.store(SB1 + w * E + c * EC + rc, b1c)
        if OUTPUT:
            xq2t, _g = gelu_fwd(dot(op(w1c, DOT), tl.trans(q), DOT) + b1c[:, None])
            zq2 = dot_acc(tl.trans(op(xq2t, DOT)), op(w2c, DOT), zq2, DOT)
    return zq2


@triton.jit
def _copy_slot(SW1, SB1, SW2, SB2, src, C1, CB1, C2, CB2, dst, D: tl.constexpr, E: tl.constexpr):
    _st_state(C1 + dst * (E * D), CB1 + dst * E, C2 + dst * (E * D), CB2 + dst * D,
              _ld(SW1 + src * (E * D), E, D), tl.load(SB1 + src * E + tl.arange(0, E)),
              _ld(SW2 + src * (E * D), E, D), tl.load(SB2 + src * D + tl.arange(0, D)), D, E)


@triton.jit
def _mlp_fwd_kernel(
    Q, K, V, ETA, NW, NB, W1, B1, W2, B2, OUT, CW1, CB1, CW2, CB2, SW1, SB1, SW2, SB2,
    H, L, NMB, GROUP,
    D: tl.constexpr, E: tl.constexpr, M: tl.constexpr, NC: tl.constexpr, DOT: tl.constexpr, EPS: tl.constexpr,
    SAVE: tl.constexpr, OUTPUT: tl.constexpr,
):
    """One program per (batch, head) stream. The fp32 state lives in two working slots of the stream (SW*, read
    from L1/L2 as each chunk needs it): mini-batch i reads slot i % 2 and writes the other, so no thread overwrites
    state another thread has yet to read. A register-resident state was measured slower (it spilled)."""
    pid = tl.program_id(0).to(tl.int64)
    h = pid % H
    rm = tl.arange(0, M)
    rd = tl.arange(0, D)
    re = tl.arange(0, E)
    nw = tl.load(NW + h * D + rd).to(tl.float32)[None, :]
    nb = tl.load(NB + h * D + rd).to(tl.float32)[None, :]
    tok = pid * L * D
    ck = pid * ((NMB + GROUP - 1) // GROUP + 1)  # this stream's first checkpoint slot
    ws = pid * 2
    # initial state; W1 [D, E] is read transposed
    _st_state(SW1 + ws * (E * D), SB1 + ws * E, SW2 + ws * (E * D), SB2 + ws * D,
              tl.load(W1 + h * (D * E) + rd[None, :] * E + re[:, None]).to(tl.float32),
              tl.load(B1 + h * E + re).to(tl.float32),
              tl.load(W2 + h * (E * D) + re[:, None] * D + rd[None, :]).to(tl.float32),
              tl.load(B2 + h * D + rd).to(tl.float32), D, E)
    tl.debug_barrier()
    if SAVE:
        _copy_slot(SW1, SB1, SW2, SB2, ws, CW1, CB1, CW2, CB2, ck, D, E)
    tile = rm[:, None] * D + rd[None, :]
    for i in range(NMB):
        off = tok + i * (M * D) + tile
        q = tl.load(Q + off)
        zq2 = _step(SW1, SB1, SW2, SB2, ws + i % 2, ws + (i + 1) % 2, tl.load(K + off), tl.load(V + off), q,
                    tl.load(ETA + pid * L + i * M + rm).to(tl.float32), nw, nb, D, E, M, NC, DOT, EPS, OUTPUT)
        if OUTPUT:
            xq, _r = ln_stats(zq2, D, EPS)
            tl.store(OUT + off, (q.to(tl.float32) + nw * xq + nb).to(OUT.dtype.element_ty))
        tl.debug_barrier()  # the next mini-batch reads the state this one wrote, in other threads
        if SAVE:
            if ((i + 1) % GROUP == 0) | (i + 1 == NMB):
                _copy_slot(SW1, SB1, SW2, SB2, ws + (i + 1) % 2, CW1, CB1, CW2, CB2, ck + (i + GROUP) // GROUP, D, E)


@triton.jit
def _mlp_bwd_kernel(
    Q, K, V, ETA, NW, NB, CW1, CB1, CW2, CB2, DO,
    DQ, DK, DV, DETA, DNW, DNB, DW1, DB1, DW2, DB2,
    SW1, SB1, SW2, SB2, XS,
    H, L, NMB, GROUP,
    D: tl.constexpr, E: tl.constexpr, M: tl.constexpr, NC: tl.constexpr, DOT: tl.constexpr, EPS: tl.constexpr,
):
    """Gradients, groups in reverse: recompute the group's states into the scratch slots SW*, then walk back.

    DW1 (as W1^T [E, D]), DB1, DW2, DB2 hold two slots per stream for the gradient w.r.t. the state after the
    current mini-batch: slot 0 between steps (and at the end: the output), slot 1 after a step's output path.
    Each phase reads one slot and writes the other. XS is a per-stream scratch of four [E, M] operand-dtype tiles
    (X2^T, dG1 * P * gelu''(Z1), dP^T, gelu'(Z1)) carried between the passes over the chunks."""
    EC: tl.constexpr = E // NC
    pid = tl.program_id(0).to(tl.int64)
    h = pid % H
    rm = tl.arange(0, M)
    rd = tl.arange(0, D)
    re = tl.arange(0, E)
    rc = tl.arange(0, EC)
    tile = rm[:, None] * D + rd[None, :]
    tec = rc[:, None] * M + rm[None, :]  # one chunk of an [E, M] scratch tile
    nw = tl.load(NW + h * D + rd).to(tl.float32)[None, :]
    nb = tl.load(NB + h * D + rd).to(tl.float32)[None, :]
    tok = pid * L * D
    ng = (NMB + GROUP - 1) // GROUP
    ck = pid * (ng + 1)
    sc = pid * (GROUP + 1)  # this stream's scratch state slots
    G0 = pid * 2  # gradient slot 0; slot 1 is G0 + 1
    xs = XS + pid * (4 * E * M)

    _st_state(DW1 + G0 * (E * D), DB1 + G0 * E, DW2 + G0 * (E * D), DB2 + G0 * D, tl.zeros([E, D], tl.float32),
              tl.zeros([E], tl.float32), tl.zeros([E, D], tl.float32), tl.zeros([D], tl.float32), D, E)
    dnw = tl.zeros([D], tl.float32)
    dnb = tl.zeros([D], tl.float32)
    for gg in range(ng):
        g = ng - 1 - gg
        start = g * GROUP
        cnt = tl.minimum(GROUP, NMB - start)
        # 1. recompute the group's states from its checkpoint into the scratch slots
        _copy_slot(CW1, CB1, CW2, CB2, ck + g, SW1, SB1, SW2, SB2, sc, D, E)
        tl.debug_barrier()
        for j in range(cnt):
            off = tok + (start + j) * (M * D) + tile
            k = tl.load(K + off)
            _step(SW1, SB1, SW2, SB2, sc + j, sc + j + 1, k, tl.load(V + off), k,
                  tl.load(ETA + pid * L + (start + j) * M + rm).to(tl.float32), nw, nb, D, E, M, NC, DOT, EPS, False)
            tl.debug_barrier()  # the next step reads this slot in other threads

        # 2. reverse through the group
        for jj in range(cnt):
            j = cnt - 1 - jj
            i = start + j
            p1, p2 = SW1 + (sc + j) * (E * D), SW2 + (sc + j) * (E * D)  # state before the step
            pb1, pb2 = SB1 + (sc + j) * E, SB2 + (sc + j) * D
            n1, n2 = SW1 + (sc + j + 1) * (E * D), SW2 + (sc + j + 1) * (E * D)  # state after it
            nb1, nb2 = SB1 + (sc + j + 1) * E, SB2 + (sc + j + 1) * D
            gw1_0, gw2_0 = DW1 + G0 * (E * D), DW2 + G0 * (E * D)
            gw1_1, gw2_1 = DW1 + (G0 + 1) * (E * D), DW2 + (G0 + 1) * (E * D)
            off = tok + i * (M * D) + tile
            k = tl.load(K + off)
            q = tl.load(Q + off)
            do = tl.load(DO + off).to(tl.float32)

            # output path, O = Q + LN(Zq2), Zq2 = b2' + sum_c gelu(W1'_c^T Q^T + b1'_c)^T W2'_c: slot 0 -> slot 1
            zq2 = tl.zeros([M, D], tl.float32) + tl.load(nb2 + rd)[None, :]
            xqs = ()
            gqs = ()
            for c in tl.static_range(NC):
                xq2t, gpqt = gelu_fwd(dot(op(_ld(n1 + c * EC * D, EC, D), DOT), tl.trans(q), DOT)
                                      + tl.load(nb1 + c * EC + rc)[:, None])
                xqs = xqs + (op(xq2t, DOT),)
                gqs = gqs + (op(gpqt, DOT),)
                zq2 = dot_acc(tl.trans(xqs[c]), op(_ld(n2 + c * EC * D, EC, D), DOT), zq2, DOT)
            xq, rq = ln_stats(zq2, D, EPS)
            dnw += tl.sum(do * xq, 0)
            dnb += tl.sum(do, 0)
            dzq2 = op(ln_bwd(do * nw, xq, rq, D), DOT)
            tl.store(DB2 + (G0 + 1) * D + rd, tl.load(DB2 + G0 * D + rd) + tl.sum(dzq2.to(tl.float32), 0))
            dq = do
            for c in tl.static_range(NC):
                _st(gw2_1 + c * EC * D, dot_acc(xqs[c], dzq2, _ld(gw2_0 + c * EC * D, EC, D), DOT), EC, D)
                dzq1t = op(dot(op(_ld(n2 + c * EC * D, EC, D), DOT), tl.trans(dzq2), DOT) * gqs[c], DOT)
                _st(gw1_1 + c * EC * D, dot_acc(dzq1t, q, _ld(gw1_0 + c * EC * D, EC, D), DOT), EC, D)
                tl.store(DB1 + (G0 + 1) * E + c * EC + rc,
                         tl.load(DB1 + G0 * E + c * EC + rc) + tl.sum(dzq1t.to(tl.float32), 1))
                dq = dot_acc(tl.trans(dzq1t), op(_ld(n1 + c * EC * D, EC, D), DOT), dq, DOT)
            tl.store(DQ + off, dq.to(DQ.dtype.element_ty))
            tl.debug_barrier()  # slot 1 is read below in other threads

            # update path: slot 1 (the gradient w.r.t. the state after this step) -> slot 0
            v = tl.load(V + off)
            eta = tl.load(ETA + pid * L + i * M + rm).to(tl.float32)
            target = v.to(tl.float32) - k.to(tl.float32)
            # (a) recompute the inner gradient at the old state
            z2 = tl.zeros([M, D], tl.float32) + tl.load(pb2 + rd)[None, :]
            for c in tl.static_range(NC):
                x2t, _gp = gelu_fwd(dot(op(_ld(p1 + c * EC * D, EC, D), DOT), tl.trans(k), DOT)
                                    + tl.load(pb1 + c * EC + rc)[:, None])
                x2t = op(x2t, DOT)
                tl.store(xs + c * EC * M + tec, x2t)
                z2 = dot_acc(tl.trans(x2t), op(_ld(p2 + c * EC * D, EC, D), DOT), z2, DOT)
            lg, _xh, _r, _y, _gh, _a, _c = ln_l2_fwd(z2, target, nw, nb, D, EPS)
            g2 = op(eta[:, None] * lg, DOT)
            tl.debug_barrier()  # X2^T written above is read below in other threads
            # (b) through G1 = P * gelu'(Z1) and the updates' use of G1, G2, X2
            gb2 = tl.load(DB2 + (G0 + 1) * D + rd)
            dg2 = tl.zeros([M, D], tl.float32) - gb2[None, :]
            dk = tl.zeros([M, D], tl.float32)
            for c in tl.static_range(NC):
                w2c = op(_ld(p2 + c * EC * D, EC, D), DOT)
                gw1c = op(_ld(gw1_1 + c * EC * D, EC, D), DOT)
                _x, gp1t, gpp1t = gelu_fwd2(dot(op(_ld(p1 + c * EC * D, EC, D), DOT), tl.trans(k), DOT)
                                            + tl.load(pb1 + c * EC + rc)[:, None])
                pt = dot(w2c, tl.trans(g2), DOT)
                dg1t = -(dot(gw1c, tl.trans(k), DOT) + tl.load(DB1 + (G0 + 1) * E + c * EC + rc)[:, None])
                dpt = op(dg1t * gp1t, DOT)
                tl.store(xs + E * M + c * EC * M + tec, op(dg1t * pt * gpp1t, DOT))
                tl.store(xs + 2 * E * M + c * EC * M + tec, dpt)
                tl.store(xs + 3 * E * M + c * EC * M + tec, op(gp1t, DOT))
                dk = dot_acc(tl.trans(op(-(pt * gp1t), DOT)), gw1c, dk, DOT)  # dK = -G1 dW1'^T
                dg2 = dot_acc(tl.trans(dpt), w2c, dg2, DOT)
                x2t = tl.load(xs + c * EC * M + tec)
                dg2 = dot_acc(tl.trans(-x2t), op(_ld(gw2_1 + c * EC * D, EC, D), DOT), dg2, DOT)
            # (c) the LN-L2 gradient (its forward pieces recomputed: [M, D] tiles are replicated over the two
            # warpgroups, so keeping them through (b) cost more registers than the arithmetic)
            lg, xh, rstd, y, gh, a, cc = ln_l2_fwd(z2, target, nw, nb, D, EPS)
            deta = tl.sum(dg2 * lg, 1)
            dz2, dy, dnw_rows = ln_l2_bwd(eta[:, None] * dg2, xh, rstd, y, gh, a, cc, nw, D)
            dnw += tl.sum(dnw_rows, 0)
            dnb += tl.sum(dy, 0)
            dz2 = op(dz2, DOT)
            tl.store(DB2 + G0 * D + rd, gb2 + tl.sum(dz2.to(tl.float32), 0))
            tl.debug_barrier()  # the scratch tiles written in (b) are read in other threads
            # (d) through X2 into Z1 and K; the state gradient before the step
            for c in tl.static_range(NC):
                w2c = op(_ld(p2 + c * EC * D, EC, D), DOT)
                gw2c = _ld(gw2_1 + c * EC * D, EC, D)
                dx2t = dot(w2c, tl.trans(dz2), DOT) - dot(op(gw2c, DOT), tl.trans(g2), DOT)
                dz1t = op(tl.load(xs + E * M + c * EC * M + tec).to(tl.float32)
                          + dx2t * tl.load(xs + 3 * E * M + c * EC * M + tec).to(tl.float32), DOT)
                dk = dot_acc(tl.trans(dz1t), op(_ld(p1 + c * EC * D, EC, D), DOT), dk, DOT)
                _st(gw1_0 + c * EC * D, dot_acc(dz1t, k, _ld(gw1_1 + c * EC * D, EC, D), DOT), EC, D)
                tl.store(DB1 + G0 * E + c * EC + rc,
                         tl.load(DB1 + (G0 + 1) * E + c * EC + rc) + tl.sum(dz1t.to(tl.float32), 1))
                gw2c = dot_acc(tl.load(xs + 2 * E * M + c * EC * M + tec), g2, gw2c, DOT)
                gw2c = dot_acc(tl.load(xs + c * EC * M + tec), dz2, gw2c, DOT)
                _st(gw2_0 + c * EC * D, gw2c, EC, D)
            tl.store(DK + off, (dk + dy).to(DK.dtype.element_ty))  # + dy: the target is V - K
            tl.store(DV + off, (-dy).to(DV.dtype.element_ty))
            tl.store(DETA + pid * L + i * M + rm, deta.to(DETA.dtype.element_ty))
            tl.debug_barrier()  # the next step reads slot 0 and the scratch in other threads
    tl.store(DNW + pid * D + rd, dnw)
    tl.store(DNB + pid * D + rd, dnb)


def _group(n_minibatches: int, checkpoint_group_size: int) -> int:
    return n_minibatches if checkpoint_group_size <= 0 else min(checkpoint_group_size, n_minibatches)


def _state_buffers(slots: int, D: int, E: int, device) -> tuple[torch.Tensor, ...]:
    """fp32 state slots: W1^T [E, D], b1 [E], W2 [E, D], b2 [D]."""
    return tuple(torch.empty(slots, *s, device=device, dtype=torch.float32) for s in ((E, D), (E,), (E, D), (D,)))


def mlp_forward(q, k, v, eta, norm_w, norm_b, w1, b1, w2, b2, mini_batch_size, checkpoint_group_size, save,
                output=True, **tune):
    """Run the forward kernel. Returns (out, checkpoints) with checkpoints None unless `save`.
    `tune` overrides the launch shape for measurements: num_warps, NC (hidden-dim chunks)."""
    check_device(q, k, v, eta, norm_w, norm_b, w1, b1, w2, b2)
    B, H, L, D = q.shape
    E = w1.shape[-1]
    n = L // mini_batch_size
    group = _group(n, checkpoint_group_size)
    out = new_output(q)
    ck = _state_buffers(B * H * ((n + group - 1) // group + 1), D, E, q.device) if save else (out,) * 4
    work = _state_buffers(B * H * 2, D, E, q.device)
    LAUNCHED["fwd"] = _mlp_fwd_kernel[(B * H,)](
        q, k, v, eta, norm_w, norm_b, w1, b1, w2, b2, out, *ck, *work,
        H, L, n, group,
        D=D, E=E, M=mini_batch_size, NC=tune.get("NC", _chunks(E)), DOT=dot_mode(q.dtype), EPS=LN_EPS,
        SAVE=save, OUTPUT=output, num_warps=tune.get("num_warps", WARPS), num_stages=1,
    )
    return out, (ck if save else None)


def mlp_backward(dout, q, k, v, eta, norm_w, norm_b, ck, mini_batch_size, checkpoint_group_size, **tune):
    """Run the backward kernel. Returns per-input gradients (slow-weight and norm gradients summed over batch)."""
    B, H, L, D = q.shape
    E = ck[1].shape[-1]
    M = mini_batch_size
    n = L // M
    group = _group(n, checkpoint_group_size)
    DOT = dot_mode(q.dtype)
    dq, dk, dv, deta = new_output(q), new_output(k), new_output(v), new_output(eta)
    dnw, dnb = new_output(q, (B * H, D), torch.float32), new_output(q, (B * H, D), torch.float32)
    grads = _state_buffers(B * H * 2, D, E, q.device)
    scratch = _state_buffers(B * H * (group + 1), D, E, q.device)
    xs = torch.empty(B * H, 4, E, M, device=q.device, dtype=torch.bfloat16 if DOT == DOT_BF16 else torch.float32)
    LAUNCHED["bwd"] = _mlp_bwd_kernel[(B * H,)](
        q, k, v, eta, norm_w, norm_b, *ck, dout.contiguous(),
        dq, dk, dv, deta, dnw, dnb, *grads, *scratch, xs,
        H, L, n, group,
        D=D, E=E, M=M, NC=tune.get("NC", _chunks(E)), DOT=DOT, EPS=LN_EPS,
        num_warps=tune.get("num_warps", WARPS), num_stages=1,
    )
    per_head = lambda t: t.view(B, H, *t.shape[1:]).sum(0)  # noqa: E731 - slow weights are shared over batch
    dw1t, db1, dw2, db2 = (per_head(t.view(B * H, 2, *t.shape[1:])[:, 0]) for t in grads)  # slot 0
    return dq, dk, dv, deta, per_head(dnw), per_head(dnb), dw1t.transpose(1, 2), db1, dw2, db2


def _chunks(E: int) -> int:
    """Hidden-dim chunks: two, so E / 2 = 128 rows at E = 256 (one 16-row MMA tile per warp at 8 warps). Measured
    against 1 chunk at 16 warps and 4 at 4 warps (benchmarks/NOTES-ttt-kernel.md)."""
    return 2 if E >= 32 else 1


class TTTMLPFunction(torch.autograd.Function):
    """Autograd wrapper: forward keeps only the group checkpoints; backward recomputes each group."""

    @staticmethod
    def forward(ctx, q, k, v, eta, norm_w, norm_b, w1, b1, w2, b2, mini_batch_size, checkpoint_group_size):
        q, k, v, eta = (t.contiguous() for t in (q, k, v, eta))
        params = tuple(t.contiguous() for t in (norm_w, norm_b, w1, b1, w2, b2))
        save = any(ctx.needs_input_grad[:10])  # grad mode is off inside forward; this says if backward will run
        out, ck = mlp_forward(q, k, v, eta, *params, mini_batch_size, checkpoint_group_size, save)
        if save:
            ctx.save_for_backward(q, k, v, eta, params[0], params[1], *ck)
            ctx.dtypes = tuple(t.dtype for t in (norm_w, norm_b, w1, b1, w2, b2))
            ctx.sizes = (mini_batch_size, checkpoint_group_size)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, eta, norm_w, norm_b, *ck = ctx.saved_tensors
        grads = mlp_backward(dout, q, k, v, eta, norm_w, norm_b, ck, *ctx.sizes)
        dq, dk, dv, deta, *rest = grads
        rest = [g.to(dt) for g, dt in zip(rest, ctx.dtypes)]
        return (dq, dk, dv, deta, *rest, None, None)
