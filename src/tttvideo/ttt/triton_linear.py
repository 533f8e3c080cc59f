"""Fused Triton TTT-Linear scan, forward and backward (math: `tttvideo.ttt.reference._linear_minibatch`).

One program per (batch, head) stream; the fp32 state W [D, D], b [D] stays in registers for the whole scan (at
D = 64 it fits at 4 warps without spilling, unlike TTT-MLP's). Group checkpoints as in `triton_mlp`; the backward
recomputes each group into a scratch and walks it in reverse with the state gradient in registers. The step and
its backward:

    G = eta * lnl2(K W + b, V - K);  W' = W - K^T G;  b' = b - sum G;  O = Q + LN(Q W' + b')
    output path   dZq = LN'(dO)  ->  dW' += Q^T dZq, db' += sum dZq, dQ = dO + dZq W'^T
    update path   dG = -(K dW' + db'), dK = -G dW'^T, then the LN-L2 backward gives dZ, d target;
                  dW = dW' + K^T dZ, db = db' + sum dZ, dK += dZ W^T - d target, dV = d target
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tttvideo.ttt.reference import scan_groups
from tttvideo.ttt.triton_carveout import fit_carveout
from tttvideo.ttt.triton_common import (
    DOT_TF32, LN_EPS, check_device, dot, dot_acc, dot_mode, interpreting, ln_bwd, ln_l2_bwd,
    ln_l2_fwd, ln_stats, new_output, output_for,
)

FWD_WARPS = 4
BWD_WARPS = 4
# tf32 products for bf16/fp16 inputs: with bf16 operands one draw at full size (1,128 mini-batches) reached 1.96e-2
# relative error on d k and d W (bound 2e-2); tf32 measured 2.5e-3 on another draw, for ~11% more time
DOT = DOT_TF32

# the last compiled kernel of each launcher (its n_regs / n_spills are read by the benchmark)
LAUNCHED: dict = {}


@triton.jit
def _store_state(CW, CB, idx, w, b, rd, D: tl.constexpr):
    tl.store(CW + idx * (D * D) + rd[:, None] * D + rd[None, :], w)
    tl.store(CB + idx * D + rd, b)


@triton.jit
def _linear_fwd_kernel(
    Q, K, V, ETA, NW, NB, W, BIAS, OUT, CW, CB,
    H, L, NMB, GROUP,
    D: tl.constexpr, M: tl.constexpr, DOT: tl.constexpr, EPS: tl.constexpr, SAVE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    h = pid % H
    rm = tl.arange(0, M)
    rd = tl.arange(0, D)
    w = tl.load(W + h * (D * D) + rd[:, None] * D + rd[None, :]).to(tl.float32)
    b = tl.load(BIAS + h * D + rd).to(tl.float32)
    nw = tl.load(NW + h * D + rd).to(tl.float32)[None, :]
    nb = tl.load(NB + h * D + rd).to(tl.float32)[None, :]
    tok = pid * L * D
    ck = pid * ((NMB + GROUP - 1) // GROUP + 1)
    tile = rm[:, None] * D + rd[None, :]
    k = tl.load(K + tok + tile).to(tl.float32)
    v = tl.load(V + tok + tile).to(tl.float32)
    q = tl.load(Q + tok + tile).to(tl.float32)
    eta = tl.load(ETA + pid * L + rm).to(tl.float32)
    for i in range(NMB):
        if SAVE:
            if i % GROUP == 0:
                _store_state(CW, CB, ck + i // GROUP, w, b, rd, D)
        # prefetch the next mini-batch (wraps to 0 at the end: a harmless re-read)
        nxt = tok + ((i + 1) % NMB) * (M * D) + tile
        k_n = tl.load(K + nxt).to(tl.float32)
        v_n = tl.load(V + nxt).to(tl.float32)
        q_n = tl.load(Q + nxt).to(tl.float32)
        eta_n = tl.load(ETA + pid * L + ((i + 1) % NMB) * M + rm).to(tl.float32)

        z = dot(k, w, DOT) + b[None, :]
        lg, xh, rstd, y, gh, a, c = ln_l2_fwd(z, v - k, nw, nb, D, EPS)
        g = eta[:, None] * lg
        w = dot_acc(tl.trans(-k), g, w, DOT)
        b = b - tl.sum(g, 0)
        zq = dot(q, w, DOT) + b[None, :]
        xq, _r = ln_stats(zq, D, EPS)
        tl.store(OUT + tok + i * (M * D) + tile, (q + nw * xq + nb).to(OUT.dtype.element_ty))
        k, v, q, eta = k_n, v_n, q_n, eta_n
    if SAVE:
        _store_state(CW, CB, ck + (NMB + GROUP - 1) // GROUP, w, b, rd, D)


@triton.jit
def _linear_bwd_kernel(
    Q, K, V, ETA, NW, NB, CW, CB, DO,
    DQ, DK, DV, DETA, DNW, DNB, DW, DB, SW, SB,
    H, L, NMB, GROUP,
    D: tl.constexpr, M: tl.constexpr, DOT: tl.constexpr, EPS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    h = pid % H
    rm = tl.arange(0, M)
    rd = tl.arange(0, D)
    tile = rm[:, None] * D + rd[None, :]
    tdd = rd[:, None] * D + rd[None, :]
    nw = tl.load(NW + h * D + rd).to(tl.float32)[None, :]
    nb = tl.load(NB + h * D + rd).to(tl.float32)[None, :]
    tok = pid * L * D
    ng = (NMB + GROUP - 1) // GROUP
    ck = pid * (ng + 1)
    sc = pid * (GROUP + 1)

    dw = tl.zeros([D, D], tl.float32)
    db = tl.zeros([D], tl.float32)
    dnw = tl.zeros([D], tl.float32)
    dnb = tl.zeros([D], tl.float32)
    for gg in range(ng):
        g_idx = ng - 1 - gg
        start = g_idx * GROUP
        cnt = tl.minimum(GROUP, NMB - start)
        w = tl.load(CW + (ck + g_idx) * (D * D) + tdd)
        b = tl.load(CB + (ck + g_idx) * D + rd)
        for j in range(cnt):
            _store_state(SW, SB, sc + j, w, b, rd, D)
            off = tok + (start + j) * (M * D) + tile
            k = tl.load(K + off).to(tl.float32)
            v = tl.load(V + off).to(tl.float32)
            eta = tl.load(ETA + pid * L + (start + j) * M + rm).to(tl.float32)
            z = dot(k, w, DOT) + b[None, :]
            lg, xh, rstd, y, gh, a, c = ln_l2_fwd(z, v - k, nw, nb, D, EPS)
            g = eta[:, None] * lg
            w = dot_acc(tl.trans(-k), g, w, DOT)
            b = b - tl.sum(g, 0)
        _store_state(SW, SB, sc + cnt, w, b, rd, D)
        tl.debug_barrier()  # the scratch is written and read by different threads

        for jj in range(cnt):
            j = cnt - 1 - jj
            i = start + j
            off = tok + i * (M * D) + tile
            k = tl.load(K + off).to(tl.float32)
            v = tl.load(V + off).to(tl.float32)
            q = tl.load(Q + off).to(tl.float32)
            do = tl.load(DO + off).to(tl.float32)
            eta = tl.load(ETA + pid * L + i * M + rm).to(tl.float32)
            w = tl.load(SW + (sc + j) * (D * D) + tdd)
            b = tl.load(SB + (sc + j) * D + rd)
            wn = tl.load(SW + (sc + j + 1) * (D * D) + tdd)
            bn = tl.load(SB + (sc + j + 1) * D + rd)

            z = dot(k, w, DOT) + b[None, :]
            lg, xh, rstd, y, gh, a, c = ln_l2_fwd(z, v - k, nw, nb, D, EPS)
            g = eta[:, None] * lg
            zq = dot(q, wn, DOT) + bn[None, :]
            xq, rq = ln_stats(zq, D, EPS)

            # output path
            dnw += tl.sum(do * xq, 0)
            dnb += tl.sum(do, 0)
            dzq = ln_bwd(do * nw, xq, rq, D)
            dw = dot_acc(tl.trans(q), dzq, dw, DOT)
            db += tl.sum(dzq, 0)
            dq = do + dot(dzq, tl.trans(wn), DOT)

            # update path
            dg = -(dot(k, dw, DOT) + db[None, :])
            dk = -dot(g, tl.trans(dw), DOT)
            deta = tl.sum(dg * lg, 1)
            dz, dy, dnw_rows = ln_l2_bwd(eta[:, None] * dg, xh, rstd, y, gh, a, c, nw, D)
            dnw += tl.sum(dnw_rows, 0)
            dnb += tl.sum(dy, 0)
            dk += dy  # target = V - K
            dk = dot_acc(dz, tl.trans(w), dk, DOT)
            dw = dot_acc(tl.trans(k), dz, dw, DOT)
            db += tl.sum(dz, 0)

            tl.store(DQ + off, dq.to(DQ.dtype.element_ty))
            tl.store(DK + off, dk.to(DK.dtype.element_ty))
            tl.store(DV + off, (-dy).to(DV.dtype.element_ty))
            tl.store(DETA + pid * L + i * M + rm, deta.to(DETA.dtype.element_ty))
        tl.debug_barrier()  # the next group's recompute overwrites this scratch

    tl.store(DW + pid * (D * D) + tdd, dw)
    tl.store(DB + pid * D + rd, db)
    tl.store(DNW + pid * D + rd, dnw)
    tl.store(DNB + pid * D + rd, dnb)


def _dot(q: torch.Tensor) -> int:
    """Product precision: tf32 for half-precision inputs (see DOT), full fp32 for fp32 inputs and the interpreter."""
    return DOT if q.dtype != torch.float32 and not interpreting() else dot_mode(q.dtype)


def linear_forward(q, k, v, eta, norm_w, norm_b, w, b, mini_batch_size, checkpoint_group_size, save, out=None,
                   **tune):
    """Run the forward kernel. Returns (out, checkpoints) with checkpoints None unless `save`. `out`: a contiguous
    tensor of q's shape and dtype to write the output into (None: a new one)."""
    check_device(q, k, v, eta, norm_w, norm_b, w, b)
    B, H, L, D = q.shape
    n = L // mini_batch_size
    group = scan_groups(n, checkpoint_group_size)[0]
    out = output_for(q, out)
    if save:
        slots = B * H * ((n + group - 1) // group + 1)
        ck = (torch.empty(slots, D, D, device=q.device, dtype=torch.float32),
              torch.empty(slots, D, device=q.device, dtype=torch.float32))
    else:
        ck = (out, out)  # never written: SAVE is off
    LAUNCHED["fwd"] = _linear_fwd_kernel[(B * H,)](
        q, k, v, eta, norm_w, norm_b, w, b, out, *ck,
        H, L, n, group,
        D=D, M=mini_batch_size, DOT=tune.get("DOT", _dot(q)), EPS=LN_EPS, SAVE=save,
        num_warps=tune.get("num_warps", FWD_WARPS), num_stages=1,
    )
    return out, (ck if save else None)


def linear_backward(dout, q, k, v, eta, norm_w, norm_b, ck, mini_batch_size, checkpoint_group_size, **tune):
    """Run the backward kernel. Returns per-input gradients (slow-weight and norm gradients summed over batch)."""
    B, H, L, D = q.shape
    n = L // mini_batch_size
    group = scan_groups(n, checkpoint_group_size)[0]
    dev, f32 = q.device, torch.float32
    dq, dk, dv, deta = new_output(q), new_output(k), new_output(v), new_output(eta)
    dnw, dnb, db = (new_output(q, (B * H, D), f32) for _ in range(3))
    dw = new_output(q, (B * H, D, D), f32)
    sw = torch.empty(B * H * (group + 1), D, D, device=dev, dtype=f32)
    sb = torch.empty(B * H * (group + 1), D, device=dev, dtype=f32)
    LAUNCHED["bwd"] = _linear_bwd_kernel[(B * H,)](
        q, k, v, eta, norm_w, norm_b, *ck, dout.contiguous(),
        dq, dk, dv, deta, dnw, dnb, dw, db, sw, sb,
        H, L, n, group,
        D=D, M=mini_batch_size, DOT=tune.get("DOT", _dot(q)), EPS=LN_EPS,
        num_warps=tune.get("num_warps", BWD_WARPS), num_stages=1,
    )
    fit_carveout(LAUNCHED["bwd"])
    per_head = lambda t: t.view(B, H, *t.shape[1:]).sum(0)  # noqa: E731 - slow weights are shared over batch
    return dq, dk, dv, deta, per_head(dnw), per_head(dnb), per_head(dw), per_head(db)


class TTTLinearFunction(torch.autograd.Function):
    """Autograd wrapper: forward keeps only the group checkpoints; backward recomputes each group."""

    @staticmethod
    def forward(ctx, q, k, v, eta, norm_w, norm_b, w, b, mini_batch_size, checkpoint_group_size):
        q, k, v, eta = (t.contiguous() for t in (q, k, v, eta))
        params = tuple(t.contiguous() for t in (norm_w, norm_b, w, b))
        save = any(ctx.needs_input_grad[:8])  # grad mode is off inside forward; this says if backward will run
        out, ck = linear_forward(q, k, v, eta, *params, mini_batch_size, checkpoint_group_size, save)
        if save:
            ctx.save_for_backward(q, k, v, eta, params[0], params[1], *ck)
            ctx.dtypes = tuple(t.dtype for t in (norm_w, norm_b, w, b))
            ctx.sizes = (mini_batch_size, checkpoint_group_size)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, eta, norm_w, norm_b, *ck = ctx.saved_tensors
        dq, dk, dv, deta, *rest = linear_backward(dout, q, k, v, eta, norm_w, norm_b, ck, *ctx.sizes)
        rest = [g.to(dt) for g, dt in zip(rest, ctx.dtypes)]
        return (dq, dk, dv, deta, *rest, None, None)
