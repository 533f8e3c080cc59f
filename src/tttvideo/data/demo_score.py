"""Does a demo video show what its captions say? A measurement, not a judgement by eye.

The demo set (`tttvideo.data.demo`) draws one shape of one colour on a flat background, moving across the frame in
one of four directions, and says so in the caption: "a {colour} {shape} moves {direction} on a {background}
background". A video generated from those captions can therefore be checked against them, scene by scene:

1. the scene's **background** is the densest colour of all its pixels (`background_colour`: the flat background is
   the biggest cluster of colours, the shape covers a smaller part of the frame); it is scored as right when the
   nearest of the four demo `BACKGROUNDS` is the captioned one (chance 1/4);
2. the **shape region** of each frame is the set of pixels farther than `REGION_DISTANCE` (RGB in [0, 1],
   Euclidean) from that background colour;
3. **colour**: the mean colour of the region over the scene's frames, each pixel weighted by its distance from the
   background (the shape's core counts most, background noise that just passes the threshold least); right when
   the nearest of the six demo `COLOURS` is the captioned one (chance 1/6);
4. **direction**: a least-squares line through the region's centroid over the scene's frames gives its
   displacement; right when the captioned direction has the largest component along it (chance 1/4);
5. **shape**: from the region's bounding box, whose sides are its summed soft coverage of rows and columns (a pixel
   counts by its distance from the background relative to the region's strongest pixel, so that anti-aliased edges
   at latent resolution count in part). The scenes set's bar and pillar: the median width / height over frames
   above `ASPECT_THRESHOLD` (1) is a bar, below a pillar (demo renders: bars 2.8, pillars 0.36). The long-range
   set's circle and square: the median fill ratio of the box, a disc fills about pi/4 of it, a square all; below
   `FILL_THRESHOLD` a circle (demo renders: circles 0.76-0.89, squares 1.0-1.06). Chance 1/2 either way.

An empty region (nothing differs from the background) fails colour, direction and shape. Chance levels are those of
a scorer that knows nothing about the video, with the demo set's uniform captions: overall (the mean of the four
attribute accuracies) (1/6 + 1/4 + 1/4 + 1/2) / 4 = 0.292. On the demo set's own latents the score is 1.0 for every
combination (`tests/test_demo_score.py`); on noise it is near chance, and against captions that name something else
it is 0.

The long-range set (`tttvideo.data.demo.long_range_video`) names the colour in its first caption only; after each
cut `score_persistence` scores the scene against its caption with that colour put in, so the colour accuracy per
scene says whether the first scene was carried across the cuts (chance 1/6).

Frames are [n, H, W, 3]: uint8 (a decoded mp4) or float in [-1, 1] (the identity decode's range, e.g. channels 0-2
of demo latents, see `latent_frames`). `pool` averages pool x pool pixel blocks first, which undoes the identity
decode's nearest-neighbour upsampling of an mp4 (`score_video_file` pools by the layout's 8). Consecutive segments
with the same caption are one scene; a video of S segments and n frames gives its first segment n - (S-1) k frames
and every later one k = (n - 1) // S (13 + 12 latent frames, or 49 + 48 decoded frames, for the demo's 6 s).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from tttvideo.data.demo import BACKGROUNDS, COLOURS, DIRECTIONS, KNOWN_SHAPES, SHAPES
from tttvideo.data.video import read_frames, story_captions
from tttvideo.text.demo import CAPTION_PATTERN, CAPTION_UNNAMED_PATTERN, demo_caption

REGION_DISTANCE = 0.25
FILL_THRESHOLD = 0.94
# a region wider than tall is a bar, taller than wide a pillar: the threshold is symmetric, so a round blob (or noise)
# is either with even odds
ASPECT_THRESHOLD = 1.0
CHANCE = {"colour": 1 / len(COLOURS), "background": 1 / len(BACKGROUNDS), "direction": 1 / len(DIRECTIONS),
          "shape": 1 / len(SHAPES)}
CHANCE_OVERALL = sum(CHANCE.values()) / len(CHANCE)  # 0.2917

@dataclass(frozen=True)
class CaptionParts:
    colour: str
    shape: str
    direction: str
    background: str


def without_scene_tokens(text: str) -> str:
    """A caption with its scene tokens (`<start_scene>`, `<end_scene>`) taken out."""
    return re.sub(r"<\w+>", " ", text).strip()


def parse_caption(text: str) -> CaptionParts:
    """The four attributes of a demo caption (scene tokens such as `<start_scene>` are ignored)."""
    m = CAPTION_PATTERN.search(without_scene_tokens(text))
    if m is None or m["colour"] not in COLOURS or m["shape"] not in KNOWN_SHAPES or m["direction"] not in DIRECTIONS \
            or m["background"] not in BACKGROUNDS:
        raise ValueError(f"not a demo caption: {text!r}")
    return CaptionParts(**m.groupdict())


def segment_bounds(frames: int, segments: int) -> list[tuple[int, int]]:
    """[start, stop) frame range of each segment: the first owns n - (S-1) k frames, the others k = (n-1) // S."""
    if segments < 1 or frames < segments:
        raise ValueError(f"{frames} frames cannot hold {segments} segments")
    k = (frames - 1) // segments if segments > 1 else frames
    first = frames - (segments - 1) * k
    return [(0, first)] + [(first + i * k, first + (i + 1) * k) for i in range(segments - 1)]


