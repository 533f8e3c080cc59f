"""Training checkpoints: everything needed to continue a run bit for bit, written atomically, pruned to the last K,
and read back for resuming. The folder layout, and finding the newest intact checkpoint, are `tttvideo.runs`'s.

state.safetensors holds the optimizer, LR scheduler, grad scaler, RNG states (python, numpy, torch CPU and CUDA,
the trainer's noise generator), optimizer step, data position and counters, as tensors and JSON
(`tttvideo.train.statefile`: reading it runs no code from it). A checkpoint of an earlier version holds state.pt
(torch.save's pickle) instead: `load_state` reads it as statefile allows and converts it in place, once.

A checkpoint is assembled in a temporary folder beside the final one and renamed into place (os.replace of a
folder is atomic on POSIX), so a process killed while saving leaves either the complete checkpoint or none; a
stray temporary folder is ignored and cleaned up by the next save. Its manifest is written last.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tttvideo.errors import UserError
from tttvideo.outputs import free_bytes
from tttvideo.runs import (CONFIG_FILE, EMA_FILE, LEGACY_STATE_FILE, MANIFEST_FILE, MANIFEST_FORMAT, MODEL_FILE,
                           STATE_FILE, checkpoint_root, file_digest, find_model_file, latest_checkpoint,
                           list_checkpoints, read_manifest, state_file)
from tttvideo.train.statefile import read_legacy_state, read_state, write_state

log = logging.getLogger(__name__)


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
                             config_text: str, keep: int, meta: dict[str, Any] | None = None,
                             trained_duration_s: int | None = None, ema: Any = None) -> Path:
    """Write checkpoint `step` atomically (its manifest last) and delete all but the newest `keep`; returns its
    folder. `trained_duration_s` goes into the model file's metadata (`tttvideo.models.weights.trained_duration`);
    `ema` (a `tttvideo.train.ema.WeightAverage`) is written as ema.safetensors beside the model file."""
    return publish_checkpoint(output_dir, step, model, state, config_text, keep, meta or {}, trained_duration_s,
                              ema=ema)


def staging_folder(output_dir: str | Path, step: int) -> Path:
    """A fresh, empty temporary folder beside where checkpoint `step` will be, to assemble it in."""
    tmp = _staging_path(output_dir, step)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _staging_path(output_dir: str | Path, step: int) -> Path:
    return checkpoint_root(output_dir) / f".tmp-step-{step:06d}-{os.getpid()}"


def publish_checkpoint(output_dir: str | Path, step: int, model: torch.nn.Module, state: dict[str, Any],
                       config_text: str, keep: int, meta: dict[str, Any], trained_duration_s: int | None,
                       tmp: Path | None = None, ema: Any = None) -> Path:
    """Complete a checkpoint in `tmp` (a `staging_folder`, which may already hold files, e.g. a multi-process run's
    dcp/ shards; None: a new one) with the model file, state.safetensors, config.toml and the manifest last, make it
    durable, rename it to step-NNNNNN (replacing a checkpoint of the same step: a resumed run's final save) and prune
    to the newest `keep`. `model` is anything `tttvideo.models.save_checkpoint` reads (named parameters, spec,
    use_ttt)."""
    from tttvideo.models import save_checkpoint

    root = checkpoint_root(output_dir)
    final = root / f"step-{step:06d}"
    try:
        tmp = staging_folder(output_dir, step) if tmp is None else tmp
        save_checkpoint(model, tmp / MODEL_FILE, trained_duration_s=trained_duration_s)
        if ema is not None:
            ema.save(tmp / EMA_FILE)
        write_state(state, tmp / STATE_FILE)
        (tmp / CONFIG_FILE).write_text(config_text, encoding="utf-8")
        write_manifest(tmp, step, meta)
        _fsync_dir_files(tmp)
    except Exception as err:
        _write_failed(err, tmp or _staging_path(output_dir, step), final, output_dir)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    prune(output_dir, keep)
    return final


LOW_SPACE = 64 << 20  # below this a failed write is taken for a full disk (a write may then say only "unexpected pos")


def _write_failed(err: Exception, tmp: Path, final: Path, output_dir: str | Path) -> None:
    """A checkpoint that could not be written: the partial one is removed (it would only hold the space), and a full
    disk or another OS error is one sentence; anything else is re-raised by the caller."""
    free = free_bytes(tmp.parent)  # at the failure, the partial checkpoint still there
    full = free is not None and free < LOW_SPACE
    shutil.rmtree(tmp, ignore_errors=True)
    # safetensors raises its own SafetensorError around the OS error ("I/O error: No space left on device (os error
    # 28)"), and a large file's write fails with gigabytes still free
    wrapped = not isinstance(err, OSError) and "I/O error" in str(err)
    if not isinstance(err, OSError) and not wrapped and not full:
        return
    if full:
        why = f"the disk was full, {free / 2**20:.1f} MiB free"
    elif "No space left on device" in str(err):
        after = free_bytes(tmp.parent)
        why = "No space left on device" + ("" if after is None else
                                           f"; {after / 2**30:.1f} GiB free once the partial checkpoint was removed")
    else:
        why = getattr(err, "strerror", None) or str(err).split("I/O error: ")[-1]
    newest = latest_checkpoint(output_dir)
    since = f"its newest checkpoint, {newest.name}" if newest is not None else "step 0 (it has no checkpoint yet)"
    raise UserError(f"cannot write checkpoint {final.name} in {final.parent} ({why}); make room there (or move "
                    f"train.output_dir) and continue the run with --resume from {since}") from None


def write_manifest(folder: Path, step: int, meta: dict[str, Any]) -> Path:
    """manifest.json: size and SHA-256 of every other file under `folder` (a sub-folder's files by their relative
    path, e.g. dcp/__0_0.distcp), the step, and `meta`."""
    files = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": file_digest(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p != folder / MANIFEST_FILE}
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "written": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "files": files,
        "meta": meta,
    }
    path = folder / MANIFEST_FILE
    path.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return path


def _fsync_dir(folder: Path) -> None:
    # the rename itself must reach the disk too, or a power cut could forget the new folder
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_dir_files(folder: Path) -> None:
    # data must be on disk before the rename publishes the folder, or a crash could publish empty files
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        else:
            _fsync_dir(p)


def prune(output_dir: str | Path, keep: int) -> None:
    found = list_checkpoints(output_dir)
    for _, path in found[: max(0, len(found) - keep)]:
        shutil.rmtree(path, ignore_errors=True)
    for stale in checkpoint_root(output_dir).glob(".tmp-step-*"):
        if not stale.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder`."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def make_room(output_dir: str | Path, need: int) -> list[Path]:
    """Before a save: while the disk has less than `need` bytes free, prune the oldest checkpoints early, never the
    newest, so that a nearly full disk keeps fewer than train.keep_checkpoints instead of failing the save (which
    would lose the steps since the newest). Returns what it removed."""
    found, removed = list_checkpoints(output_dir), []
    while len(found) > 1:
        free = free_bytes(output_dir)
        if free is None or free >= need:
            break
        _, path = found.pop(0)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.warning("%s: %.1f GiB free for a checkpoint of about %.1f GiB; pruned %s early (train.keep_checkpoints "
                    "is more than this disk holds)", output_dir, (free_bytes(output_dir) or 0) / 2**30, need / 2**30,
                    ", ".join(p.name for p in removed))
    return removed


def warn_if_short(output_dir: str | Path, disk: Any) -> None:
    """At a run's start: a warning (`tttv train: warning: ...`) when the disk of `output_dir` cannot take its
    checkpoints (`disk`, a `memory.guard.disk.CheckpointDisk`), those already there (a resume) counted in."""
    from tttvideo.memory.guard.disk import space_warning

    held = sum(folder_bytes(p) for _, p in list_checkpoints(output_dir))
    warning = space_warning(output_dir, disk, held)
    if warning:
        log.warning(warning)


def make_room_for(output_dir: str | Path, counted: int) -> list[Path]:
    """Before a save: `make_room` for the newest checkpoint's size, else the `counted` one."""
    newest = latest_checkpoint(output_dir)
    return make_room(output_dir, max(counted, folder_bytes(newest) if newest is not None else 0))


def load_state(folder: Path, trust: bool = False) -> dict[str, Any]:
    """The training state of checkpoint `folder`. A state.pt of an earlier version is read as
    `statefile.read_legacy_state` allows (the full unpickler only with `trust`: --trust-checkpoint) and then
    converted in place to state.safetensors, so that it is read safely from then on; the caller must be the only
    process reading the folder (rank 0, holding the run folder's lock)."""
    path = state_file(folder)
    if path.name == STATE_FILE:
        return read_state(path)
    state = read_legacy_state(path, trust)
    try:
        convert_legacy_state(folder, state)
    except (OSError, TypeError) as err:  # a read-only folder, or a state holding what state.safetensors cannot
        log.warning("checkpoint %s: could not convert %s to %s (%s); it stays as it is", folder, LEGACY_STATE_FILE,
                    STATE_FILE, err)
    return state


def convert_legacy_state(folder: Path, state: dict[str, Any]) -> None:
    """Replace the state.pt of checkpoint `folder` by state.safetensors holding `state` (what it held). In order,
    each step atomic: the new file (written under a temporary name, renamed), the manifest listing it instead of
    state.pt (its other entries kept), state.pt deleted. A crash in between leaves a checkpoint that reads as
    before: the manifest decides which state file counts (`runs.state_file`)."""
    new = folder / STATE_FILE
    tmp = folder / f".tmp-{STATE_FILE}"
    write_state(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, new)
    manifest = read_manifest(folder)
    if manifest is not None:
        files = {k: v for k, v in manifest.get("files", {}).items() if k != LEGACY_STATE_FILE}
        files[STATE_FILE] = {"size": new.stat().st_size, "sha256": file_digest(new)}
        manifest["files"] = dict(sorted(files.items()))
        tmp = folder / f".tmp-{MANIFEST_FILE}"
        tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, folder / MANIFEST_FILE)
    (folder / LEGACY_STATE_FILE).unlink(missing_ok=True)
    _fsync_dir(folder)
    log.info("checkpoint %s: %s converted to %s", folder, LEGACY_STATE_FILE, STATE_FILE)


