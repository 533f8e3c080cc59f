"""The TTT layer module: gates, interleave semantics, forward and reverse passes."""

from __future__ import annotations

import pytest
import torch

from tttvideo.config.schema import TTTConfig
from tttvideo.layout import VideoLayout
from tttvideo.ttt.layer import BidirectionalTTT, TTTLayer

DIM, HEADS = 64, 4


def layout(duration, text=5, mb=16):
    return VideoLayout.create(duration, height=32, width=48, text_tokens=text, mini_batch_size=mb)


def block(kind="mlp", **kw):
    """The mini-batch comes from the layout the block is called with."""
    torch.manual_seed(0)
    base_lr = 0.1 if kind == "mlp" else 1.0
    return BidirectionalTTT(DIM, HEADS, TTTConfig(kind=kind, base_lr=base_lr, scan_checkpoint_group_size=2, **kw))


def test_zero_gates_return_the_input_exactly():
    lay = layout("9s")
    m = block()
    with torch.no_grad():
        for g in (m.forward_gate_text, m.forward_gate_video, m.reverse_gate_text, m.reverse_gate_video):
            g.zero_()
    x = torch.randn(2, lay.total_tokens, DIM)
    assert torch.equal(m(x, lay), x)


def test_gates_start_at_0_1():
    m = block()
    assert torch.all(m.forward_gate_video == 0.1) and torch.all(m.reverse_gate_text == 0.1)


@pytest.mark.parametrize("kind", ["mlp", "linear"])
@pytest.mark.parametrize("duration", ["3s", "9s"])
def test_forward_and_backward_run(kind, duration):
    lay = layout(duration)
    assert lay.ttt_padding > 0  # exercise padding too
    m = block(kind)
    x = torch.randn(2, lay.total_tokens, DIM, requires_grad=True)
    y = m(x, lay)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.square().mean().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"no gradient reaches {name}"


def test_scan_order_is_the_segment_interleave():
    """Across mini-batches TTT is causal in the interleaved order [text_0, frames_0, text_1, ...]: changing the
    last segment's frames must leave text_0 untouched (its mini-batches come first) and change the last segment."""
    lay = layout("9s", text=16, mb=16)
    layer = TTTLayer(DIM, HEADS, TTTConfig(scan_checkpoint_group_size=0))
    x = torch.randn(1, lay.total_tokens, DIM)
    x2 = x.clone()
    last = lay.frames_slice(lay.segment_own_frames(2))
    x2[:, last] += torch.randn_like(x2[:, last])
    with torch.no_grad():
        y, y2 = layer(x, lay), layer(x2, lay)
    text0 = lay.text_slice(0)
    assert torch.equal(y[:, text0], y2[:, text0])
    first_frames = lay.frames_slice(range(0, 12))
    assert torch.equal(y[:, first_frames], y2[:, first_frames])
    assert not torch.allclose(y[:, last], y2[:, last])
    # in residual order text_2 comes before all video, yet it follows segment 1's frames in the scan
    mid = lay.frames_slice(lay.segment_own_frames(1))
    x3 = x.clone()
    x3[:, mid] += 1.0
    with torch.no_grad():
        y3 = layer(x3, lay)
    assert not torch.allclose(y[:, lay.text_slice(2)], y3[:, lay.text_slice(2)])
    assert torch.equal(y[:, lay.text_slice(0)], y3[:, lay.text_slice(0)])


def test_reverse_pass_sees_the_future():
    """With the forward gates at 0, only the reverse pass acts: the first frames now depend on the last ones."""
    lay = layout("9s", text=16, mb=16)
    m = block()
    with torch.no_grad():
        m.forward_gate_text.zero_()
        m.forward_gate_video.zero_()
    x = torch.randn(1, lay.total_tokens, DIM)
    x2 = x.clone()
    last = lay.frames_slice(range(lay.latent_frames - 2, lay.latent_frames))
    x2[:, last] += 1.0
    with torch.no_grad():
        y, y2 = m(x, lay), m(x2, lay)
    first = lay.frames_slice(range(0, 2))
    assert not torch.allclose(y[:, first], y2[:, first])


