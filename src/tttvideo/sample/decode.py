"""Latents -> pixel frames, streamed in temporal windows so that a one-minute video decodes in bounded memory.

`CogVideoXDecoder` wraps diffusers' `AutoencoderKLCogVideoX` loaded from a local folder. Its decoder is causal in
time: diffusers' own `decode` feeds the latent frames in batches of `num_latent_frames_batch_size` (2; the first
batch also takes the odd frame) and carries each causal convolution's last input frames forward in a `conv_cache`.
With tiling it does this per spatial tile and blends the tiles afterwards. Both variants keep every decoded frame
of the whole video on the device until the end (1009 frames x 3 x 480 x 720 for 63 s).

We run the very same decoder calls, in the same order per tile, but time-major: for each temporal batch we decode
every tile (each tile keeps its own conv cache), blend the tiles of that batch exactly as diffusers' `tiled_decode`
does (blending is per frame, so it commutes with cutting time into batches), and hand the frames out at once. The
device then holds one batch of activations, the per-tile conv caches (a fixed size, independent of the length) and
nothing else; `tests/test_sample_decode.py` checks that the concatenated stream equals `vae.decode` with and without
tiling.

`WanDecoder` wraps diffusers' `AutoencoderKLWan` (Wan2.1's VAE). Its decoder is causal in time too and diffusers
already decodes one latent frame at a time with a feature cache; we make the same calls and hand each latent
frame's pixel frames out as they come (1 for the first latent frame, 4 for each later one), so the device never
holds the whole video. With tiling (when the frame is larger than a tile) it runs diffusers' `tiled_decode` on the
whole clip instead, which holds every frame.

`IdentityDecoder` is the demo's decoder (the demo set lives in latent space): nearest-neighbour expansion by the
VAE's compression factors, first three channels as RGB, so the demo mp4 has the real frame count and resolution.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from tttvideo.errors import UserError

log = logging.getLogger(__name__)


def decoded_frame_count(latent_frames: int, temporal: int = 4) -> int:
    """Pixel frames a causal VAE gives for `latent_frames` (odd counts: 1 + 4 (T - 1); 13 -> 49, 253 -> 1009)."""
    if latent_frames % 2:
        return 1 + temporal * (latent_frames - 1)
    return temporal * latent_frames


class IdentityDecoder:
    """The demo's 'VAE': latent [B, T, C, h, w] -> frames [B, 3, 1 + s_t (T - 1), s h, s w] in [-1, 1]."""

    def __init__(self, spatial: int = 8, temporal: int = 4, window: int = 2):
        self.spatial, self.temporal, self.window = spatial, temporal, max(1, window)

    def num_frames(self, latent_frames: int) -> int:
        return 1 + self.temporal * (latent_frames - 1)

    @torch.no_grad()
    def frames(self, latents: torch.Tensor) -> Iterator[torch.Tensor]:
        """Yields [B, 3, n, H, W] chunks, `window` latent frames at a time."""
        b, t, c, h, w = latents.shape
        rgb_index = torch.arange(3) % c  # fewer than 3 channels: repeat them
        for start in range(0, t, self.window):
            chunk = latents[:, start : start + self.window, rgb_index].float()  # [B, n, 3, h, w]
            # causal time expansion: the first latent frame stands for 1 pixel frame, every later one for `temporal`
            repeats = torch.full((chunk.shape[1],), self.temporal, dtype=torch.long)
            if start == 0:
                repeats[0] = 1
            chunk = chunk.repeat_interleave(repeats.to(chunk.device), dim=1)
            chunk = F.interpolate(chunk.flatten(0, 1), scale_factor=self.spatial, mode="nearest")
            chunk = chunk.view(b, -1, 3, h * self.spatial, w * self.spatial).permute(0, 2, 1, 3, 4)
            yield chunk.clamp(-1, 1)


