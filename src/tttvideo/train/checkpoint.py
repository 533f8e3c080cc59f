"""Training checkpoints: everything needed to continue a run bit for bit, written atomically, pruned to the last K.

    <output_dir>/checkpoints/step-000500/
        model.safetensors   every parameter (tttvideo.models.save_checkpoint format; `init_from` reads it)
        state.pt            optimizer, LR scheduler, grad scaler, RNG states (python, numpy, torch CPU and CUDA,
                            the trainer's noise generator), optimizer step, data position, counters
        config.toml         the resolved config of the run
        manifest.json       size and SHA-256 of each file above, the step and a `meta` dict; written last

A checkpoint is assembled in a temporary folder beside the final one and renamed into place (os.replace of a
folder is atomic on POSIX), so a process killed while saving leaves either the complete checkpoint or none; a
stray temporary folder is ignored and cleaned up by the next save.

What the rename cannot protect against (a disk that fills or fails later, a partial copy to another machine, a
file truncated by hand) the manifest catches: `newest_intact_checkpoint` checks every file against it, warns
about a damaged checkpoint naming the file, and falls back to the newest intact one. It is what `--resume`,
`train.init_from` and `tttv sample --checkpoint RUN` use. Checkpoints written before manifests existed are
checked by reading their headers (and a failed load falls back the same way).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import random
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tttvideo.errors import UserError

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
CONFIG_FILE = "config.toml"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
HASH_CHUNK = 1 << 20  # 1 MiB reads: a 20 GB model file is hashed in constant memory


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


def step_folders(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Every `step-N` folder, complete or not, as (step, folder), oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


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
                             config_text: str, keep: int, meta: dict[str, Any] | None = None,
                             trained_duration_s: int | None = None) -> Path:
    """Write checkpoint `step` atomically (its manifest last) and delete all but the newest `keep`; returns its
    folder. `trained_duration_s` goes into the model file's metadata (`tttvideo.models.weights.trained_duration`)."""
    from tttvideo.models import save_checkpoint

    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_checkpoint(model, tmp / MODEL_FILE, trained_duration_s=trained_duration_s)
        torch.save(state, tmp / STATE_FILE)
        (tmp / CONFIG_FILE).write_text(config_text, encoding="utf-8")
        write_manifest(tmp, step, meta or {})
        _fsync_dir_files(tmp)
    except Exception as err:
        _write_failed(err, tmp, final, output_dir)
        raise
    if final.exists():  # re-saving the same step (a resumed run's final save): replace it as a whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    prune(output_dir, keep)
    return final


LOW_SPACE = 64 << 20  # below this a failed write is taken for a full disk (torch.save then says only "unexpected pos")


def _write_failed(err: Exception, tmp: Path, final: Path, output_dir: str | Path) -> None:
    """A checkpoint that could not be written: the partial one is removed (it would only hold the space), and a full
    disk or another OS error is one sentence; anything else is re-raised by the caller."""
    try:
        free = shutil.disk_usage(tmp.parent).free
    except OSError:
        free = -1
    shutil.rmtree(tmp, ignore_errors=True)
    if not isinstance(err, OSError) and not 0 <= free < LOW_SPACE:
        return
    if 0 <= free < LOW_SPACE:
        why = f"the disk was full, {free / 2**20:.1f} MiB free"
    else:
        why = getattr(err, "strerror", None) or str(err)
    newest = latest_checkpoint(output_dir)
    since = f"its newest checkpoint, {newest.name}" if newest is not None else "step 0 (it has no checkpoint yet)"
    raise UserError(f"cannot write checkpoint {final.name} in {final.parent} ({why}); make room there (or move "
                    f"train.output_dir) and continue the run with --resume from {since}") from None