def test_eta_formula():
    layer = TTTLayer(DIM, HEADS, TTTConfig(base_lr=0.1))
    with torch.no_grad():
        layer.learnable_ttt_lr_weight.zero_()
        layer.learnable_ttt_lr_bias.zero_()
    eta = layer.eta(torch.randn(1, 3, DIM), 16)
    torch.testing.assert_close(eta, torch.full((1, 3, HEADS), 0.1 * 0.5 / (16 * 16)))


def test_sequence_length_mismatch_is_a_sentence():
    lay = layout("9s")
    m = block()
    with pytest.raises(Exception, match="does not match the 9 s layout"):
        m(torch.randn(1, lay.total_tokens - 5, DIM), lay)


def test_checkpointed_passes_match():
    lay = layout("3s")
    m = block()
    x = torch.randn(1, lay.total_tokens, DIM, requires_grad=True)
    y = m(x, lay)
    (g,) = torch.autograd.grad(y.square().sum(), x)
    m.checkpoint_forward = m.checkpoint_reverse = True
    y2 = m(x, lay)
    (g2,) = torch.autograd.grad(y2.square().sum(), x)
    torch.testing.assert_close(y2, y, rtol=0, atol=0)
    torch.testing.assert_close(g2, g, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["mlp", "linear"])
@pytest.mark.parametrize("duration,text", [("3s", 5), ("9s", 7)])
def test_layer_equals_the_plain_composition(kind, duration, text):
    """Forward and every gradient of the layer equal the plain composition (tttvideo.ttt.plain_layer), fp32."""
    from tttvideo.ttt.plain_layer import plain_ttt_layer

    lay = layout(duration, text=text)
    torch.manual_seed(1)
    layer = TTTLayer(DIM, HEADS, TTTConfig(kind=kind, scan_checkpoint_group_size=2,
                                           base_lr=0.1 if kind == "mlp" else 1.0, backend="reference"))
    with torch.no_grad():  # non-trivial norms and biases, so that every path matters
        for p in (layer.ttt_norm_weight, layer.ttt_norm_bias, layer.b1, layer.learnable_ttt_lr_bias,
                  layer.wq.bias, layer.wk.bias, layer.wv.bias):
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, lay.total_tokens, DIM, requires_grad=True)
    y = layer(x, lay)
    y_ref = plain_ttt_layer(layer, x, lay)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(y)
    params = [x, *layer.parameters()]
    grads = torch.autograd.grad((y * w).sum(), params)
    grads_ref = torch.autograd.grad((y_ref * w).sum(), params)
    names = ["x", *(n for n, _ in layer.named_parameters())]
    for name, a, b in zip(names, grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"gradient w.r.t. {name}")


def test_gather_tokens_equals_indexing():
    """gather_tokens (one row gather over batch x tokens) is x[:, index], forward and backward, contiguous or not."""
    from tttvideo.sequence.bidirectional import gather_tokens

    x = torch.randn(3, 10, 4, 5, requires_grad=True)
    index = torch.randperm(10)[:7]
    for t in (x, x[:1], x.transpose(1, 2).contiguous().transpose(1, 2)):
        assert torch.equal(gather_tokens(t, index), t[:, index])
    w = torch.randn(3, 7, 4, 5)
    got = torch.autograd.grad((gather_tokens(x, index) * w).sum(), x)[0]
    want = torch.autograd.grad((x[:, index] * w).sum(), x)[0]
    assert torch.equal(got, want)