def scene_spans(frames: int, captions: Sequence[str]) -> list[tuple[str, int, int]]:
    """(caption, start, stop) of each scene: consecutive segments with the same caption are one scene (a scene that
    continues moves on continuously)."""
    bounds = segment_bounds(frames, len(captions))
    out, i = [], 0
    while i < len(captions):
        j = i
        while j + 1 < len(captions) and captions[j + 1] == captions[i]:
            j += 1
        out.append((captions[i], bounds[i][0], bounds[j][1]))
        i = j + 1
    return out


@dataclass
class SceneScore:
    caption: str
    frames: tuple[int, int]
    background: str
    colour: str
    direction: str
    shape: str
    fill: float  # median fill ratio of the region's bounding box
    aspect: float  # median width / height of the region's bounding box
    region: float  # mean fraction of the frame in the shape region
    background_ok: bool
    colour_ok: bool
    direction_ok: bool
    shape_ok: bool


@dataclass
class DemoScore:
    scenes: list[SceneScore] = field(default_factory=list)

    def accuracy(self, attribute: str) -> float:
        """Fraction of scenes whose `attribute` ("colour", "background", "direction", "shape") is the captioned one."""
        return float(np.mean([getattr(s, f"{attribute}_ok") for s in self.scenes])) if self.scenes else 0.0

    @property
    def overall(self) -> float:
        """Mean of the four attribute accuracies; chance is `CHANCE_OVERALL` (0.292)."""
        return float(np.mean([self.accuracy(a) for a in CHANCE]))

    def summary(self) -> str:
        parts = ", ".join(f"{a} {self.accuracy(a):.2f} (chance {CHANCE[a]:.2f})" for a in CHANCE)
        return f"demo score {self.overall:.2f} (chance {CHANCE_OVERALL:.2f}) over {len(self.scenes)} scene(s): {parts}"

    def to_json(self) -> dict:
        return {"overall": self.overall, "chance_overall": CHANCE_OVERALL,
                "accuracy": {a: self.accuracy(a) for a in CHANCE}, "chance": dict(CHANCE),
                "scenes": [asdict(s) for s in self.scenes]}


