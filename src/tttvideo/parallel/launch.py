"""What a process of a torchrun launch knows about itself before any process group exists: its rank, its device,
and the error type that every rank raises with the same sentence. `tttv train` and `tttv sample` both use them."""

from __future__ import annotations

import os
import sys
import time

import torch

from tttvideo.errors import UserError


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
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device
