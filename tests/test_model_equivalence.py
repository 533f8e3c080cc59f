"""Our CogVideoX + TTT against diffusers' CogVideoXTransformer3DModel, loaded from a save_pretrained folder.

(a) one 3-s segment, TTT gates at 0: the whole model equals diffusers within 1e-5 relative (fp32, CPU);
(b) three segments, gates at 0, one layer: every window's attention output equals diffusers' attention on that window
    alone (text_i + its 13 frames, local RoPE positions), shared frames get the mean of their two windows, and the
    model output of every frame that belongs to one window equals diffusers run on that window;
(c) folders of another model and folders with missing / unexpected tensors are UserErrors naming them.
"""

from __future__ import annotations

import json

import pytest
import torch

from tttvideo.layout import VideoLayout

diffusers = pytest.importorskip("diffusers")
from diffusers import CogVideoXTransformer3DModel  # noqa: E402
from diffusers.models.embeddings import get_3d_rotary_pos_embed  # noqa: E402
from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from tttvideo.config.schema import TTTConfig  # noqa: E402
from tttvideo.errors import UserError  # noqa: E402
from tttvideo.models import from_pretrained, get_preset  # noqa: E402
from tttvideo.models.attention import window_tensors  # noqa: E402

TEXT = 10  # text tokens per segment
H_LAT, W_LAT = 4, 6  # latent size: 2 x 3 tokens per frame after the 2x2 patch
TTT = TTTConfig(mini_batch_size=16, scan_checkpoint_group_size=0)


pytestmark = pytest.mark.usefixtures("one_thread")