@dataclass
class PersistenceScore:
    """The long-range set's probe (`score_persistence`): after each cut, is the shape still drawn in the colour the
    first scene's caption named, which no later caption mentions? Chance is 1/6 (six colours)."""

    colour: str  # what the first scene's caption names
    first: SceneScore  # the first scene against its own caption: the control (does the model follow captions?)
    scenes: list[SceneScore] = field(default_factory=list)  # the later scenes, scored with that colour put in

    chance: float = CHANCE["colour"]

    def by_distance(self) -> list[bool]:
        """Whether the colour held in the 1st, 2nd, ... scene after the first (each a 3-s segment further on)."""
        return [s.colour_ok for s in self.scenes]

    @property
    def accuracy(self) -> float:
        return float(np.mean(self.by_distance())) if self.scenes else 0.0

    def summary(self) -> str:
        held = ", ".join(f"+{i + 1}: {'yes' if ok else 'no'}" for i, ok in enumerate(self.by_distance()))
        return (f"long-range score {self.accuracy:.2f} (chance {self.chance:.2f}): the first scene's {self.colour} "
                f"kept after each cut ({held})")

    def to_json(self) -> dict:
        return {"colour": self.colour, "accuracy": self.accuracy, "chance": self.chance,
                "by_distance": self.by_distance(), "first": asdict(self.first),
                "scenes": [asdict(s) for s in self.scenes]}


def score_persistence(frames: np.ndarray, captions: Sequence[str], pool: int = 1) -> PersistenceScore:
    """Score a long-range video ([n, H, W, 3], as `score_frames`) against its captions: the first names the colour,
    the later ones (`CAPTION_UNNAMED`) do not; each later scene is scored against its caption with the first
    scene's colour put in, so its `colour_ok` says whether the colour carried across the cuts."""
    x = _to_unit_rgb(frames, pool)
    spans = scene_spans(len(x), captions)
    caption, start, stop = spans[0]
    first = score_scene(x[start:stop], caption)
    first.frames = (start, stop)
    out = PersistenceScore(parse_caption(caption).colour, first)
    for caption, start, stop in spans[1:]:
        m = CAPTION_UNNAMED_PATTERN.match(without_scene_tokens(caption))
        if m is None:
            raise ValueError(f"not a later caption of the long-range set (it names no colour): {caption!r}")
        scene = score_scene(x[start:stop], demo_caption(out.colour, m["shape"], m["direction"], m["background"]))
        scene.frames = (start, stop)
        out.scenes.append(scene)
    return out


