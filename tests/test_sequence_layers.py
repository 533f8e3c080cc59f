"""The long-range baselines beside TTT (`tttvideo.sequence`): the recurrences of Mamba 2 and Gated DeltaNet in
chunks against their token-by-token definition (fp32, forward and every gradient, 1e-4), flash-linear-attention's
kernels against the chunked reference (CUDA, bf16 inputs, 3e-2 relative), and the wrapper every layer runs in: scan
order (each segment's text, then its video), the direction of each pass, the gates, full attention's reach."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tttvideo.config.loader import load_config
from tttvideo.errors import ConfigError, UserError
from tttvideo.layout import VideoLayout
from tttvideo.models.build import build_model
from tttvideo.sequence import ops
from tttvideo.sequence.bidirectional import GatedBidirectional
from tttvideo.sequence.build import SEQUENCE_LAYERS, sequence_layer
from tttvideo.sequence.full_attention import FullAttentionPass
from tttvideo.sequence.gated_deltanet import GatedDeltaNetPass
from tttvideo.sequence.mamba2 import Mamba2Pass
from tttvideo.sequence.recurrence import gated_recurrence_chunked, gated_recurrence_naive
from tttvideo.config.schema import TTTConfig

pytestmark = pytest.mark.usefixtures("one_thread")
PASSES = {"mamba2": Mamba2Pass, "gated-deltanet": GatedDeltaNetPass}


def recurrence_inputs(T: int, delta: bool, seed: int, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    B, H, D = 2, 3, 16
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    if delta:  # the layer normalises q and k
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    decay = -torch.rand(B, T, H, generator=g) * 0.5
    beta = torch.rand(B, T, H, generator=g) if delta else None
    return [t.to(device=device, dtype=dtype).requires_grad_() if t is not None else None
            for t in (q, k, v, decay, beta)]


def grads(out: torch.Tensor, inputs, seed: int) -> list[torch.Tensor]:
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    return torch.autograd.grad((out.float() * w).sum(), [t for t in inputs if t is not None])


@pytest.mark.parametrize("delta", [False, True], ids=["mamba2", "gated-delta"])
@pytest.mark.parametrize("T,chunk", [(100, 16), (64, 64), (7, 16), (300, 256)])  # 256: the reference's CUDA chunk
def test_chunked_recurrence_equals_the_token_by_token_definition(delta, T, chunk):
    inputs = recurrence_inputs(T, delta, seed=T + delta)
    naive = gated_recurrence_naive(*inputs, scale=0.25)
    chunked = gated_recurrence_chunked(*inputs, scale=0.25, chunk=chunk)
    torch.testing.assert_close(chunked, naive, rtol=1e-4, atol=1e-4)
    for a, b in zip(grads(chunked, inputs, 1), grads(naive, inputs, 1)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_state_forgets_with_strong_decay_and_remembers_without():
    q, k, v, g, _ = (t.detach() if t is not None else None for t in recurrence_inputs(40, False, seed=3))
    far = v.clone()
    far[:, 0] += 10.0  # change what the first token writes
    for decay, changes in ((torch.zeros_like(g), True), (torch.full_like(g, -30.0), False)):
        a = gated_recurrence_chunked(q, k, v, decay, None, 1.0, chunk=16)[:, -1]
        b = gated_recurrence_chunked(q, k, far, decay, None, 1.0, chunk=16)[:, -1]
        assert (not torch.allclose(a, b)) == changes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-linear-attention's kernels need a CUDA GPU")
@pytest.mark.parametrize("delta", [False, True], ids=["mamba2", "gated-delta"])
def test_fla_kernels_match_the_reference(delta):
    if ops.fla_missing():
        pytest.skip(ops.fla_missing())
    inputs = recurrence_inputs(300, delta, seed=5, device="cuda")
    fast_in = [t.detach().bfloat16().requires_grad_() if t is not None and i < 3 else
               (t.detach().clone().requires_grad_() if t is not None else None) for i, t in enumerate(inputs)]
    fn = ops.gated_delta_rule if delta else ops.simple_gla
    args = (lambda x: (x[0], x[1], x[2], x[3], x[4])) if delta else (lambda x: (x[0], x[1], x[2], x[3]))
    ref = fn(*args(inputs), 0.25, backend="reference")
    refused = ops.fla_backward_refused()
    with torch.no_grad() if refused else contextlib.nullcontext():
        fast = fn(*args(fast_in), 0.25, backend="triton")
    scale = ref.abs().max()
    assert (fast.float() - ref).abs().max() / scale < 3e-2
    if refused:
        # fla's backward cannot run on this GPU: "triton" says so, "auto" trains on the reference
        with pytest.raises(ConfigError, match="#640"):
            fn(*args(fast_in), 0.25, backend="triton")
        auto = fn(*args(fast_in), 0.25, backend="auto")
        expect = fn(*args(fast_in), 0.25, backend="reference")
        for a, b in zip(grads(auto, fast_in, 2), grads(expect, fast_in, 2)):
            assert torch.equal(a, b)
        return  # fla's own backward cannot be compared here
    for a, b in zip(grads(fast, fast_in, 2), grads(ref, inputs, 2)):
        assert (a.float() - b).abs().max() / b.abs().max() < 3e-2


def layout(seconds: int = 6) -> VideoLayout:
    return VideoLayout.create(seconds, 32, 32, text_tokens=4, mini_batch_size=16)


def scan_position_effects(module, x: torch.Tensor, lay: VideoLayout, reverse: bool, token: int) -> torch.Tensor:
    """Which outputs (bool per residual position) change when the input at residual position `token` does."""
    with torch.no_grad():
        y = module(x, lay, reverse)
        x2 = x.clone()
        x2[:, token] += 1.0
        return (module(x2, lay, reverse) - y).abs().amax(dim=(0, 2)) > 1e-7


@pytest.mark.parametrize("kind", sorted(PASSES))
@pytest.mark.parametrize("reverse", [False, True])
def test_each_pass_sees_only_what_came_before_it_in_its_scan_order(kind, reverse):
    torch.manual_seed(0)
    lay = layout()
    module = PASSES[kind](64, 4, backend="reference")
    x = torch.randn(1, lay.total_tokens, 64)
    order = lay.reverse_interleave_perm if reverse else lay.interleave_perm
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))  # position of each residual token in this pass's scan order
    for token in (0, lay.total_text_tokens - 1, lay.total_text_tokens + 5, lay.total_tokens - 1):
        changed = scan_position_effects(module, x, lay, reverse, token)
        assert not changed[rank < rank[token]].any()  # nothing earlier in the scan moves
        assert changed[token]


@pytest.mark.parametrize("kind", sorted(PASSES))
def test_scan_order_puts_each_segments_text_before_its_video(kind):
    torch.manual_seed(1)
    lay = layout()
    module = PASSES[kind](64, 4, backend="reference")
    x = torch.randn(1, lay.total_tokens, 64)
    T, tt = lay.total_text_tokens, lay.text_tokens
    video_per_segment = (lay.total_tokens - T) // lay.num_segments
    second_text = tt  # the first text token of segment 1 (residual order: all text first)
    changed = scan_position_effects(module, x, lay, False, second_text)
    assert not changed[:tt].any() and not changed[T:T + video_per_segment // 2].any()  # segment 0 comes before
    j = int((lay.interleave_perm == second_text).nonzero())
    assert torch.equal(lay.interleave_perm[j:j + tt], torch.arange(tt, 2 * tt))  # its text, then its video
    assert changed[second_text:2 * tt].any() and changed[lay.interleave_perm[j + tt:j + tt + 4]].any()


def test_gates_at_zero_return_the_input_and_one_gate_opens_one_pass():
    torch.manual_seed(2)
    lay = layout()
    inner = Mamba2Pass(64, 4, backend="reference")
    wrapped = GatedBidirectional(inner, 64, gate_init=0.0)
    x = torch.randn(2, lay.total_tokens, 64)
    with torch.no_grad():
        assert torch.equal(wrapped(x, lay), x)
        wrapped.forward_gate_video.fill_(1.0)
        y = wrapped(x, lay)
        T = lay.total_text_tokens
        expect = x[:, T:] + torch.tanh(torch.tensor(1.0)) * inner(x, lay, False)[:, T:]
        torch.testing.assert_close(y[:, T:], expect)
        assert torch.equal(y[:, :T], x[:, :T])  # the text gate is still shut


def test_full_attention_reaches_across_the_whole_video_and_matches_plain_softmax():
    torch.manual_seed(3)
    lay = layout(9)
    module = FullAttentionPass(64, 4)
    x = torch.randn(1, lay.total_tokens, 64)
    assert scan_position_effects(module, x, lay, False, lay.total_tokens - 1).all()
    # against softmax(q k^T / sqrt(D)) v written out
    from tttvideo.rope import apply_rope
    from tttvideo.sequence.full_attention import global_rope

    with torch.no_grad():
        q, k, v = module.qkv(x).unflatten(-1, (3, 4, 16)).unbind(2)
        cos, sin = global_rope(lay, 16, module.rope_theta, x.device)
        q = apply_rope(module.norm_q(q).transpose(1, 2), cos, sin)
        k = apply_rope(module.norm_k(k).transpose(1, 2), cos, sin)
        attn = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v.transpose(1, 2)
        expect = module.out(attn.transpose(1, 2).flatten(2))
        torch.testing.assert_close(module(x, lay), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [k for k in SEQUENCE_LAYERS if k != "ttt"])
def test_every_baseline_trains_inside_the_model(kind):
    cfg = load_config("configs/demo.toml", [f"model.sequence_layer={kind}", "layout.duration=6s",
                                            "ttt.backend=reference"])
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():  # open the adaLN-zero gates of a fresh model, so that gradients reach every layer
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    lay = VideoLayout.from_config(cfg.layout, cfg.ttt)
    s = model.spec
    latents = torch.randn(2, lay.latent_frames, s.in_channels, lay.latent_height, lay.latent_width)
    text = torch.randn(2, lay.num_segments, lay.text_tokens, s.text_embed_dim)
    model(latents, text, torch.tensor([10, 500]), lay).square().mean().backward()
    own = {n: p for n, p in model.named_parameters() if ".ttt." in n}
    assert bool(own) == (kind != "none")
    # the last block's text tokens reach no output: its text gates alone get no gradient
    last_text_gates = {f"blocks.{s.num_layers - 1}.ttt.{d}_gate_text" for d in ("forward", "reverse")}
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in own.items() if n not in last_text_gates)
    assert model.sequence_layer == kind


def test_config_mistakes_are_sentences():
    with pytest.raises(ConfigError, match="use_ttt = false builds no long-range layer"):
        build_model(load_config("configs/demo.toml", ["model.use_ttt=false", "model.sequence_layer=mamba2"]))
    with pytest.raises(ConfigError, match="chunked_inference = false"):
        build_model(load_config("configs/demo.toml", ["model.sequence_layer=gated-deltanet",
                                                      "memory.chunked_inference=true"]))
    layer = sequence_layer("mamba2", 64, 4, TTTConfig(backend="triton"), 10000.0)
    lay = layout()
    with pytest.raises(ConfigError, match="backend 'auto' or 'reference'"):
        layer(torch.randn(1, lay.total_tokens, 64), lay)
    with pytest.raises(UserError, match="supports the TTT layer only"):
        layer.ttt(torch.randn(1, lay.total_tokens, 64), lay, False, sp=object())


def test_a_checkpoint_of_a_baseline_loads_into_the_same_kind_only(tmp_path):
    from tttvideo.models.weights import load_checkpoint, save_checkpoint

    cfg = load_config("configs/demo.toml", ["model.sequence_layer=mamba2"])
    model = build_model(cfg)
    path = save_checkpoint(model, tmp_path / "m.safetensors")
    again = build_model(cfg)
    load_checkpoint(again, path)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    other = build_model(load_config("configs/demo.toml", ["model.sequence_layer=gated-deltanet"]))
    with pytest.raises(UserError, match="sequence_layer"):
        load_checkpoint(other, path)
