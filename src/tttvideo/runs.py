"""Reading run folders: where a run's model file is, which of its checkpoints is the newest intact one, and what a
checkpoint path a user gives (run folder, checkpoint folder or model file) points to. Nothing here writes;
`tttvideo.train.checkpoint` writes checkpoints in this layout:

    <output_dir>/checkpoints/step-000500/
        model.safetensors   every parameter (tttvideo.models.save_checkpoint format; `init_from` reads it)
        ema.safetensors     with train.ema_decay > 0: the fp32 moving average of the trainable parameters, in the
                            model file's format (partial); sampling and `init_from` load it over model.safetensors
        state.safetensors   optimizer, LR scheduler, grad scaler, RNG states, counters (what resuming restores;
                            `tttvideo.train.statefile`; checkpoints of older versions hold state.pt instead)
        config.toml         the resolved config of the run
        manifest.json       size and SHA-256 of each file above, the step and a `meta` dict; written last

A checkpoint folder appears whole or not at all (it is renamed into place), but a disk that fills or fails later, a
partial copy to another machine or a file truncated by hand can still damage it; the manifest catches that:
`newest_intact_checkpoint` checks every file against it, warns about a damaged checkpoint naming the file, and
falls back to the newest intact one. It is what `--resume`, `train.init_from` and `tttv sample --checkpoint RUN`
use. Checkpoints written before manifests existed are checked by reading their headers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import zipfile
from pathlib import Path
from typing import Any

from tttvideo.config.schema import Config
from tttvideo.errors import UserError

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.safetensors"
EMA_FILE = "ema.safetensors"
LEGACY_STATE_FILE = "state.pt"  # torch.save's pickle, written before state.safetensors; read as statefile says
CONFIG_FILE = "config.toml"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
HASH_CHUNK = 1 << 20  # 1 MiB reads: a 20 GB model file is hashed in constant memory
# the flag that lets a command read a pickle (a legacy state file, a DCP index): pickles can run code when read
TRUST_FLAG = "--trust-checkpoint"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def state_file(folder: str | Path) -> Path:
    """The training-state file of checkpoint `folder`: the one its manifest lists, else state.safetensors if it
    exists, else state.pt (an older version's; it may not exist either)."""
    folder = Path(folder)
    try:
        listed = (read_manifest(folder) or {}).get("files", {})
    except (OSError, ValueError):
        listed = {}
    if isinstance(listed, dict) and LEGACY_STATE_FILE in listed and STATE_FILE not in listed:
        return folder / LEGACY_STATE_FILE
    if (isinstance(listed, dict) and STATE_FILE in listed) or (folder / STATE_FILE).is_file():
        return folder / STATE_FILE
    return folder / LEGACY_STATE_FILE


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, folder), oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and ((p / STATE_FILE).is_file() or (p / LEGACY_STATE_FILE).is_file()) and (p / MODEL_FILE).is_file():
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


