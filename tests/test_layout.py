"""Long-video layout arithmetic (the original's table of lengths) and its one-sentence errors."""

from __future__ import annotations

import pytest
import torch

from tttvideo.cli import main
from tttvideo.errors import LayoutError
from tttvideo.layout import LayoutParams, VideoLayout, explain_sequence_length, parse_duration

ORIGINAL_TABLE = [
    # duration, segments, latent frames, video tokens, text tokens per segment, total
    ("3s", 1, 13, 17_550, 498, 18_048),
    ("9s", 3, 37, 49_950, 502, 51_456),
    ("18s", 6, 73, 98_550, 471, 101_376),
    ("30s", 10, 121, 163_350, 497, 168_320),
    ("63s", 21, 253, 341_550, 458, 351_168),
]


@pytest.mark.parametrize("duration,segments,frames,video,text,total", ORIGINAL_TABLE)
def test_spec_table(duration, segments, frames, video, text, total):
    lay = VideoLayout.create(duration)
    assert lay.num_segments == segments
    assert lay.latent_frames == frames
    assert lay.tokens_per_frame == 1_350
    assert lay.video_tokens == video
    assert lay.text_tokens == text
    assert lay.total_tokens == total
    assert lay.ttt_padding == 0 and total % 64 == 0
    assert lay.num_frames == 16 * lay.duration_s + 1


def test_auto_text_length_for_other_durations_is_padding_free():
    lay = VideoLayout.create("6s")
    assert lay.text_tokens <= 512 and lay.total_tokens % 64 == 0
    lay = VideoLayout.create("6s", text_tokens=226)
    assert lay.ttt_padding == (-lay.total_tokens) % 64 and lay.ttt_padding > 0


@pytest.mark.parametrize("bad", ["10s", "0s", "-3", "2.5s", "abc", "4"])
def test_bad_duration_is_one_sentence(bad):
    with pytest.raises(LayoutError, match="duration"):
        parse_duration(bad)


def test_bad_resolution_names_the_divisor():
    with pytest.raises(LayoutError, match="divisible by .* 16"):
        VideoLayout.create("3s", height=481)


def test_text_embedding_count_mismatch():
    with pytest.raises(LayoutError, match="2 text embedding.*3 3-s segment"):
        VideoLayout.create("9s").check_text_embeddings(2)


def test_sequence_length_miscount_is_explained():
    lay = VideoLayout.create("9s")
    lay.check_sequence_length(51_456)
    with pytest.raises(LayoutError) as err:
        lay.check_sequence_length(49_950 + 502)  # the video plus ONE segment's text
    msg = str(err.value)
    assert "51,456" in msg and "ONE segment" in msg
    # a length that another segment count explains says which
    with pytest.raises(LayoutError, match="1 segment\\(s\\) with 498 text tokens"):
        lay.check_sequence_length(18_048)


def test_explain_sequence_length():
    assert (3, 502) in explain_sequence_length(51_456, 1_350)


def small_layout(duration="9s", text=5, mb=16):
    return VideoLayout.create(duration, height=32, width=48, text_tokens=text, mini_batch_size=mb)


def test_windows_share_one_frame():
    lay = small_layout()
    F = lay.tokens_per_frame
    for i in range(lay.num_segments):
        frames = lay.segment_frames(i)
        assert (frames.start, frames.stop) == (12 * i, 12 * i + 13)
        idx = lay.window_index(i)
        assert idx.numel() == lay.window_tokens
        assert idx[: lay.text_tokens].tolist() == list(range(5 * i, 5 * i + 5))
        assert idx[lay.text_tokens] == lay.total_text_tokens + 12 * i * F
    count = lay.window_overlap_count.view(lay.latent_frames, F)[:, 0]
    assert count[12] == 2 and count[24] == 2 and count[0] == 1 and count[13] == 1 and count[-1] == 1
    assert int((count == 2).sum()) == lay.num_segments - 1
    flat = lay.flat_window_index()  # the windows one after another: every position, shared frames twice
    assert flat.numel() == lay.num_segments * lay.window_tokens
    assert torch.equal(torch.bincount(flat, minlength=lay.total_tokens)[lay.total_text_tokens:].view(
        lay.latent_frames, F)[:, 0], count)


