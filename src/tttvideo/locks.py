"""One `tttv train` per run folder: an exclusive lock on `<output_dir>/.lock` for the whole run.

The lock is an `fcntl.flock(LOCK_EX | LOCK_NB)` on the open lock file, so the kernel releases it when the process
ends, however it ends (SIGKILL, a crash, a lost node); the file also holds who took it (pid, host, start time,
command line) so that a second run can say whom it is waiting for:

    train.output_dir runs/demo is in use by another run: pid 4242 on gpu-07 since 2026-11-22 10:13:46 ...

A process that gets the lock but finds another process's record in the file took over a stale lock (that process
ended without releasing it); it says so and carries on. A clean release empties the record but leaves the file:
unlinking a lock file races with a process that has just opened it.

`DataLock` is the shared variant for a data folder several runs read (the demo set): readers hold LOCK_SH while
they train on it, and only a process that gets LOCK_EX may (re)write it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tttvideo.errors import UserError

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
# errors of file systems without working locks (some network and FUSE mounts): run unlocked, with a warning
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_BUSY = {errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES}


@dataclass
class Holder:
    """Who holds (or held) a lock, as written in its file."""

    pid: int
    host: str
    since: str  # ISO time with the UTC offset
    command: str = ""

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} since {self.since.replace('T', ' ')}"

    def alive(self) -> bool | None:
        """Whether the process still exists; None when it ran on another host (no way to tell from here)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, owned by someone else
            return True
        except OSError:
            return None
        return True


def _record() -> Holder:
    since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return Holder(os.getpid(), socket.gethostname(), since, " ".join(sys.argv)[:500])


def _parse(text: str) -> Holder | None:
    try:
        data = json.loads(text)
        return Holder(int(data["pid"]), str(data["host"]), str(data["since"]), str(data.get("command", "")))
    except (ValueError, KeyError, TypeError):
        return None


def read_holder(folder: str | Path, lock_name: str = LOCK_FILE) -> Holder | None:
    """The record in `folder`'s lock file; None when there is none (never locked, released, or unreadable)."""
    try:
        return _parse((Path(folder) / lock_name).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return None


def current_holder(folder: str | Path) -> Holder | None:
    """The process holding `folder`'s lock now (its record), or None when the lock is free. Read-only: the lock file
    is not created, and a lock this call could take is let go at once."""
    path = Path(folder) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in _BUSY:
                return read_holder(folder) or Holder(0, "?", "?")
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class RunLock:
    """`with RunLock(folder):` hold the run folder's lock, or raise a UserError naming its holder.

    `what` names the folder for the user ("train.output_dir"); `advice` ends the refusal (what to do instead)."""

    def __init__(self, folder: str | Path, what: str = "train.output_dir",
                 advice: str = "wait for it to finish or stop it, or pass --new to start a new run beside it",
                 lock_name: str = LOCK_FILE):
        self.folder = Path(folder)
        self.path = self.folder / lock_name
        self.what = what
        self.advice = advice
        self.fd: int | None = None
        self.took_over: Holder | None = None

    # ------------------------------------------------------------------ taking and giving back
    def try_acquire(self, tries: int = 5) -> bool:
        """Take the lock; False when another process holds it. A few short retries ride out a holder that is just
        letting go or a `current_holder` probe."""
        if self.fd is not None:
            return True
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise UserError(f"{self.what} {self.folder}: cannot create the lock file {self.path} "
                            f"({err.strerror or err}); choose a folder you can write to") from None
        for attempt in range(tries):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno in _NO_LOCKS:
                    log.warning("cannot lock %s (%s): the file system does not support locks; make sure no other "
                                "run uses %s", self.path, err.strerror or err, self.folder)
                    break
                if err.errno not in _BUSY:
                    os.close(fd)
                    raise
                if attempt == tries - 1:
                    os.close(fd)
                    return False
                time.sleep(0.05)
        self.fd = fd
        previous = _parse(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
        if previous is not None and (previous.pid != os.getpid() or previous.host != socket.gethostname()):
            self.took_over = previous
            state = {False: "that process is gone", True: "that process no longer holds it",
                     None: "it no longer holds it"}[previous.alive()]
            log.warning("%s %s: took over the stale lock of pid %d (%s, since %s); %s", self.what, self.folder,
                        previous.pid, previous.host, previous.since.replace("T", " "), state)
        data = json.dumps(vars(_record())).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data + b"\n", 0)
        return True

    def acquire(self) -> "RunLock":
        if not self.try_acquire():
            raise self.refusal()
        return self

    def refusal(self) -> UserError:
        holder = None
        for _ in range(10):  # a holder that has just taken the lock writes its record a moment later
            holder = read_holder(self.folder, self.path.name)
            if holder is not None:
                break
            time.sleep(0.05)
        who = f"another run: {holder.describe()}" if holder else "another process (its lock file names nobody)"
        return UserError(f"{self.what} {self.folder} is in use by {who} ({self.path}); {self.advice}")

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # a clean end leaves no record: the next run takes over nothing
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


class DataLock:
    """A data folder shared by runs (the demo set): `try_exclusive()` before (re)writing it, `shared()` while
    reading it (a downgrade after writing), `release()` at the end of the run. Without working locks (or a folder
    that cannot hold the lock file) every call succeeds: the folder is then as unprotected as before."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.fd: int | None = None
        self.usable = True

    def _open(self) -> int | None:
        if self.fd is None and self.usable:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                self.fd = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:
                self.usable = False
        return self.fd

    def _flock(self, flags: int) -> bool:
        fd = self._open()
        if fd is None:
            return True
        try:
            fcntl.flock(fd, flags)
            return True
        except OSError as err:
            if err.errno in _BUSY:
                return False
            if err.errno in _NO_LOCKS:
                self.usable = False
                return True
            raise

    def try_exclusive(self) -> bool:
        return self._flock(fcntl.LOCK_EX | fcntl.LOCK_NB)

    def shared(self) -> None:
        """Shared lock, waiting while another process holds it exclusively (it is writing the folder)."""
        if not self._flock(fcntl.LOCK_SH | fcntl.LOCK_NB):
            log.info("waiting for another run to finish writing %s", self.folder)
            self._flock(fcntl.LOCK_SH)

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
