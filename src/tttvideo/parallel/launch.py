"""What a process of a torchrun launch knows about itself before any process group exists: its rank, its device,
and the error type that every rank raises with the same sentence. `tttv train` and `tttv sample` both use them."""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

from tttvideo.errors import UserError

if TYPE_CHECKING:  # the rest of this module needs no torch: a command reads its rank before torch loads
    import torch


class SharedError(UserError):
    """A UserError that every rank raises with the same sentence (a config check, or a decision rank 0 took and
    broadcast): the CLI prints it on rank 0 only."""


# how long a rank other than 0 waits before exiting on a SharedError: torchrun stops every rank as soon as one exits
# with an error, and rank 0, the one that says the sentence, may be a few seconds behind (still importing, say)
SHARED_ERROR_GRACE_S = 5.0


def let_rank_zero_speak() -> None:
    """Called by a rank other than 0 that stops on a SharedError, before it exits: rank 0 raises the same sentence
    at the same point and prints it, unless torchrun has already stopped it because this rank exited first."""
    if launch_world_size() > 1 and launch_rank() != 0:
        time.sleep(SHARED_ERROR_GRACE_S)


def exit_on_rank(err: UserError, command: str) -> int:
    """The end of a `tttv COMMAND` that stopped on `err`: rank 0 (or a run without torchrun) raises it for the CLI
    to print; another rank prints it only if it is its own (a SharedError is rank 0's to say) and exits 2."""
    from tttvideo.parallel.watchdog import finish

    finish()  # the peers stop on the same error: none of them should wait for this rank's heartbeat
    rank = launch_rank()
    if rank == 0:
        raise err
    if isinstance(err, SharedError):
        let_rank_zero_speak()
    else:
        print(f"tttv {command}: error on rank {rank}: {err}", file=sys.stderr, flush=True)
    return 2


def launch_rank() -> int:
    """This process's rank in a torchrun launch (0 without one)."""
    return int(os.environ.get("RANK", "0"))


def launch_world_size() -> int:
    """The number of processes of a torchrun launch (1 without one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size() -> int:
    """The number of processes of a torchrun launch on this machine (1 without one)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def check_launch(command: str, activity: str) -> int:
    """The world size, after checking that a WORLD_SIZE above 1 comes with torchrun's other variables (a WORLD_SIZE
    exported by hand lacks them); `command` ("train") and `activity` ("training") word the message."""
    world = launch_world_size()
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if world > 1 and missing:
        raise SharedError(f"WORLD_SIZE is {world} but {', '.join(missing)} are not set: start multi-process {activity} "
                          f"with torchrun (torchrun --nproc_per_node {world} -m tttvideo {command} ...), or unset "
                          f"WORLD_SIZE to {command} in one process")
    return world


def rank_device(device: torch.device) -> torch.device:
    """The device of this rank: under torchrun each rank takes the GPU LOCAL_RANK ('cuda' means 'the GPUs of this
    host'); CPU stays CPU. Always indexed on CUDA, since torch.cuda.set_device refuses a bare 'cuda'."""
    if device.type == "cuda" and (launch_world_size() > 1 or device.index is None):
        import torch

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def launched_by_torchrun() -> bool:
    """Whether torchrun's agent started this process (it sets TORCHELASTIC_RUN_ID for its workers)."""
    return launch_world_size() > 1 and "TORCHELASTIC_RUN_ID" in os.environ


def follow_launcher() -> None:
    """Ask the kernel to send this rank SIGTERM when torchrun's agent (its parent) dies, so that a SIGKILLed
    launcher leaves no rank training on as an orphan that holds the run folder's lock: SIGTERM stops training
    after the step with a checkpoint. Linux only (prctl); elsewhere `tttvideo.parallel.watchdog` notices the new
    parent within a second or two."""
    global _launcher_argv
    if not launched_by_torchrun():
        return
    _launcher_argv = _parent_argv()  # while the launcher lives: the resume command is printed after it may not
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


_launcher_argv: list[str] | None = None


def _parent_argv() -> list[str] | None:
    try:
        raw = open(f"/proc/{os.getppid()}/cmdline", "rb").read()
    except OSError:
        return None
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0")[:-1]] or None


def launcher_prefix(own_args: list[str], parent_argv: list[str] | None = None,
                    env: dict[str, str] | None = None) -> list[str] | None:
    """The command line that starts this launch again, up to and including the program (`... -m tttvideo` or
    `... tttv`), so that `[*prefix, 'train', CONFIG, ..., '--resume']` resumes it; None without torchrun.

    `own_args` is this process's sys.argv[1:] ('train', CONFIG, ...). The launcher's own command line (its
    /proc cmdline: torchrun's agent is each rank's parent) ends with them, so what comes before is exactly what the
    user typed, options included. When it cannot be read (not Linux, a wrapper in between) the prefix is rebuilt
    from what torchrun tells its workers: LOCAL_WORLD_SIZE processes per node, WORLD_SIZE / LOCAL_WORLD_SIZE
    nodes."""
    env = os.environ if env is None else env
    if int(env.get("WORLD_SIZE", "1")) <= 1 or "TORCHELASTIC_RUN_ID" not in env:
        return None
    parent = (_launcher_argv or _parent_argv()) if parent_argv is None else parent_argv
    if parent and own_args and len(parent) > len(own_args) and parent[-len(own_args):] == own_args:
        prefix = parent[:len(parent) - len(own_args)]
        # `torchrun` is a console script: its cmdline is the interpreter, then the script's path
        if len(prefix) > 1 and os.path.basename(prefix[1]) == "torchrun":
            prefix = ["torchrun", *prefix[2:]]
        return prefix
    nodes = nodes_of_launch(env)
    # one node: --standalone picks a free port itself; several: the caller adds the first launch's rendezvous
    # options, which no worker knows
    place = ["--nnodes", str(nodes)] if nodes > 1 else ["--standalone"]
    return ["torchrun", *place, "--nproc-per-node", env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]), "-m", "tttvideo"]


def nodes_of_launch(env: dict[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    per_node = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    return max(1, int(env.get("WORLD_SIZE", "1")) // max(1, per_node))
