"""A block's forward without gradients in bounded memory (`memory.chunked_inference`).

The plain forward holds, per block, several tensors the size of the whole sequence at once: q/k/v and their window
copies in attention, q/k/v in two layouts and in fp32 for each TTT pass, the MLP's 4x hidden layer. At 63 s
(351,168 tokens) one bf16 copy of the residual stream is 2.0 GiB and the MLP's hidden layer 8.0 GiB, which is why a
63-s step does not fit a 24 GB card. Without gradients nothing has to be kept for a backward, so the same arithmetic
runs piece by piece:

- attention one window at a time: adaLN, q/k/v, their norms, RoPE and SDPA of window i, summed into one accumulator
  the size of the residual stream; then the overlap average and the output projection over token chunks, in place;
- each TTT pass: projections, eta and the elementwise glue over token chunks in scan order, written into the scan's
  input buffers; the scan over `ttt_head_groups` groups of heads; post-norm, output projection, gate and residual
  add over token chunks, in place;
- the MLP over token chunks, added into the residual stream in place.

What is alive at the peak (inside a TTT scan), in copies of the residual stream (2.0 GiB at 63 s): the stream, the
attention output, the scan's q/k/v and output for one head group (4 / G) and, with G > 1, the output of all heads
(1): 6 copies with G = 1, 4 with G = 4; plus one chunk's work. The scan is serial along the sequence and parallel
over heads, so each group of heads costs about as long as the whole scan did: G = 1 is the fastest, larger G only
for the smallest cards (docs/memory.md has the measured figures).

The result equals the plain forward's up to the summation order inside the matmuls (the tests compare them). The
chunked forward updates the residual stream `x` in place and returns it: the model owns that tensor (it is built
from the embeddings in `CogVideoXTTT.forward`), which is what saves its copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn.functional as F

from tttvideo.config.schema import MemoryConfig
from tttvideo.layout import VideoLayout
from tttvideo.models.attention import window_tensors
from tttvideo.rope import apply_rope
from tttvideo.sequence.bidirectional import gather_tokens
from tttvideo.ttt.layer import layout_tensors
from tttvideo.ttt.scan_inputs import prepare_scan_inputs

if TYPE_CHECKING:
    from tttvideo.models.block import Block
    from tttvideo.ttt.layer import BidirectionalTTT, TTTLayer


@dataclass(frozen=True)
class ChunkPlan:
    """How the chunked forward cuts the work: `tokens` per chunk of token-local work, the TTT heads in
    `ttt_head_groups` groups."""

    tokens: int = 16384
    ttt_head_groups: int = 1


def apply_chunked_inference(model: torch.nn.Module, memory: MemoryConfig) -> None:
    """Give every block of `model` the plan of `memory` (or none when `memory.chunked_inference` is off)."""
    plan = (ChunkPlan(memory.inference_chunk_tokens, memory.ttt_head_groups) if memory.chunked_inference
            else None)
    for block in model.blocks:
        block.inference_chunks = plan


def _chunks(start: int, stop: int, size: int) -> Iterator[tuple[int, int]]:
    for s in range(start, stop, size):
        yield s, min(s + size, stop)


def _modal_chunks(length: int, text_tokens: int, size: int) -> Iterator[tuple[int, int, bool]]:
    """Token ranges of at most `size` that never straddle the text / video boundary: (start, stop, is_text)."""
    for s, e in _chunks(0, text_tokens, size):
        yield s, e, True
    for s, e in _chunks(text_tokens, length, size):
        yield s, e, False


def block_forward(block: Block, x: torch.Tensor, temb_act: torch.Tensor, layout: VideoLayout,
                  plan: ChunkPlan) -> torch.Tensor:
    """`Block.forward` without gradients and without sequence parallelism, in bounded memory; x [B, L, C] is updated
    in place and returned. The adaLN layers run per window or chunk (their modulation linear is a [B, 6C] vector:
    recomputing it is free)."""
    T = layout.total_text_tokens
    a = _attention(block, x, temb_act, layout, plan)
    if block.ttt is not None:
        _bidirectional_ttt(block.ttt, a, layout, plan)
    gate, t_gate = block.norm1.gates(temb_act)
    x[:, :T].addcmul_(a[:, :T], t_gate[:, None])
    x[:, T:].addcmul_(a[:, T:], gate[:, None])
    del a
    for s, e, is_text in _modal_chunks(x.shape[1], T, plan.tokens):
        h, gate, t_gate = block.norm2(x[:, s:e], temb_act, e - s if is_text else 0, compile_glue=False)
        x[:, s:e].addcmul_(block.mlp(h), (t_gate if is_text else gate)[:, None])
    return x


def _attention(block: Block, x: torch.Tensor, temb_act: torch.Tensor, layout: VideoLayout,
               plan: ChunkPlan) -> torch.Tensor:
    """adaLN1 + LocalAttention one window at a time -> the attention output [B, L, C] (a new tensor)."""
    attn = block.attn
    B, L, _ = x.shape
    H, D = attn.num_heads, attn.head_dim
    index, cos, sin, inv_count = window_tensors(layout, D, attn.rope_theta, x.device)
    n, W = index.shape
    acc = x.new_zeros(B, L, H * D)
    for i in range(n):
        idx = index[i]
        # every window starts with its text; eager, as the chunks' shapes vary
        h, _, _ = block.norm1(x[:, idx], temb_act, layout.text_tokens, compile_glue=False)
        q = attn.norm_q(attn.to_q(h).view(B, W, H, D)).transpose(1, 2)
        k = attn.norm_k(attn.to_k(h).view(B, W, H, D)).transpose(1, 2)
        v = attn.to_v(h).view(B, W, H, D).transpose(1, 2)
        del h
        out = F.scaled_dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, dropout_p=0.0,
                                             is_causal=False)
        del q, k, v
        acc.index_add_(1, idx, out.transpose(1, 2).reshape(B, W, H * D))
    if n > 1:
        acc.mul_(inv_count.to(acc.dtype))
    for s, e in _chunks(0, L, plan.tokens):
        acc[:, s:e] = attn.to_out(acc[:, s:e])
    return acc


def _bidirectional_ttt(bt: BidirectionalTTT, a: torch.Tensor, layout: VideoLayout, plan: ChunkPlan) -> None:
    """a <- Z' of `BidirectionalTTT` (the forward pass, gate, add; the reverse pass on the result, gate, add), in
    place."""
    _ttt_pass(bt.ttt, a, layout, plan, False, (bt.forward_gate_text, bt.forward_gate_video))
    _ttt_pass(bt.ttt, a, layout, plan, True, (bt.reverse_gate_text, bt.reverse_gate_video))


def _ttt_pass(layer: TTTLayer, x: torch.Tensor, layout: VideoLayout, plan: ChunkPlan, reverse: bool,
              gates: tuple[torch.Tensor, torch.Tensor]) -> None:
    """x <- x + tanh(gate) * TTT(x) (or of the reversed sequence), in place."""
    B, L, C = x.shape
    H, D = layer.num_heads, layer.head_dim
    forward_order, reverse_order, cos, sin = layout_tensors(layout, D, layer.rope_theta, x.device)
    scan_order, residual_order = reverse_order if reverse else forward_order
    padded = L + layout.ttt_padding
    groups = torch.arange(H).tensor_split(max(1, min(plan.ttt_head_groups, H)))
    out = None  # every head's scan output [B, H, L + pad, D], in scan order
    for group in groups:
        heads = slice(int(group[0]), int(group[-1]) + 1)
        h = heads.stop - heads.start
        inputs = x.new_zeros(3, B, h, padded, D)
        eta = torch.zeros(B, h, padded, device=x.device, dtype=torch.float32)
        w_qkv, b_qkv = layer.qkv_projection(heads)
        for s, e in _chunks(0, L, plan.tokens):
            xs = gather_tokens(x, scan_order[s:e])
            qkv = F.linear(xs, w_qkv, b_qkv).unflatten(-1, (3, h, D))
            inputs[:, :, :, s:e] = prepare_scan_inputs(qkv, cos[s:e], sin[s:e], layer.ttt_norm_weight[heads],
                                                       layer.ttt_norm_bias[heads], 0, x.dtype, layer.backend,
                                                       layer.compile_glue)
            eta[:, :, s:e] = layer.eta(xs, layout.mini_batch_size, heads).transpose(1, 2)
        del xs, qkv, w_qkv
        result = layer.scan(inputs[0], inputs[1], inputs[2], eta, layout, heads)
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
    for s, e, is_text in _modal_chunks(L, T, plan.tokens):
        y = out[:, :, residual_order[s:e]].transpose(1, 2).reshape(B, e - s, C).to(x.dtype)
        y = layer.wo(layer.post_norm(y))
        x[:, s:e].add_(y.mul_(text_gate if is_text else video_gate))
