"""The Wan block's training form with the memory switches on (`checkpointing.attention_by_window`,
`ttt_chunk_tokens`, `ttt_head_groups`: windows split from the stream and projected inside their checkpoints, the TTT
passes as `TTTLayer.gated_pass` with the gated add folded in, attention and the forward pass under one checkpoint)
computes the plain block: the same output and the same gradients of the block's inputs and of every parameter.

In float64 the two differ only where Wan's block rounds to fp32 by design (its norms, modulation and gated add, as
diffusers' does) and the TTT layer's eta gate (fp32 sigmoid): a matrix product over other rows can move a last bit
that such a rounding keeps. Measured: 1e-6 of the largest element at worst (the TTT learning-rate bias, which the
scan amplifies), 1e-7 elsewhere; a chunk or window written to the wrong place, a lost flip or a lost gate is off by
O(1) (`test_a_wrong_reversal_is_seen`). In fp32 the scan amplifies last-bit differences to ~1e-4 of the lr bias's
largest element (tests/test_ffn_chunks.py's docstring), so fp32 is compared at bounds measured for it (`test_fp32`)."""

from __future__ import annotations

import copy

import pytest
import torch

from tttvideo.config.schema import TTTConfig
from tttvideo.models.wan.block import WanBlock, window_pieces
from tttvideo.models.wan.layout import wan_layout_from_latents
from tttvideo.models.wan.spec import get_wan_preset
from tttvideo.sequence.bidirectional import GatedBidirectional, gated
from tttvideo.ttt.layer import TTTLayer

pytestmark = pytest.mark.usefixtures("one_thread")

TTT = TTTConfig(mini_batch_size=16, scan_checkpoint_group_size=2, gate_init=0.1)
CHUNK = 7  # tokens: divides no stream below, so every chunked loop has a short last chunk


def _layout(frames: int = 37):
    """Three 3-s windows (two shared frames) of 2x3 tokens a frame: 222 tokens, padded to the mini-batch."""
    layout = wan_layout_from_latents(frames, 4, 6, 2, TTT.mini_batch_size)
    assert layout.num_segments > 1 and layout.ttt_padding > 0 and layout.total_tokens % CHUNK
    return layout


def _inputs(layout, dtype, dim: int = 64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, layout.total_tokens, dim, generator=g, dtype=dtype)
    text = torch.randn(1, layout.num_segments, 5, dim, generator=g, dtype=dtype)
    projection = torch.randn(1, 6, dim, generator=g, dtype=dtype)
    weight = torch.randn(x.shape, generator=g, dtype=dtype)
    return x, text, projection, weight


def _switch(block: WanBlock, checkpoint: bool, by_window: bool, chunk: int, groups: int,
            merged: bool = True) -> WanBlock:
    """`block` with the switches `apply_checkpointing` sets; merged=False checkpoints the forward TTT pass apart
    from the attention (no shared checkpoint)."""
    block.checkpoint_attention = block.checkpoint_mlp = checkpoint
    block.ttt.checkpoint_forward = checkpoint and merged
    block.ttt.checkpoint_reverse = checkpoint
    block.attention_by_window = by_window
    block.ttt.ttt.chunk_tokens, block.ttt.ttt.head_groups = chunk, groups
    block.ffn.chunk_tokens = chunk
    return block


def _run(block: WanBlock, layout, dtype, outer_checkpoint: bool):
    """Output and gradients of (block(x) * weight).sum(): of x, the text, the time projection and every parameter
    (a parameter without one is None, so a lost path is seen)."""
    x, text, projection, weight = (t.requires_grad_(i < 3) for i, t in enumerate(_inputs(layout, dtype)))
    if outer_checkpoint:  # as a checkpointed block unit runs it: forward, then its recompute inside backward
        y = torch.utils.checkpoint.checkpoint(block, x, text, projection, layout, use_reentrant=False)
    else:
        y = block(x, text, projection, layout)
    (y * weight).sum().backward()
    grads = {n: p.grad for n, p in block.named_parameters()}
    grads.update(x=x.grad, text=text.grad, projection=projection.grad)
    return y.detach(), grads


def _plain_block(dtype) -> WanBlock:
    torch.manual_seed(0)
    return WanBlock(get_wan_preset("wan-tiny"), TTT).to(dtype)


def _compare(plain, other, rel: float, least: int = 30) -> None:
    (y0, g0), (y1, g1) = plain, other
    torch.testing.assert_close(y1, y0, rtol=rel, atol=rel * float(y0.abs().max()))
    assert g1.keys() == g0.keys() and len(g0) > least
    for name, g in g0.items():
        assert g is not None and g1[name] is not None, name
        torch.testing.assert_close(g1[name], g, rtol=rel, atol=rel * float(g.abs().max()), msg=name)


@pytest.mark.parametrize("groups", [1, 2], ids=["all heads", "2 head groups"])
@pytest.mark.parametrize("outer", [False, True], ids=["block", "checkpointed unit"])
def test_switched_block_is_the_plain_block(groups, outer):
    layout = _layout()
    plain = _run(_plain_block(torch.float64), layout, torch.float64, outer)
    block = _switch(_plain_block(torch.float64), True, True, CHUNK, groups)
    _compare(plain, _run(block, layout, torch.float64, outer), 2e-6)
    # the TTT text gates multiply no token, as in the plain block: zero gradients, not missing ones
    assert float(plain[1]["ttt.forward_gate_text"].abs().max()) == 0