def resolve_init_from(path: str | Path) -> Path:
    """`init_from` may name a model file, a checkpoint folder or a run folder (its newest checkpoint) -> the model
    file (the trainer loads the EMA weights beside it over it, `runs.ema_file_beside`)."""
    try:
        found = find_model_file(path)
    except UserError as err:
        raise UserError(f"train.init_from: {err}") from None
    if found is None:
        raise UserError(f"train.init_from {str(path)!r} is neither a model file, a checkpoint folder nor a run folder "
                        f"with checkpoints; point it at the previous stage's output_dir")
    return found


# not settings of the training: how the run folder was opened, and where it is (a run folder moved or copied)
_RESUME_KEYS = ("train.if_exists", "train.output_dir")


def config_changes(saved: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """The settings of `config` (this run's, as `config_to_dict` gives it) that differ from `saved` (a checkpoint's,
    `tttvideo.runs.saved_config`), each as 'key old -> new' ('(not set)' for a key only one of them has); none when
    the checkpoint saved no config."""
    from tttvideo.config.loader import flat_keys

    if not saved:
        return []
    before, now = flat_keys(saved), flat_keys(config)
    unset = "(not set)"
    return [f"{key} {before.get(key, unset)} -> {now.get(key, unset)}" for key in sorted(set(before) | set(now))
            if before.get(key) != now.get(key) and key not in _RESUME_KEYS]
