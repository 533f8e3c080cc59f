"""Local attention's overlap merge (`tttvideo.models.attention.merge_windows`): two gathers instead of an atomic
scatter into zeros, held bit for bit to that scatter (index_add) and its scaling, forward and gradient, for
CogVideoX's layout (text in every window) and Wan's (video only), in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from tests.benchmark_scripts import load_benchmark
from tttvideo.layout import VideoLayout
from tttvideo.models import attention

# the merge as it was (benchmarks/window_merge.py times the two against each other on a GPU)
scatter_merge = load_benchmark("window_merge").scatter_merge


def layouts():
    from tttvideo.models.wan.layout import wan_layout

    return [VideoLayout.create(9, 32, 48, text_tokens=4), VideoLayout.create(18, 32, 48, text_tokens=3),
            wan_layout(9, 32, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("which", range(3), ids=["cogvideox-9s", "cogvideox-18s", "wan-9s"])
def test_merge_equals_the_scatter_bit_for_bit_forward_and_backward(which, dtype):
    layout = layouts()[which]
    n, L = layout.num_segments, layout.total_tokens
    flat = layout.flat_window_index()
    inv_count = torch.cat([torch.ones(layout.total_text_tokens),
                           1.0 / layout.window_overlap_count.double()]).float()[:, None]
    covers = attention.window_covers(layout, torch.device("cpu"))
    assert covers[1].numel() > 0  # the layout has frames two windows share
    W = flat.numel() // n
    gen = torch.Generator().manual_seed(which)
    out = torch.randn(2 * n, 3, W, 8, generator=gen).to(dtype)
    grad = torch.randn(2, L, 24, generator=gen).to(dtype)
    results = []
    for merge in (lambda o: attention.merge_windows(o, flat, n, inv_count, L, covers),
                  lambda o: attention.merge_windows(o, flat, n, inv_count, L),  # covers computed on the spot
                  lambda o: scatter_merge(o, flat, n, inv_count, L)):
        o = out.clone().requires_grad_()
        merged = merge(o)
        merged.backward(grad)
        results.append((merged.detach(), o.grad))
    for merged, g in results[:2]:
        assert torch.equal(merged, results[2][0]) and torch.equal(g, results[2][1])


def test_covers_name_each_position_once_or_twice_and_refuse_more():
    flat = torch.tensor([0, 1, 2, 2, 3, 4])  # position 2 in two windows
    first, twice, second = attention.merge_covers(flat, 5)
    assert first.tolist() == [0, 1, 2, 4, 5] and twice.tolist() == [2] and second.tolist() == [3]
    with pytest.raises(ValueError, match="once or twice"):
        attention.merge_covers(torch.tensor([0, 1, 1, 1]), 2)
    with pytest.raises(ValueError, match="once or twice"):  # position 2 in no window
        attention.merge_covers(torch.tensor([0, 1]), 3)
    with pytest.raises(ValueError, match="covers are of 5 positions, the sequence of 6"):
        attention.merge_windows(torch.zeros(2, 1, 3, 4), flat, 2, torch.ones(6, 1), 6,
                                attention.merge_covers(flat, 5))


@pytest.mark.parametrize("which", range(3), ids=["cogvideox-9s", "cogvideox-18s", "wan-9s"])
def test_add_window_equals_index_add_with_the_window_index(which):
    """The chunked forwards' accumulation of one window at a time: slice adds, bit for bit index_add_."""
    layout = layouts()[which]
    gen = torch.Generator().manual_seed(10 + which)
    acc = torch.randn(2, layout.total_tokens, 8, generator=gen).to(torch.bfloat16)
    want = acc.clone()
    for i in range(layout.num_segments):
        idx = layout.window_index(i)
        out = torch.randn(2, idx.numel(), 8, generator=gen).to(torch.bfloat16)
        want.index_add_(1, idx, out)
        attention.add_window(acc, layout, i, out)
    assert torch.equal(acc, want)
