"""Wan's VAE and text encoder from diffusers / transformers folders (tiny random models saved in their formats):
the streamed decode equals diffusers' own `AutoencoderKLWan.decode` after Wan's latent unscaling, and the umT5
features are the pipeline's (masked encoder, zeros past the prompt). Selection goes by the backbone's names."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

DEMO_WAN = "configs/wan2.1-1.3b/demo-tiny.toml"


def tiny_wan_vae(folder):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                           latents_std=[1.5, 0.5, 2.0, 1.0])
    vae.save_pretrained(folder)
    return vae


def test_wan_vae_streams_what_diffusers_decodes(tmp_path):
    from tttvideo.sample.decode import WanDecoder, make_decoder

    vae = tiny_wan_vae(tmp_path / "vae")
    dec = make_decoder(str(tmp_path / "vae"), torch.device("cpu"), torch.float32, tiling=True, kind="wan")
    assert isinstance(dec, WanDecoder) and (dec.spatial, dec.temporal) == (8, 4)
    latents = torch.randn(1, 4, 4, 2, 3)  # [B, T, C, h, w] in the model's scale
    chunks = list(dec.frames(latents))
    assert [c.shape[2] for c in chunks] == [1, 4, 4, 4] and dec.num_frames(4) == 13
    mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 4, 1, 1, 1)
    with torch.no_grad():
        expected = vae.decode(latents.permute(0, 2, 1, 3, 4) * std + mean).sample
    torch.testing.assert_close(torch.cat(chunks, dim=2), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="holds a AutoencoderKLWan, not the AutoencoderKLCogVideoX"):
        make_decoder(str(tmp_path / "vae"), torch.device("cpu"), torch.float32, tiling=True, kind="cogvideox")


def tiny_umt5(folder, d_model=32):
    """A word-level tokenizer + a one-layer random umT5 encoder, saved as a pipeline folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    words = "a red blue circle square moves left up on green background".split()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
                            ).save_pretrained(folder / "tokenizer")
    torch.manual_seed(0)
    model = UMT5EncoderModel(UMT5Config(vocab_size=len(vocab), d_model=d_model, d_kv=8, d_ff=64, num_layers=1,
                                        num_heads=2))
    model.save_pretrained(folder / "text_encoder")
    return model.eval()


def test_umt5_features_are_wans_pipeline_features(tmp_path):
    from tttvideo.config.loader import load_config
    from tttvideo.text.encoders import make_text_encoder
    from tttvideo.text.umt5 import UMT5SceneEncoder

    model = tiny_umt5(tmp_path / "umt5")
    cfg = load_config("configs/wan2.1-1.3b/demo-tiny.toml", [f"sample.text_encoder_path={tmp_path / 'umt5'}"])
    enc = make_text_encoder(cfg, 8, 32, torch.device("cpu"))
    assert isinstance(enc, UMT5SceneEncoder) and enc.text_dim == 32
    prompts = ["a  red circle &amp; moves left", "a blue square moves up on a green background"]
    assert enc.token_counts(prompts) == [7, 10]  # whitespace collapsed, "&" unknown, </s> appended
    got = enc.encode(prompts)
    assert got.shape == (2, 8, 32)
    ids = torch.tensor([[3, 4, 6, 2, 8, 9, 1, 0], [3, 5, 7, 8, 10, 11, 3, 1]])  # the second cut to 8 tokens
    mask = (ids != 0).long()
    with torch.no_grad():
        expected = model(ids, mask).last_hidden_state * mask[..., None]
    torch.testing.assert_close(got, expected)
    assert got[0, 7].abs().sum() == 0 and got[0, 6].abs().sum() > 0
    enc.release()
    with pytest.raises(Exception, match="gives 32-d features but the model takes 64-d"):
        make_text_encoder(cfg, 8, 64, torch.device("cpu"))


def test_precompute_encodes_with_wans_vae_and_umt5(tmp_path):
    """`tttv precompute` on a wan config: the stored posterior is AutoencoderKLWan's, normalised per channel (so
    the cache's samples are the latents Wan works in), and the text is the masked umT5's, zero past the prompt."""
    import json

    from safetensors.torch import load_file

    from tests.test_precompute import clip, write_mp4
    from tttvideo.cli import main
    from tttvideo.data.cache import LatentCache
    from tttvideo.data.video import read_frames
    from tttvideo.layout import VideoLayout

    vae = tiny_wan_vae(tmp_path / "enc" / "vae")
    tiny_umt5(tmp_path / "enc")
    (tmp_path / "videos").mkdir()
    write_mp4(tmp_path / "videos" / "a.mp4", clip(49, 32, 48, seed=1))
    (tmp_path / "captions.jsonl").write_text(json.dumps({"video": "a.mp4", "captions": ["a red circle"]}) + "\n")
    out = tmp_path / "cache"
    assert main(["precompute", DEMO_WAN, "--videos", str(tmp_path / "videos"), "--captions",
                 str(tmp_path / "captions.jsonl"), "--out", str(out), "--vae", str(tmp_path / "enc"), "--t5",
                 str(tmp_path / "enc"), "--set", "layout.duration=3s", "--set", "layout.height=32", "--set",
                 "layout.width=48", "--set", "layout.text_tokens=8", "--set", "ttt.mini_batch_size=16", "--set",
                 "data.cache_dtype=fp32", "--set", "data.device=cpu"]) == 0
    x = torch.from_numpy(read_frames(tmp_path / "videos" / "a.mp4")).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
    with torch.no_grad():
        dist = vae.encode(x).latent_dist
    m = torch.tensor(vae.config.latents_mean).view(4, 1, 1, 1)
    s = torch.tensor(vae.config.latents_std).view(4, 1, 1, 1)
    stored = load_file(out / "latents" / "a.safetensors")
    torch.testing.assert_close(stored["mean"], (dist.mean[0] - m) / s, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(stored["logvar"].exp().sqrt(), dist.std[0] / s, rtol=1e-4, atol=1e-4)
    [text_file] = (out / "text").iterdir()
    text = load_file(text_file)["embedding"]
    n = int((text.abs().sum(-1) > 0).sum())
    assert 2 <= n < 8 and text[n:].abs().sum() == 0  # the prompt's tokens, then zeros
    cache = LatentCache(out / "manifest.jsonl", VideoLayout.create(3, 32, 48, text_tokens=8, mini_batch_size=16,
                                                                   text_in_stream=False), 4, 32)
    assert [e.id for e in cache.entries] == ["a"]
