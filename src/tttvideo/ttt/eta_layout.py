"""Where the inner learning rate of each (query, key) pair of a mini-batch comes from: `ttt.eta_layout`.

Inside a mini-batch every output token i is computed with the inner weights after a gradient step over the
mini-batch's keys j, each key's gradient weighted by a learning rate eta[i, j]; the state carried to the next
mini-batch is the step of the last row, eta[b - 1, :]. The two layouts differ only in eta[i, j]:

``per-token`` (the paper's math, the default): eta[i, j] is key j's own rate, the same for every row i. The layer
passes one rate per token [B, H, L] and the scan, the Triton kernels included, takes it as it is.

``reference`` (the reference system, ttt-video-dit): that system builds the b x b matrix of every mini-batch in the
residual-stream order of the sequence the pass is given (every row equal to that residual mini-batch's rates), and
then moves the matrices' ROWS into the scan order of a multi-segment video like every other per-token tensor. The
columns keep their residual order, so from two segments on, most entries hold the rate of a token other than the
key they multiply, and the last row, which drives the state update, is that of another mini-batch too. With one
segment the scan order is the residual order and both layouts are the same computation.

In scan positions p (padding appended after the last token, with rate 0, in both orders): row p of the reference
layout holds the rates of the residual mini-batch that contains the token at p, so
``rows[p, j] = scan position of residual position (residual(p) // b) * b + j``. The forward and the reverse pass
use the same map: the reverse pass's scan order is the interleave of the reversed sequence, which is what the
reference system's rows are moved by.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from tttvideo.layout import VideoLayout, inverse_permutation

PER_TOKEN = "per-token"
REFERENCE = "reference"
ETA_LAYOUTS = (PER_TOKEN, REFERENCE)


def _padded_interleave(layout: VideoLayout) -> torch.Tensor:
    """The scan order as residual positions, with the TTT padding appended in place in both orders."""
    return torch.cat([layout.interleave_perm, torch.arange(layout.total_tokens, layout.ttt_tokens)])


def reference_eta_rows(layout: VideoLayout) -> torch.Tensor:
    """[P, b] scan positions (P = layout.ttt_tokens, b its mini-batch): row p of the reference layout's
    learning-rate matrix takes its b rates from these tokens' per-token rates (int64, on the CPU)."""
    b = layout.mini_batch_size
    perm = _padded_interleave(layout)
    inv = inverse_permutation(perm)
    return inv[(perm // b * b)[:, None] + torch.arange(b)]


def per_token_eta_rows(layout: VideoLayout) -> torch.Tensor:
    """[P, b] scan positions of the per-token layout in the same form: row p holds its own mini-batch's keys."""
    b = layout.mini_batch_size
    return (torch.arange(layout.ttt_tokens) // b * b)[:, None] + torch.arange(b)


@lru_cache(maxsize=8)
def eta_rows_on(layout: VideoLayout, device: torch.device) -> torch.Tensor:
    """`reference_eta_rows` on `device`, stored as int32 (half the bytes; the scan widens one group at a time) and
    shared by every layer and both passes."""
    return reference_eta_rows(layout).to(device=device, dtype=torch.int32)


def misplaced_share(layout: VideoLayout) -> float:
    """Share of the reference layout's learning-rate entries that multiply a key other than the token whose rate
    they are (0 where the two layouts agree)."""
    b = layout.mini_batch_size
    perm = _padded_interleave(layout)
    inv = inverse_permutation(perm)
    misplaced = 0
    for start in range(0, len(perm), 1 << 14):  # a block of rows at a time: [P, b] is 180 MB at 63 s
        p = torch.arange(start, min(start + (1 << 14), len(perm)))
        keys = torch.arange(b)
        misplaced += int((inv[(perm[p] // b * b)[:, None] + keys] != (p // b * b)[:, None] + keys).sum())
    return misplaced / (len(perm) * b)
