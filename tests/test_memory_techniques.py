"""The memory techniques' registry (tttvideo.memory.techniques): each technique's keys are config keys, its options
set exactly the keys they declare (what a plan file writes), its mechanism names real code, its checks and its
preparation of a built model act, and its advice and the planner's count agree."""

from __future__ import annotations

import copy
import dataclasses
import importlib

import pytest

from tttvideo.config.loader import config_to_dict
from tttvideo.config.schema import Config
from tttvideo.errors import ConfigError
from tttvideo.memory.techniques import (ADAMW_8BIT, FP8_EVERY_LINEAR, FP8_STREAMING, FP8_WEIGHTS, REGISTRY,
                                        SAMPLE_BLOCK_OFFLOAD, ModelBytes, calibration_setups, check_techniques,
                                        techniques)

pytestmark = pytest.mark.usefixtures("one_thread")


def flat(cfg: Config) -> dict[str, object]:
    return {f"{section}.{key}": value for section, values in config_to_dict(cfg).items()
            for key, value in values.items()}


def tiny() -> Config:
    cfg = Config()
    cfg.model.adapter, cfg.model.lora_rank, cfg.model.frozen_weights = "lora", 4, "fp8"
    cfg.ttt.mini_batch_size = 16
    cfg.layout.height, cfg.layout.width, cfg.layout.text_tokens = 32, 48, 8
    return cfg


def test_names_are_unique_and_keys_are_config_keys():
    assert len({t.name for t in REGISTRY}) == len(REGISTRY) == 13
    keys = flat(Config())
    for t in REGISTRY:
        assert t.keys and set(t.keys) <= set(keys), t.name
        assert t.phases and set(t.phases) <= {"train", "sample"}, t.name
        assert (t.regime == "activation") == (t.regime_tag is not None), t.name
    assert {t.name for t in techniques("sample")} >= {"chunked inference", "sample block offload", "guidance passes"}


@pytest.mark.parametrize("phase,gpus", [("train", 1), ("train", 4), ("sample", 1), ("sample", 2)])
def test_each_option_sets_only_the_keys_it_declares(phase, gpus):
    """A plan file writes an option's declared keys: anything else it changed would be lost."""
    base = tiny()
    before = flat(base)
    tried = 0
    for t in techniques(phase):
        for option in t.options(base, phase, gpus):
            cfg = copy.deepcopy(base)
            option.apply(cfg)
            changed = {k for k, v in flat(cfg).items() if v != before[k]}
            assert changed <= set(option.keys), (t.name, option.label, changed - set(option.keys))
            assert set(option.keys) <= set(before), (t.name, option.label)
            tried += 1
    assert tried > 5


def test_mechanisms_name_importable_code():
    for t in REGISTRY:
        path = t.mechanism.split(",")[0].split(" ")[0]
        module, _, name = path.rpartition(".")
        try:
            target = importlib.import_module(path)
        except ImportError:
            target = getattr(importlib.import_module(module), name)
        assert target is not None, t.name


def test_streaming_checks_and_prepares():
    cfg = tiny()
    cfg.memory.stream_frozen_weights = True
    check_techniques(cfg, 1)
    with pytest.raises(ConfigError, match="runs in one process"):
        check_techniques(cfg, 2)
    cfg.model.frozen_weights = "dtype"
    with pytest.raises(ConfigError, match="set model.frozen_weights = 'fp8' too"):
        check_techniques(cfg, 1)
    assert FP8_STREAMING.prepare is not None and FP8_STREAMING.is_on(cfg)


