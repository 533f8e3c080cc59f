"""Stories: the scene lists `tttv sample` turns into videos, and their prompts' text features.

A story is a list of scenes, one per 3-second segment; a scene is ``{"text": ..., "requires_scene_transition":
false, "neg_text": ...}`` (only ``text`` is required). Accepted inputs:

- ``story.json`` holding a list of scenes (one story), a list of such lists (several stories, as the original's
  ``inputs/example-9s.json``), or ``{"scenes": [...], "sampling": {...}}`` (what `tttv sample` writes beside every
  video as ``out.scenes.json``, so a result can be fed back in);
- ``story.jsonl`` with one scene object per line (one story) or one list of scenes per line (one story per line);
- a folder: every ``*.json`` / ``*.jsonl`` file in it, in name order.

Scene transitions follow the original convention: when scene i (i > 0) requires a transition, the previous
scene's prompt gets ``<end_scene>`` appended and scene i's prompt gets ``<start_scene>`` prepended
(`tttvideo.text.prompts`). The first scene has no previous one, so its flag is ignored.

A prompt longer than the layout's text length is an error (`check_token_counts`; the training cache truncates
with a warning, but a user writing a story should know that the end of a scene is being dropped).

Every mistake raises a `UserError` whose one sentence names the file, the story and the scene.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tttvideo.errors import UserError
from tttvideo.layout import SEGMENT_SECONDS, parse_duration
from tttvideo.text.prompts import scene_prompt, transition_flags

if TYPE_CHECKING:  # reading stories needs no torch
    import torch

    from tttvideo.text.encoders import TextEncoder

SCENE_KEYS = ("text", "requires_scene_transition", "neg_text")
STORY_SUFFIXES = (".json", ".jsonl")


@dataclass
class Scene:
    text: str
    requires_scene_transition: bool = False
    neg_text: str = ""


@dataclass
class Story:
    """The scenes of one video; `name` names its output file when a call samples several stories."""

    name: str
    source: str
    scenes: list[Scene] = field(default_factory=list)
    seed: int | None = None  # this story's noise seed (the Python API; benchmarks give each story its own); None:
    # sample.seed

    @property
    def num_segments(self) -> int:
        return len(self.scenes)

    @property
    def duration_s(self) -> int:
        return SEGMENT_SECONDS * len(self.scenes)

    def prompts(self) -> list[str]:
        """One prompt per segment with the scene-transition tokens inserted."""
        starts, ends = transition_flags([s.requires_scene_transition for s in self.scenes])
        return [scene_prompt(s.text, a, b) for s, a, b in zip(self.scenes, starts, ends)]

    def negative_prompts(self) -> list[str]:
        """One negative prompt per segment; a scene without one gets the empty prompt, as in the original."""
        return [s.neg_text for s in self.scenes]

    def to_json(self, sampling: dict[str, Any] | None = None) -> dict[str, Any]:
        """The `{"scenes": [...], "sampling": {...}}` form, readable again by `load_stories`."""
        out: dict[str, Any] = {"scenes": [asdict(s) for s in self.scenes]}
        if sampling:
            out["sampling"] = sampling
        return out


def check_duration(story: Story, duration: str | int | None) -> int:
    """The video length in seconds: the scene count's (3 s per scene) or `duration`, which must agree with it."""
    if duration is None or duration == "":
        return story.duration_s
    seconds = parse_duration(duration)
    if seconds != story.duration_s:
        raise UserError(
            f"{story.source}: story {story.name!r} has {story.num_segments} scene(s), i.e. {story.duration_s} s at one "
            f"scene per 3-s segment, but the duration asks for {seconds} s ({seconds // SEGMENT_SECONDS} scenes); "
            f"give {seconds // SEGMENT_SECONDS} scenes or leave the duration out"
        )
    return seconds


def check_token_counts(encoder: TextEncoder, story: Story, text_tokens: int, duration_s: int) -> None:
    """One sentence naming the first scene whose prompt (scene tokens included) does not fit the text length."""
    prompts, negatives = story.prompts(), story.negative_prompts()
    for kind, texts in (("text", prompts), ("neg_text", negatives)):
        for i, n in enumerate(encoder.token_counts(texts)):
            if n > text_tokens:
                raise UserError(
                    f"{story.source}: scene {i} of story {story.name!r} has {n} tokens in its {kind} (scene tokens "
                    f"included) but the {duration_s} s layout takes {text_tokens} per scene; shorten it or raise "
                    f"layout.text_tokens"
                )


def output_paths(stories: list[Story], out: str | Path) -> list[Path]:
    """One story: `out` itself (or out/<name>.mp4 for a folder); several: out must be a folder."""
    out = Path(out)
    if out.suffix.lower() == ".mp4":
        if len(stories) > 1:
            raise UserError(f"the scenes hold {len(stories)} stories but --out {out} names one video; give a folder "
                            f"and each story is written to <folder>/<story name>.mp4")
        return [out]
    if out.suffix and not out.is_dir():
        raise UserError(f"--out {out} must end in .mp4 (one story) or name a folder")
    return [out / f"{s.name}.mp4" for s in stories]