def _to_unit_rgb(frames: np.ndarray, pool: int) -> np.ndarray:
    x = np.asarray(frames)
    if x.ndim != 4 or x.shape[-1] != 3:
        raise ValueError(f"expected frames [n, H, W, 3], got {x.shape}")
    x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else (x.astype(np.float32) + 1.0) / 2.0
    if pool > 1:
        n, h, w, _ = x.shape
        x = x[:, : h - h % pool, : w - w % pool].reshape(n, h // pool, pool, w // pool, pool, 3).mean((2, 4))
    return np.clip(x, 0.0, 1.0)


def _nearest(colour: np.ndarray, table: dict[str, tuple[float, float, float]]) -> str:
    names = list(table)
    d = np.linalg.norm(np.array([table[k] for k in names], dtype=np.float32) - colour, axis=1)
    return names[int(np.argmin(d))]


def background_colour(frames: np.ndarray, radius: float = 0.15, max_pixels: int = 2048) -> np.ndarray:
    """The densest colour of the frames ([n, h, w, 3] in [0, 1]): the mean of the pixels within `radius` of the pixel
    with the most such neighbours. Unlike a median it does not blend the background with a shape that covers a large
    part of the frame: the flat background is the biggest cluster of colours as long as it is the bigger part."""
    pixels = frames.reshape(-1, 3)
    if len(pixels) > max_pixels:  # an even subsample keeps the cost bounded
        pixels = pixels[np.linspace(0, len(pixels) - 1, max_pixels).round().astype(int)]
    # squared distances through one matmul (|a|^2 + |b|^2 - 2 a.b, in float64) instead of an [n, n, 3] difference
    p = pixels.astype(np.float64)
    sq = (p * p).sum(1)
    near = sq[:, None] + sq[None] - 2.0 * (p @ p.T) < radius * radius
    return pixels[near[int(np.argmax(near.sum(1)))]].mean(0)


def score_scene(frames: np.ndarray, caption: str) -> SceneScore:
    """Score one scene's frames (RGB in [0, 1], [n, h, w, 3]) against its caption; see the module doc."""
    want = parse_caption(caption)
    bg = background_colour(frames)
    dist = np.linalg.norm(frames - bg, axis=-1)  # [n, h, w]
    region = dist > REGION_DISTANCE
    n, h, w = region.shape
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
    centres, times, fills, aspects = [], [], [], []
    for i in range(n):
        m = region[i]
        if not m.any():
            continue
        centres.append((ys[m].mean(), xs[m].mean()))
        times.append(i)
        # soft fill: a pixel's coverage is its distance from the background relative to the region's strongest
        # pixel (anti-aliased edges count in part); the box's sides are the summed coverage of its rows / columns
        weight = np.where(m, np.clip(dist[i] / dist[i][m].max(), 0.0, 1.0), 0.0)
        tall, wide = weight.max(1).sum(), weight.max(0).sum()
        fills.append(float(weight.sum() / (tall * wide)))
        aspects.append(float(wide / tall))
    colour = direction = shape = "none"
    fill = aspect = float("nan")
    if region.any():
        # each region pixel weighted by its distance from the background: the shape's core decides, not the faint
        # background noise that just passes REGION_DISTANCE (a plain mean drifts towards the background's grey)
        colour = _nearest(np.average(frames[region], axis=0, weights=dist[region]), COLOURS)
        fill, aspect = float(np.median(fills)), float(np.median(aspects))
        if want.shape in SHAPES:  # the scenes set: bar or pillar
            shape = "bar" if aspect > ASPECT_THRESHOLD else "pillar"
        else:  # the long-range set: circle or square
            shape = "circle" if fill < FILL_THRESHOLD else "square"
    if len(set(times)) >= 2:
        t = np.array(times, dtype=np.float32)
        c = np.array(centres, dtype=np.float32)
        slope = np.polyfit(t, c, 1)[0]  # [dy/dt, dx/dt]
        along = {k: slope[0] * dy + slope[1] * dx for k, (dy, dx) in DIRECTIONS.items()}
        direction = max(along, key=along.get) if np.abs(slope).max() > 0 else "none"
    background = _nearest(bg, BACKGROUNDS)
    return SceneScore(caption=caption, frames=(0, n), background=background, colour=colour, direction=direction,
                      shape=shape, fill=fill, aspect=aspect, region=float(region.mean()),
                      background_ok=background == want.background, colour_ok=colour == want.colour,
                      direction_ok=direction == want.direction, shape_ok=shape == want.shape)


def score_frames(frames: np.ndarray, captions: Sequence[str], pool: int = 1) -> DemoScore:
    """Score a video ([n, H, W, 3] uint8, or float in [-1, 1]) against its per-segment captions, scene by scene
    (`scene_spans`)."""
    x = _to_unit_rgb(frames, pool)
    out = DemoScore()
    for caption, start, stop in scene_spans(len(x), captions):
        scene = score_scene(x[start:stop], caption)
        scene.frames = (start, stop)
        out.scenes.append(scene)
    return out


def latent_frames(latents) -> np.ndarray:
    """Demo latents [T, C, h, w] (the cache's and the sampler's order) -> frames [T, h, w, 3] in [-1, 1]: channels
    0-2 are RGB, as the identity decode shows them."""
    x = latents.detach().cpu().numpy() if hasattr(latents, "detach") else np.asarray(latents)
    return np.clip(x[:, :3].transpose(0, 2, 3, 1), -1.0, 1.0)


def score_video_file(video: str | Path, captions: Sequence[str] | None = None, pool: int = 8,
                     long_range: bool = False) -> DemoScore | PersistenceScore:
    """Score an mp4 written by `tttv sample` / the demo's end-of-run video (`score_frames`, or with `long_range`
    `score_persistence`). Captions default to the story written beside it (`<name>.scenes.json`); `pool` is the
    layout's spatial VAE factor (8)."""
    if captions is None:
        captions = story_captions(video)
    score = score_persistence if long_range else score_frames
    return score(read_frames(video), list(captions), pool=pool)
