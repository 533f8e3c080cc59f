"""Per-kind TTT defaults (the reference system's): mini-batch 64 to train and 16 to sample for TTT-MLP, 16 and 16
for TTT-Linear; base learning rate 0.1 (MLP) and 1.0 (Linear). An explicit value wins; saved configs still load."""

from __future__ import annotations

import pytest

from tttvideo.config.loader import load_config, save_config
from tttvideo.config.schema import TTTConfig
from tttvideo.layout import VideoLayout
from tttvideo.sample.pipeline import story_layouts
from tttvideo.sample.scenes import Scene, Story
from tttvideo.ttt.layer import TTTLayer


@pytest.mark.parametrize("kind,train,sample,lr", [("mlp", 64, 16, 0.1), ("linear", 16, 16, 1.0)])
def test_a_config_that_leaves_them_out_follows_the_kind(kind, train, sample, lr):
    cfg = load_config(None, [f"ttt.kind={kind}"])
    assert (cfg.ttt.train_mini_batch(), cfg.ttt.sample_mini_batch(), cfg.ttt.inner_base_lr()) == (train, sample, lr)
    assert (cfg.ttt.mini_batch("train"), cfg.ttt.mini_batch("sample")) == (train, sample)
    assert TTTLayer(32, 2, cfg.ttt).base_lr == lr


def test_an_explicit_value_wins():
    cfg = load_config(None, ["ttt.kind=linear", "ttt.mini_batch_size=32", "ttt.sample_mini_batch_size=64",
                             "ttt.base_lr=0.5"])
    assert (cfg.ttt.train_mini_batch(), cfg.ttt.sample_mini_batch(), cfg.ttt.inner_base_lr()) == (32, 64, 0.5)


def test_a_saved_run_config_of_an_earlier_version_loads_as_it_trained(tmp_path):
    """Runs saved before these keys had per-kind defaults spell out mini_batch_size = 64 and base_lr = 0.1; a
    TTT-Linear run trained with them keeps them, and a config saved now round-trips."""
    old = tmp_path / "config.toml"
    old.write_text('[ttt]\nkind = "linear"\nmini_batch_size = 64\nbase_lr = 0.1\nscan_checkpoint_group_size = 16\n'
                   'backend = "auto"\ngate_init = 0.1\nrope_theta = 10000.0\ncompile_glue = true\n')
    cfg = load_config(old)
    assert (cfg.ttt.train_mini_batch(), cfg.ttt.inner_base_lr(), cfg.ttt.eta_layout) == (64, 0.1, "per-token")
    assert cfg.ttt.sample_mini_batch() == 16
    save_config(cfg, tmp_path / "again.toml")
    assert load_config(tmp_path / "again.toml") == cfg


def test_sampling_layouts_use_the_sampling_mini_batch_and_the_training_text_length():
    # 6 s at 64x96: the automatic text length is chosen for the training mini-batch (64) and kept at 16
    cfg = load_config(None, ["layout.duration=6s", "layout.height=64", "layout.width=96"])
    train = VideoLayout.from_config(cfg.layout, cfg.ttt)
    sample = VideoLayout.from_config(cfg.layout, cfg.ttt, phase="sample")
    assert (train.mini_batch_size, sample.mini_batch_size) == (64, 16)
    assert sample.text_tokens == train.text_tokens
    assert VideoLayout.create(6, 64, 96, mini_batch_size=16).text_tokens != train.text_tokens  # it would differ
    story = Story("s", "test", [Scene("a"), Scene("b")])
    assert story_layouts(cfg, [story]) == [sample]


def test_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="phase"):
        TTTConfig().mini_batch("eval")


def test_mlp_hidden_sets_the_inner_mlp_width_and_linear_ignores_it():
    """ttt.mlp_hidden: 0 = 4 x the head dim (the original); a value is the inner MLP's hidden size per head, and
    the layer with it computes (forward and backward through its own W1 / W2)."""
    import torch

    from tttvideo.config.schema import TTTConfig
    from tttvideo.layout import VideoLayout
    from tttvideo.ttt.layer import BidirectionalTTT

    assert TTTLayer(64, 2, TTTConfig(kind="mlp")).W1.shape == (2, 32, 128)
    narrow = TTTLayer(64, 2, TTTConfig(kind="mlp", mlp_hidden=16))
    assert (narrow.W1.shape, narrow.b1.shape, narrow.W2.shape) == ((2, 32, 16), (2, 16), (2, 16, 32))
    assert TTTLayer(64, 2, TTTConfig(kind="linear", mlp_hidden=16)).W1.shape == (2, 32, 32)
    cfg = load_config(None, ["ttt.kind=mlp", "ttt.mlp_hidden=16", "ttt.mini_batch_size=16",
                             "layout.duration=3s", "layout.height=32", "layout.width=32", "layout.text_tokens=16"])
    layout = VideoLayout.from_config(cfg.layout, cfg.ttt)
    torch.manual_seed(0)
    layer = BidirectionalTTT(64, 2, cfg.ttt)
    x = torch.randn(1, layout.total_tokens, 64)
    layer(x, layout).square().mean().backward()
    inner = next(m for m in layer.modules() if isinstance(m, TTTLayer))
    assert inner.W2.shape == (2, 16, 32) and inner.W2.grad is not None and inner.W2.grad.abs().sum() > 0
