"""Writing videos: frames streamed into an H.264 mp4 (imageio-ffmpeg), the story saved beside it
(`tttvideo.data.video.scenes_path`; reading either back is `tttvideo.data.video`'s).

Frames arrive in chunks from the decoder ([n, H, W, 3] uint8) and go straight to ffmpeg's stdin, so a one-minute
video (1009 frames at 480x720, about 1 GB of raw RGB) never has to sit in memory at once.

Both files are written atomically (`tttvideo.outputs.atomic_target`): ffmpeg writes a hidden temporary beside the
mp4, renamed over it when the writer closes cleanly, so a killed or failed sample never leaves a truncated video
(that plays, cut short) under the final name.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tttvideo.data.video import scenes_path
from tttvideo.errors import UserError
from tttvideo.outputs import atomic_target, check_mp4_writer, remove_stale_temporaries, temporary_name


def to_uint8_frames(video: torch.Tensor) -> np.ndarray:
    """[n, 3, H, W] in [-1, 1] (the VAE's range) -> [n, H, W, 3] uint8, rounding to the nearest level."""
    frames = ((video.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return frames.permute(0, 2, 3, 1).contiguous().cpu().numpy()


class Mp4Writer:
    """Streams uint8 frames into an mp4: `append(frames)` any number of times, then `close()` (or use `with`). The
    frames go to a hidden temporary file beside `path`; `close()` renames it to `path`, `abort()` (or leaving the
    `with` block on an exception) removes it.

    H.264 with yuv420p needs even sides; odd frame sizes are padded by repeating the last row/column instead of
    being rescaled (ffmpeg's default), so decoded frames keep their pixels.
    """

    def __init__(self, path: str | Path, fps: int = 16, quality: float = 8.0):
        check_mp4_writer()
        from tttvideo.ffmpeg import imageio_ffmpeg

        self.path = Path(path)
        self.tmp = temporary_name(self.path)
        self.fps = fps
        self.quality = quality
        self.frames_written = 0
        self._ffmpeg = imageio_ffmpeg()
        self._gen = None
        self._size: tuple[int, int] | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(f"cannot create the output folder {self.path.parent}: {err.strerror}") from None
        if not os.access(self.path.parent, os.W_OK):
            raise UserError(f"cannot write {self.path}: the folder {self.path.parent} is not writable")

    def append(self, frames: np.ndarray) -> None:
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(f"expected [n, H, W, 3] uint8 frames, got {frames.shape} {frames.dtype}")
        h, w = frames.shape[1:3]
        pad_h, pad_w = h % 2, w % 2
        if pad_h or pad_w:
            frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
        size = (frames.shape[2], frames.shape[1])  # ffmpeg takes (width, height)
        if self._gen is None:
            self._size = size
            remove_stale_temporaries(self.path)
            self._gen = self._ffmpeg.write_frames(
                str(self.tmp), size, fps=self.fps, quality=self.quality, codec="libx264", macro_block_size=1,
                ffmpeg_log_level="error",
            )
            self._gen.send(None)  # starts ffmpeg
        elif size != self._size:
            raise ValueError(f"frame size changed from {self._size} to {size} inside one video")
        for frame in frames:
            self._gen.send(np.ascontiguousarray(frame))
        self.frames_written += len(frames)

    def close(self) -> None:
        """Finish the file and put it under its final name."""
        if self._gen is not None:
            gen, self._gen = self._gen, None
            try:
                gen.close()  # ffmpeg flushes and exits
                # imageio does not look at ffmpeg's exit status: a file it could not finish (a full disk while it
                # wrote the index at the end) is found by its boxes
                problem = mp4_problem(self.tmp)
                if problem:
                    raise OSError(errno.EIO, f"ffmpeg could not finish the video ({problem})")
                os.replace(self.tmp, self.path)
            finally:
                self.tmp.unlink(missing_ok=True)

    def abort(self) -> None:
        """Stop ffmpeg and remove what it wrote; the final name is left as it was."""
        if self._gen is not None:
            gen, self._gen = self._gen, None
            try:
                gen.close()
            except Exception:  # it is being thrown away anyway
                pass
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "Mp4Writer":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def mp4_problem(path: Path) -> str:
    """What is wrong with the mp4 at `path` as a file ('' when nothing): its top-level boxes must tile the file and
    include the index ('moov'), which ffmpeg writes last. Reads only the box headers."""
    try:
        size = path.stat().st_size
        boxes, at = set(), 0
        with open(path, "rb") as f:
            while at < size:
                f.seek(at)
                head = f.read(16)
                if len(head) < 8:
                    return f"a box header cut off at byte {at}"
                length, kind = int.from_bytes(head[:4], "big"), head[4:8]
                if length == 1 and len(head) == 16:
                    length = int.from_bytes(head[8:16], "big")
                if length < 8 or at + length > size:
                    return f"box {kind!r} at byte {at} runs past the end of the file"
                boxes.add(kind)
                at += length
    except OSError as err:
        return err.strerror or str(err)
    return "" if b"moov" in boxes else "no index (moov box)"


def write_scenes(video_path: str | Path, payload: dict[str, Any]) -> Path:
    path = scenes_path(video_path)
    with atomic_target(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path