def test_a_backbones_window_and_text_placement():
    """A window of 7 latent frames (3 s at 8 fps through a 4x temporal VAE) and text kept out of the stream:
    segments share one frame, the stream and the TTT order are the video alone, text is still counted per segment."""
    lay = VideoLayout.create("9s", height=32, width=48, fps=8, text_tokens=5, mini_batch_size=16, window_frames=7,
                             text_in_stream=False)
    F = lay.tokens_per_frame
    assert (lay.latent_frames, lay.num_frames, lay.text_tokens, lay.total_text_tokens) == (19, 73, 5, 0)
    assert lay.total_tokens == lay.video_tokens == 19 * F and lay.window_tokens == 7 * F
    assert [(r.start, r.stop) for r in map(lay.segment_frames, range(3))] == [(0, 7), (6, 13), (12, 19)]
    assert torch.equal(lay.window_index(2), torch.arange(12 * F, 19 * F))
    assert torch.equal(lay.interleave_perm, torch.arange(19 * F))
    assert torch.equal(lay.reverse_perm, torch.arange(19 * F).flip(0))
    assert lay.local_positions[:, 0].max() == 6
    same = VideoLayout.from_latents(19, 4, 6, 5, 2, 16, backbone=LayoutParams(window_frames=7, text_in_stream=False))
    assert same.total_tokens == lay.total_tokens and same.latent_frames == 19
    with pytest.raises(LayoutError, match="segment windows of 7 latent frames need 6"):
        VideoLayout.create("3s", height=32, width=48, fps=16, window_frames=7)


def test_interleave_permutation_structure_and_inverse():
    lay = small_layout()
    perm, inv = lay.interleave_perm, lay.deinterleave_perm
    assert sorted(perm.tolist()) == list(range(lay.total_tokens))
    x = torch.randn(2, lay.total_tokens, 3)
    assert torch.equal(x[:, perm][:, inv], x)
    F, T = lay.tokens_per_frame, lay.total_text_tokens
    # [text_0, 13 frames, text_1, 12 frames, text_2, 12 frames]
    assert perm[:5].tolist() == list(range(5))
    assert perm[5 : 5 + 13 * F].tolist() == list(range(T, T + 13 * F))
    second = 5 + 13 * F
    assert perm[second : second + 5].tolist() == list(range(5, 10))
    assert perm[second + 5].item() == T + 13 * F


def test_reverse_permutation():
    lay = small_layout()
    rev = lay.reverse_perm
    x = torch.arange(lay.total_tokens)
    assert torch.equal(x[rev][rev], x)
    assert rev[:5].tolist() == list(range(10, 15))  # last segment's text first, its order kept
    assert rev[lay.total_text_tokens].item() == lay.total_tokens - 1  # video flipped token by token


def test_rope_positions():
    lay = small_layout()
    glob = lay.global_positions
    assert glob.shape == (lay.video_tokens, 3)
    assert glob[:, 0].max() == lay.latent_frames - 1
    assert glob[-1].tolist() == [lay.latent_frames - 1, lay.grid_height - 1, lay.grid_width - 1]
    loc = lay.local_positions
    assert loc.shape == (13 * lay.tokens_per_frame, 3) and loc[:, 0].max() == 12


def test_cli_layout_prints_spec_numbers(capsys):
    assert main(["layout", "--duration", "63s", "--duration", "9s"]) == 0
    out = capsys.readouterr().out
    assert "351,168" in out and "51,456" in out and "341,550" in out


def test_cli_layout_of_a_config_is_its_backbones(capsys):
    """With a config the tables are its model's layout (layout_of): Wan's 9-s stage keeps the text out of the stream
    (57,720 video tokens are the whole stream); a CogVideoX config's sampling phase scans mini-batches of 16."""
    assert main(["layout", "configs/wan2.1-1.3b/stage2-9s-24gb.toml", "--windows"]) == 0
    out = capsys.readouterr().out
    assert "wan2.1-t2v-1.3b" in out and "cross-attended" in out and out.count("57,720") == 2  # video = total
    # the title is one line, however narrow the table below it
    assert "wan2.1-t2v-1.3b (configs/wan2.1-1.3b/stage2-9s-24gb.toml, train): 9 s at 480x832, 16 fps\n" in out
    assert "20,280" in out  # a window: 13 latent frames of 1,560 tokens
    assert main(["layout", "configs/cogvideox-5b/stage2-9s.toml", "--phase", "sample", "--duration", "63s",
                 "--set", "ttt.kind=mlp"]) == 0
    out = capsys.readouterr().out
    assert "351,168" in out and "TTT mini-batches of 16" in out and "sample" in out


@pytest.mark.parametrize("argv, needle", [
    (["configs/demo.toml", "--height", "64"], "--set layout.height=..."),
    (["configs/demo.toml", "--mini-batch", "16"], "--set ttt.mini_batch_size=..."),
    (["--set", "layout.height=64"], "--set needs a CONFIG"),
    (["configs/demo.toml", "--set", "layout.nope=1"], "unknown key 'layout.nope'"),
    (["63s"], "give --duration 63s"),
])
def test_cli_layout_mistakes_are_one_sentence(argv, needle, capsys):
    assert main(["layout", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_layout_bad_duration_exits_2(capsys):
    assert main(["layout", "--duration", "10s"]) == 2
    err = capsys.readouterr().err
    assert "3 + 3n seconds" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_duration_rule_and_message_agree():
    """Any multiple of 3 s is a layout (66 s included); the message for one that is not says exactly that."""
    assert parse_duration("66s") == 66 and parse_duration(129) == 129
    with pytest.raises(LayoutError) as err:
        parse_duration("10s")
    assert "any multiple of 3" in str(err.value) and "..., 63 s)" not in str(err.value)
