"""Plain PyTorch references of the two gated linear recurrences of Mamba 2 and Gated DeltaNet, in
flash-linear-attention's conventions (q, k, v [B, T, H, D], log decay g [B, T, H] <= 0, state S [B, H, K, V]):

    Mamba 2 (SSD, "simple GLA"):  S_t = exp(g_t) S_{t-1} + k_t v_t^T                      o_t = scale S_t^T q_t
    Gated DeltaNet:               S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T
                                                                                             o_t = scale S_t^T q_t

`gated_recurrence_naive` steps token by token (the definition); `gated_recurrence_chunked` is the same function in
chunks of `chunk` tokens (one matmul form per chunk, the state carried between chunks), which is what runs on a CPU
and what the GPU kernels are tested against. Inside a chunk, with G the cumulative log decay from the chunk start
and S0 the state before it, the delta rule's corrections U solve a unit lower-triangular system

    (I + A) U = diag(beta) V - diag(beta e^G) K S0,   A_tj = beta_t e^(G_t - G_j) k_t.k_j  (j < t)

(U = V without the delta rule), then O = scale (diag(e^G) Q S0 + (Q K^T * M) U) with M_tj = e^(G_t - G_j) (j <= t),
and the state leaving the chunk is e^(G_c) S0 + (K * e^(G_c - G))^T U. All math in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_recurrence_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The recurrence token by token (beta None: Mamba 2's, else the gated delta rule) -> o [B, T, H, V] fp32."""
    q, k, v, g = (t.float() for t in (q, k, v, g))
    B, T, H, K = k.shape
    S = k.new_zeros(B, H, K, v.shape[-1])
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        u = v[:, t]
        if beta is not None:
            u = beta[:, t].float()[..., None] * (u - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        out.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(out, dim=1)


def gated_recurrence_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor | None, scale: float, chunk: int = 64) -> torch.Tensor:
    """The same recurrence in chunks (differentiable, fp32) -> o [B, T, H, V] fp32."""
    B, T, H, K = k.shape
    pad = -T % chunk
    # padded tokens come last, decay 0 (g = 0) and write nothing (k = 0): the outputs before them are unchanged
    q, k, v, g = (F.pad(t.float(), (0, 0) * (t.dim() - 2) + (0, pad)) for t in (q, k, v, g))
    n = (T + pad) // chunk
    # [B, H, n, c, ...]
    q, k, v = (t.transpose(1, 2).unflatten(2, (n, chunk)) for t in (q, k, v))
    G = g.transpose(1, 2).unflatten(2, (n, chunk)).cumsum(-1)
    if beta is not None:
        beta = F.pad(beta.float(), (0, 0, 0, pad)).transpose(1, 2).unflatten(2, (n, chunk))
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    S = q.new_zeros(B, H, K, v.shape[-1])
    out = []
    for i in range(n):
        qi, ki, vi, Gi = q[:, :, i], k[:, :, i], v[:, :, i], G[:, :, i]
        # e^(G_t - G_j) on and below the diagonal; the masked exponent never overflows (G is non-increasing)
        decay = (Gi[..., :, None] - Gi[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        if beta is None:
            u = vi
        else:
            bi = beta[:, :, i, :, None]
            A = (bi * (ki @ ki.transpose(-1, -2)) * decay).tril(-1)
            rhs = bi * vi - bi * Gi.exp()[..., None] * (ki @ S)
            eye = torch.eye(chunk, dtype=A.dtype, device=A.device)
            u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        out.append(scale * (Gi.exp()[..., None] * (qi @ S) + ((qi @ ki.transpose(-1, -2)) * decay) @ u))
        last = Gi[..., -1:]
        S = last.exp()[..., None] * S + (ki * (last - Gi).exp()[..., None]).transpose(-1, -2) @ u
    return torch.stack(out, dim=2).flatten(2, 3)[:, :, :T].transpose(1, 2)
