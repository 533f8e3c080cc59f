"""Fused Triton TTT-MLP scan: the forward kernel, the host side of forward and backward, and the autograd Function.

Math: `tttvideo.ttt.reference._mlp_minibatch`. Layout: the state is kept transposed, W1^T and W2 as [E, D] fp32,
and the hidden activations as [E, M], so every product over the hidden dim has hidden rows.

Each (batch, head) stream is split over SPLIT cooperating programs (`triton_exchange`): a program holds E / SPLIT
hidden rows of the fp32 state in registers for the whole scan and exchanges the [M, D] partial sums over the hidden
dim with the other roles once per mini-batch. That spreads the serial chain of one stream over SPLIT SMs, and
half of the state fits in registers, where the whole of it spilled (docs/kernels.md).

Forward, per mini-batch: Z1^T = W1^T K^T + b1, X2 = gelu(Z1), partial Z2 = X2 W2 -> exchange -> the LN-L2
gradient G2 (every role, identical), P^T = W2 G2^T, G1 = P gelu'(Z1), the update of the role's rows. Right after
the next mini-batch's partial Z2, at the same new state, the role computes its partial of the output
gelu(Q W1' + b1') W2', which rides on the same exchange; each role then writes M / SPLIT rows of that output.

The same kernel recomputes a checkpoint group for the backward: then it starts from the group's checkpoint, skips
the output, and saves every state and the activations the backward reads, as operands in bf16
(`triton_mlp_bwd.py`). The backward, per group in reverse: that recompute, the output path of every mini-batch
of the group in parallel, the serial reverse through the updates, then d K of every mini-batch in parallel; the
serial and the parallel kernels run on two CUDA streams, one group apart (`_Lanes`).

Shapes covered: those ops.uncovered_reason accepts (D and M in 16, 32, 64; E a power of two in [16, 256], the layer's
E = 4 D among them), all of them fuzzed on an H100 (tests/gpu/ttt_fuzz.py). Warps: at most triton_common.warp_cap.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tttvideo.ttt.reference import scan_groups
from tttvideo.ttt.triton_common import (
    DOT_BF16, LN_EPS, check_device, dot, dot_acc, dot_mode, gelu_fwd, gelu_fwd2, interpreting,
    ln_l2_fwd, ln_stats, new_output, op, output_for, warp_cap,
)
from tttvideo.ttt.triton_exchange import exchange_buffers, gather, raise_flag, stage, take_ticket, wait_all

# the last compiled kernel of each launcher (its n_regs / n_spills are read by the benchmark)
LAUNCHED: dict = {}


@triton.jit
def _store_rows(SW1, SB1, SW2, SB2, slot, w1t, b1, w2, b2, role, rows, rd, D: tl.constexpr, E: tl.constexpr):
    """Write this role's rows of a state slot (W1^T [E, D], b1 [E], W2 [E, D]); role 0 also writes b2 [D]."""
    tl.store(SW1 + slot * (E * D) + rows[:, None] * D + rd[None, :], w1t.to(SW1.dtype.element_ty))
    tl.store(SB1 + slot * E + rows, b1)
    tl.store(SW2 + slot * (E * D) + rows[:, None] * D + rd[None, :], w2.to(SW2.dtype.element_ty))
    tl.store(SB2 + slot * D + rd, b2, mask=(rd < D) & (role == 0))


@triton.jit
def _activation(z1t, XS, GPS, GPPS, off, SAVE_ACT: tl.constexpr, DOT: tl.constexpr):
    """X2^T = gelu(Z1^T) and gelu'(Z1^T) in the operand dtype. A recompute (SAVE_ACT) also stores them and gelu''
    for the backward, which then needs no GELU of its own."""
    if SAVE_ACT:
        x2t, gpt, gppt = gelu_fwd2(z1t, DOT)
        tl.store(GPPS + off, op(gppt, DOT))
    else:
        x2t, gpt = gelu_fwd(z1t, DOT)
    x2t = op(x2t, DOT)
    gpt = op(gpt, DOT)
    if SAVE_ACT:
        tl.store(XS + off, x2t)
        tl.store(GPS + off, gpt)
    return x2t, gpt