def file_digest(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks; for a file this process wrote with `tensorfile.write_safetensors`
    (and has not changed since), the digest it computed on the way out."""
    from tttvideo.tensorfile import written_digest

    if (known := written_digest(path)) is not None:
        return known
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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
            from safetensors import safe_open

            try:
                with safe_open(str(path), framework="pt", device="cpu"):
                    pass
            except Exception:  # safetensors has its own error types for damaged headers and short files
                return f"{name}: unreadable (not a readable safetensors file: cut off or damaged; no manifest)"
        elif name == LEGACY_STATE_FILE:
            try:
                with zipfile.ZipFile(path):
                    pass
            except (zipfile.BadZipFile, OSError) as err:
                return f"{name}: unreadable ({err}: cut off or damaged; no manifest)"
    return ""


def verify_checkpoint(folder: str | Path, files: tuple[str, ...] | None = None) -> str:
    """'' when checkpoint `folder` is intact, else "FILE: what (details)" saying which file is wrong and how
    (missing, size mismatch, hash mismatch, unreadable). `files` limits the check (default: every file of the
    manifest, which must include the model and the state)."""
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError) as err:
        return f"{MANIFEST_FILE}: unreadable ({err})"
    if manifest is None:
        return _check_legacy(folder, files or (MODEL_FILE, state_file(folder).name))
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        return f"{MANIFEST_FILE}: unreadable (it lists no files)"
    state = LEGACY_STATE_FILE if LEGACY_STATE_FILE in listed and STATE_FILE not in listed else STATE_FILE
    for name in files or (MODEL_FILE, state, *sorted(set(listed) - {MODEL_FILE, state})):
        if not is_inside_name(name):
            return f"{MANIFEST_FILE}: unreadable (it names {name!r}, a path outside the checkpoint folder)"
        if name not in listed:
            return f"{name}: not in {MANIFEST_FILE}"
        try:
            problem = _check_file(folder / name, listed[name])
        except OSError as err:
            problem = f"{name}: unreadable ({err.strerror or err})"
        if problem:
            return problem
    return ""


def is_inside_name(name: object) -> bool:
    """Whether `name` (from a file we did not necessarily write: a manifest) is a relative path that stays inside
    the folder it is joined to: no absolute path, no '..', no backslash, no empty part."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return False
    parts = name.split("/")
    return not name.startswith("/") and all(part not in ("", ".", "..") for part in parts)


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


def ema_file_beside(model_file: Path) -> Path | None:
    """The EMA weights of the checkpoint whose model file is `model_file` (ema.safetensors beside a
    model.safetensors), checked against its manifest; None when there are none (EMA was off, or a bare model file)."""
    ema = model_file.parent / EMA_FILE
    if model_file.name != MODEL_FILE or not ema.is_file():
        return None
    _check_named(model_file.parent, EMA_FILE, ema)
    return ema


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


def resolve_checkpoint(path: str | Path, cfg: Config | None = None) -> Path:
    """A model file, a checkpoint folder (model.safetensors inside) or a run folder (its newest checkpoint). A
    damaged or foreign file, or (given `cfg`) one of another backbone than cfg.model.preset, fails here, before the
    model is built."""
    from tttvideo.models.backbone import get_preset
    from tttvideo.models.weights import check_same_model, model_file_metadata

    found = find_model_file(path)
    if found is not None:
        meta = model_file_metadata(found)
        if cfg is not None:
            check_same_model(found, meta, get_preset(cfg.model.preset),
                             f"; the config builds model.preset = {cfg.model.preset!r}: give the config the "
                             f"checkpoint was trained with (CONFIG, or config.toml beside it) or set model.preset")
        return found
    if Path(path, "config.toml").is_file():  # a run folder tttv train made, before its first checkpoint
        raise UserError(f"run folder {path} holds no checkpoint yet (train.checkpoint_every decides when the first is "
                        f"written); wait for one, or give another checkpoint")
    raise UserError(f"checkpoint {path} is neither a model file, a checkpoint folder ({MODEL_FILE} inside) nor a "
                    f"training run folder with checkpoints/; point --checkpoint at what tttv train wrote")


def is_full_checkpoint(path: Path) -> bool:
    """Whether a model file holds every weight (else only the trained ones, on top of the pretrained model)."""
    from tttvideo.models.weights import model_file_metadata

    return model_file_metadata(path).get("partial") != "True"


def load_trained(model: Any, model_file: Path, has_base: bool, _seen: tuple[Path, ...] = ()) -> None:
    """Load a checkpoint's model file into `model`. A partial file (a run with fp8 frozen weights, whose codes are
    not saved) holds only what the run trained; its frozen layers come first from where that run started: its
    config's `train.init_from` (and the EMA weights beside it, which the run started from when there were any),
    followed back while those are partial too, else the base weights `model` was built from (`has_base`: its
    model.pretrained_path was read). A run started from an earlier stage's checkpoint froze that stage's values,
    not the base's (the sft stage trains every layer), so the base serves a run that started from it, and, with a
    warning, one whose start cannot be found any more. Without either, one sentence: loading the file alone left
    the frozen layers as built (random), which sampled noise without a word."""
    from tttvideo.models import load_checkpoint

    model_file = Path(model_file)
    if not is_full_checkpoint(model_file):
        trained = saved_config(model_file)
        only = f"{model_file} holds the trained weights only (its frozen layers were stored in fp8, not saved)"
        start = str(trained.get("train", {}).get("init_from") or "")
        source, missing = (_run_start(start, model_file) if start else (None, None))
        if source is not None:
            if source.resolve() in _seen or source.resolve() == model_file.resolve():
                raise UserError(f"{model_file}: the train.init_from chain loops at {source}")
            load_trained(model, source, has_base, (*_seen, model_file.resolve()))
            ema = ema_file_beside(source)
            if ema is not None:
                load_checkpoint(model, ema)
        elif missing is not None and has_base:
            log.warning("%s: its frozen layers come from the base weights (model.pretrained_path): its run started "
                        "from train.init_from = %r, which %s; if that stage trained them, restore it", only,
                        start, missing)
        elif missing is not None:
            raise UserError(f"{only}; they come from where its run started (train.init_from = {start!r}), and "
                            f"{missing}")
        elif not has_base:
            base = str(trained.get("model", {}).get("pretrained_path") or "")
            raise UserError(f"{only}, and " + (
                f"its run loaded them from model.pretrained_path = {base!r}: set model.pretrained_path to it" if base
                else "its config names no train.init_from or model.pretrained_path they came from: set "
                     "model.pretrained_path to the base weights it was trained from"))
    load_checkpoint(model, model_file)


def _run_start(start: str, model_file: Path) -> tuple[Path | None, str | None]:
    """The model file of `train.init_from = start` of the run that wrote `model_file`, and None; or None and why
    it cannot be found. A relative path is the run's own (from where it was launched): tried from here, then from
    each folder above `model_file` (a project's runs/... read from elsewhere)."""
    tries = [Path(start)]
    if not Path(start).is_absolute():
        tries += [folder / start for folder in model_file.resolve().parents]
    first_error = ""
    for candidate in tries:
        try:
            return resolve_checkpoint(candidate), None
        except UserError as err:
            first_error = first_error or str(err)
    return None, first_error


def saved_config(path: str | Path) -> dict[str, Any]:
    """The TOML tables of the config a model file, checkpoint folder or run was trained with
    (`config_for_checkpoint`); {} without a readable one."""
    from tttvideo.config.loader import tomllib

    config = config_for_checkpoint(path)
    try:
        return tomllib.loads(config.read_text(encoding="utf-8")) if config is not None else {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}


def config_for_checkpoint(path: str | Path) -> Path | None:
    """The config a model was trained with: for a run folder, its newest intact checkpoint's config.toml (a damaged
    newer checkpoint is a warning naming it); for a checkpoint folder or model file, the config.toml beside it;
    None when there is none."""
    path = Path(path)
    if path.is_dir() and not (path / MODEL_FILE).is_file():
        intact = newest_intact_checkpoint(path, advice="point --checkpoint at another run or checkpoint")
        if intact is not None and (intact / CONFIG_FILE).is_file():
            return intact / CONFIG_FILE
    beside = path.parent / CONFIG_FILE if path.is_file() else path / CONFIG_FILE
    return beside if beside.is_file() else None
