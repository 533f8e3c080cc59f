"""Training checkpoints: everything needed to continue a run bit for bit, written atomically, pruned to the last K.

    <output_dir>/checkpoints/step-000500/
        model.safetensors   every parameter (tttvideo.models.save_checkpoint format; `init_from` reads it)
        state.pt            optimizer, LR scheduler, grad scaler, RNG states (python, numpy, torch CPU and CUDA,
                            the trainer's noise generator), optimizer step, data position, counters
        config.toml         the resolved config of the run

A checkpoint is assembled in a temporary folder beside the final one and renamed into place (os.replace of a
folder is atomic on POSIX), so a process killed while saving leaves either the complete checkpoint or none; a
stray temporary folder is ignored and cleaned up by the next save.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tttvideo.errors import UserError

STEP_DIR = re.compile(r"^step-(\d+)$")
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, folder), oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / STATE_FILE).is_file() and (p / MODEL_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_training_checkpoint(output_dir: str | Path, step: int, model: torch.nn.Module, state: dict[str, Any],
                             config_text: str, keep: int) -> Path:
    """Write checkpoint `step` atomically and delete all but the newest `keep`; returns its folder."""
    from tttvideo.models import save_checkpoint

    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_checkpoint(model, tmp / MODEL_FILE)
    torch.save(state, tmp / STATE_FILE)
    (tmp / "config.toml").write_text(config_text, encoding="utf-8")
    _fsync_dir_files(tmp)
    if final.exists():  # re-saving the same step (a resumed run's final save): replace it as a whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    prune(output_dir, keep)
    return final


def _fsync_dir_files(folder: Path) -> None:
    # data must be on disk before the rename publishes the folder, or a crash could publish empty files
    for p in folder.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())


def prune(output_dir: str | Path, keep: int) -> None:
    found = list_checkpoints(output_dir)
    for _, path in found[: max(0, len(found) - keep)]:
        shutil.rmtree(path, ignore_errors=True)
    for stale in checkpoint_root(output_dir).glob(".tmp-step-*"):
        if not stale.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)


def load_state(folder: Path) -> dict[str, Any]:
    # weights_only=False: the state holds numpy / python RNG tuples; the file is our own
    return torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False)


def find_model_file(path: str | Path) -> Path | None:
    """A model file, a checkpoint folder (model.safetensors inside) or a run folder (its newest checkpoint) -> the
    model file; None when `path` is none of these."""
    p = Path(path)
    if p.is_file():
        return p
    if (p / MODEL_FILE).is_file():
        return p / MODEL_FILE
    latest = latest_checkpoint(p) if p.is_dir() else None
    return latest / MODEL_FILE if latest is not None else None


def resolve_init_from(path: str | Path) -> Path:
    """`init_from` may name a model file, a checkpoint folder or a run folder (its newest checkpoint)."""
    found = find_model_file(path)
    if found is None:
        raise UserError(f"train.init_from {str(path)!r} is neither a model file, a checkpoint folder nor a run folder "
                        f"with checkpoints; point it at the previous stage's output_dir")
    return found
