"""Reference TTT scan in plain PyTorch: TTT-MLP and TTT-Linear, non-causal mini-batch form of the original.

This is the ground truth every fast path is tested against. Shapes (B batch, H heads, L tokens, D head dim):

    q, k, v   [B, H, L, D]  (v is the LayerNorm reconstruction target plus k, as in the original: the inner
                             loss regresses LN(g(k)) onto v - k)
    eta       [B, H, L]      per-token inner learning rate, already base_lr * sigmoid(.) / D / mini_batch
    eta_rows  [L, b] or None the reference system's learning-rate matrices (`tttvideo.ttt.eta_layout`): row t holds
                             the b rates token t's output applies to its mini-batch's keys, as indices into eta
    norm_w/b  [H, D]         ttt_norm, the per-head LayerNorm of the inner model
    MLP:      w1 [H, D, E], b1 [H, E], w2 [H, E, D], b2 [H, D]   (E = 4 D)
    Linear:   w1 [H, D, D], b1 [H, D]

For mini-batch i every token's gradient is taken at W_{i-1}; W_i = W_{i-1} - sum_t eta_t grad_t; every token of
mini-batch i is output as q + LN(g_{W_i}(q)). With `eta_rows`, token t of mini-batch i is output with its own
step W_{i-1} - sum_j eta[rows[t, j]] grad_j over the keys j of mini-batch i, and the state carried on is the last
token's step (eta may then be any [B, H, N]: tests pass explicit matrices as eta [B, H, L * b] with rows =
arange). L must be a multiple of the mini-batch (the layer pads; padded tokens carry eta = 0). The inner state is
fp32 whatever the input dtype; the output has q's dtype.

The scan is checkpointed every `checkpoint_group_size` mini-batches: only the state at group boundaries is kept,
and each group is recomputed in backward (torch.utils.checkpoint, non-reentrant). 0 disables it.

`operand_dtype=torch.bfloat16` rounds both operands of every product to bf16, in forward and backward, and keeps
everything else in fp32: the precision of a tensor-core kernel, without its bugs. Accuracy studies use it to tell
what bf16 products cost from what a kernel gets wrong (benchmarks/ttt_accuracy.py).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# LayerNorm epsilon of the inner model, as in the original's fused LN/L2 kernels.
INNER_LN_EPS = 1e-8
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def ln_fwd(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = INNER_LN_EPS) -> torch.Tensor:
    mu = x.mean(dim=-1, keepdim=True)
    var = x.var(dim=-1, keepdim=True, unbiased=False)
    return w * ((x - mu) / torch.sqrt(var + eps)) + b


def ln_l2_grad(
    x: torch.Tensor, target: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = INNER_LN_EPS
) -> torch.Tensor:
    """d/dx of 1/2 ||LN(x) - target||^2, LayerNorm backward fused with the L2 loss (closed form)."""
    d = x.shape[-1]
    mu = x.mean(dim=-1, keepdim=True)
    std = torch.sqrt(x.var(dim=-1, keepdim=True, unbiased=False) + eps)
    x_hat = (x - mu) / std
    g_hat = (w * x_hat + b - target) * w
    return (
        d * g_hat - g_hat.sum(dim=-1, keepdim=True) - x_hat * (g_hat * x_hat).sum(dim=-1, keepdim=True)
    ) / (d * std)


def gelu_tanh_grad(x: torch.Tensor) -> torch.Tensor:
    """Derivative of GELU with the tanh approximation."""
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * x**3)
    t = torch.tanh(inner)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)


State = tuple[torch.Tensor, ...]


class _RoundedOperandMatmul(torch.autograd.Function):
    """a @ b with both operands rounded to `dtype` and the product accumulated in a's dtype; the backward's two
    products round their operands the same way (the saved operands as rounded, the incoming gradient anew)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        a, b = (x.to(dtype).to(x.dtype) for x in (a, b))
        ctx.save_for_backward(a, b)
        ctx.dtype = dtype
        return a @ b

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        grad = grad.to(ctx.dtype).to(grad.dtype)
        return grad @ b.transpose(-1, -2), a.transpose(-1, -2) @ grad, None


def _rounded_matmul(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _RoundedOperandMatmul.apply(a, b, dtype)

    return mm


def _mlp_minibatch(state: State, q, k, v, eta, norm_w, norm_b, mm=torch.matmul) -> tuple[State, torch.Tensor]:
    w1, b1, w2, b2 = state
    z1 = mm(k, w1) + b1
    x2 = F.gelu(z1, approximate="tanh")
    z2 = mm(x2, w2) + b2
    g2 = ln_l2_grad(z2, v - k, norm_w, norm_b) * eta
    g1 = mm(g2, w2.transpose(-1, -2)) * gelu_tanh_grad(z1)
    w1 = w1 - mm(k.transpose(-1, -2), g1)
    b1 = b1 - g1.sum(dim=-2, keepdim=True)
    w2 = w2 - mm(x2.transpose(-1, -2), g2)
    b2 = b2 - g2.sum(dim=-2, keepdim=True)
    out = q + ln_fwd(mm(F.gelu(mm(q, w1) + b1, approximate="tanh"), w2) + b2, norm_w, norm_b)
    return (w1, b1, w2, b2), out


def _linear_minibatch(state: State, q, k, v, eta, norm_w, norm_b, mm=torch.matmul) -> tuple[State, torch.Tensor]:
    w1, b1 = state
    g = ln_l2_grad(mm(k, w1) + b1, v - k, norm_w, norm_b) * eta
    w1 = w1 - mm(k.transpose(-1, -2), g)
    b1 = b1 - g.sum(dim=-2, keepdim=True)
    out = q + ln_fwd(mm(q, w1) + b1, norm_w, norm_b)
    return (w1, b1), out


def _mlp_minibatch_rows(state: State, q, k, v, eta, norm_w, norm_b, mm=torch.matmul) -> tuple[State, torch.Tensor]:
    """TTT-MLP mini-batch with a learning-rate matrix eta [B, H, b, b] (row: output token, column: key), in the
    dual form: query i's step is folded into its products as (eta * q k^T) g instead of a weight per query."""
    w1, b1, w2, b2 = state
    z1 = mm(k, w1) + b1
    x2 = F.gelu(z1, approximate="tanh")
    g2 = ln_l2_grad(mm(x2, w2) + b2, v - k, norm_w, norm_b)
    g1 = mm(g2, w2.transpose(-1, -2)) * gelu_tanh_grad(z1)
    z1_q = mm(q, w1) + b1 - mm(eta * mm(q, k.transpose(-1, -2)), g1) - mm(eta, g1)
    x2_q = F.gelu(z1_q, approximate="tanh")
    z2_q = mm(x2_q, w2) + b2 - mm(eta * mm(x2_q, x2.transpose(-1, -2)), g2) - mm(eta, g2)
    last = eta[..., -1, :, None]  # [B, H, b, 1]: the last row's rates, the step carried on
    w1 = w1 - mm(k.transpose(-1, -2), last * g1)
    b1 = b1 - (last * g1).sum(dim=-2, keepdim=True)
    w2 = w2 - mm(x2.transpose(-1, -2), last * g2)
    b2 = b2 - (last * g2).sum(dim=-2, keepdim=True)
    return (w1, b1, w2, b2), q + ln_fwd(z2_q, norm_w, norm_b)


def _linear_minibatch_rows(state: State, q, k, v, eta, norm_w, norm_b, mm=torch.matmul) -> tuple[State, torch.Tensor]:
    """TTT-Linear mini-batch with a learning-rate matrix eta [B, H, b, b] (see `_mlp_minibatch_rows`)."""
    w1, b1 = state
    g = ln_l2_grad(mm(k, w1) + b1, v - k, norm_w, norm_b)
    z_q = mm(q, w1) + b1 - mm(eta * mm(q, k.transpose(-1, -2)), g) - mm(eta, g)
    last = eta[..., -1, :, None]
    w1 = w1 - mm(k.transpose(-1, -2), last * g)
    b1 = b1 - (last * g).sum(dim=-2, keepdim=True)
    return (w1, b1), q + ln_fwd(z_q, norm_w, norm_b)


def _with_operand_dtype(step: Callable[..., tuple[State, torch.Tensor]], operand_dtype: torch.dtype | None):
    return step if operand_dtype is None else functools.partial(step, mm=_rounded_matmul(operand_dtype))


# checkpoint_group_size 0 turns scan checkpointing off: the whole sequence is one group, nothing recomputed.
NO_SCAN_CHECKPOINT = 0


def scan_groups(n_minibatches: int, checkpoint_group_size: int) -> tuple[int, bool]:
    """(mini-batches per group, whether each group is checkpointed) for a scan of `n_minibatches`: the one place
    that decodes `checkpoint_group_size` for the reference and the kernels."""
    if checkpoint_group_size <= NO_SCAN_CHECKPOINT:
        return n_minibatches, False
    return min(checkpoint_group_size, n_minibatches), True


def _scan(
    step: Callable[..., tuple[State, torch.Tensor]],
    state: State,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    norm_w: torch.Tensor,
    norm_b: torch.Tensor,
    mini_batch_size: int,
    checkpoint_group_size: int,
    eta_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    B, H, L, D = q.shape
    if L % mini_batch_size:
        raise ValueError(f"TTT sequence length {L} is not a multiple of the mini-batch {mini_batch_size}; pad it")
    if eta.shape != (B, H, L) and (eta_rows is None or eta.shape[:2] != (B, H)):
        raise ValueError(f"eta must have shape {(B, H, L)}, got {tuple(eta.shape)}")
    n = L // mini_batch_size
    # fp32 state whatever the input dtype (float64 stays float64, for tests)
    f32 = torch.promote_types(q.dtype, torch.float32)
    # [n, B, H, b, D] so that mini-batch i is one index
    qs, ks, vs = (x.to(f32).view(B, H, n, mini_batch_size, D).movedim(2, 0) for x in (q, k, v))
    if eta_rows is None:
        etas = eta.to(f32).view(B, H, n, mini_batch_size, 1).movedim(2, 0)
        rows = None
    else:
        if eta_rows.shape != (L, mini_batch_size):
            raise ValueError(f"eta_rows must have shape {(L, mini_batch_size)}, got {tuple(eta_rows.shape)}")
        # every group gets the whole eta and its rows' indices; the [B, H, b, b] matrices are gathered one
        # mini-batch at a time (and regathered in a checkpointed group's backward), never for the whole sequence
        etas = eta.to(f32)
        rows = eta_rows.view(n, mini_batch_size, mini_batch_size)
    nw = norm_w.to(f32)[:, None, :]
    nb = norm_b.to(f32)[:, None, :]
    state = tuple(s.to(f32) for s in state)

    group, checkpointed = scan_groups(n, checkpoint_group_size)
    outs = []
    for start in range(0, n, group):
        stop = min(start + group, n)
        # The group's inputs go in as arguments, never through a closure: checkpoint saves arguments as saved
        # tensors, which an enclosing activation checkpoint (of the block) can drop and recompute; a closure
        # would pin the whole sequence's q/k/v for as long as the graph lives.
        chunk = (qs[start:stop], ks[start:stop], vs[start:stop])
        chunk += (etas[start:stop],) if rows is None else (etas, rows[start:stop].long())
        if checkpointed and torch.is_grad_enabled():
            *state, out = checkpoint(_run_group, step, len(state), nw, nb, *state, *chunk, use_reentrant=False)
        else:
            *state, out = _run_group(step, len(state), nw, nb, *state, *chunk)
        state = tuple(state)
        outs.append(out)
    out = torch.cat(outs).movedim(0, 2).reshape(B, H, L, D)
    return out.to(q.dtype)


def _run_group(step, n_state: int, nw: torch.Tensor, nb: torch.Tensor,
               *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Scan a run of mini-batches: tensors = (*state, qs, ks, vs, etas) with a leading mini-batch dim on the inputs,
    or (*state, qs, ks, vs, eta, rows) with the whole per-token eta [B, H, L] and the group's row indices
    [n, b, b]; returns (*final state, outputs stacked over mini-batches)."""
    state: State = tensors[:n_state]
    qs, ks, vs, etas, *rows = tensors[n_state:]
    outs = []
    for i in range(qs.shape[0]):
        eta = etas[i] if not rows else etas[:, :, rows[0][i]]
        state, out = step(state, qs[i], ks[i], vs[i], eta, nw, nb)
        outs.append(out)
    return (*state, torch.stack(outs))


def _initial_state(batch: int, *params: torch.Tensor) -> State:
    """Per-head slow weights -> fp32 per-sample inner state [B, H, ...]; biases become row vectors [B, H, 1, .]."""
    state = []
    for p in params:
        p = p.to(torch.promote_types(p.dtype, torch.float32))
        if p.dim() == 2:  # bias [H, E]
            p = p[:, None, :]
        state.append(p.unsqueeze(0).expand(batch, *p.shape))
    return tuple(state)


def ttt_mlp_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    norm_w: torch.Tensor,
    norm_b: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    mini_batch_size: int,
    checkpoint_group_size: int = NO_SCAN_CHECKPOINT,
    operand_dtype: torch.dtype | None = None,
    eta_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    state = _initial_state(q.shape[0], w1, b1, w2, b2)
    step = _with_operand_dtype(_mlp_minibatch if eta_rows is None else _mlp_minibatch_rows, operand_dtype)
    return _scan(step, state, q, k, v, eta, norm_w, norm_b, mini_batch_size, checkpoint_group_size, eta_rows)


def ttt_linear_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    norm_w: torch.Tensor,
    norm_b: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    mini_batch_size: int,
    checkpoint_group_size: int = NO_SCAN_CHECKPOINT,
    operand_dtype: torch.dtype | None = None,
    eta_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    state = _initial_state(q.shape[0], w1, b1)
    step = _with_operand_dtype(_linear_minibatch if eta_rows is None else _linear_minibatch_rows, operand_dtype)
    return _scan(step, state, q, k, v, eta, norm_w, norm_b, mini_batch_size, checkpoint_group_size, eta_rows)
