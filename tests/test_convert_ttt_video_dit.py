"""`tttv convert --from ttt-video-dit`: a random state dict in the reference system's names and shapes (written here
from the facts of its model, scaled to the tiny preset), converted, loaded, sampled; and the mistakes it refuses."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file

from tttvideo.cli import main
from tttvideo.config.loader import load_config
from tttvideo.models import build_model, load_checkpoint
from tttvideo.train.checkpoint import resolve_init_from

pytestmark = pytest.mark.usefixtures("one_thread")

# the tiny preset: width 64, 2 heads of 32, 2 layers, text features 64, time embedding 64, 16 latent channels,
# patch 2
C, H, D, LAYERS, TEXT, TIME, CH, P = 64, 2, 32, 2, 64, 64, 16, 2
# the tiny layout test_sample.py samples at, and the CPU settings
SETTINGS = ["layout.height=32", "layout.width=48", "layout.text_tokens=16", "ttt.scan_checkpoint_group_size=0",
            'ttt.backend="reference"', 'data.demo_text_encoder="table"', 'sample.device="cpu"', 'model.dtype="fp32"']


def reference_state_dict(kind: str = "mlp", seed: int = 0) -> dict[str, torch.Tensor]:
    """The reference model's parameters: dit.{patch_embedding, time_embed, layers, transformer_norm, final_layer}."""
    E = 4 * D if kind == "mlp" else D
    shapes = {
        "dit.patch_embedding.vid_proj.weight": (C, CH, P, P), "dit.patch_embedding.vid_proj.bias": (C,),
        "dit.patch_embedding.text_proj.weight": (C, TEXT), "dit.patch_embedding.text_proj.bias": (C,),
        "dit.time_embed.0.weight": (TIME, C), "dit.time_embed.0.bias": (TIME,),
        "dit.time_embed.2.weight": (TIME, TIME), "dit.time_embed.2.bias": (TIME,),
        "dit.transformer_norm.weight": (C,), "dit.transformer_norm.bias": (C,),
        "dit.final_layer.adaLN_modulation.1.weight": (2 * C, TIME), "dit.final_layer.adaLN_modulation.1.bias": (2 * C,),
        "dit.final_layer.norm.weight": (C,), "dit.final_layer.norm.bias": (C,),
        "dit.final_layer.linear.weight": (P * P * CH, C), "dit.final_layer.linear.bias": (P * P * CH,),
    }
    for i in range(LAYERS):
        layer = {
            "pre_seq_layernorm.weight": (C,), "pre_seq_layernorm.bias": (C,),
            "pre_seq_adaLN_modulation.1.weight": (6 * C, TIME), "pre_seq_adaLN_modulation.1.bias": (6 * C,),
            "pre_mlp_layernorm.weight": (C,), "pre_mlp_layernorm.bias": (C,),
            "pre_mlp_adaLN_modulation.1.weight": (6 * C, TIME), "pre_mlp_adaLN_modulation.1.bias": (6 * C,),
            "mlp.layer1.weight": (4 * C, C), "mlp.layer1.bias": (4 * C,),
            "mlp.layer2.weight": (C, 4 * C), "mlp.layer2.bias": (C,),
            "seq_modeling_block.q_norm.weight": (D,), "seq_modeling_block.q_norm.bias": (D,),
            "seq_modeling_block.k_norm.weight": (D,), "seq_modeling_block.k_norm.bias": (D,),
            "seq_modeling_block.ssm.ttt.learnable_ttt_lr_weight": (H, 1, C),
            "seq_modeling_block.ssm.ttt.learnable_ttt_lr_bias": (H, 1),
            "seq_modeling_block.ssm.ttt.ttt_norm_weight": (H, D), "seq_modeling_block.ssm.ttt.ttt_norm_bias": (H, D),
            "seq_modeling_block.ssm.ttt.post_norm.weight": (C,), "seq_modeling_block.ssm.ttt.post_norm.bias": (C,),
            "seq_modeling_block.ssm.ttt.W1": (H, D, E), "seq_modeling_block.ssm.ttt.b1": (H, 1, E),
        }
        if kind == "mlp":
            layer |= {"seq_modeling_block.ssm.ttt.W2": (H, E, D), "seq_modeling_block.ssm.ttt.b2": (H, 1, D)}
        for proj in ("q", "k", "v", "o", "ssm.ttt.wq", "ssm.ttt.wk", "ssm.ttt.wv", "ssm.ttt.wo"):
            layer |= {f"seq_modeling_block.{proj}.weight": (C, C), f"seq_modeling_block.{proj}.bias": (C,)}
        for gate in ("forward_ssm_gating_text", "forward_ssm_gating_video", "backward_ssm_gating_text",
                     "backward_ssm_gating_video"):
            layer[f"seq_modeling_block.{gate}.gating_alpha"] = (C,)
        shapes |= {f"dit.layers.{i}.{k}": s for k, s in layer.items()}
    g = torch.Generator().manual_seed(seed)
    return {k: 0.05 * torch.randn(s, generator=g) for k, s in shapes.items()}


