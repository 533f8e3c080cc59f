"""The run pictures: a frame strip (one captioned row per scene) and a loss curve, written as PNGs of a known size."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tttvideo.train.figures import LOSS_SIZE, frame_strip, loss_curve, moving_average, strip_size

pytest.importorskip("matplotlib")


def png_size(path) -> tuple[int, int]:
    """(width, height) from the PNG header."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


CAPTIONS = ["a red circle moves right on a black background", "a blue square moves up on a grey background"]


def test_frame_strip_from_frames(tmp_path):
    frames = np.random.default_rng(0).uniform(-1, 1, (25, 8, 12, 3)).astype(np.float32)
    out = frame_strip(frames, CAPTIONS, tmp_path / "strip.png")
    assert out == tmp_path / "strip.png" and png_size(out) == strip_size((8, 12), rows=2) == (600, 260)
    # a continued scene is one row; more frames per row make it wider
    out = frame_strip(frames, [CAPTIONS[0]] * 2, tmp_path / "one.png", frames_per_scene=6)
    assert png_size(out) == strip_size((8, 12), rows=1, frames_per_scene=6) == (900, 130)


def test_frame_strip_from_an_mp4_reads_its_story(tmp_path):
    from tttvideo.sample.video import Mp4Writer

    video = tmp_path / "v.mp4"
    with Mp4Writer(video, fps=16) as w:
        w.append(np.random.default_rng(1).integers(0, 256, (97, 64, 96, 3), dtype=np.uint8))
    (tmp_path / "v.scenes.json").write_text(json.dumps({"scenes": [{"text": c} for c in CAPTIONS]}))
    out = frame_strip(video, None, tmp_path / "sub" / "strip.png")
    assert png_size(out) == strip_size((64, 96), rows=2)
    with pytest.raises(ValueError):
        frame_strip(np.zeros((25, 8, 12, 3), np.uint8), None, tmp_path / "x.png")  # frames need captions


def test_loss_curve(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0 / s, "lr": 1e-3} for s in range(1, 41)]
    rows[5]["loss"] = math.nan  # a skipped step is left out, not plotted
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    out = loss_curve(metrics, tmp_path / "loss.png", window=10)
    assert png_size(out) == LOSS_SIZE == (640, 360)
    np.testing.assert_allclose(moving_average(np.array([1.0, 2.0, 3.0, 4.0]), 2), [1.0, 1.5, 2.5, 3.5])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no finite loss"):
        loss_curve(empty, tmp_path / "none.png")