def diffusers_model(num_layers: int, seed: int = 0) -> CogVideoXTransformer3DModel:
    torch.manual_seed(seed)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        time_embed_dim=32,
        text_embed_dim=24,
        num_layers=num_layers,
        sample_width=W_LAT,
        sample_height=H_LAT,
        sample_frames=49,
        patch_size=2,
        max_text_seq_length=TEXT,
        use_rotary_positional_embeddings=True,
        use_learned_positional_embeddings=False,
    )
    # perturb every parameter (norm weights start at exactly 1/0) so that a mixed-up name cannot go unnoticed
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def pipeline_rope(model: CogVideoXTransformer3DModel, latent_frames: int):
    """image_rotary_emb exactly as diffusers' CogVideoXPipeline._prepare_rotary_positional_embeddings builds it."""
    cfg = model.config
    grid_h, grid_w = H_LAT // cfg.patch_size, W_LAT // cfg.patch_size
    crops = get_resize_crop_region_for_grid((grid_h, grid_w), cfg.sample_width // cfg.patch_size,
                                            cfg.sample_height // cfg.patch_size)
    return get_3d_rotary_pos_embed(embed_dim=cfg.attention_head_dim, crops_coords=crops, grid_size=(grid_h, grid_w),
                                   temporal_size=latent_frames)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def inputs(segments: int, batch: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    frames = 13 + 12 * (segments - 1)
    latents = torch.randn(batch, frames, 4, H_LAT, W_LAT, generator=g)
    text = torch.randn(batch, segments, TEXT, 24, generator=g)
    timestep = torch.tensor([17.0, 803.0][:batch])
    return latents, text, timestep


@pytest.fixture(scope="module")
def two_layer(tmp_path_factory):
    ref = diffusers_model(num_layers=2)
    folder = tmp_path_factory.mktemp("cogvideox") / "transformer"
    ref.save_pretrained(folder, max_shard_size="40KB")  # sharded, with an index, like the 5B download
    return ref, folder


def test_folder_is_sharded(two_layer):
    _, folder = two_layer
    assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert len(list(folder.glob("diffusion_pytorch_model-*.safetensors"))) > 1


def test_local_rope_matches_diffusers_pipeline(two_layer):
    ref, folder = two_layer
    model = from_pretrained(folder.parent, ttt=TTT)  # the model root (with transformer/) works too
    layout = VideoLayout.from_latents(13, H_LAT, W_LAT, TEXT, model.spec.patch_size,
                                      model.ttt_config.mini_batch_size)
    _, cos, sin, _ = window_tensors(layout, 16, 10000.0, torch.device("cpu"))
    d_cos, d_sin = pipeline_rope(ref, 13)
    torch.testing.assert_close(cos[TEXT:], d_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[TEXT:], d_sin, rtol=0, atol=1e-6)
    # the text prefix of a window is not rotated
    assert torch.equal(cos[:TEXT], torch.ones_like(cos[:TEXT]))
    assert torch.equal(sin[:TEXT], torch.zeros_like(sin[:TEXT]))


def test_one_segment_equals_diffusers(two_layer):
    ref, folder = two_layer
    model = from_pretrained(folder, ttt=TTT, dtype="fp32")
    model.set_ttt_gates(0.0)
    latents, text, t = inputs(segments=1)
    with torch.no_grad():
        expect = ref(latents, text[:, 0], t, image_rotary_emb=pipeline_rope(ref, 13), return_dict=False)[0]
        out = model(latents, text, t)
    assert out.shape == expect.shape == latents.shape
    assert rel(out, expect) < 1e-5
    # the TTT path is live: opening the gates changes the output
    model.set_ttt_gates(0.1)
    with torch.no_grad():
        assert rel(model(latents, text, t), expect) > 1e-4


def test_three_segments_window_by_window(tmp_path):
    ref = diffusers_model(num_layers=1, seed=3)
    ref.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, ttt=TTT)
    model.set_ttt_gates(0.0)
    latents, text, t = inputs(segments=3)
    layout = VideoLayout.from_latents(latents.shape[1], H_LAT, W_LAT, TEXT, model.spec.patch_size,
                                      model.ttt_config.mini_batch_size)
    F = layout.tokens_per_frame

    captured = {}
    model.blocks[0].attn.register_forward_hook(lambda m, i, o: captured.__setitem__("ours", o))
    ref.transformer_blocks[0].attn1.register_forward_hook(lambda m, i, o: captured.__setitem__("ref", o))
    with torch.no_grad():
        out = model(latents, text, t)
        ours_attn = captured["ours"]
        windows = []
        for i in range(3):
            frames = layout.segment_frames(i)
            y = ref(latents[:, frames.start : frames.stop], text[:, i], t, image_rotary_emb=pipeline_rope(ref, 13),
                    return_dict=False)[0]
            video_attn, text_attn = captured["ref"]
            windows.append((frames, y, video_attn, text_attn))

    T = layout.total_text_tokens
    video_attn = ours_attn[:, T:].unflatten(1, (layout.latent_frames, F))  # [B, frames, F, C]
    expect_attn = torch.zeros_like(video_attn)
    count = torch.zeros(layout.latent_frames)
    for i, (frames, y, v_attn, t_attn) in enumerate(windows):
        # text outputs come from their own window only
        assert rel(ours_attn[:, layout.text_slice(i)], t_attn) < 1e-5
        expect_attn[:, frames.start : frames.stop] += v_attn.unflatten(1, (13, F))
        count[frames.start : frames.stop] += 1
        # model output of the frames that belong to this window alone
        own = [f for f in frames if layout.window_overlap_count[f * F] == 1]
        assert len(own) == (11 if i == 1 else 12)  # the middle window shares both ends
        assert rel(out[:, own], y[:, [f - frames.start for f in own]]) < 1e-5
    assert count.tolist().count(2) == 2  # frames 12 and 24 are shared
    expect_attn /= count[None, :, None, None]
    assert rel(video_attn, expect_attn) < 1e-5
    shared = [12, 24]
    # the shared frames really are the mean (not either window's output)
    assert rel(video_attn[:, shared], windows[0][2].unflatten(1, (13, F))[:, [12, 12]]) > 1e-3
    assert rel(video_attn[:, shared], expect_attn[:, shared]) < 1e-5


def test_folder_of_another_model_is_named(tmp_path):
    config = {"_class_name": "CogVideoXTransformer3DModel", "num_layers": 30, "num_attention_heads": 30,
              "attention_head_dim": 64, "use_rotary_positional_embeddings": False}
    folder = tmp_path / "transformer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"proj_out.bias": torch.zeros(1)}, str(folder / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(UserError, match="CogVideoX-2B.*not the 'cogvideox-5b' preset.*num_layers 30"):
        from_pretrained(tmp_path, spec=get_preset("cogvideox-5b"))


def test_wrong_preset_folder(two_layer):
    _, folder = two_layer
    with pytest.raises(UserError, match="not the 'tiny' preset") as err:
        from_pretrained(folder, spec=get_preset("tiny"), ttt=TTT)
    msg = str(err.value)
    assert "attention_head_dim 16 (preset has 32)" in msg and "text_embed_dim 24 (preset has 64)" in msg
    assert "num_layers" not in msg  # both have 2 layers: only the fields that differ are named


def test_missing_and_unexpected_tensors(tmp_path, two_layer):
    ref, _ = two_layer
    folder = tmp_path / "transformer"
    ref.save_pretrained(folder)
    weights = folder / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    del state["transformer_blocks.1.attn1.to_k.weight"]
    del state["norm_out.linear.bias"]
    state["transformer_blocks.1.attn1.extra.weight"] = torch.zeros(2)
    save_file(state, str(weights))
    with pytest.raises(UserError) as err:
        from_pretrained(folder, ttt=TTT)
    msg = str(err.value)
    assert "missing transformer_blocks.1.attn1.to_k.weight, norm_out.linear.bias" in msg
    assert "unexpected transformer_blocks.1.attn1.extra.weight" in msg


def test_load_dtype_and_ttt_init(two_layer):
    ref, folder = two_layer
    model = from_pretrained(folder, ttt=TTT, dtype="bf16")
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 and not p.is_meta for p in params.values())
    torch.testing.assert_close(params["blocks.1.attn.to_q.weight"].float(),
                               ref.transformer_blocks[1].attn1.to_q.weight.bfloat16().float())
    ttt = model.blocks[0].ttt
    assert torch.all(ttt.forward_gate_video == 0.1) and torch.all(ttt.reverse_gate_text == 0.1)
    assert torch.all(ttt.ttt.b1 == 0) and torch.all(ttt.ttt.ttt_norm_weight == 1)
    assert 0.01 < ttt.ttt.W1.float().std().item() < 0.03  # N(0, 0.02)


