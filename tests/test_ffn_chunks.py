"""checkpointing.ffn_chunk_tokens (the feed-forward MLP over token chunks in training): the same gradients as the
plain checkpointed step for both backbones, and no tensor as large as the whole video's hidden layer is ever made,
in forward or in backward.

The comparison runs in float64: chunking changes the order of sums (each chunk's matrix products, the weight
gradients accumulated chunk by chunk), and in fp32 the TTT scan amplifies those last-bit differences to 5e-5 of
the largest element of its learning-rate bias gradient (2e-6 without TTT layers). In float64 the chunked step
equals the plain one to 1e-15 for CogVideoX and 3e-7 for Wan, whose block computes its norms and modulation in fp32
by design (as diffusers' does)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tttvideo.config.schema import CheckpointingConfig, TTTConfig
from tttvideo.models import apply_checkpointing, get_preset, init_model
from tttvideo.models.layers import MLP, token_chunked

pytestmark = pytest.mark.usefixtures("one_thread")

TTT = TTTConfig(mini_batch_size=16, scan_checkpoint_group_size=2, gate_init=0.1)
SUB_BLOCK = dict(block=True, attention=True, forward_ttt=True, reverse_ttt=True, mlp=True)
CHUNK = 7  # tokens; no video below divides by it, so the last chunk is short


def cogvideox():
    torch.manual_seed(0)
    net = init_model(dataclasses.replace(get_preset("tiny"), num_layers=2), TTT, True)
    g = torch.Generator().manual_seed(1)
    # 2 segments: 25 latent frames of 2x3 tokens and 5 text tokens per segment
    inputs = (torch.randn(1, 25, 16, 4, 6, generator=g), torch.randn(1, 2, 5, 64, generator=g), torch.tensor([400.]))
    return net, inputs


def wan():
    torch.manual_seed(0)
    net = init_model(get_preset("wan-tiny"), TTT, True)
    net.set_ttt_gates(0.1)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(1, 25, 4, 4, 6, generator=g), torch.randn(1, 2, 5, 32, generator=g), torch.tensor([600.]))
    return net, inputs


class LargestHidden(TorchDispatchMode):
    """The most rows (batch x tokens) of any [B, tokens, hidden] tensor an operator makes, hidden the MLP's width."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden, self.tokens = hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == self.hidden:  # [B, tokens, hidden]
                self.tokens = max(self.tokens, t.numel() // self.hidden)
        return out


def step(build, cfg: CheckpointingConfig, watch: bool) -> tuple[dict[str, torch.Tensor], int, int]:
    """Gradients of one forward + backward under `cfg`, the most tokens of a hidden-layer tensor made in it (with
    `watch`; 0 without), and the video's tokens."""
    net, (latents, text, t) = build()
    net, latents, text = net.double(), latents.double().requires_grad_(), text.double()
    apply_checkpointing(net, cfg)
    hidden = next(m for m in net.modules() if isinstance(m, MLP)).fc1.out_features
    with LargestHidden(hidden) if watch else contextlib.nullcontext() as seen:
        out = net(latents, text, t)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
    grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    grads["latents"] = latents.grad
    return grads, seen.tokens if watch else 0, latents.shape[1] * latents.shape[3] * latents.shape[4] // 4


@pytest.mark.parametrize("build", [cogvideox, wan], ids=["cogvideox", "wan"])
def test_same_gradients_and_no_whole_hidden_layer(build):
    """Under the stage configs' policy: whole blocks and their parts checkpointed, so the MLP runs in forward, in
    the block's recompute and in the chunk's own."""
    plain, _, video = step(build, CheckpointingConfig(**SUB_BLOCK), watch=False)
    chunked, chunked_tokens, _ = step(build, CheckpointingConfig(**SUB_BLOCK, ffn_chunk_tokens=CHUNK), watch=True)
    assert chunked.keys() == plain.keys() and len(plain) > 20
    for name, g in plain.items():
        torch.testing.assert_close(chunked[name], g, rtol=1e-6, atol=1e-6 * float(g.abs().max()), msg=name)
    # one chunk's hidden layer at a time (the plain MLP makes every token's at once: the next test)
    assert video > CHUNK and video % CHUNK
    assert chunked_tokens == CHUNK


def test_token_chunked_is_the_function_without_gradients_and_when_one_chunk():
    torch.manual_seed(0)
    mlp = MLP(8, 24)
    x = torch.randn(2, 10, 8)
    for tokens, largest in ((0, 20), (3, 6)):  # batch x tokens the watch above sees, backward included
        mlp.chunk_tokens = tokens
        with LargestHidden(24) as seen:
            mlp(x.clone().requires_grad_()).sum().backward()
        assert seen.tokens == largest
    mlp.chunk_tokens = 3
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), mlp.dense(x), rtol=0, atol=0)
    x.requires_grad_()
    for tokens in (0, 10, 40):  # off, or a chunk that holds every token: the plain function, no checkpoint
        y = token_chunked(mlp.dense, x, tokens)
        assert y.grad_fn.name() != "CatBackward0"
    y = token_chunked(mlp.dense, x, 3)
    assert y.grad_fn.name() == "CatBackward0"
    torch.testing.assert_close(y, mlp.dense(x), rtol=1e-6, atol=1e-7)


def test_oom_advice_names_the_chunks_and_the_hidden_layer_they_free():
    from tttvideo.config.loader import load_config
    from tttvideo.memory.techniques import FFN_CHUNK_TOKENS, FFN_CHUNKS

    # the tiny Wan at 480x832 and 63 s: 394,680 tokens a video, hidden width 128, bf16 autocast; every video of the
    # micro-batch keeps one chunk
    cfg = load_config("configs/wan2.1-1.3b/demo-tiny.toml", [
        "layout.duration=63s", "layout.height=480", "layout.width=832", "train.precision=bf16"])
    net, _ = wan()
    (saving,) = FFN_CHUNKS.advice(cfg, net, "train", 1)
    assert saving.switch == f"checkpointing.ffn_chunk_tokens = {FFN_CHUNK_TOKENS}"
    assert saving.nbytes == cfg.train.batch_size * (394680 - FFN_CHUNK_TOKENS) * 128 * 2
    cfg.checkpointing.ffn_chunk_tokens = 4096
    assert FFN_CHUNKS.is_on(cfg) and FFN_CHUNKS.advice(cfg, net, "train", 1) == []


def test_linear_gelu_is_the_product_then_gelu_tanh():
    """linear_gelu (the MLP's first product with the bias and GELU in one cuBLASLt epilogue on CUDA; the two ops
    elsewhere, since the CPU's torch._addmm_activation takes the erf GELU) equals F.gelu(F.linear(...),
    approximate="tanh") in fp32 on the CPU, for 2-d and 3-d inputs; the MLP takes it only for a CUDA forward without
    gradients (gelu_in_epilogue; tests/gpu/test_sampling_glue_gpu.py checks the epilogue's GELU there)."""
    from tttvideo.models.layers import gelu_in_epilogue, linear_gelu

    torch.manual_seed(0)
    mlp = MLP(16, 64)
    for x in (torch.randn(5, 16), torch.randn(2, 7, 16)):
        want = torch.nn.functional.gelu(mlp.fc1(x), approximate="tanh")
        torch.testing.assert_close(linear_gelu(x, mlp.fc1.weight, mlp.fc1.bias), want, rtol=1e-6, atol=1e-6)
        with torch.no_grad():
            assert not gelu_in_epilogue(mlp.fc1, x)  # the CPU keeps the two ops
