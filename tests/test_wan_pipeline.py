"""Wan through the backbone interface: `model.preset = "wan-tiny"` trains and samples with the project's own
trainer and sampler, its config is checked against what the Wan model supports, and its VAE and umT5 text encoder
load from diffusers / transformers folders (tiny random ones here)."""

from __future__ import annotations

import pytest
import torch

from tttvideo.config.loader import load_config
from tttvideo.errors import ConfigError
from tttvideo.layout import LayoutParams
from tttvideo.models.backbone import backbone_of, get_preset, layout_of

pytestmark = pytest.mark.usefixtures("one_thread")

DEMO = "configs/wan2.1-1.3b/demo-tiny.toml"


def wan_config(tmp_path, *extra):
    return load_config(DEMO, [
        "layout.duration=6s", "layout.height=32", "layout.width=32", "layout.text_tokens=16",
        "ttt.mini_batch_size=16", "ttt.sample_mini_batch_size=16", "data.demo_videos=2",
        "data.demo_text_encoder=table", "train.batch_size=1", "train.steps=2", "train.log_every=1",
        "train.checkpoint_every=2", "train.sample_at_end=false", "train.tensorboard=false", "train.warmup_steps=1",
        "train.if_exists=refuse", "sample.steps=2", f"train.output_dir={tmp_path / 'run'}",
        f"data.demo_dir={tmp_path / 'data'}", *extra])


def test_the_presets_are_wans(tmp_path):
    spec = backbone_of("wan2.1-t2v-1.3b")
    assert spec.name == "wan" and set(spec.presets) == {"wan-tiny", "wan2.1-t2v-1.3b"}
    assert spec.objective.prediction == "flow" and spec.objective.solvers == ("unipc", "euler")
    assert (spec.vae, spec.text_encoder) == ("wan", "umt5")
    assert spec.layout == LayoutParams(window_frames=13, text_in_stream=False, patch_size=2, vae_spatial=8,
                                       vae_temporal=4)
    assert get_preset("wan2.1-t2v-1.3b").text_embed_dim == 4096
    # 6 s at 32x32: 25 latent frames of 2x2 tokens, no text in the stream, 16 text tokens per segment cross-attended
    layout = layout_of(wan_config(tmp_path))
    assert (layout.total_tokens, layout.total_text_tokens, layout.text_tokens) == (100, 0, 16)