def test_advice_is_the_footprint_the_planner_counts():
    """What the OOM advice says a switch frees is minus the footprint the planner adds when it is on."""
    from tttvideo.models import build_model

    cfg = tiny()
    cfg.train.optimizer = "adamw"
    model = build_model(cfg)
    b = ModelBytes.of(model)
    advice = {s.switch: s.nbytes for t in techniques("train") for s in t.advice(cfg, model, "train", 1)}
    on = copy.deepcopy(cfg)
    on.train.optimizer, on.memory.stream_frozen_weights = "adamw8bit", True
    assert advice["train.optimizer = 'adamw8bit'"] == -ADAMW_8BIT.footprint(on, "train", b).optimizer > 0
    assert advice["memory.stream_frozen_weights = true"] == -FP8_STREAMING.footprint(on, "train", b).weights > 0
    # the tiny model's two blocks are both in flight with one prefetched: streaming them frees nothing, said nowhere
    sampled = {s.switch: s.nbytes for t in techniques("sample") for s in t.advice(cfg, model, "sample", 1)}
    on.sample.offload_blocks = True
    assert -SAMPLE_BLOCK_OFFLOAD.footprint(on, "sample", b).weights == 0
    assert "sample.offload_blocks = true" not in sampled
    assert "model.frozen_weights = 'fp8'" not in sampled  # already fp8


def test_calibration_setups_are_ordered_and_distinct():
    setups = calibration_setups()
    assert [s.order for s in setups] == sorted(s.order for s in setups)
    assert len({s.order for s in setups}) == len({s.name for s in setups}) == len(setups)


def test_fp8_every_linear_counts_the_trained_linears_in_fp8_on_the_gpu():
    """sample.fp8_linears = 'all' takes the adapter's trainable linears to fp8 in the sample count, by what fp8
    storage saves of them (1 byte a value and a scale a row); with blocks streamed from host memory only the blocks
    on the GPU count; nothing without fp8 storage or for training."""
    from tttvideo.memory.plan.count import count, model_bytes

    cfg = tiny()
    cfg.model.adapter = "qkvo"
    b = model_bytes(cfg)
    assert b.trainable_linear_saving > 0 and b.block_trainable_linear_saving > 0
    assert b.trainable_linear_saving == b.blocks * b.block_trainable_linear_saving  # tiny: only blocks train
    frozen = count(cfg, "sample").weights
    cfg.sample.fp8_linears = "all"
    assert FP8_EVERY_LINEAR.is_on(cfg)
    assert count(cfg, "sample").weights == frozen - b.trainable_linear_saving
    assert FP8_EVERY_LINEAR.footprint(cfg, "train", b).weights == 0
    cfg.sample.offload_blocks, cfg.sample.prefetch_blocks = True, 1
    ten = dataclasses.replace(b, blocks=10, trainable_linear_saving=10 * b.block_trainable_linear_saving)
    assert FP8_EVERY_LINEAR.footprint(cfg, "sample", ten).weights == -2 * b.block_trainable_linear_saving
    # more blocks prefetched than the model has: every block is on the GPU, none counted twice
    cfg.sample.prefetch_blocks = 8
    five = dataclasses.replace(b, blocks=5, trainable_linear_saving=5 * b.block_trainable_linear_saving)
    assert FP8_EVERY_LINEAR.footprint(cfg, "sample", five).weights == -five.trainable_linear_saving
    assert SAMPLE_BLOCK_OFFLOAD.footprint(cfg, "sample", five).weights == 0
    cfg.sample.prefetch_blocks = 3
    assert SAMPLE_BLOCK_OFFLOAD.footprint(cfg, "sample", ten).weights == -6 * ten.block
    assert SAMPLE_BLOCK_OFFLOAD.footprint(cfg, "sample", ten).host == 10 * ten.block
    cfg.sample.prefetch_blocks = 1
    cfg.model.frozen_weights = "dtype"
    assert FP8_EVERY_LINEAR.footprint(cfg, "sample", b).weights == 0
    # the planner's sample setups keep the fp8 storage that every linear in fp8 needs; training ones may drop it
    assert [o.label for o in FP8_WEIGHTS.options(cfg, "sample", 1)] == ["fp8"]
    assert [o.label for o in FP8_WEIGHTS.options(cfg, "train", 1)] == ["dtype", "fp8"]
