"""Scene tokens and the prompt of a segment.

A segment that starts a scene gets ``<start_scene>`` before its caption and one that ends a scene gets
``<end_scene>`` after it, as the original writes its prompts; the tokens are plain text to the tokenizer. A scene
transition into segment i (i > 0) starts a scene at i and ends one at i - 1; the first segment has nothing before
it, so its transition flag means nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

SCENE_START_TOKEN = "<start_scene>"
SCENE_END_TOKEN = "<end_scene>"


def scene_prompt(caption: str, starts_scene: bool, ends_scene: bool) -> str:
    return (SCENE_START_TOKEN if starts_scene else "") + caption + (SCENE_END_TOKEN if ends_scene else "")


def transition_flags(transitions: Sequence[bool]) -> tuple[list[bool], list[bool]]:
    """Per-segment transition flags -> (starts_scene, ends_scene), one of each per segment."""
    n = len(transitions)
    starts = [i > 0 and bool(transitions[i]) for i in range(n)]
    ends = [i + 1 < n and bool(transitions[i + 1]) for i in range(n)]
    return starts, ends
