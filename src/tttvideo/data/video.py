"""Reading videos (imageio-ffmpeg): probe the stream, check it against the layout, decode frames; and the story
that `tttv sample` writes beside each video it makes (`scenes_path`, `story_captions`).

Precompute resizes and resamples nothing: a clip of the wrong resolution, frame rate or length is reported and
skipped, so that what trains is exactly what the user gave.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tttvideo.layout import VideoLayout

# Frame rates are stored as rationals in containers (16 may come back as 15.999...).
FPS_TOLERANCE = 0.01


@dataclass(frozen=True)
class VideoInfo:
    fps: float
    width: int
    height: int
    frames: int


class VideoReadError(Exception):
    """A clip that ffmpeg cannot open or decode; the message says why (it goes into the report)."""


def probe(path: str | Path) -> VideoInfo:
    """Frame rate, size and the exact frame count (ffmpeg decodes the stream to count; containers' counts lie)."""
    from tttvideo.ffmpeg import imageio_ffmpeg

    ffmpeg = imageio_ffmpeg()

    try:
        gen = ffmpeg.read_frames(str(path))
        meta = next(gen)
        gen.close()
        frames, _ = ffmpeg.count_frames_and_secs(str(path))
    except (OSError, RuntimeError, StopIteration) as err:
        raise VideoReadError(f"cannot read the video stream ({_first_line(err)})") from None
    width, height = meta.get("size") or (0, 0)
    return VideoInfo(fps=float(meta.get("fps") or 0.0), width=int(width), height=int(height), frames=int(frames))


def layout_problems(info: VideoInfo, layout: VideoLayout) -> list[str]:
    """Why a clip does not fit the layout ([] if it does), one phrase per problem."""
    problems = []
    if abs(info.fps - layout.fps) > FPS_TOLERANCE:
        problems.append(f"{info.fps:g} fps, not {layout.fps}")
    if (info.height, info.width) != (layout.height, layout.width):
        problems.append(f"{info.height}x{info.width} (HxW), not {layout.height}x{layout.width}")
    if info.frames != layout.num_frames:
        problems.append(
            f"{info.frames} frames, not {layout.num_frames} ({layout.fps} x {layout.duration_s} s + 1 for a "
            f"{layout.duration_s} s clip)"
        )
    return problems


def read_frames(path: str | Path, expected: VideoInfo | None = None) -> np.ndarray:
    """All frames as uint8 [T, H, W, 3]."""
    from tttvideo.ffmpeg import imageio_ffmpeg

    ffmpeg = imageio_ffmpeg()

    try:
        gen = ffmpeg.read_frames(str(path), pix_fmt="rgb24")
        meta = next(gen)
        width, height = meta["size"]
        frames = [np.frombuffer(buf, dtype=np.uint8).reshape(height, width, 3) for buf in gen]
    except (OSError, RuntimeError, StopIteration, ValueError) as err:
        raise VideoReadError(f"cannot decode the video ({_first_line(err)})") from None
    if not frames:
        raise VideoReadError("the video has no frames")
    video = np.stack(frames)
    if expected is not None and video.shape[:3] != (expected.frames, expected.height, expected.width):
        raise VideoReadError(f"decoded {video.shape[0]} frames of {video.shape[1]}x{video.shape[2]}, the probe said "
                             f"{expected.frames} of {expected.height}x{expected.width}")
    return video


def scenes_path(video_path: str | Path) -> Path:
    """out.mp4 -> out.scenes.json"""
    video_path = Path(video_path)
    return video_path.with_name(video_path.stem + ".scenes.json")


def story_captions(video_path: str | Path) -> list[str]:
    """The scene texts of the story written beside a sampled video, one per segment."""
    story = json.loads(scenes_path(video_path).read_text(encoding="utf-8"))
    return [s["text"] for s in story["scenes"]]


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__
