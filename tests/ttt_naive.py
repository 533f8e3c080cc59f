"""A deliberately naive TTT: explicit autograd gradient steps of the inner loss, mini-batch by mini-batch.

No closed-form LayerNorm backward, no dual form: the inner loss sum_t eta_t * 1/2 ||LN(g(k_t)) - (v_t - k_t)||^2 is
differentiated by autograd (create_graph=True so outer gradients flow through the inner steps). A final partial
mini-batch is processed as it is, without padding, which is what padding must reproduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-8


def _ln(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), eps=EPS) * w + b


def _inner(x, state, kind):
    if kind == "mlp":
        w1, b1, w2, b2 = state
        return F.gelu(x @ w1 + b1, approximate="tanh") @ w2 + b2
    w1, b1 = state
    return x @ w1 + b1


def naive_ttt(q, k, v, eta, norm_w, norm_b, params, mini_batch_size, kind):
    B, H, L, D = q.shape
    nw, nb = norm_w[:, None, :], norm_b[:, None, :]
    state = []
    for p in params:
        if p.dim() == 2:  # bias [H, E] -> [H, 1, E]
            p = p[:, None, :]
        state.append(p.unsqueeze(0).expand(B, *p.shape))
    outs = []
    for start in range(0, L, mini_batch_size):
        sl = slice(start, min(start + mini_batch_size, L))
        qi, ki, vi, ei = q[:, :, sl], k[:, :, sl], v[:, :, sl], eta[:, :, sl]
        pred = _ln(_inner(ki, state, kind), nw, nb)
        loss = (ei[..., None] * 0.5 * (pred - (vi - ki)) ** 2).sum()
        grads = torch.autograd.grad(loss, state, create_graph=True)
        state = [s - g for s, g in zip(state, grads)]
        outs.append(qi + _ln(_inner(qi, state, kind), nw, nb))
    return torch.cat(outs, dim=2)


def naive_ttt_matrices(q, k, v, matrices, norm_w, norm_b, params, mini_batch_size, kind):
    """The same inner loss with a learning-rate matrix per mini-batch, matrices [B, H, L, b]: row t holds the rates
    token t's output applies to the b keys of its mini-batch. Token t is output with the weights after the step
    sum_j matrices[t, j] * grad of key j's loss; the state carried on is the step of the mini-batch's last row.
    One autograd step per token: no dual form, no shared products."""
    B, H, L, D = q.shape
    b = mini_batch_size
    nw, nb = norm_w[:, None, :], norm_b[:, None, :]
    state = []
    for p in params:
        if p.dim() == 2:
            p = p[:, None, :]
        state.append(p.unsqueeze(0).expand(B, *p.shape))
    outs = []
    for start in range(0, L, b):
        ki, vi = k[:, :, start:start + b], v[:, :, start:start + b]
        half_sq = 0.5 * ((_ln(_inner(ki, state, kind), nw, nb) - (vi - ki)) ** 2).sum(-1)  # [B, H, b] per key
        for t in range(start, start + b):
            rates = matrices[:, :, t]  # [B, H, b]
            grads = torch.autograd.grad((rates * half_sq).sum(), state, create_graph=True)
            stepped = [s - g for s, g in zip(state, grads)]
            qt = q[:, :, t:t + 1]
            outs.append(qt + _ln(_inner(qt, stepped, kind), nw, nb))
        state = stepped  # the last row's step
    return torch.cat(outs, dim=2)