def vae_folder(path: str | Path, model: str = "CogVideoX") -> Path:
    """A VAE folder itself (config.json) or a diffusers pipeline folder with a vae/ subfolder; a missing one is a
    one-sentence error (the commands call this before any heavy work, the loader again)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"VAE folder {path} does not exist; give the {model} vae/ folder (config.json + weights)")
    if (path / "vae" / "config.json").is_file():
        return path / "vae"
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json; give the {model} vae/ folder or the pipeline folder above it")
    return path


def _load_vae(cls, model: str, path: str | Path, device: torch.device | str, dtype: torch.dtype):
    """diffusers VAE class `cls` from a folder, checked to be that class, in eval mode without gradients."""
    import json

    folder = vae_folder(path, model)
    try:
        kind = json.loads((folder / "config.json").read_text()).get("_class_name", "")
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {folder / 'config.json'}: {err}") from None
    if kind and kind != cls.__name__:
        raise UserError(f"{folder} holds a {kind}, not the {cls.__name__} that {model} latents need")
    try:
        vae = cls.from_pretrained(str(folder), torch_dtype=dtype)
    except (OSError, ValueError, EnvironmentError) as err:
        raise UserError(f"cannot load the VAE from {folder}: {str(err).splitlines()[0]}") from None
    return vae.to(device).eval().requires_grad_(False)


class CogVideoXDecoder:
    """diffusers `AutoencoderKLCogVideoX`, decoded time-major with per-tile causal caches (see the module doc)."""

    def __init__(self, vae, tiling: bool = True):
        self.vae = vae
        self.tiling = tiling
        self.temporal = int(vae.config.temporal_compression_ratio)
        self.spatial = 2 ** (len(vae.config.block_out_channels) - 1)

    @classmethod
    def from_folder(cls, path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    tiling: bool = True) -> "CogVideoXDecoder":
        from diffusers import AutoencoderKLCogVideoX

        vae = _load_vae(AutoencoderKLCogVideoX, "CogVideoX", path, device, dtype)
        return cls(vae, tiling=tiling)

    def num_frames(self, latent_frames: int) -> int:
        return decoded_frame_count(latent_frames, self.temporal)

    def _time_batches(self, num_frames: int) -> list[tuple[int, int]]:
        # diffusers' batching: batches of `num_latent_frames_batch_size`, the first one taking the remainder
        size = self.vae.num_latent_frames_batch_size
        rem = num_frames % size
        out = []
        for k in range(max(num_frames // size, 1)):
            out.append((size * k + (0 if k == 0 else rem), size * (k + 1) + rem))
        return out

    @torch.no_grad()
    def frames(self, latents: torch.Tensor) -> Iterator[torch.Tensor]:
        """latents [B, T, C, h, w] in the model's scale -> yields [B, 3, n, H, W] chunks in [-1, 1]."""
        vae = self.vae
        param = next(vae.parameters())
        z = latents.permute(0, 2, 1, 3, 4).to(device=param.device, dtype=param.dtype)
        z = z / vae.config.scaling_factor
        h, w = z.shape[-2:]
        tiled = self.tiling and (w > vae.tile_latent_min_width or h > vae.tile_latent_min_height)
        caches: dict[tuple[int, int], dict | None] = {}
        for start, end in self._time_batches(z.shape[2]):
            if not tiled:
                yield self._decode_tile(z[:, :, start:end], caches, (0, 0)).clamp(-1, 1)
                continue
            yield self._decode_tiled_batch(z[:, :, start:end], caches).clamp(-1, 1)

    def _decode_tile(self, z: torch.Tensor, caches: dict, key: tuple[int, int]) -> torch.Tensor:
        if self.vae.post_quant_conv is not None:
            z = self.vae.post_quant_conv(z)
        out, caches[key] = self.vae.decoder(z, conv_cache=caches.get(key))
        return out

    def _decode_tiled_batch(self, z: torch.Tensor, caches: dict) -> torch.Tensor:
        """One temporal batch of diffusers' `tiled_decode`: same tiles, same in-place blending order."""
        vae = self.vae
        h, w = z.shape[-2:]
        overlap_h = int(vae.tile_latent_min_height * (1 - vae.tile_overlap_factor_height))
        overlap_w = int(vae.tile_latent_min_width * (1 - vae.tile_overlap_factor_width))
        blend_h = int(vae.tile_sample_min_height * vae.tile_overlap_factor_height)
        blend_w = int(vae.tile_sample_min_width * vae.tile_overlap_factor_width)
        limit_h = vae.tile_sample_min_height - blend_h
        limit_w = vae.tile_sample_min_width - blend_w
        rows = []
        for i in range(0, h, overlap_h):
            row = []
            for j in range(0, w, overlap_w):
                tile = z[:, :, :, i : i + vae.tile_latent_min_height, j : j + vae.tile_latent_min_width]
                row.append(self._decode_tile(tile, caches, (i, j)))
            rows.append(row)
        result_rows = []
        for i, row in enumerate(rows):
            result_row = []
            for j, tile in enumerate(row):
                if i > 0:
                    tile = vae.blend_v(rows[i - 1][j], tile, blend_h)
                if j > 0:
                    tile = vae.blend_h(row[j - 1], tile, blend_w)
                result_row.append(tile[:, :, :, :limit_h, :limit_w])
            result_rows.append(torch.cat(result_row, dim=4))
        return torch.cat(result_rows, dim=3)


