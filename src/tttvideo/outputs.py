"""Output files: where they may go, how they are written, who may write them.

- Checked before any work: a folder that cannot be created or written, or a file path whose folder cannot be, is
  one sentence naming the flag or config key, before a model is built or a step is run (a 63-s sampling job that
  only finds out at the end loses an hour). The check writes and removes a probe file, because permission bits
  alone do not tell (root ignores them, a read-only mount or /proc refuses everyone).
- Written atomically (`atomic_target`): to a hidden temporary name in the same folder, renamed over the final name
  only once complete, so a killed or failed write never leaves a truncated file under the final name.
- Locked while a command writes them (`output_lock`, the run folder's `RunLock`): a second command writing the same
  outputs refuses, naming the holder, instead of both reporting success with one result silently gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

from tttvideo.errors import UserError


def check_writable_dir(path: str | Path, what: str) -> Path:
    """Create folder `path` if needed and prove it writable; `what` names it for the user (e.g. "train.output_dir"
    or "--out"). Returns the path."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"{what} {path} is a file, not a folder; give a folder path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"{what} {path} cannot be created ({err.strerror or err}); choose a folder you can write "
                        f"to") from None
    probe = path / f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(probe, "wb") as f:
            f.write(b"probe")
    except OSError as err:
        raise UserError(f"{what} {path} is not writable ({err.strerror or err}); choose a folder you can write "
                        f"to") from None
    finally:
        probe.unlink(missing_ok=True)
    return path


def check_writable_file(path: str | Path, what: str) -> Path:
    """A file the command will write at `path`: its folder must be creatable and writable, and `path` must not be
    a folder. Returns the path."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder; give a file path")
    check_writable_dir(path.parent if str(path.parent) else Path("."), f"the folder of {what}")
    return path


# ------------------------------------------------------------------------------------------------ atomic writing
def temporary_name(path: Path, pid: int | None = None) -> Path:
    """The hidden temporary of `path` in its folder; it keeps the suffix (ffmpeg picks the container by it)."""
    return path.with_name(f".{path.name}.{os.getpid() if pid is None else pid}.tmp{path.suffix}")


def remove_stale_temporaries(path: Path) -> None:
    """Temporaries of `path` left by processes that were killed mid-write (their pid is gone)."""
    for tmp in path.parent.glob(f".{path.name}.*.tmp{path.suffix}"):
        pid = tmp.name[len(path.name) + 2:].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except OSError:  # exists under another user, or cannot tell: leave it
            pass


@contextlib.contextmanager
def atomic_target(path: str | Path) -> Iterator[Path]:
    """`with atomic_target(path) as tmp:` write the file at `tmp`; on a clean exit it replaces `path` in one rename,
    on an exception it is removed and `path` is left as it was."""
    path = Path(path)
    remove_stale_temporaries(path)
    tmp = temporary_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def free_bytes(folder: str | Path) -> int | None:
    """Free bytes on the disk of `folder` (or of its nearest existing parent); None when it cannot be read."""
    path = Path(folder).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def write_failure(path: Path, err: BaseException) -> str:
    """Why writing `path` failed, for a sentence: the OS's reason and, when the disk is (nearly) full, how full."""
    # ffmpeg's writer raises an OSError whose text is the OS error, then ffmpeg's command line: the first line
    reason = getattr(err, "strerror", None) or (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    free = free_bytes(path.parent)  # of the nearest folder that exists: the write may have failed to make it
    return reason if free is None else f"{reason}; {free / 2**20:.1f} MiB free on its disk"


# ------------------------------------------------------------------------------------------------ locking
def output_lock(paths: list[Path], out: str | Path, what: str = "--out"):
    """The lock of a command's outputs, not yet taken (use it in a `with`): the folder's own lock when `out` is a
    folder (several stories), or one lock per file beside it (`.<name>.lock`), so that commands writing other
    files of the same folder run side by side."""
    from tttvideo.locks import RunLock

    advice = "wait for it to finish, or give another --out"
    out = Path(out)
    if len(paths) == 1 and paths[0] == out:
        return RunLock(out.parent, what=what, advice=advice, lock_name=f".{out.name}.lock")
    return RunLock(out, what=what, advice=advice)


def check_mp4_writer(what: str = "writing the mp4") -> None:
    """The mp4 writer's package is installed, checked before the work whose result it writes."""
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        raise UserError(f"{what} needs the imageio-ffmpeg package: pip install imageio-ffmpeg (it comes with "
                        f"pip install 'tttvideo[models]')") from None
