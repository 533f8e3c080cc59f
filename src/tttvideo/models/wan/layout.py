"""The long-video token layout of Wan: `tttvideo.layout.VideoLayout` with no text in the stream.

Wan's VAE compresses 4 frames in time and 8x8 in space (4k + 1 frames -> k + 1 latent frames), and its patch is
1x2x2, so at 16 fps a 3-s segment (49 frames) is 13 latent frames and at 480x832 a latent frame is 60x104 -> 30x52
= 1,560 tokens: the same window arithmetic as CogVideoX's (each further 3-s segment adds 12 latent frames, windows of
13 frames overlap by one) on a wider frame. Text is not part of Wan's residual stream (every block cross-attends to
it), so the layout is built with 0 text tokens per segment: the stream is the video tokens alone in (frame, row,
column) order, a segment's window is its 13 frames, the TTT scan order is the frame order, and the reverse pass
flips it token by token.

`VideoLayout.create` reads text_tokens=0 as "choose automatically", so the layouts here are made through it with one
text token (for its checks) and the count then set to 0.
"""

from __future__ import annotations

import dataclasses

from tttvideo.config.schema import TRAIN_MINI_BATCH
from tttvideo.layout import VideoLayout

WAN_HEIGHT, WAN_WIDTH = 480, 832  # Wan2.1-T2V-1.3B's trained resolution
WAN_FPS = 16
WAN_VAE_SPATIAL, WAN_VAE_TEMPORAL = 8, 4


def wan_layout(duration: str | int = 3, height: int = WAN_HEIGHT, width: int = WAN_WIDTH, patch_size: int = 2,
               mini_batch_size: int = TRAIN_MINI_BATCH["mlp"]) -> VideoLayout:
    """The layout of a `duration`-second video (3 + 3n) at height x width for Wan: video tokens only."""
    layout = VideoLayout.create(duration, height, width, fps=WAN_FPS, vae_spatial=WAN_VAE_SPATIAL,
                                vae_temporal=WAN_VAE_TEMPORAL, patch_size=patch_size, text_tokens=1,
                                mini_batch_size=mini_batch_size)
    return dataclasses.replace(layout, text_tokens=0)


def wan_layout_from_latents(latent_frames: int, latent_height: int, latent_width: int, patch_size: int,
                            mini_batch_size: int) -> VideoLayout:
    """The layout of latents [.., latent_frames, C, latent_height, latent_width]: what the model infers when it is
    called without one (a LayoutError when the frame count is not 13 + 12 (n - 1))."""
    layout = VideoLayout.from_latents(latent_frames, latent_height, latent_width, 1, patch_size, mini_batch_size,
                                      vae_spatial=WAN_VAE_SPATIAL)
    return dataclasses.replace(layout, text_tokens=0)


def layout_table(durations: tuple[int, ...] = (3, 9, 18, 30, 63), height: int = WAN_HEIGHT,
                 width: int = WAN_WIDTH) -> list[dict[str, int]]:
    """Per duration: frames, latent frames, tokens per latent frame, video tokens (docs/wan.md's table)."""
    rows = []
    for seconds in durations:
        layout = wan_layout(seconds, height, width)
        rows.append({"seconds": seconds, "segments": layout.num_segments, "frames": layout.num_frames,
                     "latent_frames": layout.latent_frames, "tokens_per_frame": layout.tokens_per_frame,
                     "tokens": layout.video_tokens, "window_tokens": layout.window_tokens})
    return rows