@pytest.mark.parametrize("duration,text", [("3s", 5), ("9s", 7)])
def test_sampling_forward_equals_the_plain_composition(duration, text):
    """Without gradients the layer takes the sampling output path (the residual order restored before the post-norm
    and the output projection, `post_norm_rows`): equal to the plain composition and to the path with gradients,
    fp32, padding included."""
    from tttvideo.ttt.plain_layer import plain_ttt_layer

    lay = layout(duration, text=text)
    assert lay.ttt_padding > 0
    torch.manual_seed(2)
    layer = TTTLayer(DIM, HEADS, TTTConfig(kind="mlp", scan_checkpoint_group_size=2, base_lr=0.1,
                                           backend="reference"))
    with torch.no_grad():
        layer.post_norm.weight.add_(0.3 * torch.randn_like(layer.post_norm.weight))
        layer.post_norm.bias.add_(0.3 * torch.randn_like(layer.post_norm.bias))
    x = torch.randn(2, lay.total_tokens, DIM)
    with torch.no_grad():
        sampled = layer(x, lay)
        reverse = layer(x, lay, reverse=True)
    trained = layer(x.requires_grad_(), lay)
    torch.testing.assert_close(sampled, trained.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sampled, plain_ttt_layer(layer, x, lay).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reverse, layer(x, lay, reverse=True).detach(), rtol=1e-6, atol=1e-6)


def test_post_norm_rows_is_transpose_gather_norm():
    """post_norm_rows: the rows of [B, H, L + pad, D] at `index`, heads joined, layer-normalised; bit for bit the
    eager composition it replaces (transpose, join, norm, then the gather)."""
    from tttvideo.ttt.layer import post_norm_rows

    B, H, L, pad, D = 2, 3, 11, 5, 4
    scanned = torch.randn(B, H, L + pad, D)
    index = torch.randperm(L)
    w, b = torch.randn(H * D), torch.randn(H * D)
    want = torch.nn.functional.layer_norm(scanned[:, :, :L].transpose(1, 2).reshape(B, L, H * D), (H * D,), w, b,
                                          1e-6)[:, index]
    assert torch.equal(post_norm_rows(scanned, index, w, b, 1e-6), want)


def test_gates_add_in_one_rounding():
    """The gated residual x + tanh(gate) * y (text gate on the text tokens): the fp32 sum of the bf16 operands,
    rounded once to bf16, where a product rounded before the sum would differ."""
    lay = layout("3s")
    m = block()
    with torch.no_grad():
        m.forward_gate_text.normal_()
        m.forward_gate_video.normal_()
    T = lay.total_text_tokens
    x = torch.randn(2, lay.total_tokens, DIM, dtype=torch.bfloat16)
    y = torch.randn_like(x)
    got = m._gated_residual(x, y, T, m.forward_gate_text, m.forward_gate_video)
    gates = torch.cat([torch.tanh(m.forward_gate_text).bfloat16().expand(T, DIM),
                       torch.tanh(m.forward_gate_video).bfloat16().expand(lay.total_tokens - T, DIM)]).float()
    want = (x.float() + y.float() * gates).bfloat16()
    assert torch.equal(got, want)
    assert not torch.equal(want, x + y * gates.bfloat16())  # the two-rounding form differs somewhere


def test_sampling_frees_the_projection_before_the_scan():
    """Without gradients the layer drops the scan-order copy of its input and the q/k/v projection's output once
    read (16 GiB of a guided 63-s block): while each pass scans, neither is alive (memory.trace.LiveBytes, CPU)."""
    from tttvideo.memory.trace.live_bytes import LiveBytes

    lay = layout("9s")
    m = block()
    m.requires_grad_(False)
    x = torch.randn(2, lay.total_tokens, DIM)
    seen = []
    scan = m.ttt.scan

    def watched(*args, **kwargs):
        seen.append([a for a in live._live.values() if a.shape[-1] in (DIM, 3 * DIM)])  # rows of x or of q/k/v
        return scan(*args, **kwargs)

    m.ttt.scan = watched
    with torch.no_grad(), LiveBytes(m) as live:
        x = x.clone()  # the input, allocated where it is counted
        m(x, lay)
    assert len(seen) == 2  # the forward and the reverse pass
    for alive in seen:
        assert not [a for a in alive if "project_qkv" in a.site or "gather_tokens" in a.site], alive
        assert [a for a in alive if a.shape == tuple(x.shape)]  # the block's input itself is still there
