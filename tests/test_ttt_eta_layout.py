"""ttt.eta_layout = "reference": the reference system's learning-rate matrices, against a plain statement of them.

The statement (from the reference system's documented layout, not its code): the sequence a pass is given is cut
into mini-batches of b tokens in its own (residual) order; each mini-batch gets a b x b matrix whose every row is
that mini-batch's per-token rates (the column j multiplies key j); the matrices' rows are then moved into the scan
order of the segment interleave like any per-token tensor, and their columns are not. Padding (our extension; the
reference system never pads) is appended at the end of both orders with rate 0.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.ttt_naive import naive_ttt_matrices
from tttvideo.config.schema import TTTConfig
from tttvideo.layout import VideoLayout
from tttvideo.ttt import ops
from tttvideo.ttt.eta_layout import misplaced_share, per_token_eta_rows, reference_eta_rows
from tttvideo.ttt.layer import BidirectionalTTT, TTTLayer
from tttvideo.ttt.plain_layer import plain_ttt_layer

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_layout(segments: int, text: int = 2, mb: int = 4) -> VideoLayout:
    """One token per latent frame (16 x 16 pixels): 13 + 12 (n - 1) video tokens and `text` per segment."""
    return VideoLayout.create(3 * segments, height=16, width=16, text_tokens=text, mini_batch_size=mb)


def stated_matrices(rates_residual: torch.Tensor, layout: VideoLayout) -> torch.Tensor:
    """The plain statement: rates [..., P] in residual order (padding included) -> matrices [..., P, b] in scan
    order, built one mini-batch and one row at a time."""
    b, P, L = layout.mini_batch_size, layout.ttt_tokens, layout.total_tokens
    residual_rows = torch.empty(*rates_residual.shape, b, dtype=rates_residual.dtype)
    for m in range(P // b):
        for i in range(b):
            residual_rows[..., m * b + i, :] = rates_residual[..., m * b:(m + 1) * b]
    scan_to_residual = list(layout.interleave_perm.tolist()) + list(range(L, P))
    return torch.stack([residual_rows[..., r, :] for r in scan_to_residual], dim=-2)


@pytest.mark.parametrize("segments", range(1, 22))
def test_rows_are_the_stated_matrices(segments):
    lay = tiny_layout(segments, text=3, mb=8)
    P = lay.ttt_tokens
    scan_to_residual = torch.cat([lay.interleave_perm, torch.arange(lay.total_tokens, P)])
    # rates that name their own token: the matrices then hold residual positions, the rows scan positions of them
    stated = stated_matrices(torch.arange(P, dtype=torch.float64), lay).long()
    assert torch.equal(scan_to_residual[reference_eta_rows(lay)], stated)
    same = torch.equal(reference_eta_rows(lay), per_token_eta_rows(lay))
    assert same == (segments == 1)


def test_misplaced_share_on_the_5b_layouts():
    """The shares the issue counted on the real 480x720 layouts at mini-batch 64."""
    shares = {d: misplaced_share(VideoLayout.create(d, mini_batch_size=64)) for d in (3, 9, 18, 63)}
    assert {d: round(s, 2) for d, s in shares.items()} == {3: 0.0, 9: 0.68, 18: 0.84, 63: 0.95}


def scan_inputs(kind, lay, B=1, H=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    P, L = lay.ttt_tokens, lay.total_tokens
    q = torch.nn.functional.normalize(r(B, H, P, D), dim=-1)
    k = torch.nn.functional.normalize(r(B, H, P, D), dim=-1)
    v = r(B, H, P, D)
    eta = torch.rand(B, H, P, generator=g, dtype=torch.float64) * 0.5
    eta[..., L:] = 0  # padding
    E = 4 * D if kind == "mlp" else D
    params = [0.3 * r(H, D, E), 0.1 * r(H, E)] + ([0.3 * r(H, E, D), 0.1 * r(H, D)] if kind == "mlp" else [])
    tensors = [q, k, v, eta, 1 + 0.1 * r(H, D), 0.1 * r(H, D), *params]
    return [t.requires_grad_() for t in tensors]


def grads_of(out, tensors, seed=1):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * w).sum(), tensors)


NAMES = ["q", "k", "v", "eta", "norm_w", "norm_b", "W1", "b1", "W2", "b2"]


@pytest.mark.parametrize("kind,segments,group", [("mlp", 1, 0), ("mlp", 2, 3), ("mlp", 21, 0), ("linear", 3, 2),
                                                 ("linear", 21, 4)])
def test_scan_equals_the_naive_scan_of_the_stated_matrices(kind, segments, group):
    lay = tiny_layout(segments)
    tensors = scan_inputs(kind, lay, seed=segments)
    scan = ops.ttt_mlp if kind == "mlp" else ops.ttt_linear
    out = scan(*tensors, mini_batch_size=lay.mini_batch_size, checkpoint_group_size=group, backend="reference",
               eta_rows=reference_eta_rows(lay))
    q, k, v, eta = tensors[:4]
    # the per-token rates the scan got are in scan order; the statement starts from the residual order
    residual = torch.empty_like(eta)
    residual[..., torch.cat([lay.interleave_perm, torch.arange(lay.total_tokens, lay.ttt_tokens)])] = eta
    naive = naive_ttt_matrices(q, k, v, stated_matrices(residual, lay), *tensors[4:6], tensors[6:],
                               lay.mini_batch_size, kind)
    torch.testing.assert_close(out, naive, rtol=1e-9, atol=1e-10)
    for name, a, b in zip(NAMES, grads_of(out, tensors), grads_of(naive, tensors)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"gradient w.r.t. {name}")


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_one_segment_is_the_per_token_scan(kind):
    lay = tiny_layout(1, text=2, mb=8)
    assert lay.ttt_padding > 0
    tensors = scan_inputs(kind, lay, seed=7)
    scan = ops.ttt_mlp if kind == "mlp" else ops.ttt_linear
    per_token = scan(*tensors, mini_batch_size=8, checkpoint_group_size=2, backend="reference")
    reference = scan(*tensors, mini_batch_size=8, checkpoint_group_size=2, backend="reference",
                     eta_rows=reference_eta_rows(lay))
    torch.testing.assert_close(reference, per_token, rtol=1e-10, atol=1e-12)
    for name, a, b in zip(NAMES, grads_of(reference, tensors), grads_of(per_token, tensors)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=f"gradient w.r.t. {name}")


DIM, HEADS = 32, 2


def layer_pair(kind):
    torch.manual_seed(3)
    per_token = BidirectionalTTT(DIM, HEADS, TTTConfig(kind=kind, scan_checkpoint_group_size=2)).double()
    reference = BidirectionalTTT(DIM, HEADS, TTTConfig(kind=kind, scan_checkpoint_group_size=2,
                                                       eta_layout="reference")).double()
    reference.load_state_dict(per_token.state_dict())
    with torch.no_grad():  # larger inner steps and gates than at init, so that the layouts' difference shows
        for m in (per_token, reference):
            m.ttt.learnable_ttt_lr_bias.fill_(2.0)
            for gate in (m.forward_gate_text, m.forward_gate_video, m.reverse_gate_text, m.reverse_gate_video):
                gate.fill_(0.5)
    return per_token, reference


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_layer_on_one_segment_equals_per_token(kind):
    lay = tiny_layout(1, text=2, mb=8)
    per_token, reference = layer_pair(kind)
    x = torch.randn(2, lay.total_tokens, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    outs = []
    for m in (per_token, reference):
        xi = x.clone().requires_grad_()
        y = m(xi, lay)
        (y * torch.sin(torch.arange(y.numel(), dtype=y.dtype)).view_as(y)).sum().backward()
        outs.append((y.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-9, atol=1e-12)
    for name, g in outs[0][2].items():
        torch.testing.assert_close(outs[1][2][name], g, rtol=1e-9, atol=1e-12, msg=f"gradient w.r.t. {name}")


@pytest.mark.parametrize("kind,reverse", [("mlp", False), ("mlp", True), ("linear", True)])
def test_layer_equals_the_plain_statement_on_three_segments(kind, reverse):
    lay = tiny_layout(3, text=3, mb=8)
    assert lay.ttt_padding > 0
    per_token, reference = layer_pair(kind)
    x = torch.randn(1, lay.total_tokens, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y = reference.ttt(x, lay, reverse=reverse)
        plain = plain_ttt_layer(reference.ttt, x, lay, reverse=reverse)
        other = per_token.ttt(x, lay, reverse=reverse)
    torch.testing.assert_close(y, plain, rtol=1e-9, atol=1e-11)
    assert (y - other).norm() > 1e-3 * other.norm()  # on three segments the layouts differ


def test_kernels_fall_back_with_one_log_line(monkeypatch, caplog):
    """The Triton kernels take one rate per token: "auto" falls back to the reference (logged once), "triton"
    refuses, and a config asking for both fails before any work."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter counts as a Triton device for dispatch
    monkeypatch.setattr(ops, "_logged", set())
    lay = tiny_layout(2, mb=16)
    tensors = [t.detach().float() for t in scan_inputs("linear", lay, D=16)]
    rows = reference_eta_rows(lay)
    with caplog.at_level(logging.WARNING, logger="tttvideo.ttt.ops"):
        out = ops.ttt_linear(*tensors, mini_batch_size=16, backend="auto", eta_rows=rows)
        ops.ttt_linear(*tensors, mini_batch_size=16, backend="auto", eta_rows=rows)
    assert len(caplog.records) == 1 and "eta_layout" in caplog.records[0].getMessage()
    assert torch.equal(out, ops.ttt_linear(*tensors, mini_batch_size=16, backend="reference", eta_rows=rows))
    with pytest.raises(ValueError, match="eta_layout"):
        ops.ttt_linear(*tensors, mini_batch_size=16, backend="triton", eta_rows=rows)
    from tttvideo.errors import ConfigError

    with pytest.raises(ConfigError, match="ttt.eta_layout = 'reference'"):
        ops.check_backend_config(TTTConfig(backend="triton", eta_layout="reference"), 64, 256, "cpu")


def test_unknown_eta_layout_is_refused():
    with pytest.raises(ValueError, match="eta_layout"):
        TTTLayer(DIM, HEADS, TTTConfig(eta_layout="rows"))