@pytest.mark.parametrize("setting, message", [
    ("sample.solver=ddim", "sample.solver = 'ddim' steps another objective than the 'flow'-prediction of "
                           "model.preset 'wan-tiny' (wan); set sample.solver to one of 'unipc', 'euler'"),
    ("layout.text_tokens=0", "layout.text_tokens = 0 picks CogVideoX's in-stream text length"),
    ("parallel.sp=2", "parallel.sp = 2: sequence parallelism is not wired for the Wan model yet"),
    ("layout.patch_size=1", "layout.patch_size = 1 but the model's backbone has 2"),
])
def test_settings_the_wan_model_lacks_are_one_sentence(tmp_path, setting, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as err:
        layout_of(wan_config(tmp_path, setting))
    assert "\n" not in str(err.value)
    # and a flow sampler for CogVideoX the other way round
    with pytest.raises(ConfigError, match="'v'-prediction of model.preset 'tiny-4ch'"):
        layout_of(load_config("configs/demo.toml", ["sample.solver=unipc"]))


def test_wan_tiny_trains_and_samples_through_the_cli(tmp_path, monkeypatch, capsys):
    """`tttv train` 2 steps on the wan-tiny demo config, then `tttv sample` 2 UniPC steps from its run folder: the
    loss is finite, the checkpoint reloads into a WanTTT (its spec through the file's JSON), the video has the
    layout's frames."""
    import json

    import tttvideo.sample.pipeline as pipeline
    from tttvideo.cli import main
    from tttvideo.models.wan import WanTTT

    # the sampler's gc.collect between phases walks the whole test session's heap (seconds) and frees nothing checked
    monkeypatch.setattr(pipeline, "free_memory", lambda: None)
    built = []
    load_model = pipeline.load_model
    monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: built.append(load_model(*a, **k)) or built[-1])
    cfg = wan_config(tmp_path)
    from tttvideo.config.loader import save_config

    config = save_config(cfg, tmp_path / "wan.toml")
    assert main(["train", str(config)]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 2 and all(0 < x < 100 for x in losses)
    story = tmp_path / "story.json"
    story.write_text(json.dumps([{"text": "a red circle moves left on a blue background"},
                                 {"text": "a blue square moves up on a green background"}]))
    out = tmp_path / "out.mp4"
    assert main(["sample", "--checkpoint", str(tmp_path / "run"), "--scenes", str(story), "--out", str(out),
                 "--steps", "2"]) == 0
    assert out.is_file() and out.stat().st_size > 0
    assert isinstance(built[0].model, WanTTT)
    assert '"solver": "unipc"' in (tmp_path / "out.scenes.json").read_text()


def test_chunked_inference_equals_the_plain_forward():
    """`memory.chunked_inference` on Wan: both attentions window by window, the TTT passes, projections and FFN over
    chunks of 7 tokens (not a divisor of anything), in place: the velocity equals the plain forward's (fp32, 1e-5)."""
    from tttvideo.config.schema import TTTConfig
    from tttvideo.models.wan.layout import wan_layout
    from tttvideo.models.weights import init_model
    from tttvideo.sequence.chunks import ChunkPlan

    model = init_model(get_preset("wan-tiny"), TTTConfig(kind="mlp", mini_batch_size=16, backend="reference"))
    model.set_ttt_gates(0.5)
    layout = wan_layout(6, 32, 48, mini_batch_size=16)  # 25 latent frames of 2x3 tokens, 2 windows
    latents = torch.randn(1, 25, 4, 4, 6)
    text = torch.randn(1, 2, 5, 32)
    with torch.no_grad():
        plain = model(latents, text, torch.tensor([700.0]), layout)
        for block in model.blocks:
            block.inference_chunks = ChunkPlan(7, 2)
        chunked = model(latents, text, torch.tensor([700.0]), layout)
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-5)
    assert plain.abs().mean() > 0.1


@pytest.mark.parametrize("card", ["24gb", "80gb"])
def test_stage_configs_chain_3_to_63_seconds(card):
    """configs/wan2.1-1.3b/: five stages per card that load, pass the Wan checks and the memory techniques' checks,
    each starting from the previous stage's run and saying what it measured (or that it is not measured yet)."""
    from pathlib import Path

    from tttvideo.memory.techniques import check_techniques, checkpoint_policy

    files = sorted(Path("configs/wan2.1-1.3b").glob(f"stage*-{card}.toml"))
    assert [f.name.split("-")[1] for f in files] == ["3s", "9s", "18s", "30s", "63s"]
    previous = ""
    for f in files:
        cfg = load_config(f)
        assert cfg.model.preset == "wan2.1-t2v-1.3b" and cfg.sample.solver == "unipc"
        assert layout_of(cfg).duration_s == int(f.name.split("-")[1][:-1])
        check_techniques(cfg, 1)
        assert cfg.train.init_from == previous and cfg.train.output_dir.endswith(f.stem)
        # the 24 GB stages ran on a GPU (the Wan chain) and say what they measured; the 80 GB ones have not
        marker = ("stage_chain_wan_24gb_h200.json" if card == "24gb" else "NOT YET MEASURED ON A GPU")
        assert marker in f.read_text()
        previous = cfg.train.output_dir
        # every stage's memory switches are the planner's choice, its figures in the comments
        assert f"`tttv plan configs/wan2.1-1.3b/{f.name} --gpu-mem" in f.read_text()
        assert checkpoint_policy(cfg) == "sub-block" and cfg.checkpointing.offload_activations
    last = load_config(files[-1])
    if card == "24gb":
        assert (last.model.frozen_weights, last.train.optimizer, last.memory.max_gpu_gib) == ("fp8", "adamw8bit", 23)
        # every block input offloaded (30 x 1.24 GiB in the host pool), none nested: the traced plan's choice
        assert (last.checkpointing.nested_span, last.checkpointing.ffn_chunk_tokens) == (0, 32768)
        assert last.checkpointing.offload_host_gib >= 38