class WanDecoder:
    """diffusers `AutoencoderKLWan`, one latent frame at a time with its causal feature cache (see the module doc).
    Latents in the model's scale are (x - latents_mean) / latents_std per channel, as Wan's pipeline has them."""

    def __init__(self, vae, tiling: bool = True):
        self.vae = vae
        self.tiling = tiling
        self.temporal = 2 ** sum(vae.temperal_downsample)
        self.spatial = int(vae.spatial_compression_ratio)

    @classmethod
    def from_folder(cls, path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    tiling: bool = True) -> "WanDecoder":
        from diffusers import AutoencoderKLWan

        return cls(_load_vae(AutoencoderKLWan, "Wan2.1", path, device, dtype), tiling=tiling)

    def num_frames(self, latent_frames: int) -> int:
        return 1 + self.temporal * (latent_frames - 1)

    def unscale(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, T, C, h, w] in the model's scale -> [B, C, T, h, w] in the VAE's, on its device and dtype."""
        vae = self.vae
        param = next(vae.parameters())
        z = latents.permute(0, 2, 1, 3, 4).to(device=param.device, dtype=param.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(shape)
        std = torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(shape)
        return z * std + mean

    @torch.no_grad()
    def frames(self, latents: torch.Tensor) -> Iterator[torch.Tensor]:
        """latents [B, T, C, h, w] in the model's scale -> yields [B, 3, n, H, W] chunks in [-1, 1]."""
        vae = self.vae
        z = self.unscale(latents)
        h, w = z.shape[-2:]
        tile_h = vae.tile_sample_min_height // vae.spatial_compression_ratio
        tile_w = vae.tile_sample_min_width // vae.spatial_compression_ratio
        if self.tiling and (w > tile_w or h > tile_h):
            yield vae.tiled_decode(z, return_dict=False)[0].clamp(-1, 1)
            return
        if vae.config.patch_size is not None:
            raise UserError("this AutoencoderKLWan patchifies its frames (Wan2.2's VAE); tttvideo decodes Wan2.1's")
        # diffusers' `AutoencoderKLWan._decode`, frame by frame with its feature cache, each frame handed out
        vae.clear_cache()
        try:
            x = vae.post_quant_conv(z)
            for i in range(x.shape[2]):
                vae._conv_idx = [0]
                out = vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                  **({"first_chunk": True} if i == 0 else {}))
                yield out.clamp(-1, 1)
        finally:
            vae.clear_cache()


# the VAEs a backbone can name (`BackboneSpec.vae`): kind -> (folder, device=, dtype=, tiling=) -> decoder
VAE_DECODERS: dict[str, Callable[..., CogVideoXDecoder | WanDecoder]] = {"cogvideox": CogVideoXDecoder.from_folder,
                                                                         "wan": WanDecoder.from_folder}


def make_decoder(vae_path: str, device: torch.device, dtype: torch.dtype, tiling: bool, spatial: int = 8,
                 temporal: int = 4, kind: str | None = "cogvideox"):
    """The VAE of `kind` (the backbone's, `BackboneSpec.vae`) from `vae_path`, or the identity decode when it is
    empty (the demo)."""
    if not vae_path:
        log.info("no VAE folder given: identity decode (demo latents are shown as pixels)")
        return IdentityDecoder(spatial=spatial, temporal=temporal)
    if kind not in VAE_DECODERS:
        raise UserError(f"a VAE folder is set ({vae_path}), but the model's backbone names no VAE tttvideo can load"
                        f"{f' ({kind!r})' if kind else ''}; leave sample.vae_path and data.vae_path empty for the "
                        f"identity decode")
    dec = VAE_DECODERS[kind](vae_path, device=device, dtype=dtype, tiling=tiling)
    factor = dec.spatial
    if factor != spatial or dec.temporal != temporal:
        raise UserError(
            f"the VAE in {vae_path} compresses {factor}x spatially and {dec.temporal}x in time, but the layout "
            f"expects {spatial}x and {temporal}x; set layout.vae_spatial / layout.vae_temporal to match"
        )
    return dec

