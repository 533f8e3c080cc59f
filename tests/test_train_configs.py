"""The shipped training configs: the five CogVideoX-5B stages follow the original recipe, chain into each other, and
their 1-GPU and 4-GPU versions keep the global batch of 64 by accumulation; the demo config is the tiny CPU run."""

from __future__ import annotations

import pytest

from tttvideo.config.loader import load_config
from tttvideo.layout import VideoLayout
from tttvideo.train.trainer import batch_plan

# the original recipe: duration, adapter, lr, lr_ssm, steps; text tokens per segment
STAGES = [
    ("stage1-3s", "3s", "sft", 1e-5, 1e-4, 5000, 498),
    ("stage2-9s", "9s", "qkvo", 1e-5, 1e-5, 5000, 502),
    ("stage3-18s", "18s", "qkvo", 1e-5, 1e-5, 1000, 471),
    ("stage4-30s", "30s", "qkvo", 1e-5, 1e-5, 500, 497),
    ("stage5-63s", "63s", "qkvo", 1e-5, 1e-5, 250, 458),
]


@pytest.mark.parametrize("gpus", ["", "-1gpu", "-4gpu"])
def test_stages_follow_the_recipe_and_chain(gpus):
    previous = None
    for name, duration, adapter, lr, lr_ssm, steps, text in STAGES:
        cfg = load_config(f"configs/cogvideox-5b/{name}{gpus}.toml")
        t = cfg.train
        assert (cfg.layout.duration, cfg.model.adapter, t.lr, t.lr_ssm, t.steps) == (duration, adapter, lr, lr_ssm,
                                                                                     steps)
        assert (t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay, t.grad_clip) == (0.9, 0.95, 1e-8, 1e-4, 0.1)
        assert (t.text_dropout, t.lr_end, cfg.model.preset, cfg.ttt.kind) == (0.1, 1e-5, "cogvideox-5b", "mlp")
        layout = VideoLayout.from_config(cfg.layout, cfg.ttt)
        assert layout.text_tokens == text and layout.ttt_padding == 0
        assert batch_plan(t, 1) == (64, 64)  # one process: 64 micro-batches of 1 per optimizer step
        if gpus == "":
            assert batch_plan(t, 64) == (1, 64)  # the paper's 64 GPUs: no accumulation
        elif gpus == "-1gpu":
            assert t.grad_accum == 64 and cfg.checkpointing.block and cfg.checkpointing.forward_ttt
        else:  # 4 data-parallel GPUs, FSDP over all of them: 16 micro-batches each
            assert (cfg.parallel.dp_shard, cfg.parallel.sp, cfg.parallel.dp_replicate) == (4, 1, 1)
            assert batch_plan(t, 4) == (16, 64) and cfg.checkpointing.forward_ttt
        if previous is None:
            assert cfg.model.pretrained_path and not t.init_from
        else:
            assert t.init_from == previous and not cfg.model.pretrained_path
        assert t.output_dir.endswith(name + gpus)
        assert cfg.data.manifest.startswith(cfg.data.cache_dir)  # precompute with the same config writes it
        previous = t.output_dir


def test_demo_config_is_the_tiny_cpu_run():
    cfg = load_config("configs/demo.toml")
    assert cfg.model.preset == "tiny-4ch" and cfg.train.device == "cpu" and cfg.train.precision == "fp32"
    assert cfg.data.manifest == "" and cfg.train.sample_at_end
    lay = VideoLayout.from_config(cfg.layout, cfg.ttt)
    assert lay.num_segments >= 2  # the demo video has scene cuts


# ------------------------------------------------------------------------------------------ the 24 GB configs
def fixed_gib(cfg) -> float:
    """Frozen weights (fp8: 1 byte + a scale per row), trainable parameters, their gradients and 8-bit AdamW state
    of the config's model, counted on the meta device."""
    import torch

    from tttvideo.dtypes import torch_dtype
    from tttvideo.memory.techniques import ModelBytes
    from tttvideo.models import apply_adapter, get_preset
    from tttvideo.models.cogvideox.transformer import CogVideoXTTT

    with torch.device("meta"):
        model = CogVideoXTTT(get_preset(cfg.model.preset), cfg.ttt, cfg.model.use_ttt).to(torch_dtype(cfg.model.dtype))
    apply_adapter(model, cfg.model.adapter, cfg.model.lora_rank, cfg.model.lora_alpha)
    counted = ModelBytes.of(model)
    frozen = sum(p.nbytes for p in model.parameters() if not p.requires_grad) - counted.frozen_linear_saving
    trainable = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    return (frozen + 2 * trainable + counted.optimizer["adamw8bit"]) / 2**30


def test_24gb_training_configs_have_every_switch_on_and_chain():
    pytest.importorskip("peft")
    previous = None
    for name, duration in (("24gb-3s", "3s"), ("24gb-9s", "9s")):
        cfg = load_config(f"configs/cogvideox-5b/{name}.toml")
        m, t, ck = cfg.model, cfg.train, cfg.checkpointing
        assert (m.preset, m.adapter, m.dtype, m.frozen_weights, cfg.ttt.kind) == ("cogvideox-5b", "lora", "bf16",
                                                                                   "fp8", "mlp")
        assert (t.optimizer, t.precision, t.batch_size, cfg.memory.max_gpu_gib) == ("adamw8bit", "bf16", 1, 24)
        assert ck.block and ck.offload_activations and cfg.ttt.scan_checkpoint_group_size > 0
        assert cfg.layout.duration == duration and batch_plan(t, 1) == (64, 64)
        # checkpoints of an fp8 model hold no frozen weights: every stage builds them from the base model
        assert m.pretrained_path and t.init_from == (previous or "")
        assert t.output_dir.endswith(name)
        # what docs/memory.md counts: ~14.9 GiB before activations, ~7 GiB left on a 24 GB card
        assert 14 < fixed_gib(cfg) < 15.5
        previous = t.output_dir


def test_24gb_sample_config_streams_blocks_with_fp8_weights():
    cfg = load_config("configs/cogvideox-5b/24gb-sample-63s.toml")
    assert cfg.layout.duration == "63s" and cfg.model.adapter == "lora" and cfg.model.frozen_weights == "fp8"
    assert cfg.model.pretrained_path and cfg.sample.offload_blocks and not cfg.sample.cfg_batched
    assert cfg.memory.max_gpu_gib == 24 and cfg.memory.chunked_inference and cfg.memory.ttt_head_groups == 1
    small = load_config("configs/cogvideox-5b/12gb-sample-63s.toml")
    assert small.memory.max_gpu_gib == 12 and small.memory.ttt_head_groups == 2 and small.memory.chunked_inference