@triton.jit
def _out_partial(q, w1t, b1, w2, b2, role, DOT: tl.constexpr):
    """This role's partial of the pre-LN output gelu(Q W1' + b1') W2' (+ b2' from role 0), at the current state."""
    xq2t, _g = gelu_fwd(dot(op(w1t, DOT), tl.trans(q), DOT) + b1[:, None], DOT)
    zq2p = dot(tl.trans(op(xq2t, DOT)), op(w2, DOT), DOT)
    return tl.where(role == 0, zq2p + b2[None, :], zq2p)


@triton.jit
def _out_rows(tok, ib, role, M: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr):
    """Offsets of the output rows [role * M / SPLIT, ...) of mini-batch ib that this role writes."""
    MS: tl.constexpr = M // SPLIT
    return tok + ib * (M * D) + (role * MS + tl.arange(0, MS))[:, None] * D + tl.arange(0, D)[None, :]


@triton.jit
def _write_out(OUT, Q, XB, stream, seq, role, tok, ib, q, write, nw, nb, M: tl.constexpr, D: tl.constexpr,
               SPLIT: tl.constexpr, EPS: tl.constexpr, LOAD_Q: tl.constexpr):
    """This role's output rows of mini-batch ib (`_out_rows`) from the summed partials (tile 1) of exchange seq and
    their Q rows: `q`, or with LOAD_Q loaded here, after the gather (the launches that branch around the call,
    `BRANCHED_OUT`). Sampling at mini-batch 16 loads `q` before the wait and writes under the mask `write` instead
    of a branch, so no branch parts this tile's loads from the Z2 tile's and both share one round trip to L2."""
    MS: tl.constexpr = M // SPLIT
    xq, _r = ln_stats(gather(XB, stream, seq, 1, role * MS, MS, M, D, SPLIT), D, EPS)
    off = _out_rows(tok, ib, role, M, D, SPLIT)
    if LOAD_Q:  # (the caller branched: no mask)
        tl.store(OUT + off, (tl.load(Q + off).to(tl.float32) + nw * xq + nb).to(OUT.dtype.element_ty))
    else:
        tl.store(OUT + off, (q.to(tl.float32) + nw * xq + nb).to(OUT.dtype.element_ty), mask=(off >= 0) & write)


