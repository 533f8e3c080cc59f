"""The process group of a torchrun launch: started with a bounded timeout, its ranks' configs compared, its
liveness watched (`tttvideo.parallel.watchdog`). `tttv train` and `tttv sample` start it the same way, after the
checks that need no other rank and before the mesh."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from tttvideo.config.loader import config_to_dict, flat_keys
from tttvideo.parallel.launch import SharedError, follow_launcher
from tttvideo.parallel.watchdog import PeerWatch, backstop_timeout

# how many differing keys the mismatch sentence names
NAMED_DIFFERENCES = 3
# set by `start_group`: this process is a rank of a launch (`tttvideo.cli` ends it without the interpreter's teardown)
_started = False


def started_group() -> bool:
    """Whether `start_group` ran in this process (the group may since have been destroyed)."""
    return _started


def flat_config(cfg: Any) -> dict[str, str]:
    """{'train.lr': '0.001', ...}: every resolved key as JSON text, nested sections dotted."""
    return flat_keys(config_to_dict(cfg))


def config_hash(flat: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def config_differences(per_rank: list[dict[str, str]]) -> str:
    """The sentence naming how the ranks' configs differ ('' when they do not): the first keys that differ, each
    with its values and the ranks that hold them."""
    keys = sorted({k for flat in per_rank for k in flat})
    differing = [k for k in keys if len({flat.get(k, "(not set)") for flat in per_rank}) > 1]
    if not differing:
        return ""
    parts = []
    for key in differing[:NAMED_DIFFERENCES]:
        holders: dict[str, list[int]] = {}
        for rank, flat in enumerate(per_rank):
            holders.setdefault(flat.get(key, "(not set)"), []).append(rank)
        parts.append(f"{key} is " + " but ".join(f"{value} on {_ranks_text(ranks)}"
                                                 for value, ranks in holders.items()))
    more = len(differing) - NAMED_DIFFERENCES
    listed = "; ".join(parts) + (f" (and {more} more key(s))" if more > 0 else "")
    return (f"the ranks were started with different configs: {listed}; start every rank with the same config file "
            f"and --set flags")


def check_same_config(cfg: Any) -> None:
    """All-gather a hash of the resolved config; on a mismatch, all-gather the configs and raise the sentence that
    names the differences on every rank (a SharedError: rank 0 prints it, every rank exits 2)."""
    flat = flat_config(cfg)
    hashes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, config_hash(flat))
    if len(set(hashes)) == 1:
        return
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, flat)
    raise SharedError(config_differences(per_rank))


def _watch_store() -> dist.Store | None:
    """A connection of its own to the launch's key-value store (torchrun's agent hosts it), for the watch's thread."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    import datetime

    try:
        return dist.TCPStore(addr, int(port), is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10))
    except Exception:  # no store to watch through: the process group's own timeout still bounds the waits
        return None


def bound_mesh_timeouts(par: Any, *meshes: Any) -> None:
    """Give every process group of `meshes` the backstop timeout of the default group: torch creates them with its
    own defaults (30 min for gloo, 10 min for NCCL, whose watchdog would end a slow first step before the watch's
    sentence)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    timeout = backstop_timeout(par.timeout_s, par.slow_timeout_s)
    for mesh in meshes:
        for group in mesh.get_all_groups():
            _set_pg_timeout(timeout, group)


def start_group(cfg: Any, command: str, device_type: str) -> PeerWatch:
    """Initialise the default process group (if nobody has), with a timeout above the watch's budgets; start the
    watch; compare the ranks' configs. Raises a SharedError on a config mismatch."""
    global _started
    follow_launcher()
    par = cfg.parallel
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(timeout=backstop_timeout(par.timeout_s, par.slow_timeout_s))
    _started = True
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    watch = PeerWatch(dist.get_rank(), dist.get_world_size(), par.timeout_s, par.slow_timeout_s, command,
                      _watch_store(), prefix=f"tttv/{run}/{attempt}/").start()
    with watch.phase("comparing the ranks' configs", slow=True):
        check_same_config(cfg)
    return watch
