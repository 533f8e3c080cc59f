"""Activation offload on CUDA (skipped without it): the pinned exact-size host pool, side-stream copies and
prefetch give bit-identical gradients to keeping everything on the device, with block checkpointing and nested
checkpointing; a second micro-batch reuses the pool."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tttvideo.config.schema import CheckpointingConfig, TTTConfig
from tttvideo.models import apply_adapter, apply_checkpointing, get_preset, init_model
from tttvideo.models.activation_offload import HostPool, offload_activations

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def grads(model, offload):
    g = torch.Generator(device="cuda").manual_seed(1)
    latents = torch.randn(1, 13, 16, 8, 12, generator=g, device="cuda").requires_grad_()
    text, t = torch.randn(1, 1, 5, 64, generator=g, device="cuda"), torch.tensor([400.0], device="cuda")
    model.zero_grad(set_to_none=True)
    if offload is None:
        out = model(latents, text, t)
    else:
        with offload:
            out = model(latents, text, t)
    (out * torch.randn(out.shape, generator=g, device="cuda")).sum().backward()
    found = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    found["latents"] = latents.grad.clone()
    return found


@pytest.mark.parametrize("nested", [0, 2])
def test_pinned_pool_same_gradients(nested):
    torch.manual_seed(0)
    spec = dataclasses.replace(get_preset("tiny"), num_layers=4)
    model = apply_adapter(init_model(spec, TTTConfig(mini_batch_size=16, backend="reference"), True), "qkvo").cuda()
    apply_checkpointing(model, CheckpointingConfig(block=True, nested_span=nested))
    plain = grads(model, None)
    pool = HostPool(pin=True)
    for _ in range(2):
        off = offload_activations(min_bytes=4096, keep=model, pool=pool)
        moved = grads(model, off)
        assert off.offloaded_tensors > 0 and pool.pin
        for name, g in plain.items():
            assert torch.equal(moved[name], g), name
    assert pool.allocated_bytes == off.offloaded_bytes
