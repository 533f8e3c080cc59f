"""Fused Triton TTT-MLP scan, forward and backward (math: `tttvideo.ttt.reference._mlp_minibatch`).

One program per (batch, head) stream walks the serial chain of mini-batches with the fp32 inner state
W1 [D, E], b1 [E], W2 [E, D], b2 [D] held on-chip for the whole scan.

Forward: per mini-batch, the inner gradient at the old state, the update, and the output at the new state; the
state is written every `group` mini-batches (and once more at the end) when a backward will follow.

Backward: groups in reverse. For each group the program reloads its checkpoint, recomputes the group's states
into a per-stream scratch (group + 1 states), then walks the group's mini-batches in reverse, carrying the
gradient w.r.t. the state (fp32, on-chip) and writing d q, d k, d v, d eta per token. The step's backward is
derived by hand (it is checked against autograd of the reference in tests/test_ttt_triton.py):

    output path   O = Q + LN(gelu(Q W1' + b1') W2' + b2')            -> dQ, and adds to dW1', db1', dW2', db2'
    update path   W1' = W1 - K^T G1, b1' = b1 - sum G1, W2' = W2 - X2^T G2, b2' = b2 - sum G2
                  dG1 = -(K dW1' + db1'), dK = -G1 dW1'^T, dG2 = -(X2 dW2' + db2'), dX2 = -G2 dW2'^T
    inner grad    G1 = P * gelu'(Z1), P = G2 W2^T, G2 = eta * lnl2(Z2, V - K), Z2 = X2 W2 + b2, X2 = gelu(Z1),
                  Z1 = K W1 + b1        -> backpropagated term by term (gelu'' and the LN-L2 second derivative)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tttvideo.ttt.triton_common import (
    LN_EPS, check_device, dot, dot_acc, dot_mode, op, gelu_fwd, gelu_fwd2, ln_bwd, ln_l2_bwd, ln_l2_fwd, ln_stats, new_output,
)

# Launch shape for one stream's program (measured on H100: benchmarks/NOTES-ttt-kernel.md).
FWD_WARPS = 16
BWD_WARPS = 16

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
def _inner_grad(w1t, b1, w2, b2, k, v, eta, nw, nb, ON, D: tl.constexpr, DOT: tl.constexpr, EPS: tl.constexpr):
    """Gradient of the inner loss at state (W1^T, b1, W2, b2) for one mini-batch, in the transposed layout:
    returns X2^T [E, M], G1^T [E, M] and G2 [M, D] in the matrix operand dtype (`op`).
    The [M, D] product Z2 gets a region of its own (ON, see triton_common.dot): chained to the others it would be
    replicated over the four warpgroups, and so would the LayerNorm arithmetic on it."""
    z1t = dot(w1t, tl.trans(k), DOT) + b1[:, None]
    x2t, gp1t = gelu_fwd(z1t)
    x2t = op(x2t, DOT)
    z2 = dot(tl.trans(x2t), w2, DOT, ON) + b2[None, :]
    lg, xh, rstd, y, gh, a, c = ln_l2_fwd(z2, v.to(tl.float32) - k.to(tl.float32), nw, nb, D, EPS)
    g2 = op(eta[:, None] * lg, DOT)
    g1t = op(dot(w2, tl.trans(g2), DOT) * gp1t, DOT)
    return x2t, g1t, g2


@triton.jit
def _mlp_fwd_kernel(
    Q, K, V, ETA, NW, NB, W1, B1, W2, B2, OUT, CW1, CB1, CW2, CB2, SW1, SB1, SW2, SB2,
    H, L, NMB, GROUP,
    D: tl.constexpr, E: tl.constexpr, M: tl.constexpr, DOT: tl.constexpr, EPS: tl.constexpr,
    SAVE: tl.constexpr, OUTPUT: tl.constexpr,
):
    """One program per (batch, head) stream; the state lives in that stream's fp32 working slot SW*."""
    pid = tl.program_id(0).to(tl.int64)
    h = pid % H
    rm = tl.arange(0, M)
    rd = tl.arange(0, D)
    re = tl.arange(0, E)
    nw = tl.load(NW + h * D + rd).to(tl.float32)[None, :]
    nb = tl.load(NB + h * D + rd).to(tl.float32)[None, :]
    tok = pid * L * D
    ck = pid * ((NMB + GROUP - 1) // GROUP + 1)  # this stream's first checkpoint slot
    # two working slots per stream: mini-batch i reads slot i % 2 and writes the other, so no thread can overwrite
    # state another thread has yet to read
    ws = pid * 2

    # initial state; W1 [D, E] is read transposed
    w1t = tl.load(W1 + h * (D * E) + rd[None, :] * E + re[:, None]).to(tl.float32)
    b1 = tl.load(B1 + h * E + re).to(tl.float32)
    w2 = tl.load(W2 + h * (E * D) + re[:, None] * D + rd[None, :]).to(tl.float32)
    b2 = tl.load(B2 + h * D + rd).to(tl.float32)
    _st_state(SW1 + ws * (E * D), SB1 + ws * E, SW2 + ws * (E * D), SB2 + ws * D, w1t, b1, w2, b2, D, E)
    if SAVE:
        _st_state(CW1 + ck * (E * D), CB1 + ck * E, CW2 + ck * (E * D), CB2 + ck * D, w1t, b1, w2, b2, D, E)
    tl.debug_barrier()

    tile = rm[:, None] * D + rd[None, :]
    for i in range(NMB):
        off = tok + i * (M * D) + tile
        k = tl.load(K + off)
        v = tl.load(V + off)
        q = tl.load(Q + off)
        eta = tl.load(ETA + pid * L + i * M + rm).to(tl.float32)
        r = ws + i % 2
        w = ws + (i + 1) % 2
        x2t, g1t, g2 = _inner_grad(_ld(SW1 + r * (E * D), E, D), tl.load(SB1 + r * E + re),
                                   _ld(SW2 + r * (E * D), E, D), tl.load(SB2 + r * D + rd),
                                   k, v, eta, nw, nb, NMB > 0, D, DOT, EPS)
        save_now = SAVE & (((i + 1) % GROUP == 0) | (i + 1 == NMB))
        slot = ck + (i + GROUP) // GROUP  # the checkpoint after mini-batch i
        # W1 update and the first half of the output; the state is re-read for the update (an L1 hit) rather
        # than kept live through the gradient
        w1t = dot_acc(-g1t, k, _ld(SW1 + r * (E * D), E, D), DOT)
        b1 = tl.load(SB1 + r * E + re) - tl.sum(g1t.to(tl.float32), 1)
        _st(SW1 + w * (E * D), w1t, E, D)
        tl.store(SB1 + w * E + re, b1)
        if save_now:
            _st(CW1 + slot * (E * D), w1t, E, D)
            tl.store(CB1 + slot * E + re, b1)
        if OUTPUT:
            xq2t, _gq = gelu_fwd(dot(w1t, tl.trans(q), DOT) + b1[:, None])
            xq2t = op(xq2t, DOT)
        # W2 update and the second half
        w2 = dot_acc(-x2t, g2, _ld(SW2 + r * (E * D), E, D), DOT)
        b2 = tl.load(SB2 + r * D + rd) - tl.sum(g2.to(tl.float32), 0)
        _st(SW2 + w * (E * D), w2, E, D)
        tl.store(SB2 + w * D + rd, b2)
        if save_now:
            _st(CW2 + slot * (E * D), w2, E, D)
            tl.store(CB2 + slot * D + rd, b2)
        if OUTPUT:
            zq2 = dot(tl.trans(xq2t), w2, DOT) + b2[None, :]
            xq, _r = ln_stats(zq2, D, EPS)
            tl.store(OUT + off, (q.to(tl.float32) + nw * xq + nb).to(OUT.dtype.element_ty))
        tl.debug_barrier()  # the next mini-batch reads the state this one wrote, in other threads


@triton.jit
def _mlp_bwd_kernel(
    Q, K, V, ETA, NW, NB, CW1, CB1, CW2, CB2, DO,
    DQ, DK, DV, DETA, DNW, DNB, DW1, DB1, DW2, DB2,
    SW1, SB1, SW2, SB2,
    H, L, NMB, GROUP,
    D: tl.constexpr, E: tl.constexpr, M: tl.constexpr, DOT: tl.constexpr, EPS: tl.constexpr,
):
    """Gradients. DW1 (as W1^T [E, D]), DB1, DW2, DB2 hold two slots per stream for the gradient w.r.t. the state
    after the current mini-batch: slot 0 between steps (and at the end: the output), slot 1 in the middle of a step
    (after the output path). Each phase reads one slot and writes the other, so only read-after-write needs a
    barrier. Operands are re-read from the (L1-resident) state slots at each use rather than kept in registers."""
    ON = NMB > 0  # run-time true: [M, D] products get regions of their own, see triton_common.dot
    pid = tl.program_id(0).to(tl.int64)
    h = pid % H
    rm = tl.arange(0, M)
    rd = tl.arange(0, D)
    re = tl.arange(0, E)
    tile = rm[:, None] * D + rd[None, :]
    nw = tl.load(NW + h * D + rd).to(tl.float32)[None, :]
    nb = tl.load(NB + h * D + rd).to(tl.float32)[None, :]
    tok = pid * L * D
    ng = (NMB + GROUP - 1) // GROUP
    ck = pid * (ng + 1)
    sc = pid * (GROUP + 1)  # this stream's scratch slots
    g0 = pid * 2  # gradient slot 0; slot 1 is g0 + 1

    # gradient w.r.t. the final state: zero
    _st_state(DW1 + g0 * (E * D), DB1 + g0 * E, DW2 + g0 * (E * D), DB2 + g0 * D, tl.zeros([E, D], tl.float32),
              tl.zeros([E], tl.float32), tl.zeros([E, D], tl.float32), tl.zeros([D], tl.float32), D, E)
    dnw = tl.zeros([D], tl.float32)
    dnb = tl.zeros([D], tl.float32)
    for gg in range(ng):
        g = ng - 1 - gg
        start = g * GROUP
        cnt = tl.minimum(GROUP, NMB - start)
        # 1. recompute the group's states from its checkpoint into the scratch
        _st_state(SW1 + sc * (E * D), SB1 + sc * E, SW2 + sc * (E * D), SB2 + sc * D,
                  _ld(CW1 + (ck + g) * (E * D), E, D), tl.load(CB1 + (ck + g) * E + re),
                  _ld(CW2 + (ck + g) * (E * D), E, D), tl.load(CB2 + (ck + g) * D + rd), D, E)
        tl.debug_barrier()
        for j in range(cnt):
            s0 = sc + j
            off = tok + (start + j) * (M * D) + tile
            k = tl.load(K + off)
            eta = tl.load(ETA + pid * L + (start + j) * M + rm).to(tl.float32)
            x2t, g1t, g2 = _inner_grad(_ld(SW1 + s0 * (E * D), E, D), tl.load(SB1 + s0 * E + re),
                                       _ld(SW2 + s0 * (E * D), E, D), tl.load(SB2 + s0 * D + rd),
                                       k, tl.load(V + off), eta, nw, nb, ON, D, DOT, EPS)
            s1 = s0 + 1
            _st(SW1 + s1 * (E * D), dot_acc(-g1t, k, _ld(SW1 + s0 * (E * D), E, D), DOT), E, D)
            tl.store(SB1 + s1 * E + re, tl.load(SB1 + s0 * E + re) - tl.sum(g1t.to(tl.float32), 1))
            _st(SW2 + s1 * (E * D), dot_acc(-x2t, g2, _ld(SW2 + s0 * (E * D), E, D), DOT), E, D)
            tl.store(SB2 + s1 * D + rd, tl.load(SB2 + s0 * D + rd) - tl.sum(g2.to(tl.float32), 0))
            tl.debug_barrier()  # the next step reads this slot in other threads

        # 2. reverse through the group
        for jj in range(cnt):
            j = cnt - 1 - jj
            i = start + j
            w1p, b1p, w2p, b2p = SW1 + (sc + j) * (E * D), SB1 + (sc + j) * E, SW2 + (sc + j) * (E * D), SB2 + (sc + j) * D
            w1n, b1n = SW1 + (sc + j + 1) * (E * D), SB1 + (sc + j + 1) * E
            w2n, b2n = SW2 + (sc + j + 1) * (E * D), SB2 + (sc + j + 1) * D
            off = tok + i * (M * D) + tile
            k = tl.load(K + off)
            q = tl.load(Q + off)
            do = tl.load(DO + off).to(tl.float32)

            # output path, O = Q + LN(gelu(W1'^T Q^T + b1')^T W2' + b2'): slot 0 -> slot 1
            zq1t = dot(op(_ld(w1n, E, D), DOT), tl.trans(q), DOT) + tl.load(b1n + re)[:, None]
            xq2t, gpqt = gelu_fwd(zq1t)
            xq2t = op(xq2t, DOT)
            zq2 = dot(tl.trans(xq2t), op(_ld(w2n, E, D), DOT), DOT, ON) + tl.load(b2n + rd)[None, :]
            xq, rq = ln_stats(zq2, D, EPS)
            dnw += tl.sum(do * xq, 0)
            dnb += tl.sum(do, 0)
            dzq2 = ln_bwd(do * nw, xq, rq, D)
            _st(DW2 + (g0 + 1) * (E * D), dot_acc(xq2t, op(dzq2, DOT), _ld(DW2 + g0 * (E * D), E, D), DOT), E, D)
            tl.store(DB2 + (g0 + 1) * D + rd, tl.load(DB2 + g0 * D + rd) + tl.sum(dzq2, 0))
            dzq1t = op(dot(op(_ld(w2n, E, D), DOT), tl.trans(dzq2), DOT) * gpqt, DOT)
            _st(DW1 + (g0 + 1) * (E * D), dot_acc(dzq1t, q, _ld(DW1 + g0 * (E * D), E, D), DOT), E, D)
            tl.store(DB1 + (g0 + 1) * E + re, tl.load(DB1 + g0 * E + re) + tl.sum(dzq1t.to(tl.float32), 1))
            dq = do + dot(tl.trans(dzq1t), op(_ld(w1n, E, D), DOT), DOT, ON)
            tl.store(DQ + off, dq.to(DQ.dtype.element_ty))
            tl.debug_barrier()  # slot 1 is read below in other threads

            # update path: slot 1 (the gradient w.r.t. the state after this step) -> slot 0
            v = tl.load(V + off)
            eta = tl.load(ETA + pid * L + i * M + rm).to(tl.float32)
            gw1 = DW1 + (g0 + 1) * (E * D)
            gw2 = DW2 + (g0 + 1) * (E * D)
            gb1 = tl.load(DB1 + (g0 + 1) * E + re)
            gb2 = tl.load(DB2 + (g0 + 1) * D + rd)
            # recompute the inner gradient at the old state
            z1t = dot(op(_ld(w1p, E, D), DOT), tl.trans(k), DOT) + tl.load(b1p + re)[:, None]
            x2t, gp1t, gpp1t = gelu_fwd2(z1t)
            x2t = op(x2t, DOT)
            z2 = dot(tl.trans(x2t), op(_ld(w2p, E, D), DOT), DOT, ON) + tl.load(b2p + rd)[None, :]
            target = v.to(tl.float32) - k.to(tl.float32)
            lg, xh, rstd, y, gh, a, c = ln_l2_fwd(z2, target, nw, nb, D, EPS)
            g2 = op(eta[:, None] * lg, DOT)
            pt = dot(op(_ld(w2p, E, D), DOT), tl.trans(g2), DOT)
            g1t = op(pt * gp1t, DOT)
            # through G1 = P * gelu'(Z1)
            dg1t = -(dot(op(_ld(gw1, E, D), DOT), tl.trans(k), DOT) + gb1[:, None])
            dz1t_a = dg1t * pt * gpp1t
            dpt = op(dg1t * gp1t, DOT)
            dk = -dot(tl.trans(g1t), op(_ld(gw1, E, D), DOT), DOT, ON)
            # through G2 (the W2 update and P = G2 W2^T), then the LN-L2 gradient
            dg2 = dot(tl.trans(dpt), op(_ld(w2p, E, D), DOT), DOT, ON) - gb2[None, :]
            dg2 -= dot(tl.trans(x2t), op(_ld(gw2, E, D), DOT), DOT, ON)
            deta = tl.sum(dg2 * lg, 1)
            lg, xh, rstd, y, gh, a, c = ln_l2_fwd(z2, target, nw, nb, D, EPS)
            dz2, dy, dnw_rows = ln_l2_bwd(eta[:, None] * dg2, xh, rstd, y, gh, a, c, nw, D)
            dnw += tl.sum(dnw_rows, 0)
            dnb += tl.sum(dy, 0)
            dz2 = op(dz2, DOT)
            # through X2 (the W2 update and Z2) into Z1, then K
            dx2t = dot(op(_ld(w2p, E, D), DOT), tl.trans(dz2), DOT) - dot(op(_ld(gw2, E, D), DOT), tl.trans(g2), DOT)
            dz1t = op(dz1t_a + dx2t * gp1t, DOT)
            dk += dot(tl.trans(dz1t), op(_ld(w1p, E, D), DOT), DOT, ON) + dy  # + dy: target = V - K
            tl.store(DK + off, dk.to(DK.dtype.element_ty))
            tl.store(DV + off, (-dy).to(DV.dtype.element_ty))
            tl.store(DETA + pid * L + i * M + rm, deta.to(DETA.dtype.element_ty))
            _st(DW1 + g0 * (E * D), dot_acc(dz1t, k, _ld(gw1, E, D), DOT), E, D)
            tl.store(DB1 + g0 * E + re, gb1 + tl.sum(dz1t.to(tl.float32), 1))
            _st(DW2 + g0 * (E * D), dot_acc(x2t, dz2, dot_acc(dpt, g2, _ld(gw2, E, D), DOT), DOT), E, D)
            tl.store(DB2 + g0 * D + rd, gb2 + tl.sum(dz2.to(tl.float32), 0))
            tl.debug_barrier()  # the next step reads slot 0 in other threads
    tl.store(DNW + pid * D + rd, dnw)
    tl.store(DNB + pid * D + rd, dnb)


def _group(n_minibatches: int, checkpoint_group_size: int) -> int:
    return n_minibatches if checkpoint_group_size <= 0 else min(checkpoint_group_size, n_minibatches)


def _state_buffers(slots: int, D: int, E: int, device) -> tuple[torch.Tensor, ...]:
    """fp32 state slots: W1^T [E, D], b1 [E], W2 [E, D], b2 [D]."""
    return tuple(torch.empty(slots, *s, device=device, dtype=torch.float32) for s in ((E, D), (E,), (E, D), (D,)))


def mlp_forward(q, k, v, eta, norm_w, norm_b, w1, b1, w2, b2, mini_batch_size, checkpoint_group_size, save,
                output=True, **tune):
    """Run the forward kernel. Returns (out, checkpoints) with checkpoints None unless `save`."""
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
        D=D, E=E, M=mini_batch_size, DOT=dot_mode(q.dtype), EPS=LN_EPS, SAVE=save, OUTPUT=output,
        num_warps=tune.get("num_warps", FWD_WARPS), num_stages=1,
    )
    return out, (ck if save else None)


