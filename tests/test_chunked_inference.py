"""memory.chunked_inference: the bounded-memory block forward equals the plain one (fp32, tolerance 1e-5 relative,
the difference being matmul summation order), whatever the chunk size, head grouping, batch and segment count; it
only runs without gradients and in one process."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tttvideo.config.schema import Config, MemoryConfig, TTTConfig
from tttvideo.errors import ConfigError
from tttvideo.models import build_model, get_preset, init_model
from tttvideo.models.chunked_inference import ChunkPlan, apply_chunked_inference

from tests.test_model import inputs, rel  # the same inputs as the model's own tests

pytestmark = pytest.mark.usefixtures("one_thread")

TTT = TTTConfig(mini_batch_size=16, scan_checkpoint_group_size=2)


def model_with_heads(heads: int = 4, seed: int = 0):
    spec = dataclasses.replace(get_preset("tiny"), name="tiny4h", num_attention_heads=heads,
                               attention_head_dim=64 // heads)
    torch.manual_seed(seed)
    model = init_model(spec, TTT, True).eval()
    with torch.no_grad():  # distinct gates per pass, modality and channel: the TTT passes must all contribute
        for m in model.ttt_modules():
            for g in (m.forward_gate_text, m.forward_gate_video, m.reverse_gate_text, m.reverse_gate_video):
                g.normal_(std=0.7)
    return model


def set_plan(model, plan):
    for block in model.blocks:
        block.inference_chunks = plan


@pytest.mark.parametrize("segments,batch,tokens,groups", [
    (1, 1, 7, 1),      # one window, chunks straddling nothing: the text part alone is one short chunk
    (3, 2, 16, 2),     # three overlapping windows, batch 2, two head groups
    (2, 1, 1000, 3),   # one chunk for everything, uneven head groups (4 heads in 3)
    (3, 1, 24, 4),     # one head per group
])
def test_chunked_forward_equals_plain(segments, batch, tokens, groups):
    model = model_with_heads()
    latents, text, t = inputs(segments, batch)
    with torch.no_grad():
        plain = model(latents, text, t)
        set_plan(model, ChunkPlan(tokens=tokens, ttt_head_groups=groups))
        chunked = model(latents, text, t)
    assert rel(chunked, plain) < 1e-5
    assert not torch.equal(plain, torch.zeros_like(plain))


def test_gradients_take_the_plain_path():
    """With gradients on, the plan is ignored: training and its gradients are unchanged."""
    model = model_with_heads()
    latents, text, t = inputs(2)
    plain = model(latents, text, t)
    set_plan(model, ChunkPlan(tokens=8))
    chunked = model(latents, text, t)
    assert chunked.requires_grad and torch.equal(chunked, plain)


def test_build_model_applies_the_plan_with_lora_and_fp8():
    """The config switch reaches every block, and the chunked path runs the adapters' and fp8 layers' own forward
    (LoRA wrappers, fp8 dequantisation), so it equals the plain forward of the same model."""
    cfg = Config()
    cfg.ttt.mini_batch_size = 16
    cfg.model.adapter = "lora"
    cfg.model.lora_rank = 4
    cfg.model.frozen_weights = "fp8"
    cfg.memory.chunked_inference = True
    cfg.memory.inference_chunk_tokens = 256
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    assert all(b.inference_chunks == ChunkPlan(256, 1) for b in model.blocks)
    model.set_ttt_gates(0.5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)  # LoRA B starts at zero; make the adapters matter
        latents, text, t = inputs(2)
        chunked = model(latents, text, t)
        apply_chunked_inference(model, MemoryConfig())
        assert all(b.inference_chunks is None for b in model.blocks)
        plain = model(latents, text, t)
    assert rel(chunked, plain) < 1e-5


def test_chunked_inference_refuses_sequence_parallelism():
    from tttvideo.sample.distributed import resolve_sample_degrees

    cfg = Config()
    cfg.memory.chunked_inference = True
    cfg.parallel.sp = 2
    with pytest.raises(ConfigError, match="memory.chunked_inference"):
        resolve_sample_degrees(cfg, heads=48, world_size=2)


def test_chunked_pass_multiplies_in_fp8_where_every_linear_does():
    """sample.fp8_linears = 'all' (every linear stored and multiplied in fp8): the chunked TTT pass projects q/k/v
    with the layers' stacked fp8 product too (`TTTLayer.qkv_product`), so it equals the plain forward, which does;
    an upcast bf16 product there would differ by the input's quantisation (about 1e-2)."""
    from tttvideo.models.fp8_storage import store_every_linear_fp8

    model = model_with_heads()
    store_every_linear_fp8(model, "cpu", matmul=True)
    latents, text, t = inputs(2)
    with torch.no_grad():
        plain = model(latents, text, t)
        set_plan(model, ChunkPlan(tokens=16, ttt_head_groups=2))
        chunked = model(latents, text, t)
    assert rel(chunked, plain) < 1e-5