def test_tiny_preset_round_trips_through_a_diffusers_folder(tmp_path):
    """build_model(cfg) with model.pretrained_path: the tiny preset written as a diffusers config, loaded through the
    config path with the lora adapter, equals diffusers at the preset's native 64x96 (integer RoPE grid)."""
    from tttvideo.config.schema import Config
    from tttvideo.models import build_model

    spec = get_preset("tiny")
    torch.manual_seed(4)
    ref = CogVideoXTransformer3DModel(**spec.to_diffusers_config()).eval()
    ref.save_pretrained(tmp_path / "transformer")
    cfg = Config()
    cfg.model.pretrained_path = str(tmp_path)
    cfg.model.adapter = "lora"
    cfg.ttt.mini_batch_size = 16
    model = build_model(cfg)
    model.set_ttt_gates(0.0)
    g = torch.Generator().manual_seed(2)
    latents = torch.randn(1, 13, 16, 8, 12, generator=g)
    text = torch.randn(1, 1, 8, 64, generator=g)
    t = torch.tensor([250.0])
    grid = get_resize_crop_region_for_grid((4, 6), spec.sample_width // 2, spec.sample_height // 2)
    rope = get_3d_rotary_pos_embed(embed_dim=32, crops_coords=grid, grid_size=(4, 6), temporal_size=13)
    with torch.no_grad():
        expect = ref(latents, text[:, 0], t, image_rotary_emb=rope, return_dict=False)[0]
        assert rel(model(latents, text, t), expect) < 1e-5


def test_our_diffusers_folder_loads_in_diffusers_and_back(tmp_path):
    """save_diffusers_folder (the benchmarks' full-size random-weight folders): diffusers loads it as a
    CogVideoXTransformer3DModel with our backbone's tensors, sharded with an index, and our loader reads it back."""
    from tttvideo.models import init_model
    from tttvideo.models.cogvideox.weights import diffusers_name_map, save_diffusers_folder

    spec = get_preset("tiny")
    torch.manual_seed(5)
    ours = init_model(spec, TTTConfig(mini_batch_size=16), True)
    folder = save_diffusers_folder(ours, tmp_path / "transformer", shard_bytes=200_000)
    assert len(list(folder.glob("*.safetensors"))) > 1 and not (tmp_path / "transformer.partial").exists()
    ref = CogVideoXTransformer3DModel.from_pretrained(folder)
    theirs = ref.state_dict()
    mapped = diffusers_name_map(spec.num_layers)
    assert set(theirs) == {d for d, o in mapped.items() if o in dict(ours.named_parameters())}
    for d, t in theirs.items():
        assert torch.equal(t, ours.state_dict()[mapped[d]]), d
    back = from_pretrained(tmp_path, spec=spec, ttt=TTTConfig(mini_batch_size=16))
    for d, o in mapped.items():
        if d in theirs:
            assert torch.equal(back.state_dict()[o], ours.state_dict()[o]), o