def file_digest(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, step: int, meta: dict[str, Any]) -> Path:
    """manifest.json: size and SHA-256 of every other file in `folder`, the step, and `meta`."""
    files = {p.name: {"size": p.stat().st_size, "sha256": file_digest(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST_FILE}
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


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a checkpoint folder; None for one written before manifests existed."""
    path = Path(folder) / MANIFEST_FILE
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


# what each check found, by (file, size, mtime): `tttv sample` looks a run folder up twice, and a 20 GB model file
# should be hashed once per process
_CHECKED: dict[tuple[str, int, int], str] = {}
_WARNED: set[str] = set()


def _check_file(path: Path, entry: dict[str, Any]) -> str:
    """'' when `path` matches its manifest entry, else what is wrong (naming the file)."""
    if not path.is_file():
        return f"{path.name}: missing"
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _CHECKED:
        if st.st_size != entry["size"]:
            problem = (f"{path.name}: size mismatch ({st.st_size:,} bytes, the manifest says {entry['size']:,}: cut "
                       f"off or still being copied)")
        elif file_digest(path) != entry["sha256"]:
            problem = f"{path.name}: hash mismatch (its SHA-256 is not the manifest's: the file is damaged)"
        else:
            problem = ""
        _CHECKED[key] = problem
    return _CHECKED[key]


def _check_legacy(folder: Path, files: tuple[str, ...]) -> str:
    """A checkpoint without a manifest: its files exist and their headers read (safetensors checks its header
    against the file size, torch's zip format has its directory at the end), so a cut-off file is caught."""
    from tttvideo.models.weights import model_file_metadata

    for name in files:
        path = folder / name
        if not path.is_file():
            return f"{name}: missing"
        if name == MODEL_FILE:
            try:
                model_file_metadata(path)
            except UserError:
                return f"{name}: unreadable (not a readable safetensors file: cut off or damaged; no manifest)"
        elif name == STATE_FILE:
            try:
                with zipfile.ZipFile(path):
                    pass
            except (zipfile.BadZipFile, OSError) as err:
                return f"{name}: unreadable ({err}: cut off or damaged; no manifest)"
    return ""


def verify_checkpoint(folder: str | Path, files: tuple[str, ...] | None = None) -> str:
    """'' when checkpoint `folder` is intact, else "FILE: what (details)" saying which file is wrong and how
    (missing, size mismatch, hash mismatch, unreadable). `files` limits the check (default: every file of the manifest, which must include the
    model and the state)."""
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError) as err:
        return f"{MANIFEST_FILE}: unreadable ({err})"
    if manifest is None:
        return _check_legacy(folder, files or (MODEL_FILE, STATE_FILE))
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        return f"{MANIFEST_FILE}: unreadable (it lists no files)"
    for name in files or (MODEL_FILE, STATE_FILE, *sorted(set(listed) - {MODEL_FILE, STATE_FILE})):
        if name not in listed:
            return f"{name}: not in {MANIFEST_FILE}"
        try:
            problem = _check_file(folder / name, listed[name])
        except OSError as err:
            problem = f"{name}: unreadable ({err.strerror or err})"
        if problem:
            return problem
    return ""


def newest_intact_checkpoint(output_dir: str | Path, exclude: tuple[Path, ...] = (),
                             advice: str = "start a new run (tttv train --new) or restore them from a backup",
                             warn_once: bool = True) -> Path | None:
    """The newest checkpoint of run folder `output_dir` whose files match its manifest; None when the run has no
    checkpoint at all. Each damaged checkpoint passed over is a warning naming the file and what is wrong with it
    (once per process with `warn_once`: `tttv sample` looks the run up twice); a run whose checkpoints are all
    damaged is a UserError (ending with `advice`)."""
    found = [folder for _, folder in reversed(step_folders(output_dir)) if folder not in exclude]
    damaged: list[tuple[Path, str]] = []
    for folder in found:
        problem = verify_checkpoint(folder)
        if not problem:
            for bad, why in damaged:
                note = f"checkpoint {bad} is damaged, {why}; using {folder} instead"
                if note not in _WARNED or not warn_once:
                    _WARNED.add(note)
                    log.warning(note)
            return folder
        damaged.append((folder, problem))
    if not damaged:
        return None
    listed = ", ".join(f"{folder.name}/{why.split(' (')[0]}" for folder, why in damaged)
    raise UserError(f"{output_dir} has no intact checkpoint ({listed}); {advice}")


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
    """A model file, a checkpoint folder (model.safetensors inside) or a run folder (its newest intact checkpoint,
    `newest_intact_checkpoint`) -> the model file; None when `path` is none of these. A model file or checkpoint
    folder named directly is checked against its manifest (when it has one): a damaged one is a UserError."""
    p = Path(path)
    if p.is_file():
        _check_named(p.parent, p.name, p)
        return p
    if (p / MODEL_FILE).is_file():
        _check_named(p, MODEL_FILE, p)
        return p / MODEL_FILE
    if not p.is_dir():
        return None
    intact = newest_intact_checkpoint(p, advice="point at another run or checkpoint")
    return intact / MODEL_FILE if intact is not None else None


def _check_named(folder: Path, name: str, given: Path) -> None:
    """A model file the user named directly must match the manifest beside it, if there is one that lists it."""
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError):
        return
    if manifest is None or name not in manifest.get("files", {}):
        return
    problem = verify_checkpoint(folder, files=(name,))
    if problem:
        hint = (f"; give the run folder {folder.parent.parent} instead to use its newest intact checkpoint"
                if folder.parent.name == "checkpoints" else "")
        raise UserError(f"checkpoint {given} is damaged, {problem}{hint}")


def resolve_init_from(path: str | Path) -> Path:
    """`init_from` may name a model file, a checkpoint folder or a run folder (its newest checkpoint)."""
    try:
        found = find_model_file(path)
    except UserError as err:
        raise UserError(f"train.init_from: {err}") from None
    if found is None:
        raise UserError(f"train.init_from {str(path)!r} is neither a model file, a checkpoint folder nor a run folder "
                        f"with checkpoints; point it at the previous stage's output_dir")
    return found
