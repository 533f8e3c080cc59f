"""Segment-local self-attention of the long-video DiT.

Segment i attends over [text_i ; latent frames 12i .. 12i+12] (`VideoLayout.window_index(i)`), plain non-causal,
with CogVideoX's per-head q/k LayerNorm and 3D RoPE on the video q/k at LOCAL positions (every window restarts at
t = 0, as in pretraining, so one table serves all windows). Text tokens take their output from their own window;
a video frame shared by two windows takes the mean of the two outputs. With one segment this is exactly
CogVideoX's full attention (diffusers' `CogVideoXAttnProcessor2_0`).

All windows have the same length, so they are gathered into the batch dimension and go through ONE SDPA call
(flash / memory-efficient kernels on CUDA) instead of a loop over segments. The output projection is affine, so it
is applied after the overlap average, on L tokens rather than n x window tokens.

With sequence parallelism (`tttvideo.parallel.sequence`) the layer gets this rank's shard of the tokens; the q/k/v
projections and their norms run on it, an all-to-all gives every rank the whole sequence for H / sp heads, the
windows are attended exactly as above on those heads, and the reverse all-to-all precedes the output projection.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from tttvideo.device import compiled_on_cuda, triton_runs_on
from tttvideo.layout import VideoLayout
from tttvideo.rope import apply_rope, rope_cos_sin
from tttvideo.sequence.chunks import ChunkPlan, token_chunks

if TYPE_CHECKING:  # the parallel package imports torch.distributed; the model needs it only when given a group
    from tttvideo.parallel.sequence import SequenceParallel


@lru_cache(maxsize=16)
def window_tensors(layout: VideoLayout, head_dim: int, theta: float, device: torch.device):
    """Per layout and device, shared by every layer: window gather index [n, W], the window's RoPE cos/sin [W, D]
    (identity rotation on the text prefix so that one elementwise op covers the whole window) and the reciprocal
    overlap count over residual positions [L, 1] (1 for text, 1/1 or 1/2 for video)."""
    n = layout.num_segments
    index = layout.flat_window_index().reshape(n, -1)
    cos, sin = rope_cos_sin(layout.local_positions, head_dim, theta)
    text = layout.stream_text_tokens
    cos = torch.cat([torch.ones(text, head_dim), cos])
    sin = torch.cat([torch.zeros(text, head_dim), sin])
    inv_count = torch.cat([torch.ones(layout.total_text_tokens), 1.0 / layout.window_overlap_count.double()]).float()
    return index.to(device), cos.to(device), sin.to(device), inv_count[:, None].to(device)


HeadNorm = tuple[torch.Tensor | None, torch.Tensor | None, float]  # a LayerNorm over head_dim: weight, bias, eps


def gather_windows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flat: torch.Tensor | None, n: int,
                   cos: torch.Tensor, sin: torch.Tensor, norm_q: HeadNorm | None = None,
                   norm_k: HeadNorm | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, L, H, D] q, k, v -> the windows in the batch dim, heads first, [B n, H, W, D], with the per-head
    LayerNorm (`norm_q`, `norm_k`; None: none) and RoPE on q and k; `flat` the window gather index [n W] (None with
    one window: no gather). One function so that torch.compile writes each window tensor once instead of a norm, a
    gather, an fp32 copy and five elementwise passes each (eager LayerNorm over rows of 64 runs far below the
    memory bandwidth: 88 of a 712-ms 5B forward on an H100)."""
    B, _, H, D = q.shape

    def windows(t: torch.Tensor, norm: HeadNorm | None = None) -> torch.Tensor:
        if norm is not None:
            t = F.layer_norm(t, (D,), *norm)
        if flat is not None:
            t = t[:, flat].reshape(B * n, -1, H, D)
        return t.transpose(1, 2)

    return apply_rope(windows(q, norm_q), cos, sin), apply_rope(windows(k, norm_k), cos, sin), windows(v)


def use_window_kernel(q: torch.Tensor) -> bool:
    """Whether `window_glue` runs the Triton kernel (`triton_window_gather`): without gradients (sampling) and
    autocast, with a power-of-two head dim, on CUDA from compute capability 8.0 with Triton installed, or on CPU
    inside the Triton interpreter (the tests)."""
    D = q.shape[-1]
    return (not torch.is_grad_enabled() and not torch.is_autocast_enabled(q.device.type) and D >= 2
            and not D & (D - 1) and triton_runs_on(q, (8, 0)))