@pytest.mark.parametrize("case", ["no checkpoints", "TTT pass checkpointed apart", "windows off", "one segment"])
def test_every_path_of_the_training_form(case):
    frames = 13 if case == "one segment" else 37
    layout = wan_layout_from_latents(frames, 4, 6, 2, TTT.mini_batch_size)
    plain = _run(_plain_block(torch.float64), layout, torch.float64, True)
    checkpoint, by_window, merged = {"no checkpoints": (False, True, True),
                                     "TTT pass checkpointed apart": (True, True, False),
                                     "windows off": (True, False, True), "one segment": (True, True, True)}[case]
    block = _switch(_plain_block(torch.float64), checkpoint, by_window, CHUNK, 2, merged)
    _compare(plain, _run(block, layout, torch.float64, True), 2e-6)


def test_one_way_ttt_layer():
    """A long-range layer with one pass (bidirectional = False): the block's gated add folded into that pass."""
    layout = _layout()

    def one_way(block: WanBlock) -> WanBlock:
        torch.manual_seed(3)
        inner = TTTLayer(64, 4, TTT).double()
        block.ttt = GatedBidirectional(inner, 64, 0.1, bidirectional=False).double()
        return block

    plain = _run(one_way(_plain_block(torch.float64)), layout, torch.float64, True)
    block = _switch(one_way(_plain_block(torch.float64)), True, True, CHUNK, 2)
    _compare(plain, _run(block, layout, torch.float64, True), 2e-6)


def test_fp32():
    """The same in fp32, the dtype the block runs in on a CPU. Measured: the output to 2e-7, every gradient to 1e-6
    but the TTT learning-rate gate's (1e-5 for its weight, 1.2e-4 for its bias: the scan amplifies last bits)."""
    layout = _layout()
    (y0, g0) = _run(_plain_block(torch.float32), layout, torch.float32, True)
    (y1, g1) = _run(_switch(_plain_block(torch.float32), True, True, CHUNK, 2), layout, torch.float32, True)
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6 * float(y0.abs().max()))
    for name, g in g0.items():
        rel = 3e-4 if "learnable_ttt_lr" in name else 3e-6
        torch.testing.assert_close(g1[name], g, rtol=rel, atol=rel * float(g.abs().max()), msg=name)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward pass", "reverse pass"])
@pytest.mark.parametrize("residual", [False, True], ids=["pass", "pass and gated add"])
def test_gated_pass_is_the_gated_layer(reverse, residual):
    """TTTLayer.gated_pass = x + tanh(gate) TTT(x) [and (r + z gate) in fp32]: output and every gradient."""
    layout = _layout()
    torch.manual_seed(0)
    layer = TTTLayer(64, 4, TTT).double()
    gates = (torch.full((64,), 0.3, dtype=torch.float64), torch.linspace(-1, 1, 64, dtype=torch.float64))
    x, _, _, weight = _inputs(layout, torch.float64)
    r = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    g = torch.randn(1, 1, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(6))

    def run(chunk: int):
        layer.zero_grad()
        leaves = [t.clone().requires_grad_() for t in (x, r, g, *gates)]
        xs, rs, gs, text_gate, video_gate = leaves
        layer.chunk_tokens, layer.head_groups = chunk, 2
        if chunk:
            assert layer.uses_gated_pass(layout, xs.shape[1])
            y = layer.gated_pass(xs, layout, reverse, (text_gate, video_gate), *((rs, gs) if residual else ()))
        else:
            y = xs + gated(layer(xs, layout, reverse), text_gate, video_gate, 0)
            if residual:
                y = (rs.float() + y * gs).to(xs.dtype)
        (y * weight).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        grads.update({f"leaf {i}": t.grad for i, t in enumerate(leaves) if residual or i not in (1, 2)})
        return y.detach(), grads

    _compare(run(0), run(CHUNK), 1e-6, least=12)


def test_a_wrong_reversal_is_seen():
    """The comparisons above can fail: the forward pass's result is far from the reverse pass's."""
    layout = _layout()
    torch.manual_seed(0)
    layer = TTTLayer(64, 4, TTT).double()
    layer.chunk_tokens = CHUNK
    x = _inputs(layout, torch.float64)[0]
    gates = (torch.zeros(64, dtype=torch.float64), torch.ones(64, dtype=torch.float64))
    with torch.enable_grad():
        forward, backward = (layer.gated_pass(x, layout, r, gates).detach() for r in (False, True))
    assert float((forward - backward).abs().max()) > 1e-2 * float(forward.abs().max())


def test_window_pieces_cover_each_window():
    for frames in (13, 25, 37):
        layout = wan_layout_from_latents(frames, 4, 6, 2, 16)
        sizes, spans = window_pieces(layout)
        assert sum(sizes) == layout.total_tokens and len(spans) == layout.num_segments
        starts = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
        for i, (first, last) in enumerate(spans):
            assert torch.equal(layout.window_index(i), torch.arange(starts[first], starts[last]))


def test_without_gradients_the_block_is_unchanged():
    """No gradients: the plain forward whatever the switches (the chunked inference form is apart)."""
    layout = _layout()
    x, text, projection, _ = _inputs(layout, torch.float64)
    with torch.no_grad():
        plain = _plain_block(torch.float64)(x, text, projection, layout)
        block = _switch(copy.deepcopy(_plain_block(torch.float64)), True, True, CHUNK, 2)
        torch.testing.assert_close(block(x, text, projection, layout), plain, rtol=0, atol=0)
