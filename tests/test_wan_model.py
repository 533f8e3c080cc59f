"""Our Wan + TTT against diffusers' WanTransformer3DModel, loaded from a save_pretrained folder.

(a) one 3-s segment, TTT gates at 0: the whole model equals diffusers within 1e-5 (fp32, CPU);
(b) three segments, one layer, gates at 0: the output of every frame that lies in one window only equals diffusers
    run on that window alone with its segment's text (local RoPE, windowed self- and cross-attention);
(c) three segments, TTT on: forward + backward are finite and reach every TTT parameter; checkpointing the halves,
    the TTT passes and the blocks gives the same gradients;
(d) segment-local attention does not mix windows: with TTT off, perturbing a token (or the text) of segment 3 leaves
    segment 1's own frames unchanged; with TTT on it does not;
(e) the full-size preset matches diffusers' 1.3B parameter for parameter (on the meta device); folders of another
    model or with missing / unexpected tensors are UserErrors naming them. The test folder is sharded (an index and
    several files), as the real download is.
"""

from __future__ import annotations

import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from diffusers import WanTransformer3DModel  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from tttvideo.config.schema import CheckpointingConfig, TTTConfig  # noqa: E402
from tttvideo.errors import LayoutError, UserError  # noqa: E402
from tttvideo.models.checkpointing import apply_checkpointing  # noqa: E402
from tttvideo.models.wan import WanSpec, get_wan_preset  # noqa: E402
from tttvideo.models.wan.weights import from_pretrained_wan, wan_name_map  # noqa: E402
from tttvideo.models.weights import init_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

H_LAT, W_LAT = 4, 6  # 2 x 3 tokens per latent frame after the 2x2 patch
TEXT = 5  # text tokens per segment
TTT = TTTConfig(mini_batch_size=16, scan_checkpoint_group_size=0, gate_init=0.0)
SPEC = WanSpec(name="wan-test", num_layers=2, num_attention_heads=2, attention_head_dim=16, ffn_dim=40, in_channels=4,
               out_channels=4, text_dim=24, freq_dim=16, ttt_head_dim=16)


def diffusers_wan(spec: WanSpec, seed: int = 0) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**spec.to_diffusers_config())
    # perturb every parameter (norm weights start at exactly 1/0) so that a mixed-up name cannot go unnoticed
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def reference(model: WanTransformer3DModel, latents: torch.Tensor, text: torch.Tensor, t: torch.Tensor):
    """diffusers' prediction in our [B, T, C, H, W] convention."""
    return model(latents.transpose(1, 2), t, text).sample.transpose(1, 2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("wan") / "Wan-test-Diffusers"
    # small shards, so that the loader reads the index and several files as for the real 1.3B download
    diffusers_wan(SPEC).save_pretrained(path / "transformer", max_shard_size="40KB")
    assert len(list((path / "transformer").glob("diffusion_pytorch_model-*.safetensors"))) > 1
    return path


def test_one_segment_equals_diffusers(folder):
    ref = WanTransformer3DModel.from_pretrained(folder / "transformer").eval()
    ours = from_pretrained_wan(folder, SPEC, TTT).eval()
    assert all(g.abs().max() == 0 for m in ours.ttt_modules() for g in m.gates())
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 13, 4, H_LAT, W_LAT, generator=g)
    text = torch.randn(2, TEXT, 24, generator=g)
    t = torch.tensor([731.0, 12.5])
    with torch.no_grad():
        want = reference(ref, latents, text, t)
        got = ours(latents, text, t)
    assert got.shape == latents.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the TTT layers are really in the path: opening their gates changes the output
    ours.set_ttt_gates(0.5)
    with torch.no_grad():
        assert (ours(latents, text, t) - want).abs().max() > 1e-3


def test_windows_equal_diffusers_on_each_window(tmp_path):
    spec = WanSpec(**{**SPEC.__dict__, "name": "one-layer", "num_layers": 1})
    ref = diffusers_wan(spec, seed=3)
    ref.save_pretrained(tmp_path)
    ours = from_pretrained_wan(tmp_path, spec, TTT).eval()
    g = torch.Generator().manual_seed(2)
    latents = torch.randn(1, 37, 4, H_LAT, W_LAT, generator=g)
    text = torch.randn(1, 3, TEXT, 24, generator=g)
    t = torch.tensor([400.0])
    with torch.no_grad():
        got = ours(latents, text, t)
        for i in range(3):
            frames = slice(12 * i, 12 * i + 13)
            want = reference(ref, latents[:, frames], text[:, i], t)
            own = slice(1 if i else 0, 12 if i < 2 else 13)  # frames of this window alone
            torch.testing.assert_close(got[:, frames][:, own], want[:, own], rtol=1e-5, atol=1e-5)


def tiny_model(use_ttt: bool = True, gate: float = 0.1, seed: int = 0):
    torch.manual_seed(seed)
    model = init_model(get_wan_preset("wan-tiny"), TTT, use_ttt=use_ttt)
    if use_ttt:
        model.set_ttt_gates(gate)
    return model


def tiny_inputs(seed: int = 0, segments: int = 3):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, 13 + 12 * (segments - 1), 4, H_LAT, W_LAT, generator=g)
    text = torch.randn(1, segments, TEXT, 32, generator=g)
    return latents, text, torch.tensor([600.0])


