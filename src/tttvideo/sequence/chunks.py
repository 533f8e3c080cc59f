"""How a layer's forward without gradients cuts its work to bound memory (`memory.chunked_inference`): the plan
and the token ranges. Every layer that has a chunked forward (the CogVideoX block, local attention, the TTT layer)
takes a `ChunkPlan`; `tttvideo.models.chunked_inference` hands it to the blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class ChunkPlan:
    """How the chunked forward cuts the work: `tokens` per chunk of token-local work, the TTT heads in
    `ttt_head_groups` groups."""

    tokens: int = 16384
    ttt_head_groups: int = 1


def token_chunks(start: int, stop: int, size: int) -> Iterator[tuple[int, int]]:
    """[start, stop) in ranges of at most `size`."""
    for s in range(start, stop, size):
        yield s, min(s + size, stop)


def modal_chunks(length: int, text_tokens: int, size: int) -> Iterator[tuple[int, int, bool]]:
    """Token ranges of at most `size` that never straddle the text / video boundary: (start, stop, is_text)."""
    for s, e in token_chunks(0, text_tokens, size):
        yield s, e, True
    for s, e in token_chunks(text_tokens, length, size):
        yield s, e, False
