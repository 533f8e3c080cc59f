"""VAE decode path and mp4 writing.

A small random diffusers `AutoencoderKLCogVideoX` is saved with save_pretrained and loaded back through our loader;
our time-major streamed decode must equal diffusers' own `vae.decode` exactly (same decoder calls, same order per
tile), both whole-frame and tiled, while handing frames out one temporal batch at a time.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tttvideo.errors import UserError
from tttvideo.sample.decode import CogVideoXDecoder, IdentityDecoder, decoded_frame_count, make_decoder
from tttvideo.data.video import read_frames, scenes_path
from tttvideo.sample.video import Mp4Writer, to_uint8_frames

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def vae_folder(tmp_path_factory):
    torch.manual_seed(0)
    # 4 blocks: 8x spatial, 4x temporal compression like CogVideoX's; 4 channels keep the CPU conv3d cheap
    vae = diffusers.AutoencoderKLCogVideoX(block_out_channels=(4, 4, 4, 4), latent_channels=4, layers_per_block=1,
                                           norm_num_groups=2, sample_height=64, sample_width=64)
    folder = tmp_path_factory.mktemp("vae")
    vae.save_pretrained(folder)
    return folder


def test_frame_counts():
    assert decoded_frame_count(13) == 49
    assert decoded_frame_count(253) == 1009
    assert IdentityDecoder().num_frames(37) == 145


@pytest.mark.parametrize("tiling", [False, True])
def test_streamed_decode_equals_diffusers_decode(vae_folder, tiling):
    dec = CogVideoXDecoder.from_folder(vae_folder, tiling=tiling)
    vae = dec.vae
    if tiling:
        # 32x48 px = 4x6 latents in 2x2 tiles of 4x4 latents; overlaps chosen so that diffusers' tile arithmetic
        # covers the frame exactly (as it does at CogVideoX's 480x720 with its defaults)
        vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32)
        vae.tile_overlap_factor_height = vae.tile_overlap_factor_width = 1 / 4
    else:
        vae.disable_tiling()
    z = torch.randn(1, 5, 4, 4, 6, generator=torch.Generator().manual_seed(1))  # [B, T, C, h, w]
    with torch.no_grad():
        expected = vae.decode(z.permute(0, 2, 1, 3, 4) / vae.config.scaling_factor).sample.clamp(-1, 1)
    chunks = list(dec.frames(z))
    # the stream comes in temporal batches (3 latent frames -> 9 pixel frames, then 2 -> 8), not all at once
    assert [c.shape[2] for c in chunks] == [9, 8]
    got = torch.cat(chunks, dim=2)
    assert got.shape == (1, 3, decoded_frame_count(5), 32, 48)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_vae_folder_errors(tmp_path, vae_folder):
    with pytest.raises(UserError, match="does not exist"):
        CogVideoXDecoder.from_folder(tmp_path / "nope")
    with pytest.raises(UserError, match="no config.json"):
        CogVideoXDecoder.from_folder(tmp_path)
    # a pipeline folder with vae/ inside is accepted
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "vae").symlink_to(vae_folder, target_is_directory=True)
    assert isinstance(make_decoder(str(tmp_path / "pipe"), torch.device("cpu"), torch.float32, True), CogVideoXDecoder)
    with pytest.raises(UserError, match="compresses 8x spatially"):
        make_decoder(str(vae_folder), torch.device("cpu"), torch.float32, True, spatial=16)


def test_identity_decode_shapes_and_values():
    lat = torch.zeros(1, 3, 16, 2, 3)
    lat[:, 1, 0] = 0.5  # second latent frame, red channel
    chunks = list(IdentityDecoder(spatial=8, temporal=4, window=2).frames(lat))
    video = torch.cat(chunks, dim=2)
    assert video.shape == (1, 3, 9, 16, 24)
    # frame 0 comes from latent 0; frames 1-4 from latent 1, nearest-neighbour in space
    assert video[0, 0, 0].abs().max() == 0
    assert torch.all(video[0, 0, 1:5] == 0.5) and torch.all(video[0, 1:, 1:5] == 0)


def test_mp4_roundtrip_and_odd_sizes(tmp_path):
    gen = torch.Generator().manual_seed(0)
    smooth = torch.linspace(-1, 1, 48).view(1, 1, 1, 48).expand(3, 3, 31, 48)  # [n, 3, H, W] with H odd
    frames = to_uint8_frames(smooth)
    assert frames.shape == (3, 31, 48, 3) and frames.dtype == np.uint8
    path = tmp_path / "v" / "out.mp4"
    with Mp4Writer(path, fps=16) as w:
        w.append(frames)
        w.append(to_uint8_frames(torch.rand(2, 3, 31, 48, generator=gen) * 2 - 1))
    back = read_frames(path)
    assert back.shape == (5, 32, 48, 3)  # padded to an even height, never rescaled
    # lossy codec: the smooth ramp survives to within a few levels
    assert np.abs(back[:3, :31].astype(int) - frames.astype(int)).mean() < 4
    assert scenes_path(path).name == "out.scenes.json"