def test_multi_segment_forward_backward_reaches_ttt():
    model = tiny_model()
    latents, text, t = tiny_inputs()
    out = model(latents, text, t)
    assert out.shape == latents.shape and torch.isfinite(out).all()
    out.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        # the text gates of the TTT layers touch no token (Wan's text is cross-attended, not in the stream)
        if "_gate_text" not in name:
            assert p.grad.abs().sum() > 0, name
    ttt_names = [n for n, _ in model.named_parameters() if ".ttt." in n]
    assert any(n.endswith("ttt.W1") for n in ttt_names) and any("reverse_gate_video" in n for n in ttt_names)

    # every checkpointing switch at once gives the same gradients
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    apply_checkpointing(model, CheckpointingConfig(block=True, group_size=2, attention=True, forward_ttt=True,
                                                   reverse_ttt=True, mlp=True))
    model(latents, text, t).square().mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], rtol=1e-5, atol=1e-7, msg=n)


def test_attention_is_segment_local():
    latents, text, t = tiny_inputs(seed=4)
    moved = latents.clone()
    moved[:, 30, :, 1, 2] += 3.0  # a token of segment 3 (frames 24..36), in no other window
    retext = text.clone()
    retext[:, 2] += 1.0  # segment 3's text
    first = slice(0, 12)  # segment 1's own frames (frame 12 is shared with segment 2)
    for use_ttt in (False, True):
        model = tiny_model(use_ttt=use_ttt, gate=0.5, seed=5).eval()
        with torch.no_grad():
            base = model(latents, text, t)
            for changed in (model(moved, text, t), model(latents, retext, t)):
                assert (changed[:, 24:] - base[:, 24:]).abs().max() > 1e-4  # the change is seen where it is
                diff = (changed[:, first] - base[:, first]).abs().max()
                if use_ttt:  # the TTT layer carries it across the whole video
                    assert diff > 1e-5
                else:
                    assert diff <= 1e-6


def test_inputs_are_checked():
    model = tiny_model()
    latents, text, t = tiny_inputs()
    with pytest.raises(LayoutError, match="one text embedding per segment"):
        model(latents, text[:, :2], t)
    with pytest.raises(LayoutError, match="13 \\+ 12"):
        model(latents[:, :20], text, t)
    with pytest.raises(LayoutError, match="32-d"):
        model(latents, text[..., :16], t)


def test_full_size_preset_matches_diffusers_on_meta():
    spec = get_wan_preset("wan2.1-t2v-1.3b")
    with torch.device("meta"):
        ref = WanTransformer3DModel(**spec.to_diffusers_config())
    ours = init_model(spec, TTTConfig(), device="meta")
    theirs = dict(ref.named_parameters())
    mine = dict(ours.named_parameters())
    name_map = wan_name_map(spec.num_layers)
    assert {name_map[n] for n in theirs} == {n for n in mine if ".ttt." not in n}
    for n, p in theirs.items():
        assert tuple(mine[name_map[n]].shape) == tuple(p.shape), n
    backbone = sum(p.numel() for p in theirs.values())
    assert 1.2e9 < backbone < 1.5e9  # "1.3B"
    assert ours.blocks[0].ttt.ttt.head_dim == 64 and ours.blocks[0].attn.head_dim == 128


def test_folder_errors(folder, tmp_path):
    tensors = {k: v for f in (folder / "transformer").glob("*.safetensors") for k, v in load_file(f).items()}
    config = json.loads((folder / "transformer" / "config.json").read_text())

    def write(name: str, tensors: dict, config: dict):
        out = tmp_path / name
        out.mkdir()
        save_file(tensors, out / "diffusion_pytorch_model.safetensors")
        (out / "config.json").write_text(json.dumps(config))
        return out

    missing = write("missing", {k: v for k, v in tensors.items() if k != "blocks.1.attn2.norm_k.weight"}, config)
    with pytest.raises(UserError, match="missing blocks.1.attn2.norm_k.weight"):
        from_pretrained_wan(missing, SPEC, TTT)
    extra = write("extra", {**tensors, "blocks.0.attn2.add_k_proj.weight": torch.zeros(2, 2)}, config)
    with pytest.raises(UserError, match="unexpected blocks.0.attn2.add_k_proj.weight"):
        from_pretrained_wan(extra, SPEC, TTT)
    other = write("other", tensors, {**config, "_class_name": "CogVideoXTransformer3DModel"})
    with pytest.raises(UserError, match="not a WanTransformer3DModel"):
        from_pretrained_wan(other, SPEC, TTT)
    with pytest.raises(UserError, match="ffn_dim 40 \\(preset has 8960\\)"):
        from_pretrained_wan(folder, get_wan_preset("wan2.1-t2v-1.3b"))
    with pytest.raises(UserError, match="does not exist"):
        from_pretrained_wan(tmp_path / "nowhere", SPEC)


def test_our_folder_writer_round_trips_through_diffusers(folder, tmp_path):
    """save_wan_folder (the backbone's save_pretrained: benchmarks/stage_chain.py makes its random-weight base with
    it) writes what diffusers' WanTransformer3DModel reads tensor for tensor, and what from_pretrained_wan reads
    back; small shards give an index and several files, as a download has."""
    from tttvideo.models.backbone import backbone_of
    from tttvideo.models.wan.weights import save_wan_folder

    assert backbone_of(SPEC).save_pretrained is save_wan_folder
    ours = from_pretrained_wan(folder, SPEC, TTT)
    written = save_wan_folder(ours, tmp_path / "transformer", shard_bytes=40_000)
    assert len(list(written.glob("diffusion_pytorch_model-*.safetensors"))) > 1
    theirs = WanTransformer3DModel.from_pretrained(written).state_dict()
    original = WanTransformer3DModel.from_pretrained(folder / "transformer").state_dict()
    assert theirs.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(theirs[name], tensor), name
    back = from_pretrained_wan(tmp_path, SPEC, TTT).state_dict()
    for name, tensor in ours.state_dict().items():
        if name in set(wan_name_map(SPEC.num_layers).values()):
            assert torch.equal(back[name], tensor), name
