"""The run folder and the demo set's folder: who may use them, what an earlier run in them is, and what happens
to it (`train.if_exists`: refuse, resume, new, overwrite).

Nothing in a run folder is written or deleted before the run holds its lock (`tttvideo.locks.RunLock`); the demo set is
shared by the runs that train on it and rewritten only under its exclusive lock (`tttvideo.locks.DataLock`).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from tttvideo import runs
from tttvideo.config.schema import Config
from tttvideo.data.cache import LatentCache
from tttvideo.errors import UserError
from tttvideo.outputs import check_writable_dir
from tttvideo.locks import DataLock, RunLock, current_holder

if TYPE_CHECKING:
    from rich.console import Console

    from tttvideo.layout import VideoLayout
    from tttvideo.models.backbone import BackboneConfig

IF_EXISTS = ("refuse", "resume", "new", "overwrite")

# what a run writes in its folder besides config.toml: what "a run exists" means, and what --overwrite deletes
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tensorboard", "samples")
IN_USE_ADVICE = "wait for it to finish or stop it, or pass --new to start a new run beside it"


def open_dataset(cfg: Config, layout: VideoLayout, spec: BackboneConfig, output_dir: Path, console: Console,
                 stack: contextlib.ExitStack | None = None) -> LatentCache:
    """The data set: `data.manifest`, or the demo set, built (or reused) in data.demo_dir. A demo folder is shared
    by the runs that train on it: it is (re)written only under its exclusive lock and read under a shared one,
    held until `stack` closes (the end of the run)."""
    manifest = cfg.data.manifest
    if not manifest:
        from tttvideo.data.demo import build_demo_cache

        demo_dir = demo_folder(cfg, output_dir)
        lock = DataLock(demo_dir)
        if stack is not None:
            stack.callback(lock.release)
        settings = demo_settings(cfg, layout, spec)
        try:
            if lock.try_exclusive():
                manifest = build_demo_cache(demo_dir, **settings, console=console)
                lock.shared()
            else:  # another run is writing it, or training on it: use it as it is, never rewrite it under them
                lock.shared()
                manifest = build_demo_cache(demo_dir, **settings, console=console, may_write=False)
                if manifest is None:
                    raise UserError(
                        f"data.demo_dir {demo_dir} holds a demo set of other settings (layout, data.demo_videos, "
                        f"data.demo_kind, train.seed or text encoder) that another run is training on; set "
                        f"data.demo_dir to another folder or wait for that run to end")
        except OSError as err:
            raise UserError(f"data.demo_dir {demo_dir}: cannot write the demo set ({err.strerror or err}); choose "
                            f"a folder you can write to") from None
        finally:
            if stack is None:
                lock.release()
    return LatentCache(manifest, layout, spec.in_channels, spec.text_embed_dim)


def demo_settings(cfg: Config, layout: VideoLayout, spec: BackboneConfig) -> dict:
    """The settings that make a run's demo set (`build_demo_cache`'s keywords; `DemoSpec.of` fingerprints them):
    the training layout, the model's channels and text width, data.demo_videos, train.seed, the text encoder
    setting and data.demo_kind. Two runs with equal settings can train on one folder."""
    return dict(layout=layout, channels=spec.in_channels, text_dim=spec.text_embed_dim, videos=cfg.data.demo_videos,
                seed=cfg.train.seed, text_encoder=cfg.data.demo_text_encoder, kind=cfg.data.demo_kind)


def demo_folder(cfg: Config, output_dir: Path) -> Path:
    return Path(cfg.data.demo_dir) if cfg.data.demo_dir else Path(output_dir) / "data"


def run_outputs(folder: Path) -> list[str]:
    """What an earlier run left in `folder`: the names of RUN_OUTPUTS that exist and are not empty."""
    found = []
    for name in RUN_OUTPUTS:
        path = folder / name
        if name == "checkpoints":
            present = bool(runs.step_folders(folder))
        elif path.is_dir():
            present = any(path.iterdir())
        else:
            present = path.is_file() and path.stat().st_size > 0
        if present:
            found.append(name)
    return found


def check_creatable(path: Path, what: str) -> None:
    """A folder that is written later (the demo set): it exists and is writable, or it can be created. Nothing is
    created here."""
    if path.is_dir():
        check_writable_dir(path, what)
        return
    if path.exists():
        raise UserError(f"{what} {path} is a file, not a folder; give a folder path")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{what} {path} cannot be created: {parent} is a file; choose a folder you can write to")
    try:
        check_writable_dir(parent, what)
    except UserError:
        raise UserError(f"{what} {path} cannot be created: {parent} is not writable; choose a folder you can "
                        f"write to") from None


def check_before_work(cfg: Config, output_dir: Path, if_exists: str) -> None:
    """What can be refused without the lock, before any work (the model, the demo set): unwritable folders, a run
    folder in use by another run, an earlier run that `refuse` keeps. `claim` decides again under the lock."""
    check_writable_dir(output_dir, "train.output_dir")
    if not cfg.data.manifest:
        check_creatable(demo_folder(cfg, output_dir), "data.demo_dir")
    if if_exists != "new":
        if current_holder(output_dir) is not None:
            raise RunLock(output_dir, advice=IN_USE_ADVICE).refusal()
        if if_exists == "refuse":
            refuse_earlier_run(output_dir)


def refuse_earlier_run(folder: Path) -> None:
    found = run_outputs(folder)
    if not found:
        return
    choices = "--new to start a new one beside it, or --overwrite to delete it and start over (train.if_exists)"
    steps = runs.step_folders(folder)
    if steps:
        raise UserError(f"{folder} already holds checkpoints (newest {steps[-1][1].name}); pass --resume to "
                        f"continue that run, {choices}")
    raise UserError(f"{folder} already holds a run that saved no checkpoint ({', '.join(found)}); pass --resume "
                    f"to start it again at step 0 with fresh logs, {choices}")


def claim(output_dir: Path, if_exists: str, stack: contextlib.ExitStack, console: Console) -> tuple[Path, Path | None]:
    """Lock the run folder (released when `stack` closes), then act on an earlier run in it as `if_exists` says.
    Returns (the folder the run writes to, the checkpoint to resume from or None)."""
    if if_exists == "new":
        return claim_new_folder(output_dir, stack, console), None
    stack.enter_context(RunLock(output_dir, advice=IN_USE_ADVICE))
    if if_exists == "refuse":
        refuse_earlier_run(output_dir)
    elif if_exists == "overwrite":
        found = run_outputs(output_dir)
        if found:
            for name in RUN_OUTPUTS:
                path = output_dir / name
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            console.print(f"train.if_exists = 'overwrite': removed the earlier run's {', '.join(found)} in "
                          f"{output_dir}")
    elif if_exists == "resume":
        resume_from = runs.newest_intact_checkpoint(
            output_dir, advice="start over with --overwrite or beside it with --new", warn_once=False)
        if resume_from is None and run_outputs(output_dir):
            console.print(f"--resume: no checkpoint in {runs.checkpoint_root(output_dir)}; starting at step 0")
        elif resume_from is None:
            # resuming into an empty folder is how a preemptible job's first launch looks, so no error; but a
            # mistyped output_dir looks the same, so say which folder it is
            console.print(f"--resume: {output_dir} holds no earlier run (no checkpoint, no logs); starting a new "
                          f"run at step 0 (if you meant to continue a run, check train.output_dir)",
                          style="yellow")
        return output_dir, resume_from
    return output_dir, None


def claim_new_folder(base: Path, stack: contextlib.ExitStack, console: Console) -> Path:
    """train.if_exists = 'new': `base` if it holds no run and nobody uses it, else the first such of base-2, -3,
    ...; the earlier runs are kept. The folder is locked until `stack` closes."""
    for n in range(1, 10_000):
        folder = base if n == 1 else base.with_name(f"{base.name}-{n}")
        if folder.exists() and (not folder.is_dir() or run_outputs(folder)):
            continue
        check_writable_dir(folder, "train.output_dir")
        lock = RunLock(folder, advice=IN_USE_ADVICE)
        if not lock.try_acquire(tries=1):
            continue
        if run_outputs(folder):  # another process started there between the look and the lock
            lock.release()
            continue
        stack.callback(lock.release)
        if folder != base:
            console.print(f"train.if_exists = 'new': {base} holds an earlier run (kept); this run writes to {folder}")
        return folder
    raise UserError(f"train.output_dir {base}: no free folder among {base.name}-2 ... -9999; clean up or choose "
                    f"another train.output_dir")