def mlp_backward(dout, q, k, v, eta, norm_w, norm_b, ck, mini_batch_size, checkpoint_group_size, **tune):
    """Run the backward kernel. Returns per-input gradients (slow-weight and norm gradients summed over batch)."""
    B, H, L, D = q.shape
    E = ck[1].shape[-1]
    n = L // mini_batch_size
    group = _group(n, checkpoint_group_size)
    dq, dk, dv, deta = new_output(q), new_output(k), new_output(v), new_output(eta)
    dnw, dnb = new_output(q, (B * H, D), torch.float32), new_output(q, (B * H, D), torch.float32)
    grads = _state_buffers(B * H * 2, D, E, q.device)
    scratch = _state_buffers(B * H * (group + 1), D, E, q.device)
    LAUNCHED["bwd"] = _mlp_bwd_kernel[(B * H,)](
        q, k, v, eta, norm_w, norm_b, *ck, dout.contiguous(),
        dq, dk, dv, deta, dnw, dnb, *grads, *scratch,
        H, L, n, group,
        D=D, E=E, M=mini_batch_size, DOT=dot_mode(q.dtype), EPS=LN_EPS,
        num_warps=tune.get("num_warps", BWD_WARPS), num_stages=1,
    )
    per_head = lambda t: t.view(B, H, *t.shape[1:]).sum(0)  # noqa: E731 - slow weights are shared over batch
    dw1t, db1, dw2, db2 = (per_head(t.view(B * H, 2, *t.shape[1:])[:, 0]) for t in grads)  # slot 0
    return dq, dk, dv, deta, per_head(dnw), per_head(dnb), dw1t.transpose(1, 2), db1, dw2, db2


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
