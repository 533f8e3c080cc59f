"""The TTT layer of the long-video DiT.

`TTTLayer` maps a residual-order sequence [all text | all video] of width C to a sequence of the same shape:
projections wq/wk/wv, per-head L2-normalised Q/K, 3D RoPE with GLOBAL temporal positions on video Q/K, the
LayerNorm reconstruction target, the per-token inner learning rate eta, the per-segment interleave, padding to the
mini-batch (padded tokens carry eta = 0 and their outputs are dropped), the TTT scan, post-norm, wo, and the
inverse interleave. With `ttt.eta_layout = "reference"` the scan applies the reference system's learning-rate
matrices instead of the per-token rates (`tttvideo.ttt.eta_layout`), on the PyTorch scan.

`BidirectionalTTT` runs it twice with shared parameters, as in the paper: Z = X + tanh(alpha) * TTT(X), then
Z' = Z + tanh(beta) * reverse(TTT(reverse(Z))), with separate per-channel gates for text and video tokens.

With sequence parallelism (`tttvideo.parallel.sequence`) the layer gets this rank's shard of the residual stream:
the q/k/v projections and eta run on it, an all-to-all gives every rank the whole sequence for H / sp heads, which
is permuted into scan order and scanned with those heads' inner weights exactly as without it, and the reverse
all-to-all precedes the post-norm and the output projection. The reversal of the reverse pass is folded into the
scan-order permutation, since a rank never holds the whole residual stream.
"""

from __future__ import annotations

import functools
from functools import lru_cache
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tttvideo import initializers as init
from tttvideo.config.schema import TTTConfig
from tttvideo.device import compiled_on_cuda
from tttvideo.layout import VideoLayout
from tttvideo.rope import rope_cos_sin
from tttvideo.sequence.bidirectional import GatedBidirectional, gated, gather_tokens, scan_permutations
from tttvideo.sequence.chunks import ChunkPlan, modal_chunks, token_chunks
from tttvideo.ttt import ops, scan_inputs
from tttvideo.ttt.eta_layout import ETA_LAYOUTS, REFERENCE, eta_rows_on
from tttvideo.ttt.scan_inputs import prepare_scan_inputs

if TYPE_CHECKING:  # the parallel package imports torch.distributed; the layer needs it only when given a group
    from tttvideo.parallel.sequence import SequenceParallel


@lru_cache(maxsize=16)
def layout_tensors(layout: VideoLayout, head_dim: int, theta: float, device: torch.device):
    """Index maps and RoPE tables of a layout on a device, shared by every layer of the model: the scan order and
    its inverse of the forward and of the reverse pass, and the RoPE cos/sin.

    The RoPE tables are in scan (interleaved) order over all tokens, with the identity rotation (cos 1, sin 0) on
    text tokens, so that one elementwise op rotates a whole scan-order sequence. The reverse pass uses the same
    tables: RoPE goes by position in the sequence scanned."""
    cos, sin = rope_cos_sin(layout.global_positions, head_dim, theta)
    text = layout.total_text_tokens
    cos = torch.cat([torch.ones(text, head_dim), cos])[layout.interleave_perm]
    sin = torch.cat([torch.zeros(text, head_dim), sin])[layout.interleave_perm]
    return (
        scan_permutations(layout, device, reverse=False),
        scan_permutations(layout, device, reverse=True),
        cos[:, None, :].to(device),  # [L, 1, D]: broadcast over heads
        sin[:, None, :].to(device),
    )


