"""The captions file of `tttv precompute`: one JSON object per clip, one caption per 3-s segment.

    {"video": "clip-001.mp4", "captions": ["a fox runs ...", "the fox stops ...", "a city at night ..."],
     "scene_transition": [false, false, true]}

`video` is relative to the videos folder. Scene flags come in one of two forms:

- ``scene_transition`` (the form a story for `tttv sample` uses): segment i > 0 starts a new scene, so segment
  i - 1 ends one. The first segment's flag is ignored (nothing comes before it).
- ``scene_start`` and ``scene_end``, one boolean per segment each (the original's training data form), for clips
  whose first segment opens a scene or whose last one closes it.

A segment's prompt is its caption with the scene tokens of `tttvideo.text.prompts`.
Structural mistakes in the file are errors; per-clip problems (flags of the wrong length, a caption count that does
not match the clip's segments) are returned as problems so that precompute can report and skip that clip.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tttvideo.errors import UserError
from tttvideo.text.prompts import scene_prompt, transition_flags

CLIP_KEYS = ("video", "captions", "scene_transition", "scene_start", "scene_end")


@dataclass
class ClipCaptions:
    video: str
    captions: list[str]
    scene_start: list[bool]
    scene_end: list[bool]
    line: int
    problem: str = ""  # non-empty: this clip is reported and skipped

    def prompts(self) -> list[str]:
        return [scene_prompt(c, s, e) for c, s, e in zip(self.captions, self.scene_start, self.scene_end)]


@dataclass
class CaptionsFile:
    path: Path
    clips: list[ClipCaptions] = field(default_factory=list)


def read_captions(path: str | Path) -> CaptionsFile:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"captions file {path} does not exist; give a JSONL file with one line per clip")
    out = CaptionsFile(path)
    seen: dict[str, int] = {}
    with open(path, "rb") as f:  # decoded line by line, so that a bad byte is named by its line
        for lineno, raw in enumerate(f, start=1):
            where = f"captions file {path} line {lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UserError(f"{where} is not valid UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of "
                                f"the line); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{where} is not valid JSON ({err.msg}, column {err.colno})") from None
            if not isinstance(row, dict):
                raise UserError(f"{where} must be an object like {{\"video\": \"a.mp4\", \"captions\": [...]}}")
            unknown = sorted(set(row) - set(CLIP_KEYS))
            if unknown:
                raise UserError(f"{where} has unknown key {unknown[0]!r}; a clip takes {', '.join(CLIP_KEYS)}")
            video = row.get("video")
            if not isinstance(video, str) or not video:
                raise UserError(f"{where} needs a \"video\" file name")
            if video in seen:
                raise UserError(f"{where} lists {video!r} again (first on line {seen[video]}); one line per clip")
            seen[video] = lineno
            captions = row.get("captions")
            if not isinstance(captions, list) or not captions or not all(isinstance(c, str) for c in captions):
                raise UserError(f"{where} needs \"captions\": a non-empty list of strings, one per 3-s segment")
            out.clips.append(_flags(row, video, [c.strip() for c in captions], lineno))
    if not out.clips:
        raise UserError(f"captions file {path} lists no clips")
    return out


def _flags(row: dict, video: str, captions: list[str], lineno: int) -> ClipCaptions:
    n = len(captions)
    clip = ClipCaptions(video, captions, [False] * n, [False] * n, lineno)
    if any(not c for c in captions):
        clip.problem = f"caption {[i for i, c in enumerate(captions) if not c][0]} is empty"
        return clip
    if "scene_transition" in row and ("scene_start" in row or "scene_end" in row):
        raise UserError(f"line {lineno} of the captions file gives both scene_transition and scene_start/scene_end; "
                        f"use one form")
    for key in ("scene_transition", "scene_start", "scene_end"):
        if key not in row:
            continue
        flags = row[key]
        if not isinstance(flags, list) or not all(isinstance(x, bool) for x in flags):
            raise UserError(f"line {lineno} of the captions file: {key} must be a list of true/false, one per caption")
        if len(flags) != n:
            clip.problem = f"{key} has {len(flags)} flag(s) for {n} caption(s)"
            return clip
    if "scene_transition" in row:
        clip.scene_start, clip.scene_end = transition_flags(row["scene_transition"])
    else:
        clip.scene_start = list(row.get("scene_start", clip.scene_start))
        clip.scene_end = list(row.get("scene_end", clip.scene_end))
    return clip
