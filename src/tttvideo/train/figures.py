"""Pictures of a training run: a frame strip of its video and its loss curve, as PNG files.

`frame_strip(video, captions, out_png)`: one row per scene (consecutive segments with the same caption are one
scene, `tttvideo.data.demo_score.scene_spans`), `frames_per_scene` frames evenly spaced inside it,
the scene's caption above its row. `video` is an mp4 path (its captions default to the story written beside it,
`<name>.scenes.json`) or frames [n, H, W, 3] (uint8, or float in [-1, 1]).

`loss_curve(metrics_jsonl, out_png)`: the loss of every step from the trainer's `metrics.jsonl` (thin) and its
trailing moving average (thick), on a log scale.

Both draw with matplotlib's object API on an Agg canvas (no pyplot, no global state, no display needed) at a fixed
size and dpi, so the PNG's pixel size is known in advance (`strip_size`, `LOSS_SIZE`), and return the PNG's path.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np

DPI = 100
PANEL_IN = 1.5  # width of one frame panel, inches
TITLE_IN = 0.3  # caption band above each row, inches
LOSS_FIGSIZE = (6.4, 3.6)
LOSS_SIZE = (int(LOSS_FIGSIZE[0] * DPI), int(LOSS_FIGSIZE[1] * DPI))  # (width, height) in pixels


def _frames_and_captions(video, captions: Sequence[str] | None) -> tuple[np.ndarray, list[str]]:
    if isinstance(video, (str, Path)):
        from tttvideo.data.video import read_frames, story_captions

        if captions is None:
            captions = story_captions(video)
        frames = read_frames(video)
    else:
        if captions is None:
            raise ValueError("frames given without captions")
        frames = np.asarray(video)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected frames [n, H, W, 3], got {frames.shape}")
    if frames.dtype != np.uint8:
        frames = ((np.clip(frames.astype(np.float32), -1, 1) + 1) * 127.5).round().astype(np.uint8)
    return frames, list(captions)


def strip_size(frame_hw: tuple[int, int], rows: int, frames_per_scene: int = 4) -> tuple[int, int]:
    """(width, height) in pixels of the PNG `frame_strip` writes for frames of (H, W) and `rows` scenes."""
    fig_w, fig_h = _strip_figsize(frame_hw, rows, frames_per_scene)
    return int(round(fig_w * DPI)), int(round(fig_h * DPI))


def _strip_figsize(frame_hw: tuple[int, int], rows: int, frames_per_scene: int) -> tuple[float, float]:
    h, w = frame_hw
    panel_h = PANEL_IN * h / w
    return PANEL_IN * frames_per_scene, rows * (panel_h + TITLE_IN)


def frame_strip(video, captions: Sequence[str] | None, out_png: str | Path, frames_per_scene: int = 4) -> Path:
    """Write a PNG with one row of `frames_per_scene` frames per scene, captioned; returns its path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from tttvideo.data.demo_score import scene_spans

    frames, captions = _frames_and_captions(video, captions)
    scenes = scene_spans(len(frames), captions)
    h, w = frames.shape[1:3]
    fig_w, fig_h = _strip_figsize((h, w), len(scenes), frames_per_scene)
    fig = Figure(figsize=(fig_w, fig_h), dpi=DPI)
    FigureCanvasAgg(fig)
    row_h = 1.0 / len(scenes)
    panel_h = (fig_h / len(scenes) - TITLE_IN) / fig_h
    for r, (caption, start, stop) in enumerate(scenes):
        top = 1.0 - r * row_h
        picks = np.linspace(start, stop - 1, frames_per_scene).round().astype(int)
        for c, k in enumerate(picks):
            ax = fig.add_axes((c / frames_per_scene, top - row_h, 1.0 / frames_per_scene, panel_h))
            ax.imshow(frames[k], interpolation="nearest", aspect="auto")
            ax.set_axis_off()
            ax.text(0.02, 0.04, f"{k}", transform=ax.transAxes, color="white", fontsize=6,
                    bbox={"facecolor": "black", "alpha": 0.5, "pad": 1, "linewidth": 0})
        fig.text(0.5, top - 0.5 * TITLE_IN / fig_h, f"scene {r + 1}: {caption} (frames {start}-{stop - 1})",
                 ha="center", va="center", fontsize=7)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return out


def _read_losses(metrics_jsonl: str | Path) -> tuple[np.ndarray, np.ndarray]:
    steps, losses = [], []
    for line in Path(metrics_jsonl).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        loss = row.get("loss")
        if "step" in row and isinstance(loss, (int, float)) and math.isfinite(loss):
            steps.append(row["step"])
            losses.append(float(loss))
    return np.array(steps), np.array(losses)


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` values (fewer at the start)."""
    values = np.asarray(values, dtype=np.float64)
    csum = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return (csum[idx] - csum[lo]) / (idx - lo)


def loss_curve(metrics_jsonl: str | Path, out_png: str | Path, window: int = 25) -> Path:
    """Write a PNG of the loss per step and its `window`-step moving average; returns its path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps, losses = _read_losses(metrics_jsonl)
    if not len(steps):
        raise ValueError(f"{metrics_jsonl} holds no finite loss")
    fig = Figure(figsize=LOSS_FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, losses, lw=0.6, alpha=0.45, color="tab:blue", label="loss")
    ax.plot(steps, moving_average(losses, window), lw=2.0, color="tab:orange",
            label=f"moving average ({window} steps)")
    if losses.min() > 0:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("v-prediction MSE")
    ax.set_title(f"training loss ({len(steps)} steps)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return out
