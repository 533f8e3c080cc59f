"""checkpointing.nested_span (nested checkpointing): the same gradients as whole-block checkpointing, and forward
keeps one input per span of block units instead of one per unit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from tttvideo.config.schema import CheckpointingConfig, TTTConfig
from tttvideo.models import apply_adapter, apply_checkpointing, get_preset, init_model
from tttvideo.models.checkpointing import nested_spans

pytestmark = pytest.mark.usefixtures("one_thread")

TTT = TTTConfig(mini_batch_size=16, scan_checkpoint_group_size=2)
LAYERS = 6


def model(cfg: CheckpointingConfig) -> nn.Module:
    torch.manual_seed(0)
    net = apply_adapter(init_model(dataclasses.replace(get_preset("tiny"), num_layers=LAYERS), TTT, True), "qkvo")
    apply_checkpointing(net, cfg)
    return net


def step(net: nn.Module) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of one forward + backward, and how many stream-sized tensors forward saved for backward."""
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 13, 16, 4, 6, generator=g).requires_grad_()
    text, t = torch.randn(1, 1, 5, 64, generator=g), torch.tensor([400.0])
    saved = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and x.shape[-1] == net.spec.dim and x.shape[1] > 64:  # [B, tokens, dim]: a block's input
            saved.append(x.data_ptr())
        return x

    with saved_tensors_hooks(pack, lambda x: x):
        out = net(latents, text, t)
    stream = len(set(saved))
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    grads["latents"] = latents.grad
    return grads, stream


def test_spans():
    ckpt = [(i, i + 1, True) for i in range(7)]
    assert nested_spans(ckpt, 0) == [(i, i + 1) for i in range(7)]
    assert nested_spans(ckpt, 3) == [(0, 3), (3, 6), (6, 7)]
    mixed = [(0, 1, False), (1, 3, True), (3, 5, True), (5, 6, False), (6, 7, True)]
    assert nested_spans(mixed, 4) == [(0, 1), (1, 3), (3, 4), (4, 5)]


@pytest.mark.parametrize("span", [4])
def test_same_gradients_fewer_saved_inputs(span):
    plain, plain_saved = step(model(CheckpointingConfig(block=True)))
    nested, nested_saved = step(model(CheckpointingConfig(block=True, nested_span=span)))
    assert nested.keys() == plain.keys() and len(plain) > 10
    for name, g in plain.items():
        torch.testing.assert_close(nested[name], g, rtol=1e-6, atol=1e-7, msg=name)
    # every block's input against one per span (the head's own saved inputs are in both)
    assert plain_saved - nested_saved == LAYERS - -(-LAYERS // span)


def test_nested_with_submodule_checkpointing_and_keep():
    cfg = dict(block=True, attention=True, mlp=True, forward_ttt=True, reverse_ttt=True, keep=["attention"])
    plain, plain_saved = step(model(CheckpointingConfig(**cfg)))
    nested, nested_saved = step(model(CheckpointingConfig(**cfg, nested_span=3)))
    for name, g in plain.items():
        torch.testing.assert_close(nested[name], g, rtol=1e-6, atol=1e-7, msg=name)
    assert plain_saved - nested_saved == LAYERS - 2