@triton.jit
def _mlp_fwd_kernel(
    Q, K, V, ETA, NW, NB,
    W1, B1, W2, B2, HW, S_W1, S_B1, S_W2, S_B2, W1_SD, W1_SE,
    OUT, CW1, CB1, CW2, CB2, NSLOT, GROUP, XS, GPS, GPPS, Z2S, G2S, XB, SYNC,
    H, L, I0, NMB,
    D: tl.constexpr, E: tl.constexpr, M: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    EPS: tl.constexpr, SAVE: tl.constexpr, OUTPUT: tl.constexpr, SAVE_ACT: tl.constexpr, PREFETCH: tl.constexpr = 1,
):
    """NMB mini-batches from I0, per (stream, role).

    Initial state: W1 (element (d, e) at W1 + idx S_W1 + d W1_SD + e W1_SE), B1, W2 ([E, D] rows), B2 with
    idx = stream % HW (HW = H: the layer's weights, shared over batch; HW = streams: a checkpoint per stream).
    SAVE: the state goes to slot stream * NSLOT + s after every GROUP mini-batches (s = 0 is the initial state,
    the last mini-batch always closes a slot; W1^T and W2 in the slot buffers' dtype). SAVE_ACT: what the
    backward reads of mini-batch i (triton_mlp_bwd: X2^T, gelu'(Z1)^T, gelu''(Z1)^T, Z2, G2) goes to index
    stream * (NSLOT - 1) + i of XS, GPS, GPPS, Z2S, G2S.

    Exchange s (s = i + 1) carries the partial Z2 of mini-batch i and the partial output of mini-batch i - 1, both
    computed at the state after mini-batch i - 1 (their first products share the converted W1^T), and is waited on
    in step i, which writes that output."""
    stream, role = take_ticket(SYNC, SPLIT)
    EC: tl.constexpr = E // SPLIT
    h = stream % H
    idx = stream % HW
    rm = tl.arange(0, M)
    rd = tl.arange(0, D)
    rows = role * EC + tl.arange(0, EC)
    nw = tl.load(NW + h * D + rd).to(tl.float32)[None, :]
    nb = tl.load(NB + h * D + rd).to(tl.float32)[None, :]
    w1t = tl.load(W1 + idx * S_W1 + rows[:, None] * W1_SE + rd[None, :] * W1_SD).to(tl.float32)
    b1 = tl.load(B1 + idx * S_B1 + rows).to(tl.float32)
    w2 = tl.load(W2 + idx * S_W2 + rows[:, None] * D + rd[None, :]).to(tl.float32)
    b2 = tl.load(B2 + idx * S_B2 + rd).to(tl.float32)
    if SAVE:
        _store_rows(CW1, CB1, CW2, CB2, stream * NSLOT, w1t, b1, w2, b2, role, rows, rd, D, E)
    tok = stream * L * D
    tile = rm[:, None] * D + rd[None, :]
    zrows = rows[:, None] * M + rm[None, :]
    # mini-batch 0's partial Z2 = gelu(K W1 + b1) W2 over this role's hidden rows
    off = tok + I0 * (M * D) + tile
    k = tl.load(K + off)
    z1t = dot(op(w1t, DOT), tl.trans(k), DOT) + b1[:, None]
    x2t, gpt = _activation(z1t, XS, GPS, GPPS, stream * (NSLOT - 1) * (E * M) + zrows, SAVE_ACT, DOT)
    seq = 1
    stage(XB, stream, role, seq, 0, dot(tl.trans(x2t), op(w2, DOT), DOT), M, D, SPLIT)
    # the output write: masked (no branch) in the sampling forward at mini-batch 16, a step 6 % faster there; behind a
    # branch elsewhere, where the masked form spilled more and the training forward measured 2.6 % slower with it
    BRANCHED_OUT: tl.constexpr = SAVE or M != 16
    for i0 in range(0, NMB, GROUP):  # the checkpoint store sits between groups, not inside the step loop
        for i in range(i0, tl.minimum(i0 + GROUP, NMB)):
            ib = I0 + i
            off = tok + ib * (M * D) + tile
            raise_flag(SYNC, stream, role, seq, SPLIT)
            if OUTPUT:
                if PREFETCH:  # used after the update, so its load is off the chain
                    q = tl.load(Q + off)
                if not BRANCHED_OUT:  # the Q rows of the output this step writes (none at i = 0), off the chain
                    out_off = _out_rows(tok, ib - 1, role, M, D, SPLIT)
                    q_out = tl.load(Q + out_off, mask=(out_off >= 0) & (i > 0), other=0.0)
            v = tl.load(V + off)
            eta = tl.load(ETA + stream * L + ib * M + rm).to(tl.float32)
            if PREFETCH:  # K of the next mini-batch is loaded one step ahead, off the chain
                k_next = tl.load(K + off + M * D, mask=(tile >= 0) & (i + 1 < NMB), other=0.0)
            wait_all(SYNC, stream, role, seq, SPLIT)
            z2 = gather(XB, stream, seq, 0, 0, M, M, D, SPLIT) + b2[None, :]
            if OUTPUT:  # the output of mini-batch ib - 1
                if BRANCHED_OUT:
                    if i > 0:
                        _write_out(OUT, Q, XB, stream, seq, role, tok, ib - 1, 0.0, True, nw, nb, M, D, SPLIT, EPS,
                                   True)
                else:  # masked, not branched, so its tile shares the Z2 tile's round trip
                    _write_out(OUT, Q, XB, stream, seq, role, tok, ib - 1, q_out, i > 0, nw, nb, M, D, SPLIT, EPS,
                               False)
            if SAVE_ACT:
                tl.store(Z2S + (stream * (NSLOT - 1) + i) * (M * D) + tile, z2, mask=(tile >= 0) & (role == 0))
            lg, _xh, _rs, _y, _gh, _a, _c = ln_l2_fwd(z2, v.to(tl.float32) - k.to(tl.float32), nw, nb, D, EPS)
            g2 = op(eta[:, None] * lg, DOT)
            if SAVE_ACT:
                tl.store(G2S + (stream * (NSLOT - 1) + i) * (M * D) + tile, g2, mask=(tile >= 0) & (role == 0))
            # the update of this role's rows (b2 is shared: every role computes the same)
            g1t = op(dot(op(w2, DOT), tl.trans(g2), DOT) * gpt.to(tl.float32), DOT)
            w1t = dot_acc(-g1t, k, w1t, DOT)
            b1 = b1 - tl.sum(g1t.to(tl.float32), 1)
            w2 = dot_acc(-x2t, g2, w2, DOT)
            b2 = b2 - tl.sum(g2.to(tl.float32), 0)
            seq += 1
            if i + 1 < NMB:  # the next mini-batch's partial Z2, at the new state
                if PREFETCH:
                    k = k_next
                else:
                    k = tl.load(K + off + M * D)
                z1t = dot(op(w1t, DOT), tl.trans(k), DOT) + b1[:, None]
                x2t, gpt = _activation(z1t, XS, GPS, GPPS, (stream * (NSLOT - 1) + i + 1) * (E * M) + zrows,
                                       SAVE_ACT, DOT)
                stage(XB, stream, role, seq, 0, dot(tl.trans(x2t), op(w2, DOT), DOT), M, D, SPLIT)
            if OUTPUT:  # this mini-batch's output partial, at the same new state: it rides on the same exchange
                if not PREFETCH:
                    q = tl.load(Q + off)
                stage(XB, stream, role, seq, 1, _out_partial(q, w1t, b1, w2, b2, role, DOT), M, D, SPLIT)
        if SAVE:
            _store_rows(CW1, CB1, CW2, CB2, stream * NSLOT + i0 // GROUP + 1, w1t, b1, w2, b2, role, rows, rd, D, E)
    if OUTPUT:  # exchange seq carries only the output of the last mini-batch
        if BRANCHED_OUT:
            q_out = 0.0  # unused: the branched form loads its Q rows itself
        else:
            q_out = tl.load(Q + _out_rows(tok, I0 + NMB - 1, role, M, D, SPLIT))
        raise_flag(SYNC, stream, role, seq, SPLIT)
        wait_all(SYNC, stream, role, seq, SPLIT)
        _write_out(OUT, Q, XB, stream, seq, role, tok, I0 + NMB - 1, q_out, True, nw, nb, M, D, SPLIT, EPS,
                   BRANCHED_OUT)


def split_for(E: int, M: int, D: int) -> int:
    """Programs per stream. The interpreter runs programs one after another, so it takes 1 (see triton_exchange).
    On a GPU, 2 roles: at E = 256 each holds 128 hidden rows at 8 warps (its state rows, 64 KiB, in registers).
    Measured on an H200 at L = 18,048 (docs/kernels.md): 2 roles at 8 warps 3.19 / 27.9 ms
    forward / forward+backward, 4 roles at 4 warps 3.94 / 33.8, 4 at 8 warps 6.38 / 36.6. At M = 16 one role (2 at 8
    warps made a 63-s guided block 14 % slower on an H100, 663 against 580 ms: two waves); sampling there takes 2 at
    4 warps instead (`forward_shape`)."""
    if interpreting():
        return 1
    if os.environ.get("TTT_MLP_SPLIT"):  # for measurements and device tests of the other splits
        return int(os.environ["TTT_MLP_SPLIT"])
    return max(1, min(2, E // 64, M // 16))


def warps_for(E: int, split: int, M: int = 64, D: int = 64) -> int:
    """16 hidden rows per warp: one MMA tile of rows per warp, no replicated tiles; at most `warp_cap(M, D)` (8, or 4
    where Triton 3.6 miscompiles [64, D < 64] products at 8 warps: triton_common.warp_cap)."""
    return max(1, min(warp_cap(M, D), E // split // 16))


def forward_shape(E: int, M: int, D: int, device: torch.device, save: bool) -> tuple[int, int]:
    """(split, warps) of a forward launch. A forward that saves nothing (sampling) at mini-batch 16 takes 2 roles at
    4 warps: two programs then share an SM, so a guided step's 96 streams (2 x 48 heads; at 63 s two launches of
    48 side by side, ops.kernel_parts) run in one wave. H100, L = 18,048: 96 streams 6.37 us a mini-batch against
    7.85 for 1 role at 8 warps and 9.55 for 2 roles at 8 warps (two waves); 48 streams 5.26 (8 warps: 5.05, but
    not when another launch runs beside it). Only at the measured shape (D = 64, E = 256); else, and for a forward
    that saves (training, measured at its own shapes: docs/kernels.md), split_for and warps_for."""
    split = split_for(E, M, D)
    if save or (M, D, E) != (16, 64, 256) or interpreting() or os.environ.get("TTT_MLP_SPLIT") or device.type != "cuda":
        return split, warps_for(E, split, M, D)
    return 2, min(4, warps_for(E, 2, M, D))


def _state_buffers(slots: int, D: int, E: int, device) -> tuple[torch.Tensor, ...]:
    """fp32 state slots: W1^T [E, D], b1 [E], W2 [E, D], b2 [D]."""
    return tuple(torch.empty(slots, *s, device=device, dtype=torch.float32) for s in ((E, D), (E,), (E, D), (D,)))


def _launch_fwd(q, k, v, eta, norm_w, norm_b, init, init_transposed, out, slots, nslot, group, acts, i0, nmb, M,
                output, split, num_warps, key, prefetch=1):
    """Launch the forward kernel over mini-batches [i0, i0 + nmb) of every stream.

    init: (W1, b1, W2, b2) with a leading index that is the head ([H, D, E], [H, E], [H, E, D], [H, D]: the layer's
    weights) or the stream (views of state slots, W1^T [S, E, D] when init_transposed). slots: state slot buffers
    to save into, nslot slots per stream (None: no saving); acts: the five activation buffers of a recompute
    (triton_mlp_bwd) or None; out: None without output."""
    B, H, L, D = q.shape
    E = init[1].shape[-1]
    w1, b1, w2, b2 = init
    sd, se = (w1.stride(2), w1.stride(1)) if init_transposed else (w1.stride(1), w1.stride(2))
    streams = B * H
    sync, xb = exchange_buffers(streams, split, M, D, q.device)
    save = slots is not None
    dummy = q  # stands in for unused pointers (never dereferenced: their constexpr switch is off)
    LAUNCHED[key] = _mlp_fwd_kernel[(streams * split,)](
        q, k, v, eta, norm_w, norm_b,
        w1, b1, w2, b2, w1.shape[0], w1.stride(0), b1.stride(0), w2.stride(0), b2.stride(0), sd, se,
        out if output else dummy, *(slots if save else (dummy,) * 4), nslot, group,
        *(acts if acts is not None else (dummy,) * 5), xb, sync,
        H, L, i0, nmb,
        D=D, E=E, M=M, SPLIT=split, DOT=dot_mode(q.dtype), EPS=LN_EPS, SAVE=save, OUTPUT=output,
        SAVE_ACT=acts is not None, PREFETCH=prefetch, num_warps=num_warps, num_stages=1,
    )


def mlp_forward(q, k, v, eta, norm_w, norm_b, w1, b1, w2, b2, mini_batch_size, checkpoint_group_size, save,
                output=True, out=None, **tune):
    """Run the forward scan. Returns (out, checkpoints) with checkpoints None unless `save`: state slots with
    ceil(n / group) + 1 per stream (the initial state, then one after every group). `out`: a contiguous tensor of
    q's shape and dtype to write the output into (None: a new one).
    `tune` overrides the launch shape for measurements: split (programs per stream), num_warps, prefetch (0: load K
    of a mini-batch in its own step instead of one step ahead, and Q right before its output product instead of at
    the start of its step)."""
    check_device(q, k, v, eta, norm_w, norm_b, w1, b1, w2, b2)
    B, H, L, D = q.shape
    E = w1.shape[-1]
    M = mini_batch_size
    n = L // M
    group = scan_groups(n, checkpoint_group_size)[0]
    if "split" in tune:  # a measurement's split, at its own warps unless they are given too
        split, warps = tune["split"], warps_for(E, tune["split"], M, D)
    else:
        split, warps = forward_shape(E, M, D, q.device, save)
    warps = tune.get("num_warps", warps)
    out = output_for(q, out) if output else None
    nslot = (n + group - 1) // group + 1
    ck = _state_buffers(B * H * nslot, D, E, q.device) if save else None
    _launch_fwd(q, k, v, eta, norm_w, norm_b, (w1, b1, w2, b2), False, out, ck, nslot, group, None, 0, n, M,
                output, split, warps, "fwd", tune.get("prefetch", 1))
    return out, ck


class _Lanes:
    """CUDA streams for the backward: the serial kernels (reverse, and the group recompute unless it takes a lane of
    its own, high priority too) on a high-priority one, and the parallel kernels (output path, d K) on a
    low-priority one, where they fill the SMs the serial kernels leave idle. `after` names the launches (keys)
    a launch must follow across lanes; each must have been issued already (a key that was not is an error, not a
    dependency silently dropped: the caller names only launches that exist).
    Without CUDA (the interpreter), or with `overlap` off (for measurements), everything runs inline on the current
    stream, in call order, and the keys are checked all the same."""

    _streams: dict = {}
    PRIORITY = {"serial": -1, "parallel": 0, "recompute": -1}

    def __init__(self, device, overlap=True, lanes=("serial", "parallel")):
        self.cuda = device.type == "cuda" and overlap
        self.events = {}
        if self.cuda:
            # one stream per (device, lane) for the process; a launch joins only the lanes it uses
            for lane in lanes:
                if (device, lane) not in self._streams:
                    self._streams[device, lane] = torch.cuda.Stream(device, priority=self.PRIORITY[lane])
            self.streams = {lane: self._streams[device, lane] for lane in lanes}
            self.entry = torch.cuda.current_stream(device)
            for stream in self.streams.values():
                stream.wait_stream(self.entry)

    def run(self, lane, key, fn, after=()):
        missing = [a for a in after if a not in self.events]
        if missing or key in self.events:
            raise RuntimeError(f"TTT backward schedule: {key} waits on {missing} (not issued yet)" if missing
                               else f"TTT backward schedule: {key} issued twice")
        if not self.cuda:
            fn()
            self.events[key] = None
            return
        stream = self.streams[lane]
        with torch.cuda.stream(stream):
            for a in after:
                stream.wait_event(self.events[a])
            fn()
            self.events[key] = torch.cuda.Event()
            self.events[key].record(stream)

    def join(self):
        if self.cuda:
            for stream in self.streams.values():
                self.entry.wait_stream(stream)


def _backward_buffers(S, group, D, E, M, operand, device, sets):
    """The scratch of one checkpoint group (layouts: triton_mlp_bwd's docstring), `sets` copies of each part."""
    def new(*shape, dtype=operand):  # NaN-filled under TTT_TRITON_POISON: a read of an unwritten element shows
        return new_output(None, shape, dtype, device)

    f32 = torch.float32
    rows = S * group
    states = [(new(S * (group + 1), E, D), new(S * (group + 1), E, dtype=f32), new(S * (group + 1), E, D),
               new(S * (group + 1), D, dtype=f32)) for _ in range(sets["states"])]
    acts = [(new(rows, E, M), new(rows, E, M), new(rows, E, M), new(rows, M, D, dtype=f32), new(rows, M, D))
            for _ in range(sets["states"])]
    outs = [(new(rows, E, M), new(rows, E, M), new(rows, E, M), new(rows, M, D), new(rows, E, dtype=f32),
             new(rows, D, dtype=f32)) for _ in range(sets["outs"])]
    dk_ops = [(new(rows, E, D), new(rows, E, M)) for _ in range(sets["outs"])]
    return states, acts, outs, dk_ops


def mlp_backward(dout, q, k, v, eta, norm_w, norm_b, ck, mini_batch_size, checkpoint_group_size, **tune):
    """Gradients of every input, groups in reverse. Per group g: recompute it from its checkpoint (states and
    activations), the output path of all its mini-batches in parallel, the serial reverse through its updates, then
    d K of all its mini-batches in parallel. The recompute runs one group ahead on a stream of its own (recompute
    g - 1 beside reverse g; `recompute_lane`) and the parallel kernels on a third, so the recompute and output path
    of g - 1 and d K of g overlap the reverse of g; the group scratch rotates over three sets (recomputed states and
    activations) and two (the rest).
    Slow-weight and norm gradients are summed over batch. `tune`: split, num_warps (both serial kernels),
    reverse_split, reverse_warps, out_warps (both parallel kernels; op_warps / dk_warps set one of them), overlap
    (False: one stream), prefetch (the forward kernel's), recompute_lane (or TTT_RECOMPUTE_LANE): "recompute", the
    default, runs the group recompute on a stream of its own beside the reverse (1.5-2.4 % faster, docs/kernels.md);
    "serial" runs it on the reverse's stream. The parallel kernels take 8 warps, 4 where triton_common.warp_cap says
    8 is miscompiled (the d K kernel read shared memory out of bounds at M = 64, D < 64).
    """
    from tttvideo.ttt import triton_mlp_bwd

    B, H, L, D = q.shape
    E = ck[1].shape[-1]
    M = mini_batch_size
    n = L // M
    S = B * H
    group = scan_groups(n, checkpoint_group_size)[0]
    ng = (n + group - 1) // group
    split = tune.get("split", split_for(E, M, D))
    warps = tune.get("num_warps", warps_for(E, split, M, D))
    out_warps = tune.get("out_warps", warp_cap(M, D))
    dev = q.device
    dout = dout.contiguous()
    dq, dk, dv, deta = new_output(q), new_output(k), new_output(v), new_output(eta)
    dnw = torch.zeros(S, D, device=dev, dtype=torch.float32)
    dnb = torch.zeros(S, D, device=dev, dtype=torch.float32)
    operand = torch.bfloat16 if dot_mode(q.dtype) == DOT_BF16 else torch.float32
    states, acts, outs, dk_ops = _backward_buffers(S, group, D, E, M, operand, dev,
                                                   dict(states=min(3, ng), outs=min(2, ng)))
    carried = tuple(torch.zeros(S, *t.shape[1:], device=dev, dtype=torch.float32) for t in states[0])
    views = tuple(t.view(S, ng + 1, *t.shape[1:]) for t in ck)
    # the recompute of g - 1 needs no result of the reverse of g, so on a lane of its own it can overlap it
    recompute_lane = tune.get("recompute_lane", os.environ.get("TTT_RECOMPUTE_LANE", "recompute"))
    if recompute_lane not in ("serial", "recompute"):
        raise ValueError(f"TTT_RECOMPUTE_LANE / recompute_lane = {recompute_lane!r}: 'serial' or 'recompute'")
    lanes = _Lanes(dev, tune.get("overlap", True), ("serial", "parallel", recompute_lane))

    def span(g):
        return g * group, min(group, n - g * group)

    def recompute(g):  # reuses the set of group g + 3, last read by d K of g + 3
        i0, cnt = span(g)
        init = tuple(t[:, g] for t in views)
        lanes.run(recompute_lane, ("rc", g), lambda: _launch_fwd(
            q, k, v, eta, norm_w, norm_b, init, True, None, states[g % 3], group + 1, 1, acts[g % 3], i0, cnt, M,
            False, split, warps, "bwd_recompute", tune.get("prefetch", 1)), after=[("dk", g + 3)] if g + 3 < ng else [])

    def output_path(g):  # reuses the set of group g + 2, read by the reverse of g + 2 (before the recompute of g)
        i0, cnt = span(g)
        lanes.run("parallel", ("op", g), lambda: triton_mlp_bwd.output_path(
            dout, q, norm_w, states[g % 3], group + 1, acts[g % 3], outs[g % 2], group, dq, dnw, dnb, i0, cnt, M,
            tune.get("op_warps", out_warps), LAUNCHED), after=[("rc", g)])

    def reverse(g):  # writes the d K operands of g % 2, last read by d K of g + 2
        i0, cnt = span(g)
        lanes.run("serial", ("rev", g), lambda: triton_mlp_bwd.reverse(
            q, k, v, eta, norm_w, norm_b, states[g % 3], group + 1, acts[g % 3], outs[g % 2], carried, dk_ops[g % 2],
            dv, deta, dnw, dnb, i0, cnt, M, tune.get("reverse_split", split), tune.get("reverse_warps", warps),
            LAUNCHED), after=[("op", g)] + ([("dk", g + 2)] if g + 2 < ng else []))

    def grad_k(g):
        i0, cnt = span(g)
        lanes.run("parallel", ("dk", g), lambda: triton_mlp_bwd.grad_k(
            states[g % 3], group + 1, acts[g % 3], dk_ops[g % 2], dv, dk, i0, cnt, M, tune.get("dk_warps", out_warps),
            LAUNCHED),
            after=[("rev", g)])

    recompute(ng - 1)
    output_path(ng - 1)
    for g in reversed(range(ng)):
        if g > 0:
            recompute(g - 1)
            output_path(g - 1)
        reverse(g)
        grad_k(g)
    lanes.join()
    per_head = lambda t: t.view(B, H, *t.shape[1:]).sum(0)  # noqa: E731 - slow weights are shared over batch
    dw1t, db1, dw2, db2 = (per_head(t) for t in carried)
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
