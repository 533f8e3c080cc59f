"""Wan's long-video layout: video tokens only, 3-s windows of 13 latent frames sharing one frame, 1,560 tokens a
latent frame at 480x832."""

from __future__ import annotations

import pytest
import torch

from tttvideo.errors import LayoutError
from tttvideo.models.wan.layout import layout_table, wan_layout, wan_layout_from_latents


def test_token_arithmetic_at_480x832():
    rows = {r["seconds"]: r for r in layout_table()}
    assert {s: (r["frames"], r["latent_frames"], r["tokens"]) for s, r in rows.items()} == {
        3: (49, 13, 20_280),
        9: (145, 37, 57_720),
        18: (289, 73, 113_880),
        30: (481, 121, 188_760),
        63: (1009, 253, 394_680),
    }
    assert all(r["tokens_per_frame"] == 30 * 52 and r["window_tokens"] == 13 * 1560 for r in rows.values())


def test_windows_scan_order_and_reversal():
    layout = wan_layout(9, 32, 48, mini_batch_size=16)  # 2 x 3 tokens a latent frame, 37 frames
    F = layout.tokens_per_frame
    assert (layout.total_text_tokens, layout.total_tokens, F) == (0, 37 * 6, 6)
    windows = [layout.window_index(i) for i in range(3)]
    assert all(torch.equal(w, torch.arange(12 * i * F, (12 * i + 13) * F)) for i, w in enumerate(windows))
    # consecutive windows share exactly one latent frame, which is averaged over its two windows
    assert len(set(windows[0].tolist()) & set(windows[1].tolist())) == F
    assert layout.window_overlap_count.view(37, F)[:, 0].tolist() == [1] * 12 + [2] + [1] * 11 + [2] + [1] * 12
    # the TTT scan is the frame order; the reverse pass flips it token by token
    assert torch.equal(layout.interleave_perm, torch.arange(layout.total_tokens))
    assert torch.equal(layout.reverse_perm, torch.arange(layout.total_tokens).flip(0))
    assert layout.ttt_padding == (-layout.total_tokens) % 16
    assert wan_layout_from_latents(37, 4, 6, 2, 16) == layout


def test_bad_durations_and_sizes_are_one_sentence():
    with pytest.raises(LayoutError, match="3 \\+ 3n seconds"):
        wan_layout(10)
    with pytest.raises(LayoutError, match="divisible by VAE compression x patch size"):
        wan_layout(3, 480, 830)
    with pytest.raises(LayoutError, match="13 \\+ 12 \\(n - 1\\)"):
        wan_layout_from_latents(20, 60, 104, 2, 64)
