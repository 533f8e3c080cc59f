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
