"""The backbone seam (tttvideo.models.backbone): a second backbone, defined here and registered under a test name,
trains and samples through the unchanged trainer and sampler.

The toy backbone differs from CogVideoX where the layout and the objective are asked of the backbone: its text is
cross-attended instead of being in the residual stream (the stream is the video alone), and its noise schedule is
another one. It shares what every backbone shares: segment-local attention, the gated bidirectional TTT layer,
checkpoints, the adapters' parameter names.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tttvideo.api import VideoPipeline, train
from tttvideo.config.loader import load_config
from tttvideo.config.schema import TTTConfig
from tttvideo.diffusion import ZeroSNRSchedule
from tttvideo.errors import ConfigError
from tttvideo.layout import LayoutParams, VideoLayout
from tttvideo.models import build_model
from tttvideo.models.attention import LocalAttention
from tttvideo.models.backbone import (Backbone, BackboneSpec, Objective, backbone_of, get_preset, layout_of,
                                      register_backbone, unregister_backbone)
from tttvideo.sequence.build import sequence_layer

pytestmark = pytest.mark.usefixtures("one_thread")

TOY = "toy-xattn"
TOY_SCHEDULE = functools.partial(ZeroSNRSchedule, beta_end=0.02)


@dataclass(frozen=True)
class ToyConfig:
    name: str
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    in_channels: int = 16
    text_embed_dim: int = 64
    patch_size: int = 2

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def validate(self) -> None:
        pass


class CrossAttention(nn.Module):
    def __init__(self, dim: int, text_dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k = nn.Linear(dim, dim), nn.Linear(text_dim, dim)
        self.to_v, self.to_out = nn.Linear(text_dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        def heads(t):
            return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.to_q(x)), heads(self.to_k(text)), heads(self.to_v(text)))
        return self.to_out(out.transpose(1, 2).flatten(2))


class ToyBlock(nn.Module):
    """Pre-norm: segment-local self-attention over the video, the long-range layer on its output, cross-attention
    to all segments' text, MLP."""

    def __init__(self, cfg: ToyConfig, ttt: TTTConfig | None, kind: str):
        super().__init__()
        dim, heads = cfg.dim, cfg.num_attention_heads
        self.norm1, self.norm_text, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = LocalAttention(dim, heads, cfg.attention_head_dim)
        self.ttt = sequence_layer(kind if ttt is not None else "none", dim, heads, ttt, 10000.0)
        self.cross = CrossAttention(dim, cfg.text_embed_dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        # the switches models.checkpointing sets on every block
        self.checkpoint_attention = self.checkpoint_mlp = False
        self.checkpoint_keep: tuple[str, ...] = ()

    def forward(self, x, temb, text, layout):
        a = self.attn(self.norm1(x) + temb[:, None], layout)
        if self.ttt is not None:
            a = self.ttt(a, layout)
        x = x + a
        x = x + self.cross(self.norm_text(x), text)
        return x + self.mlp(self.norm2(x))


class ToyCrossAttentionDiT(Backbone):
    def __init__(self, spec: ToyConfig, ttt: TTTConfig | None = None, use_ttt: bool = True,
                 sequence_layer: str = "ttt"):
        super().__init__()
        self.spec, self.ttt_config, self.use_ttt = spec, ttt or TTTConfig(), use_ttt
        self.sequence_layer = sequence_layer if use_ttt else "none"
        dim, p = spec.dim, spec.patch_size
        self.patch = nn.Linear(spec.in_channels * p * p, dim)
        self.time = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(ToyBlock(spec, self.ttt_config if use_ttt else None, sequence_layer)
                                    for _ in range(spec.num_layers))
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, spec.in_channels * p * p)
        self.block_units = [(i, i + 1, False) for i in range(spec.num_layers)]

    def forward(self, latents, text, timestep, layout=None, sp=None):
        assert sp is None, "the toy backbone runs in one process"
        if not isinstance(text, torch.Tensor):
            text = torch.stack(list(text), dim=1)
        B, T, C, H, W = latents.shape
        p = self.spec.patch_size
        if layout is None:
            layout = VideoLayout.from_latents(T, H, W, text.shape[-2], p, self.ttt_config.mini_batch_size,
                                              backbone=backbone_of(self.spec).layout)
        dtype = self.patch.weight.dtype
        patches = latents.reshape(B, T, C, H // p, p, W // p, p).permute(0, 1, 3, 5, 2, 4, 6)
        x = self.patch(patches.reshape(B, T * (H // p) * (W // p), C * p * p).to(dtype))
        layout.check_sequence_length(x.shape[1])  # the stream is the video alone
        t = torch.as_tensor(timestep, device=latents.device, dtype=torch.float32).expand(B)
        temb = self.time((t / 1000)[:, None].to(dtype))
        context = text.reshape(B, -1, text.shape[-1]).to(dtype)
        for block in self.blocks:
            x = block(x, temb, context, layout)
        x = self.proj_out(self.norm_out(x)).reshape(B, T, H // p, W // p, C, p, p)
        return x.permute(0, 1, 4, 2, 5, 3, 6).reshape(B, T, C, H, W)


@pytest.fixture
def toy_backbone():
    spec = register_backbone(BackboneSpec(
        name="toy-cross-attention", presets={TOY: ToyConfig(name=TOY)}, config_type=ToyConfig,
        build=ToyCrossAttentionDiT, layout=LayoutParams(text_in_stream=False),
        objective=Objective(prediction="v", schedule=TOY_SCHEDULE)))
    yield spec
    unregister_backbone(spec.name)


def toy_config(tmp_path, *extra):
    cfg = load_config("configs/demo.toml", [
        "layout.duration=6s", "layout.height=32", "layout.width=32", "layout.text_tokens=8",
        "ttt.mini_batch_size=16", "data.demo_videos=2", "data.demo_text_encoder=table", "train.batch_size=1",
        "train.steps=2", "train.log_every=1", "train.checkpoint_every=2", "train.sample_at_end=false",
        "train.tensorboard=false", "train.warmup_steps=1", "train.if_exists=refuse", "sample.steps=2",
        f"train.output_dir={tmp_path / 'run'}", f"data.demo_dir={tmp_path / 'data'}", *extra])
    # model.preset's choices in a TOML file are the shipped presets; a registered backbone is chosen in Python
    cfg.model.preset = TOY
    return cfg


def test_the_registry_knows_cogvideox():
    spec = backbone_of("cogvideox-5b")
    assert spec.name == "cogvideox" and set(spec.presets) == {"tiny", "tiny-4ch", "small", "cogvideox-5b"}
    assert backbone_of(dataclasses.replace(get_preset("tiny"), num_layers=3)) is spec
    assert spec.layout == LayoutParams(window_frames=13, text_in_stream=True, patch_size=2, vae_spatial=8,
                                       vae_temporal=4)
    assert torch.equal(spec.objective.schedule().alphas_cumprod, ZeroSNRSchedule().alphas_cumprod)


def test_a_preset_name_belongs_to_one_backbone(toy_backbone):
    with pytest.raises(ValueError, match="belong to 'cogvideox'"):
        register_backbone(dataclasses.replace(toy_backbone, name="other", presets={"tiny": ToyConfig(name="tiny")}))


def test_the_layout_is_the_backbones(toy_backbone, tmp_path):
    """6 s at 32x32 px: 25 latent frames of 2x2 tokens = 100 video tokens; the toy's stream holds no text."""
    cfg = toy_config(tmp_path)
    toy = layout_of(cfg)
    cog = VideoLayout.from_config(cfg.layout, cfg.ttt)
    assert (toy.total_tokens, toy.total_text_tokens, toy.text_tokens) == (100, 0, 8)
    assert (cog.total_tokens, cog.total_text_tokens) == (116, 16)
    assert torch.equal(toy.window_index(1), torch.arange(12 * 4, 25 * 4))
    cfg.layout.patch_size = 1
    with pytest.raises(ConfigError, match="layout.patch_size = 1 but the model's backbone has 2"):
        layout_of(cfg)


def test_the_vae_and_text_encoder_are_the_backbones(toy_backbone, tmp_path):
    """The toy names no VAE and no text encoder: a folder for either is refused before anything loads (CogVideoX's
    are diffusers' AutoencoderKLCogVideoX and T5, loaded from such folders in tests/test_sample.py)."""
    from tttvideo.errors import UserError
    from tttvideo.sample.decode import VAE_DECODERS
    from tttvideo.sample.pipeline import make_story_decoder
    from tttvideo.text.encoders import TEXT_ENCODERS, make_text_encoder

    cog = backbone_of("tiny")
    assert cog.vae in VAE_DECODERS and cog.text_encoder in TEXT_ENCODERS
    cfg = toy_config(tmp_path)
    cfg.sample.vae_path = cfg.sample.text_encoder_path = str(tmp_path / "nothing-here")
    with pytest.raises(UserError, match="names no VAE tttvideo can load"):
        make_story_decoder(cfg, torch.device("cpu"))
    with pytest.raises(UserError, match="'toy-cross-attention' backbone .* names none tttvideo can load"):
        make_text_encoder(cfg, 8, 64, torch.device("cpu"))


def test_precompute_refuses_a_backbone_with_other_encoders(toy_backbone, tmp_path, monkeypatch, capsys):
    """`tttv precompute` encodes with CogVideoX's VAE and T5 only: for the toy it stops with one sentence."""
    from tttvideo.cli import main, precompute_cmd

    monkeypatch.setattr(precompute_cmd, "config_from_args", lambda args: toy_config(tmp_path))
    args = ["--videos", "v", "--captions", "c.jsonl", "--vae", "vae", "--t5", "t5", "--out", str(tmp_path / "out")]
    assert main(["precompute", *args]) == 2
    err = capsys.readouterr().err
    assert "precompute encodes with CogVideoX's VAE and T5" in err and "'toy-cross-attention'" in err
    assert not (tmp_path / "out").exists()


def test_no_chunked_forward_is_a_config_error(toy_backbone, tmp_path):
    cfg = toy_config(tmp_path)
    cfg.memory.chunked_inference = True
    with pytest.raises(ConfigError, match="no chunked forward"):
        build_model(cfg)


def test_a_second_backbone_trains_and_samples(toy_backbone, tmp_path, monkeypatch):
    """`tttvideo.api.train` and `VideoPipeline` on the toy: the trainer's loss is the toy schedule's and the
    sampler steps on it; checkpoints save and load the toy's config."""
    import tttvideo.sample.pipeline as pipeline
    import tttvideo.train.step as step

    # the sampler's gc.collect between phases walks the whole test session's heap (seconds) and frees nothing checked
    monkeypatch.setattr(pipeline, "free_memory", lambda: None)
    schedules = []
    objective = step.DiffusionObjective
    monkeypatch.setattr(step, "DiffusionObjective", lambda schedule, *a, **k: (schedules.append(schedule),
                                                                                  objective(schedule, *a, **k))[1])
    cfg = toy_config(tmp_path)
    torch.manual_seed(0)
    result = train(cfg, quiet=True)
    assert result.steps_done == 2 and torch.isfinite(torch.tensor([result.first_loss, result.last_loss])).all()
    [schedule] = schedules
    assert torch.equal(schedule.alphas_cumprod, TOY_SCHEDULE().alphas_cumprod)
    assert not torch.equal(schedule.alphas_cumprod, ZeroSNRSchedule().alphas_cumprod)

    with VideoPipeline(cfg, result.output_dir, device="cpu") as pipe:
        assert isinstance(pipe.model, ToyCrossAttentionDiT)
        video = pipe(["a red circle", "a blue square"], steps=2)
    # 2 scenes = 6 s = 25 latent frames -> 97 frames at the layout's resolution
    assert video.frames.shape == (97, 32, 32, 3) and video.frames.std() > 0
