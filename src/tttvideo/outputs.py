"""Output locations are checked before any work: a folder that cannot be created or written, or a file path whose
folder cannot be, is one sentence naming the flag or config key, before a model is built or a step is run (a 63-s
sampling job that only finds out at the end loses an hour).

The check writes and removes a probe file, because permission bits alone do not tell (root ignores them, a
read-only mount or /proc refuses everyone).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

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
