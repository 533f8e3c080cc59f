"""The long-video sequence layout, in one place.

A video of n 3-second segments is one sequence ``[text_0 .. text_{n-1} | video frames 0 .. T-1]`` (the residual
stream order), with T = W + (W - 1)(n - 1) latent frames for a window of W latent frames per segment (CogVideoX: 13)
and F tokens per latent frame. Everything that depends on that arithmetic lives here: token counts, the attention
window of every segment, the TTT interleave permutation and its inverse, the reversal used by the reverse TTT pass,
padding to the TTT mini-batch, and RoPE positions.

What a layout depends on besides the config is the backbone's (`LayoutParams`, which `BackboneSpec.layout` gives):
the window W, the patch size and VAE factors, and whether the text is in the stream. A backbone that cross-attends
to the text keeps it out of the stream: its sequence is the video alone (`stream_text_tokens` = 0) while
`text_tokens` is still the length of each segment's text embedding.

Every check fails with one sentence that says what was expected; the most common failure of the original system
(counting ONE segment's text instead of all of them, which surfaced as an opaque RoPE shape assertion) is named
explicitly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from tttvideo.config.schema import TRAIN_MINI_BATCH, LayoutConfig, TTTConfig
from tttvideo.errors import ConfigError, LayoutError

# torch is imported where a tensor is built: the arithmetic and the checks need none, so a command checks durations
# and scene counts (`tttv sample`'s inputs) before torch loads
if TYPE_CHECKING:
    import torch

SEGMENT_SECONDS = 3
# CogVideoX's latent frames per segment window (49 frames of 3 s at 16 fps through the 4x temporal VAE);
# consecutive windows share one frame.
WINDOW_FRAMES = 13

# Text tokens per segment chosen by the original system so that the total is a multiple of 64.
ORIGINAL_TEXT_TOKENS: dict[int, int] = {1: 498, 3: 502, 6: 471, 10: 497, 21: 458}
# Upper bound used when choosing a text length for durations the original did not train.
MAX_AUTO_TEXT_TOKENS = 512
# A duration as written: seconds, optionally with an 's' ('63s', '63', '63 s'), lower-cased and stripped
DURATION_TEXT = re.compile(r"(\d+(?:\.\d+)?)\s*s?")


def parse_duration(value: str | int | float) -> int:
    """'63s', '63', 63 -> 63 (seconds); anything that is not 3 + 3n seconds is an error."""
    text = str(value).strip().lower()
    match = DURATION_TEXT.fullmatch(text)
    if match is None:
        raise LayoutError(f"duration {value!r} is not a number of seconds; give it as e.g. '9s' or 9")
    seconds = float(match.group(1))
    if seconds != int(seconds) or int(seconds) < SEGMENT_SECONDS or int(seconds) % SEGMENT_SECONDS:
        raise LayoutError(
            f"duration {value!r} is not 3 + 3n seconds; the model works in 3-second segments, so any multiple of 3 "
            f"from 3 s up (3, 6, 9, 12, ... s; the reference system trained up to 63 s)"
        )
    return int(seconds)


def latent_frames_for(num_segments: int, window_frames: int = WINDOW_FRAMES) -> int:
    return window_frames + (window_frames - 1) * (num_segments - 1)


@dataclass(frozen=True)
class LayoutParams:
    """What a layout asks of the backbone (`BackboneSpec.layout`); the defaults are CogVideoX's. `VideoLayout.
    from_config` takes them with the config: the config's patch size and VAE factors must agree with them."""

    window_frames: int = WINDOW_FRAMES  # latent frames per segment's attention window
    text_in_stream: bool = True  # False: the text is cross-attended, the sequence is the video alone
    patch_size: int = 2
    vae_spatial: int = 8
    vae_temporal: int = 4


def auto_text_tokens(num_segments: int, video_tokens: int, mini_batch_size: int) -> int:
    """The original's text length where it has one, else the largest length <= 512 whose total needs no padding."""
    if num_segments in ORIGINAL_TEXT_TOKENS and (
        video_tokens + num_segments * ORIGINAL_TEXT_TOKENS[num_segments]
    ) % mini_batch_size == 0:
        return ORIGINAL_TEXT_TOKENS[num_segments]
    for text in range(MAX_AUTO_TEXT_TOKENS, 0, -1):
        if (video_tokens + num_segments * text) % mini_batch_size == 0:
            return text
    return MAX_AUTO_TEXT_TOKENS  # unreachable for mini-batch <= 512; padding covers it anyway


@dataclass(frozen=True)
class VideoLayout:
    """Token arithmetic of one long video. Build it with `VideoLayout.create`.

    Index tensors are over residual-stream positions: ``x[..., perm, :]`` reorders a sequence.
    """

    duration_s: int
    height: int
    width: int
    fps: int
    vae_spatial: int
    vae_temporal: int
    patch_size: int
    text_tokens: int  # per segment: the length of each segment's text embedding
    mini_batch_size: int  # TTT mini-batch; the TTT sequence is padded to a multiple of it
    window_frames: int = WINDOW_FRAMES  # latent frames per segment's window (`LayoutParams`)
    text_in_stream: bool = True  # False: the stream is the video alone (`LayoutParams`)

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        duration: str | int = 3,
        height: int = 480,
        width: int = 720,
        fps: int = 16,
        vae_spatial: int = LayoutConfig.vae_spatial,
        vae_temporal: int = LayoutConfig.vae_temporal,
        patch_size: int = LayoutConfig.patch_size,
        text_tokens: int = LayoutConfig.text_tokens,
        mini_batch_size: int = TRAIN_MINI_BATCH["mlp"],
        window_frames: int = WINDOW_FRAMES,
        text_in_stream: bool = True,
    ) -> "VideoLayout":
        """text_tokens=0 picks the original's per-duration length or the largest one <= 512 that
        makes the total a multiple of the mini-batch."""
        seconds = parse_duration(duration)
        for name, value in (("patch size", patch_size), ("VAE compression", vae_spatial), ("height", height),
                            ("width", width)):
            if value <= 0:
                raise LayoutError(f"{name} {value} must be positive")
        cell = vae_spatial * patch_size
        for name, value in (("height", height), ("width", width)):
            if value % cell:
                raise LayoutError(
                    f"resolution {height}x{width}: {name} {value} is not divisible by VAE compression x patch size "
                    f"= {vae_spatial} x {patch_size} = {cell}; use a multiple of {cell} "
                    f"(e.g. {max(cell, value // cell * cell)})"
                )
        if window_frames < 2:
            raise LayoutError(f"a segment window of {window_frames} latent frame(s): consecutive windows share one "
                              f"frame, so a window needs at least 2")
        new_frames = window_frames - 1
        if fps != 16 or vae_temporal != 4 or window_frames != WINDOW_FRAMES:
            # 3 s at 16 fps = 49 frames -> 13 latent frames is what CogVideoX's segment windows are built on.
            if (SEGMENT_SECONDS * fps) % vae_temporal:
                raise LayoutError(
                    f"{fps} fps with temporal compression {vae_temporal} does not give whole latent frames per 3-s "
                    f"segment; use 16 fps with compression 4"
                )
            if SEGMENT_SECONDS * fps // vae_temporal != new_frames:
                raise LayoutError(
                    f"{fps} fps with temporal compression {vae_temporal} gives "
                    f"{SEGMENT_SECONDS * fps // vae_temporal} new latent frames per 3 s; the segment windows of "
                    f"{window_frames} latent frames need {new_frames} ({new_frames * vae_temporal // SEGMENT_SECONDS}"
                    f" fps with compression {vae_temporal})"
                )
        if mini_batch_size <= 0:
            raise LayoutError(f"TTT mini-batch size must be positive, got {mini_batch_size}")
        if text_tokens < 0:
            raise LayoutError(f"text tokens per segment must be >= 0 (0 = automatic), got {text_tokens}")
        n = seconds // SEGMENT_SECONDS
        tokens_per_frame = (height // cell) * (width // cell)
        if text_tokens == 0:
            # with the text out of the stream any length leaves the total as it is: the original's choice stands
            video = latent_frames_for(n, window_frames) * tokens_per_frame
            text_tokens = auto_text_tokens(n, video, mini_batch_size if text_in_stream else 1)
        return cls(seconds, height, width, fps, vae_spatial, vae_temporal, patch_size, text_tokens, mini_batch_size,
                   window_frames, text_in_stream)

    @classmethod
    def from_config(cls, layout: LayoutConfig, ttt: TTTConfig, duration: str | int | None = None,
                    phase: str = "train", backbone: LayoutParams | None = None) -> "VideoLayout":
        """The layout of a config's `[layout]` and `[ttt]` sections for a backbone's `LayoutParams` (None:
        CogVideoX's); `duration` (e.g. a story's) replaces layout.duration. The TTT mini-batch of `phase` ("train"
        or "sample") sets the padding; the automatic text length is always the training mini-batch's, so that a
        model samples with the text length it trained with."""
        backbone = LayoutParams() if backbone is None else backbone
        for key in ("patch_size", "vae_spatial", "vae_temporal"):
            if getattr(layout, key) != getattr(backbone, key):
                raise ConfigError(f"layout.{key} = {getattr(layout, key)} but the model's backbone has "
                                  f"{getattr(backbone, key)}; set layout.{key} = {getattr(backbone, key)}")
        common = dict(duration=layout.duration if duration is None else duration, height=layout.height,
                      width=layout.width, fps=layout.fps, vae_spatial=layout.vae_spatial,
                      vae_temporal=layout.vae_temporal, patch_size=layout.patch_size,
                      window_frames=backbone.window_frames, text_in_stream=backbone.text_in_stream)
        trained = cls.create(**common, text_tokens=layout.text_tokens, mini_batch_size=ttt.train_mini_batch())
        if phase == "train":
            return trained
        return cls.create(**common, text_tokens=trained.text_tokens, mini_batch_size=ttt.mini_batch(phase))

    @classmethod
    def from_latents(cls, latent_frames: int, latent_height: int, latent_width: int, text_tokens: int,
                     patch_size: int, mini_batch_size: int,
                     vae_spatial: int = LayoutConfig.vae_spatial,
                     backbone: LayoutParams | None = None) -> "VideoLayout":
        """The layout of latents [.., latent_frames, C, latent_height, latent_width] with `text_tokens` per segment:
        what a model infers when it is called without a layout (`backbone`: its window and text placement)."""
        backbone = LayoutParams() if backbone is None else backbone
        w = backbone.window_frames
        if latent_frames < w or (latent_frames - w) % (w - 1):
            raise LayoutError(
                f"{latent_frames} latent frames is not {w} + {w - 1} (n - 1) for n 3-s segments "
                f"({w} for 3 s, {latent_frames_for(2, w)} for 6 s, {latent_frames_for(3, w)} for 9 s, ...)"
            )
        if latent_height % patch_size or latent_width % patch_size:
            raise LayoutError(
                f"latent size {latent_height}x{latent_width} is not divisible by the patch size {patch_size}")
        if text_tokens <= 0:
            raise LayoutError("the text embeddings have 0 tokens; give at least one text token per segment")
        n = (latent_frames - w) // (w - 1) + 1
        return cls.create(duration=SEGMENT_SECONDS * n, height=latent_height * vae_spatial,
                          width=latent_width * vae_spatial, fps=(w - 1) * backbone.vae_temporal // SEGMENT_SECONDS,
                          vae_spatial=vae_spatial, vae_temporal=backbone.vae_temporal, patch_size=patch_size,
                          text_tokens=text_tokens, mini_batch_size=mini_batch_size, window_frames=w,
                          text_in_stream=backbone.text_in_stream)

    # ------------------------------------------------------------------ counts
    @property
    def num_segments(self) -> int:
        return self.duration_s // SEGMENT_SECONDS

    @property
    def num_frames(self) -> int:
        """Pixel frames: 16 per second plus the first one (49 for 3 s)."""
        return self.fps * self.duration_s + 1

    @property
    def latent_frames(self) -> int:
        return latent_frames_for(self.num_segments, self.window_frames)

    @property
    def new_frames_per_segment(self) -> int:
        return self.window_frames - 1

    @property
    def latent_height(self) -> int:
        return self.height // self.vae_spatial

    @property
    def latent_width(self) -> int:
        return self.width // self.vae_spatial

    @property
    def grid_height(self) -> int:
        return self.latent_height // self.patch_size

    @property
    def grid_width(self) -> int:
        return self.latent_width // self.patch_size

    @property
    def tokens_per_frame(self) -> int:
        return self.grid_height * self.grid_width

    @property
    def video_tokens(self) -> int:
        return self.latent_frames * self.tokens_per_frame

    @property
    def stream_text_tokens(self) -> int:
        """Text tokens per segment inside the residual stream: `text_tokens`, or 0 when the text is cross-attended."""
        return self.text_tokens if self.text_in_stream else 0

    @property
    def total_text_tokens(self) -> int:
        """Text tokens in the residual stream, all segments."""
        return self.num_segments * self.stream_text_tokens

    @property
    def total_tokens(self) -> int:
        return self.total_text_tokens + self.video_tokens

    @property
    def ttt_padding(self) -> int:
        """Tokens appended to the TTT sequence so that it is a whole number of mini-batches."""
        return (-self.total_tokens) % self.mini_batch_size

    @property
    def ttt_tokens(self) -> int:
        return self.total_tokens + self.ttt_padding

    @property
    def window_tokens(self) -> int:
        """Tokens in one attention window: one segment's text (in the stream) and its window of latent frames."""
        return self.stream_text_tokens + self.window_frames * self.tokens_per_frame

    def segment_frames(self, i: int) -> range:
        """Latent frames of segment i's attention window (13 for CogVideoX; later windows share their first with
        the previous)."""
        start = self.new_frames_per_segment * i
        return range(start, start + self.window_frames)

    def segment_own_frames(self, i: int) -> range:
        """Frames that belong to segment i alone in the TTT interleave (the first segment carries the extra one)."""
        if i == 0:
            return range(0, self.window_frames)
        start = self.new_frames_per_segment * i + 1
        return range(start, start + self.new_frames_per_segment)

    # ------------------------------------------------------------------ index maps
    def text_slice(self, i: int) -> slice:
        """Residual-stream positions of segment i's text (empty when the text is not in the stream)."""
        return slice(i * self.stream_text_tokens, (i + 1) * self.stream_text_tokens)

    def frames_slice(self, frames: range) -> slice:
        """Residual-stream positions of a contiguous run of latent frames."""
        start = self.total_text_tokens + frames.start * self.tokens_per_frame
        return slice(start, start + len(frames) * self.tokens_per_frame)

    def window_index(self, i: int) -> torch.Tensor:
        """Residual positions of segment i's attention window: [text_i ; its window of frames]."""
        import torch

        text = self.text_slice(i)
        video = self.frames_slice(self.segment_frames(i))
        return torch.cat([torch.arange(text.start, text.stop), torch.arange(video.start, video.stop)])

    def flat_window_index(self) -> torch.Tensor:
        """Every segment's `window_index`, window after window [n W]: local attention's gather index of its windows
        over the residual stream, and the index its overlap merge scatters back by."""
        import torch

        return torch.cat([self.window_index(i) for i in range(self.num_segments)])

    @cached_property
    def window_overlap_count(self) -> torch.Tensor:
        """How many windows cover each video token (1 or 2), shape [video_tokens]; outputs are averaged by it."""
        import torch

        count = torch.zeros(self.latent_frames, dtype=torch.int64)
        for i in range(self.num_segments):
            frames = self.segment_frames(i)
            count[frames.start : frames.stop] += 1
        return count.repeat_interleave(self.tokens_per_frame)

    @cached_property
    def interleave_perm(self) -> torch.Tensor:
        """TTT order [text_0, frames of segment 0, text_1, frames of segment 1, ...] as residual positions."""
        import torch

        parts = []
        for i in range(self.num_segments):
            text = self.text_slice(i)
            video = self.frames_slice(self.segment_own_frames(i))
            parts += [torch.arange(text.start, text.stop), torch.arange(video.start, video.stop)]
        return torch.cat(parts)

    @cached_property
    def deinterleave_perm(self) -> torch.Tensor:
        return inverse_permutation(self.interleave_perm)

    @cached_property
    def reverse_perm(self) -> torch.Tensor:
        """Reversal of the reverse TTT pass: text chunks in reversed segment order (each chunk keeps its order),
        video tokens flipped one by one. It is its own inverse."""
        import torch

        text = torch.arange(self.total_text_tokens).view(self.num_segments, self.stream_text_tokens).flip(0)
        text = text.reshape(-1)
        video = torch.arange(self.total_text_tokens, self.total_tokens).flip(0)
        return torch.cat([text, video])

    @cached_property
    def reverse_interleave_perm(self) -> torch.Tensor:
        """Scan order of the reverse TTT pass as residual positions: the interleave of the reversed sequence, so
        that one gather ``x[:, reverse_interleave_perm]`` equals ``x[:, reverse_perm][:, interleave_perm]``."""
        return self.reverse_perm[self.interleave_perm]

    @cached_property
    def reverse_deinterleave_perm(self) -> torch.Tensor:
        """Back from the reverse pass's scan order to residual order (the reversal undone too)."""
        return inverse_permutation(self.reverse_interleave_perm)

    # ------------------------------------------------------------------ sequence parallelism
    def sp_shard_tokens(self, sp: int) -> int:
        """Residual-stream tokens each of `sp` sequence-parallel ranks holds: the stream is padded at its end to a
        multiple of sp and cut into equal contiguous shards, rank r holding [r * shard, (r + 1) * shard)."""
        if sp < 1:
            raise LayoutError(f"sequence-parallel degree must be >= 1, got {sp}")
        return -(-self.total_tokens // sp)

    def sp_padding(self, sp: int) -> int:
        """Tokens appended to the residual stream so that it splits evenly over `sp` ranks (dropped before any
        operation that mixes tokens, so they never reach a real token's output)."""
        return sp * self.sp_shard_tokens(sp) - self.total_tokens

    def sp_shard_text_tokens(self, sp: int, rank: int) -> int:
        """Text tokens in rank's shard: text opens the stream, so a shard holds a (possibly empty) run of text
        followed by video (and, in the last shard, padding)."""
        if not 0 <= rank < sp:
            raise LayoutError(f"sequence-parallel rank {rank} is outside 0 .. {sp - 1}")
        shard = self.sp_shard_tokens(sp)
        return min(max(self.total_text_tokens - rank * shard, 0), shard)

    # ------------------------------------------------------------------ RoPE positions
    def _frame_grid(self, frames: int, first_frame: int = 0) -> torch.Tensor:
        import torch

        t = torch.arange(first_frame, first_frame + frames)
        h = torch.arange(self.grid_height)
        w = torch.arange(self.grid_width)
        grid = torch.stack(torch.meshgrid(t, h, w, indexing="ij"), dim=-1)
        return grid.reshape(-1, 3)

    @cached_property
    def global_positions(self) -> torch.Tensor:
        """(t, h, w) of every video token in residual order, t global over the whole video: [video_tokens, 3].
        The TTT layer applies RoPE by position in the sequence it is given (the reverse pass uses the same table)."""
        return self._frame_grid(self.latent_frames)

    @cached_property
    def local_positions(self) -> torch.Tensor:
        """(t, h, w) inside one attention window, t restarting at 0 as in pretraining: [window_frames * F, 3]."""
        return self._frame_grid(self.window_frames)

    # ------------------------------------------------------------------ checks
    def check_text_embeddings(self, count: int) -> None:
        if count != self.num_segments:
            raise LayoutError(
                f"got {count} text embedding(s) for a {self.duration_s} s video, which has {self.num_segments} "
                f"3-s segment(s): give exactly one text embedding per segment"
            )

    def check_sequence_length(self, length: int) -> None:
        if length == self.total_tokens:
            return
        msg = (
            f"sequence length {length:,} does not match the {self.duration_s} s layout: expected "
            f"{self.num_segments} segment(s) x {self.stream_text_tokens} text tokens + {self.video_tokens:,} video "
            f"tokens = {self.total_tokens:,}"
        )
        if self.text_in_stream and length == self.video_tokens + self.text_tokens:
            msg += (
                f"; {length:,} is the video plus ONE segment's text: count the text of all "
                f"{self.num_segments} segments"
            )
        hints = explain_sequence_length(length, self.tokens_per_frame, window_frames=self.window_frames)
        if hints:
            msg += "; " + " or ".join(f"{n} segment(s) with {t} text tokens" for n, t in hints[:3])
            msg += f" would give {length:,}"
        raise LayoutError(msg)

    # ------------------------------------------------------------------ report
    def summary(self) -> dict[str, int]:
        return {
            "duration_s": self.duration_s,
            "segments": self.num_segments,
            "frames": self.num_frames,
            "latent_frames": self.latent_frames,
            "tokens_per_frame": self.tokens_per_frame,
            "video_tokens": self.video_tokens,
            "text_tokens_per_segment": self.text_tokens,
            "total_tokens": self.total_tokens,
            "window_tokens": self.window_tokens,
            "ttt_padding": self.ttt_padding,
        }


def explain_sequence_length(length: int, tokens_per_frame: int, max_segments: int = 64,
                            window_frames: int = WINDOW_FRAMES) -> list[tuple[int, int]]:
    """(segments, text tokens per segment) pairs that would produce `length` at this frame size."""
    out = []
    for n in range(1, max_segments + 1):
        rest = length - latent_frames_for(n, window_frames) * tokens_per_frame
        if rest > 0 and rest % n == 0 and rest // n <= 4096:
            out.append((n, rest // n))
    return out


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    import torch

    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv
