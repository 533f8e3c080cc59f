"""The built-in demo set: moving coloured shapes, generated directly in latent space, written as a real cache.

There is no VAE: the "latents" are the frames themselves at latent resolution and latent frame rate (13 frames per
3 s at h x w = height/8 x width/8), with the first three channels RGB in [-1, 1] and any further channels zero, so
`tttvideo.sample.decode.IdentityDecoder` (first three channels, nearest-neighbour upsampling) turns a generated
latent back into a viewable video. Posterior log-variances are -30 (a point mass), so a drawn latent is the frame.

Each video has one caption per 3-s segment. Segment 0 opens a scene; every later segment either continues the
scene (same shape, same motion, same caption) or cuts to a new one, and every video of more than one segment has at
least one cut. Cuts carry the original's scene tokens: `<end_scene>` after the last caption of a scene and
`<start_scene>` before the first caption of the next.

The captions' wording and their text features are `tttvideo.text.demo`'s; the cache records which text encoder
made the features.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tttvideo.data.cache import CacheEntry, save_latent, save_text, write_manifest
from tttvideo.layout import VideoLayout
from tttvideo.text.demo import DemoTextEncoder, demo_caption
from tttvideo.text.prompts import scene_prompt, transition_flags

DEMO_VERSION = 4  # 4: the scenes set draws bars and pillars (was circles and squares); 3: shape radius 0.3 (was 0.2)
POINT_MASS_LOGVAR = -30.0

COLOURS = {"red": (0.9, 0.1, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.15, 0.3, 1.0), "yellow": (0.95, 0.9, 0.1),
           "white": (0.95, 0.95, 0.95), "magenta": (0.9, 0.2, 0.9)}
BACKGROUNDS = {"black": (0.0, 0.0, 0.0), "grey": (0.35, 0.35, 0.35), "navy": (0.0, 0.05, 0.3),
               "brown": (0.3, 0.15, 0.05)}
# The scenes set's two shapes differ in orientation, a difference that survives 8x8 latent frames and a small
# model's blur: a bar lies across the frame, a pillar stands up (half-extents `BAR_HALF_EXTENTS`). A disc and a
# square of the same size differ only in their corners, which no trained tiny model drew (docs/training.md)
SHAPES = ("bar", "pillar")
# the long-range set keeps the disc and the square it was made with: its probe reads the colour only
LONG_RANGE_SHAPES = ("circle", "square")
KNOWN_SHAPES = SHAPES + LONG_RANGE_SHAPES
# disc radius (half the square's side) as a fraction of the frame's shorter side: 2.4 latent pixels at 8x8 (a disc
# covers 28 % of the frame, a square 36 %). 0.2 (1.6 pixels) gave the captioned colour in 64 % of the sampled scenes
# of the demo's training, 0.3 in 95 % (docs/training.md, the CPU demo)
SHAPE_RADIUS = 0.3
# a bar's half-extents (across, along its length) as fractions of the frame's shorter side: 1.5 x 2.8 latent pixels at
# 8x8, a 3 x 5.6 block (26 % of the frame); along its length it still travels 2.4 pixels over a scene
BAR_HALF_EXTENTS = (0.1875, 0.35)
DIRECTIONS = {"right": (0, 1), "left": (0, -1), "down": (1, 0), "up": (-1, 0)}


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    background: str
    direction: str
    offset: float  # position across the direction of motion, in [0, 1] (0.5: the caption says everything)
    says_colour: bool = True  # False: the caption leaves the colour out (the long-range set's later scenes)

    @property
    def caption(self) -> str:
        return demo_caption(self.colour if self.says_colour else None, self.shape, self.direction, self.background)


def random_scene(rng: np.random.Generator, shapes: tuple[str, ...] = SHAPES) -> Scene:
    return Scene(shape=str(rng.choice(shapes)), colour=str(rng.choice(list(COLOURS))),
                 background=str(rng.choice(list(BACKGROUNDS))), direction=str(rng.choice(list(DIRECTIONS))),
                 offset=0.5)


def render_scene(scene: Scene, frames: int, height: int, width: int, start: int, length: int) -> np.ndarray:
    """RGB frames [frames, 3, h, w] in [-1, 1]: frame `start + i` of a scene `length` frames long, so a scene that
    spans several segments moves on continuously. The shape crosses the frame once over the scene."""
    short = min(height, width)
    radius = max(1.0, short * SHAPE_RADIUS)
    # half-extents (rows, columns) of a bar or pillar
    across, lengthwise = (max(1.0, short * f) for f in BAR_HALF_EXTENTS)
    half_y, half_x = {"bar": (across, lengthwise), "pillar": (lengthwise, across)}.get(scene.shape, (radius, radius))
    dy, dx = DIRECTIONS[scene.direction]
    along = width if dx else height
    reach = half_x if dx else half_y  # how far the shape reaches along its motion
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32) + 0.5
    out = np.empty((frames, 3, height, width), dtype=np.float32)
    bg = np.array(BACKGROUNDS[scene.background], dtype=np.float32)[:, None, None]
    fg = np.array(COLOURS[scene.colour], dtype=np.float32)[:, None, None]
    for i in range(frames):
        progress = (start + i) / max(1, length - 1)
        travel = reach + progress * (along - 2 * reach)  # from one edge to the other
        pos = travel if (dx > 0 or dy > 0) else along - travel
        cy, cx = (pos, scene.offset * width) if dy else (scene.offset * height, pos)
        # one pixel of anti-aliasing at every edge: sub-pixel motion shows
        if scene.shape == "circle":
            mask = np.clip(radius - np.sqrt((ys - cy) ** 2 + (xs - cx) ** 2) + 0.5, 0.0, 1.0)
        elif scene.shape == "square":
            mask = np.clip(radius - np.maximum(np.abs(ys - cy), np.abs(xs - cx)) + 0.5, 0.0, 1.0)
        else:
            mask = np.clip(half_y - np.abs(ys - cy) + 0.5, 0.0, 1.0) * np.clip(half_x - np.abs(xs - cx) + 0.5, 0.0, 1.0)
        mask = mask[None]
        out[i] = (bg * (1 - mask) + fg * mask) * 2 - 1
    return out


@dataclass
class DemoVideo:
    scenes: list[Scene]  # one per segment (repeated while a scene continues)
    scene_start: list[bool]
    scene_end: list[bool]

    def prompts(self) -> list[str]:
        return [scene_prompt(s.caption, a, b) for s, a, b in zip(self.scenes, self.scene_start, self.scene_end)]

    def story(self) -> list[dict[str, Any]]:
        """The sampler's scene list for this video (`tttv sample` input)."""
        return [{"text": s.caption, "requires_scene_transition": bool(i > 0 and self.scene_start[i])}
                for i, s in enumerate(self.scenes)]


def random_video(rng: np.random.Generator, segments: int) -> DemoVideo:
    cuts = [False] + [bool(rng.random() < 0.5) for _ in range(segments - 1)]
    if segments > 1 and not any(cuts):
        cuts[int(rng.integers(1, segments))] = True
    scenes, scene = [], random_scene(rng)
    for i in range(segments):
        if cuts[i]:
            new = random_scene(rng)
            while new.caption == scene.caption:  # a cut must change what the caption says
                new = random_scene(rng)
            scene = new
        scenes.append(scene)
    # the original marks only the cuts: the first segment of a video carries no start token
    return DemoVideo(scenes, *transition_flags(cuts))


def long_range_video(rng: np.random.Generator, segments: int) -> DemoVideo:
    """The long-range set's video: every segment a new scene (shape, direction and background drawn again), all in
    the colour the first scene's caption names; later captions leave the colour out, so only a model that carries
    the first scene across the cuts can draw it (`tttvideo.data.demo_score.score_persistence` reads it back)."""
    first = random_scene(rng, LONG_RANGE_SHAPES)
    scenes = [first]
    for _ in range(segments - 1):
        new = replace(random_scene(rng, LONG_RANGE_SHAPES), colour=first.colour, says_colour=False)
        while new.caption == scenes[-1].caption:  # a cut must change what the caption says
            new = replace(random_scene(rng, LONG_RANGE_SHAPES), colour=first.colour, says_colour=False)
        scenes.append(new)
    return DemoVideo(scenes, *transition_flags([False] + [True] * (segments - 1)))


def forgotten_colour(video: DemoVideo) -> DemoVideo:
    """A long-range video with every later scene in another colour than the first: what a model that does not
    carry the first scene across the cuts draws at best by luck (the probe's negative control)."""
    names = list(COLOURS)
    other = names[(names.index(video.scenes[0].colour) + 1) % len(names)]
    return DemoVideo([video.scenes[0]] + [replace(s, colour=other) for s in video.scenes[1:]], video.scene_start,
                     video.scene_end)


VIDEO_KINDS = {"scenes": random_video, "long-range": long_range_video}