def post_norm_rows(scanned: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
    """Scan outputs [B, H, L + pad, D] in scan order -> the post-LayerNorm (over H D) of the rows at scan positions
    `index` [n] (the residual order), [B, n, H D]. One function so that torch.compile reads the scan output once and
    writes the normalised rows once (eager: the gather, a transposed copy and the norm each write the rows); the
    token order changes before the output projection instead of after it, which commutes with it (it is per
    token)."""
    B, H, _, D = scanned.shape
    # the gather first: run eagerly (the chunked pass), only the n rows are transposed, not the whole output
    rows = scanned.index_select(2, index).transpose(1, 2).reshape(B, index.numel(), H * D)
    return F.layer_norm(rows, (H * D,), weight, bias, eps)


def sampling_post_norm(scanned: torch.Tensor, index: torch.Tensor, norm: nn.LayerNorm, backend: str,
                       compile_glue: bool) -> torch.Tensor:
    """`post_norm_rows` without gradients: the Triton kernel (`triton_post_norm`, one pass) where the layer's glue
    kernels run (`scan_inputs.use_kernel`: CUDA from compute capability 8.0 unless `ttt.backend` is "reference",
    the interpreter with "triton") and no autocast would change the norm's dtype; else the reference, torch.compile'd
    on CUDA by `compile_glue`."""
    # through the module: the memory trace's stand-in for the rule (`memory.trace.gpu_stand_ins`) covers this call
    if scan_inputs.use_kernel(scanned, backend) and not torch.is_autocast_enabled(scanned.device.type):
        from tttvideo.ttt.triton_post_norm import post_norm_rows_forward

        return post_norm_rows_forward(scanned, index, norm.weight, norm.bias, norm.eps)
    return compiled_on_cuda(post_norm_rows, scanned, compile_glue)(scanned, index, norm.weight, norm.bias, norm.eps)


class _WriteRows(torch.autograd.Function):
    """buffer[:, :, start:start + n] = rows in place, for rows written once each into disjoint ranges of a fresh
    buffer. Its backward hands the buffer's gradient on as it is and the rows a view of it, where the generic
    in-place copy's backward clones the whole buffer's gradient for every write (to zero the range written,
    which no earlier write reached here)."""

    @staticmethod
    def forward(ctx, buffer: torch.Tensor, rows: torch.Tensor, start: int) -> torch.Tensor:
        ctx.start, ctx.n = start, rows.shape[2]
        buffer[:, :, start:start + rows.shape[2]] = rows
        ctx.mark_dirty(buffer)
        return buffer

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad[:, :, ctx.start:ctx.start + ctx.n], None


class _GatedResidual(torch.autograd.Function):
    """(residual + z * gate) in fp32, back in the residual's dtype. Autograd's own form hands the residual a
    fresh copy of the incoming gradient (cast to fp32 and back, which changes no value); this one hands it the
    incoming gradient itself, so that a chunk's residual gradient is a view of the stream's gradient, alive anyway,
    rather than a second stream-sized tensor gathered chunk by chunk."""

    @staticmethod
    def forward(ctx, residual: torch.Tensor, z: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(z, gate)
        return (residual.float() + z * gate).to(residual.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        z, gate = ctx.saved_tensors
        # the dtype the forward summed in (fp32, or wider inputs' own)
        wide = grad.to(torch.promote_types(torch.float32, torch.promote_types(z.dtype, gate.dtype)))
        grad_z = (wide * gate).to(z.dtype) if ctx.needs_input_grad[1] else None
        grad_gate = (wide * z).sum_to_size(gate.shape) if ctx.needs_input_grad[2] else None
        # the residual's fp32 copy passes its gradient through fp32: lossless for a residual of fp32 or narrower
        # (the training stream), rounded as autograd rounds it for a wider one
        residual_grad = grad if grad.element_size() <= 4 else grad.float().to(grad.dtype)
        return residual_grad, grad_z, grad_gate


def write_rows(buffer: torch.Tensor, rows: torch.Tensor, start: int) -> None:
    """buffer[:, :, start:start + n] = rows [B, h, n, ...] (`_WriteRows` when gradients flow)."""
    if torch.is_grad_enabled() and rows.requires_grad:
        _WriteRows.apply(buffer, rows, start)
    else:
        buffer[:, :, start:start + rows.shape[2]] = rows


MLP_EXPANSION = 4  # TTT-MLP hidden size = 4 x head dim (64 -> 256), as in the original


def inner_hidden(kind: str, head_dim: int, mlp_expansion: int = MLP_EXPANSION) -> int:
    """Width of the inner model's weight W1 (head_dim x hidden): the MLP's hidden size, or head_dim for Linear."""
    return mlp_expansion * head_dim if kind == "mlp" else head_dim


def head_groups(heads: int, groups: int) -> list[slice]:
    """`heads` cut into `groups` contiguous groups (at most one per head) of sizes differing by at most one, as
    torch.tensor_split cuts them."""
    groups = max(1, min(groups, heads))
    sizes = [heads // groups + (i < heads % groups) for i in range(groups)]
    starts = [sum(sizes[:i]) for i in range(groups)]
    return [slice(a, a + n) for a, n in zip(starts, sizes)]


class TTTLayer(nn.Module):
    """One TTT pass over the whole sequence. Its settings come from a TTTConfig, except the mini-batch size, which
    belongs to the layout the layer is called with (the layout pads the sequence to it, and the inner learning rate
    divides by it): `VideoLayout.from_config` reads the training or the sampling mini-batch of the config."""

    def __init__(self, dim: int, num_heads: int, config: TTTConfig | None = None, mlp_expansion: int = MLP_EXPANSION):
        super().__init__()
        config = config if config is not None else TTTConfig()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by {num_heads} heads")
        if config.kind not in ("mlp", "linear"):
            raise ValueError(f"TTT kind must be 'mlp' or 'linear', got {config.kind!r}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        if config.eta_layout not in ETA_LAYOUTS:
            raise ValueError(f"ttt.eta_layout must be one of {ETA_LAYOUTS}, got {config.eta_layout!r}")
        self.kind = config.kind
        self.base_lr = config.inner_base_lr()
        self.eta_layout = config.eta_layout
        self.scan_checkpoint_group_size = config.scan_checkpoint_group_size
        self.rope_theta = config.rope_theta
        # backend and compile_glue may be switched on a built layer (benchmarks compare them)
        self.backend = config.backend
        self.compile_glue = config.compile_glue
        # checkpointing.ttt_chunk_tokens and ttt_head_groups (set by models.checkpointing.apply_checkpointing):
        # training runs the projections, eta, the scan-input glue and the output path over chunks of this many
        # tokens, and the scan over this many groups of heads (`_chunked`)
        self.chunk_tokens = 0
        self.head_groups = 1

        H, D = num_heads, self.head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=True) for _ in range(4))
        # eta gate: one linear map of the full hidden state per head
        self.learnable_ttt_lr_weight = nn.Parameter(torch.empty(H, dim))
        self.learnable_ttt_lr_bias = nn.Parameter(torch.empty(H))
        self.ttt_norm_weight = nn.Parameter(torch.empty(H, D))
        self.ttt_norm_bias = nn.Parameter(torch.empty(H, D))
        self.post_norm = nn.LayerNorm(dim, eps=1e-6)
        hidden = config.mlp_hidden if self.kind == "mlp" and config.mlp_hidden else inner_hidden(self.kind, D,
                                                                                                  mlp_expansion)
        self.W1 = nn.Parameter(torch.empty(H, D, hidden))
        self.b1 = nn.Parameter(torch.empty(H, hidden))
        if self.kind == "mlp":
            self.W2 = nn.Parameter(torch.empty(H, hidden, D))
            self.b2 = nn.Parameter(torch.empty(H, D))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """As the original initialises them: projections and inner weights N(0, 0.02), biases 0, ttt_norm identity."""
        for lin in (self.wq, self.wk, self.wv, self.wo):
            init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        init.normal_(self.learnable_ttt_lr_weight, std=0.02)
        nn.init.zeros_(self.learnable_ttt_lr_bias)
        nn.init.ones_(self.ttt_norm_weight)
        nn.init.zeros_(self.ttt_norm_bias)
        self.post_norm.reset_parameters()
        init.normal_(self.W1, std=0.02)
        nn.init.zeros_(self.b1)
        if self.kind == "mlp":
            init.normal_(self.W2, std=0.02)
            nn.init.zeros_(self.b2)

    def inner_params(self) -> tuple[torch.Tensor, ...]:
        return (self.W1, self.b1, self.W2, self.b2) if self.kind == "mlp" else (self.W1, self.b1)

    def eta(self, x: torch.Tensor, mini_batch_size: int, heads: slice = slice(None)) -> torch.Tensor:
        """Per-token, per-head inner learning rate [B, L, h] of `heads` (all H by default):
        base_lr * sigmoid(theta_h . x + b_h) / D / b."""
        w, b = self.learnable_ttt_lr_weight[heads], self.learnable_ttt_lr_bias[heads]
        gate = F.linear(x, w.to(x.dtype), b.to(x.dtype))
        return self.base_lr * torch.sigmoid(gate.float()) / (self.head_dim * mini_batch_size)

    def forward(self, x: torch.Tensor, layout: VideoLayout, reverse: bool = False,
                sp: SequenceParallel | None = None) -> torch.Tensor:
        """x [B, L, C] in residual order -> [B, L, C]; reverse: scan the reversed sequence (the output is in x's
        order). With `sp`, x and the output are this rank's shard [B, L / sp, C]."""
        B, L, C = x.shape
        forward_order, reverse_order, cos, sin = layout_tensors(layout, self.head_dim, self.rope_theta, x.device)
        scan_order, residual_order = reverse_order if reverse else forward_order

        if sp is None and 0 < self.chunk_tokens < L and torch.is_grad_enabled():
            layout.check_sequence_length(L)
            return self._chunked(x, layout, scan_order, residual_order, cos, sin)
        if sp is None:
            layout.check_sequence_length(L)
            # Everything runs in scan order: one gather of x replaces a gather of each of q, k, v and eta, and all
            # per-token ops commute with the permutation.
            xs = gather_tokens(x, scan_order)
            eta = self.eta(xs, layout.mini_batch_size)
            qkv = self._qkv(xs)
            # Each is dropped once read for the last time: without gradients (which save both for backward) the
            # scan-order copy goes before the scan inputs are made, the projection's output before the scan and
            # the scan inputs after it. A guided 63-s block's TTT then peaks at 32.5 GiB of activations, not 40.7
            # (memory.trace, eager glue), with the projection's output and the scan inputs (12 GiB each) at once.
            del xs
            q, k, v = self._scan_inputs(qkv, layout, cos, sin, None, x.dtype)
            del qkv
            scanned = self._scan_prepared(q, k, v, eta, layout, None)
            del q, k, v
            if not torch.is_grad_enabled():  # sampling: back to residual order before the output projection
                return self.wo(sampling_post_norm(scanned, residual_order, self.post_norm, self.backend,
                                                  self.compile_glue))
            out = scanned[:, :, :L].transpose(1, 2).reshape(B, L, C)
            out = self.wo(self.post_norm(out.to(x.dtype)))
            return gather_tokens(out, residual_order)

        # the projections and eta on this rank's tokens, the permutation on the whole sequence after the exchange
        qkv = gather_tokens(sp.to_head_shards(self._qkv(x), layout, head_axis=3), scan_order)
        eta = gather_tokens(sp.to_head_shards(self.eta(x, layout.mini_batch_size), layout, head_axis=2), scan_order)
        out = gather_tokens(self._scan(qkv, eta, layout, cos, sin, sp.heads(self.num_heads), x.dtype).to(x.dtype),
                            residual_order)
        out = sp.to_sequence_shards(out, layout, head_axis=2).flatten(2)
        return self.wo(self.post_norm(out))

    def _chunked(self, x: torch.Tensor, layout: VideoLayout, scan_order: torch.Tensor, residual_order: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`forward` in training with the token-wise parts over chunks of `chunk_tokens` tokens, each under its own
        checkpoint, and the scan over `head_groups` groups of heads: per group of heads, a chunk's gather into scan
        order, q/k/v projection, eta and scan-input glue write into the group's scan-input buffers (q, k, v:
        [B, h, L + pad, D] each, and eta's), so neither the scan-order copy of the stream nor the projection's
        output exists whole, and the group's scan runs on them. With several groups each group is checkpointed:
        forward keeps its scan output only, backward recomputes one group's inputs, scan checkpoints and scratch at
        a time (the scan is per head; only the post-norm mixes heads). Then the post-norm (fp32 under autocast) and
        the output projection run chunk by chunk."""
        L = x.shape[1]
        out = self._chunked_scan(x, layout, scan_order, cos, sin)[:, :, :L].transpose(1, 2)  # [B, L, H, D]
        # split, not a slice per chunk: backward joins the chunks' gradients once instead of widening each to L
        y = torch.cat([checkpoint(self._output_rows, rows, x.dtype, use_reentrant=False)
                       for rows in out.split(self.chunk_tokens, dim=1)], dim=1)
        return gather_tokens(y, residual_order)

    def _chunked_scan(self, x: torch.Tensor, layout: VideoLayout, scan_order: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, flip: bool = False, *rows: torch.Tensor) -> torch.Tensor:
        """Every head's scan output [B, H, L + pad, D] in scan order, over `head_groups` groups of heads (each
        checkpointed when there are several). `rows`: x's scan-order chunks as views of x (reversed token by token
        when `flip`), as `gated_pass` has them; none: each chunk is gathered from x by `scan_order`. They are
        passed one by one, not in a list: a checkpoint saves its tensor arguments for backward through the
        enclosing checkpoint's hooks, but holds a list's tensors as they are, for as long as the graph lives."""
        groups = head_groups(self.num_heads, self.head_groups)
        if len(groups) == 1:
            return self._scan_heads(x, layout, scan_order, cos, sin, groups[0], flip, *rows)
        return torch.cat([checkpoint(self._scan_heads, x, layout, scan_order, cos, sin, heads, flip, *rows,
                                     use_reentrant=False) for heads in groups], dim=1)

    def _scan_heads(self, x: torch.Tensor, layout: VideoLayout, scan_order: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, heads: slice, flip: bool = False, *rows: torch.Tensor) -> torch.Tensor:
        """The scan output [B, h, L + pad, D] of `heads`, its inputs made chunk by chunk."""
        B, L, _ = x.shape
        h, D, pad = heads.stop - heads.start, self.head_dim, layout.ttt_padding
        # three buffers, not one [3, ...]: the gradient of each reaches the scan's without a stacked copy
        inputs = [x.new_empty(B, h, L + pad, D) for _ in range(3)]
        eta = torch.empty(B, h, L + pad, device=x.device, dtype=torch.float32)
        if pad:
            for t in inputs:
                t[:, :, L:] = 0
            eta[:, :, L:] = 0  # padded tokens: eta = 0, no update
        for i, (s, e) in enumerate(token_chunks(0, L, self.chunk_tokens)):
            source, index = (rows[i], None) if rows else (x, scan_order[s:e])
            qkv_s, eta_s = checkpoint(self._scan_inputs_rows, source, index, cos[s:e], sin[s:e],
                                      layout.mini_batch_size, heads, flip, use_reentrant=False)
            for t, part in zip(inputs, qkv_s.unbind(0)):
                write_rows(t, part, s)
            write_rows(eta, eta_s, s)
        return self.scan(*inputs, eta, layout, heads)

    def _scan_inputs_rows(self, x: torch.Tensor, index: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                          mini_batch_size: int, heads: slice, flip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The scan inputs [3, B, h, n, D] and eta [B, h, n] of `heads` for the n stream rows `index` (in scan
        order; None: x is those rows already, reversed when `flip`)."""
        xs = gather_tokens(x, index) if index is not None else x.flip(1) if flip else x
        qkv = self.project_qkv(xs, heads).unflatten(-1, (3, heads.stop - heads.start, self.head_dim))
        qkv = prepare_scan_inputs(qkv, cos, sin, self.ttt_norm_weight[heads], self.ttt_norm_bias[heads], 0, x.dtype,
                                  self.backend, self.compile_glue)
        return qkv, self.eta(xs, mini_batch_size, heads).transpose(1, 2)

    def gated_pass(self, x: torch.Tensor, layout: VideoLayout, reverse: bool, gates: tuple[torch.Tensor, torch.Tensor],
                   residual: torch.Tensor | None = None, residual_gate: torch.Tensor | None = None) -> torch.Tensor:
        """z = x + tanh(gate) * TTT(x) (`GatedBidirectional`'s pass and gate), and with `residual`:
        (residual + z * residual_gate) in fp32, back in x's dtype (the Wan block's gated add), in training over the
        chunked form, for a layout without text in the stream, whose scan order is the stream's own (the forward
        pass) or its reversal (the reverse pass; `uses_gated_pass`). The chunks of x are views of x (split, reversed
        inside each chunk's checkpoint for the reverse pass) rather than gathers, so backward joins their gradients
        once instead of scattering each chunk's into a stream-sized zero tensor; and each chunk's post-norm, output
        projection, gate and residual add run under one checkpoint that saves views of tensors alive anyway, so
        neither the pass's output nor its gated copy is kept or made whole. `gates`: (text, video) gate parameters
        (the text gate multiplies no token, as in `gated`)."""
        B, L, C = x.shape
        forward_order, reverse_order, cos, sin = layout_tensors(layout, self.head_dim, self.rope_theta, x.device)
        scan_order = (reverse_order if reverse else forward_order)[0]
        sizes = [e - s for s, e in token_chunks(0, L, self.chunk_tokens)]  # scan-order chunks
        # residual-order pieces: the reverse pass's scan chunk i is the reversal of residual piece n - 1 - i
        order = sizes[::-1] if reverse else sizes
        pieces = x.split(order, dim=1)
        out = self._chunked_scan(x, layout, scan_order, cos, sin, reverse, *(pieces[::-1] if reverse else pieces))
        pad = out.shape[2] - L
        out_rows = out.split(sizes + ([pad] if pad else []), dim=2)[:len(sizes)]
        if reverse:
            out_rows = out_rows[::-1]
        extra = residual.split(order, dim=1) if residual is not None else [None] * len(order)
        return torch.cat([checkpoint(self._gated_rows, rows, piece, gates, reverse, res, residual_gate,
                                     use_reentrant=False) for rows, piece, res in zip(out_rows, pieces, extra)], dim=1)

    def _gated_rows(self, out: torch.Tensor, x: torch.Tensor, gates: tuple[torch.Tensor, torch.Tensor], flip: bool,
                    residual: torch.Tensor | None, residual_gate: torch.Tensor | None) -> torch.Tensor:
        """One residual-order chunk of `gated_pass` from its scan outputs out [B, H, n, D]."""
        y = self._output_rows(out.transpose(1, 2), x.dtype)
        z = x + gated(y.flip(1) if flip else y, *gates, 0)
        return z if residual is None else _GatedResidual.apply(residual, z, residual_gate)

    def uses_gated_pass(self, layout: VideoLayout, length: int) -> bool:
        """Whether training runs `gated_pass` on this layout: the chunked form is on and the stream holds no text,
        so the scan order is the stream's order (its reversal for the reverse pass)."""
        return 0 < self.chunk_tokens < length and layout.total_text_tokens == 0 and torch.is_grad_enabled()

    def _output_rows(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Post-norm and output projection of scan outputs [B, n, H, D] -> [B, n, C]."""
        B, n = out.shape[:2]
        return self.wo(self.post_norm(out.reshape(B, n, -1).to(dtype)))

    @torch.no_grad()
    def chunked_pass_(self, x: torch.Tensor, layout: VideoLayout, plan: ChunkPlan, reverse: bool,
                      gates: tuple[torch.Tensor, torch.Tensor]) -> None:
        """x <- x + tanh(gate) * TTT(x) (or of the reversed sequence), in place, in bounded memory (one process,
        no gradients): projections, eta and the elementwise glue over `plan.tokens`-token chunks in scan order,
        written into the scan's input buffers; the scan over `plan.ttt_head_groups` groups of heads; post-norm,
        output projection, gate and residual add over token chunks. `gates`: (text, video) gate parameters."""
        B, L, C = x.shape
        H, D = self.num_heads, self.head_dim
        forward_order, reverse_order, cos, sin = layout_tensors(layout, D, self.rope_theta, x.device)
        scan_order, residual_order = reverse_order if reverse else forward_order
        padded = L + layout.ttt_padding
        groups = torch.arange(H).tensor_split(max(1, min(plan.ttt_head_groups, H)))
        out = None  # every head's scan output [B, H, L + pad, D], in scan order
        for group in groups:
            heads = slice(int(group[0]), int(group[-1]) + 1)
            h = heads.stop - heads.start
            # every token's rows are written below, in place (`out=`): only the padding is zeroed here
            inputs = x.new_empty(3, B, h, padded, D)
            inputs[:, :, :, L:] = 0
            eta = torch.zeros(B, h, padded, device=x.device, dtype=torch.float32)
            project = self.qkv_product(heads)
            for s, e in token_chunks(0, L, plan.tokens):
                xs = gather_tokens(x, scan_order[s:e])
                qkv = project(xs).unflatten(-1, (3, h, D))
                prepare_scan_inputs(qkv, cos[s:e], sin[s:e], self.ttt_norm_weight[heads], self.ttt_norm_bias[heads],
                                    0, x.dtype, self.backend, self.compile_glue, out=inputs[:, :, :, s:e])
                eta[:, :, s:e] = self.eta(xs, layout.mini_batch_size, heads).transpose(1, 2)
            del xs, qkv, project
            result = self.scan(inputs[0], inputs[1], inputs[2], eta, layout, heads)
            del inputs, eta
            if len(groups) == 1:
                out = result
            else:
                if out is None:
                    out = x.new_empty(B, H, padded, D)
                out[:, heads] = result
            del result
        T = layout.total_text_tokens
        text_gate, video_gate = (torch.tanh(g).to(x.dtype) for g in gates)
        for s, e, is_text in modal_chunks(L, T, plan.tokens):
            # eager where the kernel does not run: compiled, each chunk length would be a recompile
            y = self.wo(sampling_post_norm(out, residual_order[s:e], self.post_norm, self.backend, False))
            x[:, s:e].add_(y.mul_(text_gate if is_text else video_gate))

    def qkv_projection(self, heads: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """Weight [3 h D, C] and bias [3 h D] of the q/k/v projections of `heads` (all H by default), stacked."""
        H, D, C = self.num_heads, self.head_dim, self.dim
        w = torch.stack([self.wq.weight, self.wk.weight, self.wv.weight]).view(3, H, D, C)[:, heads]
        b = torch.stack([self.wq.bias, self.wk.bias, self.wv.bias]).view(3, H, D)[:, heads]
        return w.reshape(-1, C), b.reshape(-1)

    def qkv_product(self, heads: slice = slice(None)) -> Callable[[torch.Tensor], torch.Tensor]:
        """The q/k/v projections of `heads` as one product x [..., C] -> [..., 3 h D], its weights stacked once (a
        caller projecting many chunks keeps it). In fp8 where the three multiply in fp8 (sampling with
        sample.fp8_linears = 'all'): a layer class with a `stacked_product` (`models.fp8_storage.Fp8Linear`, a
        layer above this one) returns its own stacked product, or declines (None)."""
        stacked = getattr(type(self.wq), "stacked_product", None)
        product = None if stacked is None else stacked((self.wq, self.wk, self.wv), heads, self.num_heads)
        if product is not None:
            return product
        weight, bias = self.qkv_projection(heads)
        return functools.partial(F.linear, weight=weight, bias=bias)

    def project_qkv(self, x: torch.Tensor, heads: slice = slice(None)) -> torch.Tensor:
        """x [B, L, C] through the q/k/v projections of `heads` in one product: [B, L, 3 h D]."""
        return self.qkv_product(heads)(x)

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The three projections in one matmul: [B, L, C] -> [B, L, 3, H, D]."""
        return self.project_qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim))

    def _scan(self, qkv: torch.Tensor, eta: torch.Tensor, layout: VideoLayout, cos: torch.Tensor, sin: torch.Tensor,
              heads: slice | None, dtype: torch.dtype) -> torch.Tensor:
        """The TTT scan of a whole scan-order sequence: qkv [B, L, 3, h, D], eta [B, L, h] -> [B, L, h, D], where
        the h heads are `heads` of the layer's H (None: all of them); q/k/v enter the scan in `dtype` (the
        residual stream's)."""
        scanned = self._scan_prepared(*self._scan_inputs(qkv, layout, cos, sin, heads, dtype), eta, layout, heads)
        return scanned[:, :, :qkv.shape[1]].transpose(1, 2)

    def _scan_inputs(self, qkv: torch.Tensor, layout: VideoLayout, cos: torch.Tensor, sin: torch.Tensor,
                     heads: slice | None, dtype: torch.dtype) -> torch.Tensor:
        """The scan's q, k, v [3, B, h, L + pad, D] from the projection's output qkv [B, L, 3, h, D]."""
        heads = slice(None) if heads is None else heads
        return prepare_scan_inputs(qkv, cos, sin, self.ttt_norm_weight[heads], self.ttt_norm_bias[heads],
                                   layout.ttt_padding, dtype, self.backend, self.compile_glue)

    def _scan_prepared(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor,
                       layout: VideoLayout, heads: slice | None) -> torch.Tensor:
        """The scan on prepared inputs, eta [B, L, h] padded here (padded tokens: eta = 0, no update)."""
        eta = F.pad(eta.transpose(1, 2), (0, layout.ttt_padding))
        return self.scan(q, k, v, eta, layout, slice(None) if heads is None else heads)

    def scan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, layout: VideoLayout,
             heads: slice = slice(None)) -> torch.Tensor:
        """The scan alone on prepared inputs (`scan_inputs.scan_inputs`): q/k/v [B, h, L + pad, D], eta
        [B, h, L + pad] with zeros on the padding -> [B, h, L + pad, D], with the inner weights of `heads`."""
        scan = ops.ttt_mlp if self.kind == "mlp" else ops.ttt_linear
        return scan(
            q, k, v, eta, self.ttt_norm_weight[heads], self.ttt_norm_bias[heads],
            *(p[heads] for p in self.inner_params()),
            mini_batch_size=layout.mini_batch_size,
            checkpoint_group_size=self.scan_checkpoint_group_size,
            backend=self.backend,
            eta_rows=eta_rows_on(layout, q.device) if self.eta_layout == REFERENCE else None,
        )


class BidirectionalTTT(GatedBidirectional):
    """Forward and reverse TTT passes sharing all parameters, each behind per-modality tanh gates."""

    def __init__(self, dim: int, num_heads: int, config: TTTConfig | None = None):
        config = config if config is not None else TTTConfig()
        super().__init__(TTTLayer(dim, num_heads, config), dim, config.gate_init)