def convert(source, out, *extra):
    return main(["convert", "--from", "ttt-video-dit", str(source), "--out", str(out), *extra,
                 *(a for s in SETTINGS for a in ("--set", s))])


def saved_safetensors(tmp_path, sd, name="model.safetensors"):
    from safetensors.torch import save_file

    path = tmp_path / name
    save_file(sd, str(path))
    return path


def loaded(run):
    folder = run / "checkpoints" / "step-000000"
    cfg = load_config(folder / "config.toml")
    model = build_model(cfg)
    load_checkpoint(model, resolve_init_from(run))
    assert all(m.ttt.eta_layout == cfg.ttt.eta_layout for m in model.ttt_modules())
    return cfg, dict(model.named_parameters())


def test_safetensors_converts_loads_and_samples(tmp_path, capsys):
    sd = reference_state_dict("mlp")
    run = tmp_path / "run"
    assert convert(saved_safetensors(tmp_path, sd), run, "--duration", "6s") == 0
    assert "tttv sample --checkpoint" in capsys.readouterr().out
    cfg, ours = loaded(run)
    assert (cfg.model.preset, cfg.ttt.kind, cfg.ttt.eta_layout, cfg.layout.duration) == ("tiny", "mlp", "reference",
                                                                                         "6s")
    t = "dit.layers.1.seq_modeling_block."
    pairs = {"blocks.1.ttt.ttt.W1": sd[t + "ssm.ttt.W1"], "blocks.1.ttt.ttt.b1": sd[t + "ssm.ttt.b1"][:, 0],
             "blocks.1.ttt.ttt.b2": sd[t + "ssm.ttt.b2"][:, 0],
             "blocks.1.ttt.ttt.learnable_ttt_lr_weight": sd[t + "ssm.ttt.learnable_ttt_lr_weight"][:, 0],
             "blocks.1.ttt.ttt.learnable_ttt_lr_bias": sd[t + "ssm.ttt.learnable_ttt_lr_bias"][:, 0],
             "blocks.1.ttt.reverse_gate_video": sd[t + "backward_ssm_gating_video.gating_alpha"],
             "blocks.1.ttt.forward_gate_text": sd[t + "forward_ssm_gating_text.gating_alpha"],
             "blocks.1.attn.to_out.weight": sd[t + "o.weight"], "blocks.1.attn.norm_k.bias": sd[t + "k_norm.bias"],
             "blocks.1.norm1.linear.weight": sd["dit.layers.1.pre_seq_adaLN_modulation.1.weight"],
             "blocks.1.mlp.fc2.weight": sd["dit.layers.1.mlp.layer2.weight"],
             "time_embed.linear2.bias": sd["dit.time_embed.2.bias"], "embed.patch.weight":
             sd["dit.patch_embedding.vid_proj.weight"], "proj_out.weight": sd["dit.final_layer.linear.weight"],
             "norm_out.linear.bias": sd["dit.final_layer.adaLN_modulation.1.bias"]}
    for name, value in pairs.items():
        assert torch.equal(ours[name], value), name
    assert len(ours) == len(sd)  # every parameter came from the file (load_checkpoint also checks it)

    scenes = tmp_path / "story.json"
    scenes.write_text(json.dumps([{"text": "a red circle"}, {"text": "a blue square"}]))
    assert main(["sample", "--checkpoint", str(run), "--scenes", str(scenes), "--out", str(tmp_path / "v.mp4"),
                 "--steps", "1", "--set", "sample.save_latents=true", "--set", "sample.write_video=false"]) == 0
    latents = load_file(str(tmp_path / "v.latents.safetensors"))["latents"]
    assert latents.shape[1] == 25 and torch.isfinite(latents).all()  # 2 scenes: 25 latent frames

    # weights only: resuming the imported run is refused in one sentence that says what to do instead
    capsys.readouterr()
    assert main(["train", str(run / "checkpoints" / "step-000000" / "config.toml"), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "imported by tttv convert" in err and "train.init_from" in err


def test_trained_torch_file_with_model_prefix_and_linear_kind(tmp_path):
    """A torch.save of the trainer's {"model": state dict, ...}: keys "model.dit...", other entries ignored."""
    sd = reference_state_dict("linear", seed=1)
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": sd, "optimizer": {"state": {}}, "metadata": {"wandb_id": "x"}}, path)
    assert convert(path, tmp_path / "run") == 0
    cfg, ours = loaded(tmp_path / "run")
    assert (cfg.ttt.kind, cfg.ttt.eta_layout) == ("linear", "reference")
    assert torch.equal(ours["blocks.0.ttt.ttt.b1"], sd["dit.layers.0.seq_modeling_block.ssm.ttt.b1"][:, 0])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_dcp_folder_needs_trust(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    sd = reference_state_dict("mlp", seed=2)
    folder = tmp_path / "dcp"
    dcp.save({"model": sd, "lr_scheduler": {"step": torch.tensor(3)}}, checkpoint_id=str(folder), no_dist=True)
    assert convert(folder, tmp_path / "run") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pickle" in err and "--trust-checkpoint" in err
    assert not (tmp_path / "run").exists()
    assert convert(folder, tmp_path / "run", "--trust-checkpoint") == 0
    _, ours = loaded(tmp_path / "run")
    assert torch.equal(ours["blocks.0.ttt.ttt.W2"], sd["dit.layers.0.seq_modeling_block.ssm.ttt.W2"])


@pytest.mark.parametrize("damage,words", [
    ("missing", ["'dit.layers.1.seq_modeling_block.ssm.ttt.W1' is missing"]),
    ("shape", ["'dit.layers.0.seq_modeling_block.ssm.ttt.b1'", "[2, 128]", "expected [2, 1, 128]"]),
])
def test_a_mismatch_is_one_sentence_naming_the_key(tmp_path, capsys, damage, words):
    sd = reference_state_dict("mlp", seed=3)
    if damage == "missing":
        del sd["dit.layers.1.seq_modeling_block.ssm.ttt.W1"]
    else:
        sd["dit.layers.0.seq_modeling_block.ssm.ttt.b1"] = sd["dit.layers.0.seq_modeling_block.ssm.ttt.b1"][:, 0]
    assert convert(saved_safetensors(tmp_path, sd), tmp_path / "run") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tttv convert: error:")
    assert all(w in err for w in words), err
    assert not (tmp_path / "run").exists()


def test_a_pickle_of_other_objects_is_refused_unread(tmp_path, capsys):
    path = tmp_path / "model.pt"
    torch.save({"model": reference_state_dict(), "args": argparse.Namespace(lr=1)}, path)
    assert convert(path, tmp_path / "run") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "never unpickles" in err


def test_an_existing_run_folder_is_refused(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.txt").write_text("mine")
    assert convert(saved_safetensors(tmp_path, reference_state_dict()), tmp_path / "run") == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "run" / "keep.txt").read_text() == "mine"