def channel_mix(channels: int, seed: int = 0) -> np.ndarray:
    """[C, 3]: identity on channels 0-2 (RGB, what the identity decode shows) and fixed unit-norm mixes of R, G, B
    in the rest, so that every latent channel carries the picture and the loss is about the picture, not about
    predicting constant channels."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0xC4A7])))
    extra = rng.standard_normal((max(0, channels - 3), 3))
    extra /= np.linalg.norm(extra, axis=1, keepdims=True)
    return np.concatenate([np.eye(3), extra])[:channels].astype(np.float32)


def render_video(video: DemoVideo, layout: VideoLayout, channels: int) -> np.ndarray:
    """Latent [C, T, h, w]: RGB in channels 0-2, fixed mixes of it in the rest (`channel_mix`)."""
    T, h, w = layout.latent_frames, layout.latent_height, layout.latent_width
    rgb = np.empty((T, 3, h, w), dtype=np.float32)
    # latent frames of each segment: the first segment owns 13, later ones 12 (they share one with the previous)
    owners = np.zeros(T, dtype=np.int64)
    for i in range(layout.num_segments):
        owners[layout.segment_own_frames(i).start : layout.segment_own_frames(i).stop] = i
    t = 0
    while t < T:  # one run of frames per scene, rendered as one continuous motion
        seg = owners[t]
        scene = video.scenes[seg]
        end = t
        while end < T and video.scenes[owners[end]] is scene:
            end += 1
        rgb[t:end] = render_scene(scene, end - t, h, w, 0, end - t)
        t = end
    return np.einsum("ck,tkhw->cthw", channel_mix(channels), rgb).astype(np.float32)


# ---------------------------------------------------------------------------------------------------- cache
@dataclass(frozen=True)
class DemoSpec:
    layout: dict
    channels: int
    text_dim: int
    videos: int
    seed: int
    text_encoder: str
    version: int = DEMO_VERSION
    kind: str = "scenes"

    @classmethod
    def of(cls, layout: VideoLayout, channels: int, text_dim: int, videos: int, seed: int, text_encoder: str,
           kind: str = "scenes") -> DemoSpec:
        """The spec of `build_demo_cache`'s settings (its stamp resolves `text_encoder` to the encoder it used)."""
        return cls(layout.summary(), channels, text_dim, videos, seed, text_encoder, kind=kind)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def build_demo_cache(out: str | Path, layout: VideoLayout, channels: int, text_dim: int, videos: int = 32,
                     seed: int = 0, text_encoder: str = "auto", console: Any = None,
                     may_write: bool = True, kind: str = "scenes") -> Path | None:
    """Write (or reuse) the demo cache in `out`; returns the manifest path. Videos also get a `stories.json`.
    With `may_write` False (another run is training on the folder) an existing cache of these settings is reused
    and anything else returns None. `kind` picks the videos (`VIDEO_KINDS`): "scenes" (`random_video`) or
    "long-range" (`long_range_video`)."""
    out = Path(out)
    encoder = DemoTextEncoder(layout.text_tokens, text_dim, text_encoder, seed)
    spec = DemoSpec.of(layout, channels, text_dim, videos, seed, encoder.kind, kind)
    stamp = out / "demo.json"
    manifest = out / "manifest.jsonl"
    if stamp.is_file() and manifest.is_file():
        try:
            if json.loads(stamp.read_text()).get("fingerprint") == spec.fingerprint():
                return manifest
        except (OSError, json.JSONDecodeError):
            pass
    if not may_write:
        return None
    for sub in ("latents", "text"):  # another layout's files would only confuse a reader of the folder
        shutil.rmtree(out / sub, ignore_errors=True)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0xDE30])))
    demo = [VIDEO_KINDS[kind](rng, layout.num_segments) for _ in range(videos)]
    prompts = [p for v in demo for p in v.prompts()]
    feats, counts = encoder.encode(prompts)
    entries = []
    k = 0
    for i, video in enumerate(demo):
        vid = f"demo-{i:04d}"
        latent = torch.from_numpy(render_video(video, layout, channels))
        save_latent(out / f"latents/{vid}.safetensors", latent, torch.full_like(latent, POINT_MASS_LOGVAR), 1.0)
        texts = []
        for seg, prompt in enumerate(video.prompts()):
            rel = f"text/{vid}-{seg:03d}.safetensors"
            save_text(out / rel, feats[k], prompt, min(counts[k], layout.text_tokens),
                      extra={"encoder": encoder.kind})
            texts.append(rel)
            k += 1
        entries.append(CacheEntry(id=vid, latent=f"latents/{vid}.safetensors", text=texts,
                                  captions=[s.caption for s in video.scenes], scene_start=video.scene_start,
                                  scene_end=video.scene_end, source="synthetic"))
    write_manifest(manifest, entries)
    (out / "stories.json").write_text(json.dumps([v.story() for v in demo], indent=1) + "\n")
    stamp.write_text(json.dumps({"fingerprint": spec.fingerprint(), **asdict(spec),
                                 "text_encoder_description": encoder.describe()}, indent=1) + "\n")
    if console is not None:
        console.print(f"demo set: {videos} synthetic videos of {layout.num_segments} segment(s) in {out} "
                      f"(text: {encoder.describe()})")
    return manifest