def window_glue(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, norm_q: HeadNorm | None, norm_k: HeadNorm | None,
                compile_glue: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gather_windows` for the windows of `index` [n, W] (`window_tensors`' gather index; with one window the
    identity) by the Triton kernel where `use_window_kernel` says (one pass over q, k, v; q, k and v of one stride
    set, rows contiguous), else the function itself, torch.compile'd on CUDA by `compile_glue`
    (`model.compile_attention_glue`)."""
    n = index.shape[0]
    if use_window_kernel(q) and q.stride() == k.stride() == v.stride() and q.stride(-1) == 1:
        from tttvideo.models.triton_window_gather import window_gather

        return window_gather(q, k, v, index.reshape(-1), n, cos, sin, norm_q, norm_k)
    flat = index.reshape(-1) if n > 1 else None
    return compiled_on_cuda(gather_windows, q, compile_glue)(q, k, v, flat, n, cos, sin, norm_q, norm_k)


def merge_covers(flat: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a window gather index `flat` [n W] over `length` residual positions: each position's first window
    position (in `flat`'s order) [length], the positions a second window covers [m] and that window position [m].
    Adjacent windows share at most a frame, so a position is covered once or twice."""
    counts = torch.bincount(flat, minlength=length)
    if counts.numel() != length or int(counts.min()) < 1 or int(counts.max()) > 2:
        raise ValueError(f"window index covers positions 0..{length - 1} {int(counts.min())} to "
                         f"{int(counts.max())} times; the merge takes once or twice")
    order = torch.argsort(flat, stable=True)  # window positions grouped by residual position, flat's order kept
    starts = torch.cumsum(counts, 0) - counts
    twice = torch.nonzero(counts == 2).flatten()
    return order[starts], twice, order[starts[twice] + 1]


@lru_cache(maxsize=16)
def window_covers(layout: VideoLayout, device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """`merge_covers` of `layout`'s windows (None with one window), per layout and device, shared by every layer
    (computed on the CPU: the counts' checks would wait for the GPU)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if layout.num_segments == 1:
        return None
    with unset_fake_temporarily():  # real numbers even inside the memory trace's fake mode
        flat = layout.flat_window_index()
        covers = merge_covers(flat, layout.total_tokens)
    if detect_fake_mode() is not None:  # tttvideo.memory.trace: tensors of the shapes, as every table there is
        return tuple(torch.empty(t.shape, dtype=t.dtype, device=device) for t in covers)
    return tuple(t.to(device) for t in covers)


def add_window(acc: torch.Tensor, layout: VideoLayout, i: int, out: torch.Tensor) -> None:
    """acc[:, window i's residual positions] += out [B, W, C], in place (no gradient): the window is its segment's
    text slice and its frames' slice (`VideoLayout.window_index`), so two slice adds, equal bit for bit to
    `index_add_` with the window's index and free of its atomics."""
    text = layout.text_slice(i)
    t = text.stop - text.start
    acc[:, text] += out[:, :t]
    acc[:, layout.frames_slice(layout.segment_frames(i))] += out[:, t:]


class _MergeWindows(torch.autograd.Function):
    """[B, n W, C] window outputs -> [B, L, C]: a gather of each position's first window output, the second
    window's added where there is one and that sum scaled by `inv_count` (1/2); backward a gather by `flat`.
    Equal, bit for bit, to summing every window into zeros with index_add and scaling by `inv_count`, without
    the atomic scatter (bf16 atomics: 36 ms a call at 63 s on an H200, against a gather's bandwidth)."""

    @staticmethod
    def forward(ctx, out, flat, first, twice, second, inv_count):
        summed = out.index_select(1, first)
        if twice.numel():
            shared = summed.index_select(1, twice) + out.index_select(1, second)
            summed.index_copy_(1, twice, shared * inv_count.index_select(0, twice).to(out.dtype))
        ctx.save_for_backward(flat, inv_count)
        return summed

    @staticmethod
    def backward(ctx, grad):
        flat, inv_count = ctx.saved_tensors
        return (grad * inv_count.to(grad.dtype)).index_select(1, flat), None, None, None, None, None


def merge_windows(out: torch.Tensor, flat: torch.Tensor | None, n: int, inv_count: torch.Tensor,
                  length: int, covers: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """SDPA's output [B n, H, W, D] -> [B, L, H D]: each residual position's windows summed, divided by how many
    windows cover it. `covers`: `merge_covers(flat, length)` (`window_covers` of the layout), computed here when
    None."""
    Bn, H, W, D = out.shape
    out = out.transpose(1, 2).reshape(Bn // n, n * W, H * D)
    if flat is None:
        return out
    first, twice, second = covers if covers is not None else merge_covers(flat, length)
    if first.numel() != length:
        raise ValueError(f"the window covers are of {first.numel()} positions, the sequence of {length}")
    return _MergeWindows.apply(out, flat, first, twice, second, inv_count)


class LocalAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int, bias: bool = True, qk_norm_eps: float = 1e-6,
                 norm_elementwise_affine: bool = True, rope_theta: float = 10000.0):
        super().__init__()
        self.num_heads, self.head_dim, self.rope_theta = num_heads, head_dim, rope_theta
        # model.compile_attention_glue (set by the model builder; benchmarks switch it on a built model)
        self.compile_glue = False
        inner = num_heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=bias)
        self.to_k = nn.Linear(dim, inner, bias=bias)
        self.to_v = nn.Linear(dim, inner, bias=bias)
        self.norm_q = nn.LayerNorm(head_dim, eps=qk_norm_eps, elementwise_affine=norm_elementwise_affine)
        self.norm_k = nn.LayerNorm(head_dim, eps=qk_norm_eps, elementwise_affine=norm_elementwise_affine)
        self.to_out = nn.Linear(inner, dim, bias=True)

    @staticmethod
    def head_norm(norm: nn.LayerNorm) -> HeadNorm:
        return norm.weight, norm.bias, norm.eps

    def forward(self, x: torch.Tensor, layout: VideoLayout, sp: SequenceParallel | None = None) -> torch.Tensor:
        """x [B, L, dim] in residual order [all text | all video] -> [B, L, dim]; with `sp`, this rank's shard
        [B, L / sp, dim] -> [B, L / sp, dim]."""
        B, L, _ = x.shape
        H, D = self.num_heads, self.head_dim
        index, cos, sin, inv_count = window_tensors(layout, D, self.rope_theta, x.device)
        n = index.shape[0]

        q = self.to_q(x).view(B, L, H, D)
        k = self.to_k(x).view(B, L, H, D)
        v = self.to_v(x).view(B, L, H, D)
        if sp is not None:
            # one exchange for q, k and v: [B, L / sp, 3, H, D] -> [B, L, 3, H / sp, D] (the q/k norms act per
            # head and token, so they run after it, on the head shards)
            q, k, v = sp.to_head_shards(torch.stack([q, k, v], dim=2), layout, head_axis=3).unbind(2)
            B, L, H, _ = q.shape
        flat = index.reshape(-1) if n > 1 else None
        q, k, v = window_glue(q, k, v, index, cos, sin, self.head_norm(self.norm_q), self.head_norm(self.norm_k),
                              self.compile_glue)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        # eager: the merge is two gathers (torch.compile's would fall back to an atomic index_add)
        out = merge_windows(out, flat, n, inv_count, L, window_covers(layout, x.device))
        if sp is not None:
            out = sp.to_sequence_shards(out.view(B, L, H, D), layout, head_axis=2).flatten(2)
        return self.to_out(out)

    def chunked_forward(self, x: torch.Tensor, norm: Callable[[torch.Tensor], torch.Tensor], layout: VideoLayout,
                        plan: ChunkPlan) -> torch.Tensor:
        """`forward(norm(x))` without gradients, one window at a time: `norm` (the block's adaLN, which modulates
        a window's text and video tokens apart: every window starts with its text) of the window's tokens, q/k/v,
        their norms and RoPE (`window_glue`: the Triton kernel on a GPU) and SDPA, summed into one accumulator
        [B, L, H D] (a new tensor); then the overlap average and the output projection over `plan.tokens`-token
        chunks, in place."""
        B, L, _ = x.shape
        H, D = self.num_heads, self.head_dim
        index, cos, sin, inv_count = window_tensors(layout, D, self.rope_theta, x.device)
        n, W = index.shape
        one_window = torch.arange(W, device=x.device)[None]  # a window's own tokens: window_glue gathers nothing
        acc = x.new_zeros(B, L, H * D)
        for i in range(n):
            idx = index[i]
            h = norm(x[:, idx])
            q, k, v = (proj(h).view(B, W, H, D) for proj in (self.to_q, self.to_k, self.to_v))
            del h
            q, k, v = window_glue(q, k, v, one_window, cos, sin, self.head_norm(self.norm_q),
                                  self.head_norm(self.norm_k), self.compile_glue)
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
            del q, k, v
            add_window(acc, layout, i, out.transpose(1, 2).reshape(B, W, H * D))
        if n > 1:
            acc.mul_(inv_count.to(acc.dtype))
        for s, e in token_chunks(0, L, plan.tokens):
            acc[:, s:e] = self.to_out(acc[:, s:e])
        return acc
