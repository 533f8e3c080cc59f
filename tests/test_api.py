"""The Python API (tttvideo.api): the README's snippet runs as written, a diffusers CogVideoX folder loads into a
pipeline with its own weights, and mistakes are one-sentence UserErrors."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tttvideo
from tttvideo.errors import UserError
from tttvideo.models.cogvideox.weights import diffusers_name_map

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.toml"
# a small demo layout, so that a pipeline samples in seconds
SMALL = ["layout.height=32", "layout.width=32", "layout.duration=3s"]


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Python API"):]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "README.md: the Python API section has no ```python block"
    return blocks[0]


def test_readme_snippet_runs(tmp_path):
    """The README's snippet, unchanged, in a fresh interpreter in a copy of the configs folder."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    (tmp_path / "snippet.py").write_text(readme_snippet(), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "(97, 64, 64, 3)"
    video = tmp_path / "runs/api-demo/story.mp4"
    assert video.is_file() and video.stat().st_size > 1000
    assert (tmp_path / "runs/api-demo/story.scenes.json").is_file()
    assert sorted(p.name for p in (tmp_path / "runs/api-demo/checkpoints").iterdir()) == ["step-000020"]


def test_config_object_and_lazy_exports():
    cfg = tttvideo.as_config(DEMO, ["train.steps=3"])
    assert cfg.train.steps == 3 and cfg.model.preset == "tiny-4ch"
    again = tttvideo.as_config(cfg, ["train.steps=5"])
    assert again.train.steps == 5 and cfg.train.steps == 3  # overrides copy, never mutate
    assert set(tttvideo.__all__) >= {"VideoPipeline", "Video", "train", "as_config"}
    with pytest.raises(AttributeError):
        tttvideo.NoSuchThing  # noqa: B018


@pytest.fixture(scope="module")
def diffusers_folder(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A diffusers CogVideoX pipeline folder holding a random transformer of the demo config's preset's shape."""
    from diffusers import CogVideoXTransformer3DModel

    from tttvideo.models.backbone import get_preset

    torch.manual_seed(0)
    ref = CogVideoXTransformer3DModel(**get_preset(tttvideo.as_config(DEMO).model.preset).to_diffusers_config())
    folder = tmp_path_factory.mktemp("cogvideox")
    ref.save_pretrained(folder / "transformer")
    return folder, {k: v.clone() for k, v in ref.state_dict().items()}


def test_from_pretrained_uses_the_folders_weights(diffusers_folder):
    folder, weights = diffusers_folder
    with tttvideo.VideoPipeline.from_pretrained(folder, config=DEMO, overrides=SMALL) as pipe:
        ours = pipe.model.state_dict()
        names = diffusers_name_map(pipe.spec.num_layers)
        assert len(weights) > 20 and all(torch.equal(ours[names[k]], v) for k, v in weights.items())
        video = pipe(["a red circle moves right on a black background"], steps=2, seed=0)
    assert video.frames.shape == (49, 32, 32, 3) and video.frames.dtype == np.uint8
    assert video.fps == 16 and video.sampling["steps"] == 2
    t = video.tensor()
    assert t.shape == (49, 3, 32, 32) and 0 <= t.min() and t.max() <= 1


def test_same_seed_same_video(diffusers_folder):
    folder, _ = diffusers_folder
    with tttvideo.VideoPipeline.from_pretrained(folder, config=DEMO, overrides=SMALL) as pipe:
        a = pipe(["a blue square moves up on a grey background"], steps=2, seed=3)
        b = pipe(["a blue square moves up on a grey background"], steps=2, seed=3)
        c = pipe(["a blue square moves up on a grey background"], steps=2, seed=4)
    assert np.array_equal(a.frames, b.frames) and not np.array_equal(a.frames, c.frames)


@pytest.mark.parametrize("call, match", [
    (lambda tmp: tttvideo.VideoPipeline.from_run(tmp / "nothing"), "does not exist"),
    (lambda tmp: tttvideo.VideoPipeline.from_pretrained(tmp / "nothing"), "not a folder"),
    (lambda tmp: tttvideo.as_config(DEMO, ["train.no_such_key=1"]), "no_such_key"),
    (lambda tmp: tttvideo.as_config(42), "must be a tttvideo Config"),
])
def test_mistakes_are_one_sentence(tmp_path, call, match):
    with pytest.raises(UserError, match=match):
        call(tmp_path)


def test_empty_scenes_and_bad_video_path(diffusers_folder, tmp_path):
    folder, _ = diffusers_folder
    pipe = tttvideo.VideoPipeline.from_pretrained(folder, config=DEMO, overrides=SMALL)
    with pytest.raises(UserError, match="non-empty list of scenes"):
        pipe([])
    video = tttvideo.Video(np.zeros((3, 8, 8, 3), np.uint8), 16, None)  # type: ignore[arg-type]
    with pytest.raises(UserError, match=r"saved as \.mp4"):
        video.save(tmp_path / "x.gif")