def encode_story(encoder: TextEncoder, story: Story) -> tuple[torch.Tensor, torch.Tensor]:
    """(conditional, unconditional) features, each [segments, text_tokens, text_dim] float32 on the CPU."""
    prompts, negatives = story.prompts(), story.negative_prompts()
    feats = encoder.encode(prompts + negatives)
    n = len(prompts)
    return feats[:n], feats[n:]


def load_stories(path: str | Path) -> list[Story]:
    """Every story in a .json/.jsonl file or a folder of them; at least one, each with at least one scene."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in STORY_SUFFIXES and p.is_file())
        if not files:
            raise UserError(f"scenes folder {path} holds no .json or .jsonl files")
        stories = [story for f in files for story in _load_file(f)]
    else:
        stories = _load_file(path)
    names = [s.name for s in stories]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UserError(f"scenes in {path} give two stories the same name {dupes[0]!r}; rename one of the files")
    return stories


def _load_file(path: Path) -> list[Story]:
    if path.suffix.lower() not in STORY_SUFFIXES:
        raise UserError(f"scenes file {path} must end in .json or .jsonl (a list of scenes per story)")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"scenes file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read scenes file {path}: {err}") from None
    if path.suffix.lower() == ".jsonl":
        stories = _parse_jsonl(path, text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
        stories = _parse_json(path, data)
    if not stories:
        raise UserError(f"scenes file {path} holds no story; give a list of scenes")
    return stories


def _parse_json(path: Path, data: Any) -> list[Story]:
    if isinstance(data, dict):
        extra = sorted(set(data) - {"scenes", "sampling"})
        if "scenes" not in data or extra:
            raise UserError(
                f"{path}: a JSON object must be {{\"scenes\": [...]}} (with an optional \"sampling\"); "
                f"got key(s) {', '.join(map(repr, extra or sorted(data)))}"
            )
        return [_story(path, path.stem, data["scenes"], where="scenes")]
    if not isinstance(data, list) or not data:
        raise UserError(f"{path}: expected a list of scenes or a list of stories (lists of scenes), got "
                        f"{_kind(data)}")
    if all(isinstance(item, dict) for item in data):
        return [_story(path, path.stem, data, where="the list")]
    if all(isinstance(item, list) for item in data):
        return [_story(path, f"{path.stem}-{i:03d}", item, where=f"story {i}") for i, item in enumerate(data)]
    raise UserError(f"{path}: the top-level list mixes scenes (objects) and stories (lists); use one or the other")


def _parse_jsonl(path: Path, text: str) -> list[Story]:
    rows: list[tuple[int, Any]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((lineno, json.loads(line)))
        except json.JSONDecodeError as err:
            raise UserError(f"{path} line {lineno} is not valid JSON ({err.msg}, column {err.colno})") from None
    if not rows:
        return []
    if all(isinstance(r, dict) for _, r in rows):
        scenes = [_scene(path, path.stem, i, r, where=f"line {n}") for i, (n, r) in enumerate(rows)]
        return [Story(path.stem, str(path), scenes)]
    if all(isinstance(r, list) for _, r in rows):
        return [_story(path, f"{path.stem}-{i:03d}", r, where=f"line {n}") for i, (n, r) in enumerate(rows)]
    raise UserError(f"{path}: lines mix scenes (objects) and stories (lists); put one scene per line, or one "
                    f"story (a list of scenes) per line")


def story_from_scenes(scenes: Any, name: str = "video") -> Story:
    """A story from Python values: a list whose items are scene texts or scene objects
    ({"text": ..., "requires_scene_transition": ..., "neg_text": ...}), checked as a scenes file is."""
    if isinstance(scenes, (str, dict)):
        scenes = [scenes]
    items = [{"text": s} if isinstance(s, str) else s for s in scenes] if isinstance(scenes, (list, tuple)) else scenes
    return _story(Path("scenes"), name, items, where="scenes")


def _story(path: Path, name: str, items: Any, where: str) -> Story:
    if not isinstance(items, list) or not items:
        raise UserError(f"{path}: {where} must be a non-empty list of scenes, got {_kind(items)}")
    return Story(name, str(path), [_scene(path, name, i, item, where) for i, item in enumerate(items)])


def _scene(path: Path, story: str, index: int, item: Any, where: str) -> Scene:
    label = f"{path}: scene {index} of story {story!r} ({where})"
    if not isinstance(item, dict):
        raise UserError(f"{label} must be an object like {{\"text\": \"...\"}}, got {_kind(item)}")
    unknown = sorted(set(item) - set(SCENE_KEYS))
    if unknown:
        raise UserError(f"{label} has unknown key {unknown[0]!r}; a scene takes {', '.join(SCENE_KEYS)}")
    text = item.get("text")
    if not isinstance(text, str):
        raise UserError(f"{label} needs a \"text\" string, got {_kind(text)}")
    if not text.strip():
        raise UserError(f"{label} has empty text; describe what happens in this 3-s segment")
    flag = item.get("requires_scene_transition", False)
    if not isinstance(flag, bool):
        raise UserError(f"{label}: requires_scene_transition must be true or false, got {flag!r}")
    neg = item.get("neg_text")
    if neg is None:
        neg = ""
    if not isinstance(neg, str):
        raise UserError(f"{label}: neg_text must be a string or null, got {_kind(neg)}")
    return Scene(text=text.strip(), requires_scene_transition=flag, neg_text=neg.strip())


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
