"""Deterministic, resumable data order: everything a batch holds is a function of (seed, data position).

The trainer counts samples consumed across the whole run (the data position, saved in every checkpoint). Position
p belongs to epoch p // N and is sample perm_epoch[p % N] of the cache, where perm_epoch is a permutation seeded by
(seed, epoch); the latent drawn from that sample's posterior is seeded by (seed, p). So a run resumed at position p
sees exactly the batches an uninterrupted run would, whatever the number of loader workers, and without saving any
iterator state.

With data parallelism, optimizer step s consumes positions [s * G, (s + 1) * G) for the global batch G; micro-step
m of rank r takes the `batch_size` positions starting at s * G + (m * world + r) * batch_size.

A sample whose file turns out damaged when it is read (`tttvideo.data.cache.DamagedSample`: unreadable, another
shape, NaN / Inf) is replaced by the next sample of the same epoch's order that reads intact, drawn with the
position's own seed, so the batch keeps its size and the order stays a function of (seed, position) and of which
files are damaged. The item's "damaged" field names what was passed over (a JSON list of [path, why], empty when
nothing was); `DamagedFiles` reads it for the trainer: one warning per file, and a count against
data.max_damaged_samples.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from tttvideo.data.cache import DamagedSample, LatentCache, position_seed, rebuild_advice
from tttvideo.errors import UserError

log = logging.getLogger(__name__)

# Tag mixed into the permutation seed so that order and latent draws never share a stream.
_ORDER_TAG = 0x0D7A


class PositionDataset(Dataset):
    """Maps a global data position to a sample of `source` (a LatentCache)."""

    def __init__(self, source: LatentCache, seed: int):
        self.source = source
        self.seed = seed
        self._perm: tuple[int, np.ndarray] | None = None

    def index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.source))
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, _ORDER_TAG, epoch])))
            self._perm = (epoch, rng.permutation(len(self.source)))
        return int(self._perm[1][offset])

    def __len__(self) -> int:  # positions are unbounded; DataLoader only needs this for len(), never calls it
        return len(self.source)

    def __getitem__(self, position: int) -> dict[str, Any]:
        seed = position_seed(self.seed, position)
        epoch, offset = divmod(position, len(self.source))
        damaged: list[tuple[str, str]] = []
        for step in range(len(self.source)):  # the position's own sample, else the next ones of this epoch's order
            index = self.index(epoch * len(self.source) + (offset + step) % len(self.source))
            try:
                item = self.source.sample(index, seed)
            except DamagedSample as err:
                damaged.append((str(err.path), err.why))
                continue
            item["index"] = index
            item["position"] = position
            item["damaged"] = json.dumps(damaged) if damaged else ""
            return item
        first, why = damaged[0]
        raise UserError(f"every sample of {self.source.manifest} is damaged ({first}: {why}; ...); "
                        f"{rebuild_advice(self.source.root, 'them')}")


class MicroBatchSampler(Sampler[list[int]]):
    """Lists of positions, one per micro-batch, from optimizer step `start_step` on, forever."""

    def __init__(self, start_step: int, batch_size: int, grad_accum: int, rank: int = 0, world_size: int = 1):
        self.start_step = start_step
        self.batch_size, self.grad_accum = batch_size, grad_accum
        self.rank, self.world_size = rank, world_size

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.grad_accum * self.world_size

    def positions(self, step: int, micro: int) -> list[int]:
        first = step * self.global_batch + (micro * self.world_size + self.rank) * self.batch_size
        return list(range(first, first + self.batch_size))

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            for micro in range(self.grad_accum):
                yield self.positions(step, micro)
            step += 1


def make_loader(source: LatentCache, seed: int, start_step: int, batch_size: int, grad_accum: int,
                rank: int = 0, world_size: int = 1, num_workers: int = 0, pin_memory: bool = False) -> DataLoader:
    """Batches {"latents" [B, T, C, h, w], "text" [B, segments, L, D], "index" [B], "position" [B]} in micro-step
    order from optimizer step `start_step`. Workers prefetch ahead of the GPU; the order does not depend on them."""
    sampler = MicroBatchSampler(start_step, batch_size, grad_accum, rank, world_size)
    kwargs: dict[str, Any] = {}
    if num_workers > 0:
        kwargs.update(prefetch_factor=2, persistent_workers=False)
    # an own generator: creating the iterator would otherwise draw from torch's global RNG, which a resumed run
    # restores to the interrupted run's state
    return DataLoader(PositionDataset(source, seed), batch_sampler=sampler, num_workers=num_workers,
                      pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed), **kwargs)


class DamagedFiles:
    """The cache files the loader passed over as damaged in this process, each warned about once; `limit`:
    data.max_damaged_samples, past which the trainer saves and stops. `read` collects the dataset indices of the
    batches seen (the trainer names a step's samples when its loss is not finite)."""

    def __init__(self, source: LatentCache, limit: int):
        self.source, self.limit = source, limit
        self.found: dict[str, str] = {}  # path -> why
        self.read: list[int] = []

    def watch(self, batches: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for batch in batches:
            self.read.extend(int(i) for i in batch["index"])
            for listed in batch.get("damaged", ()):
                for path, why in json.loads(listed) if listed else ():
                    if path not in self.found:
                        self.found[path] = why
                        log.warning("cache file %s is damaged (%s); another sample takes its place whenever it "
                                    "comes up (%d damaged file(s) so far; past data.max_damaged_samples = %d the run "
                                    "saves and stops); %s", path, why, len(self.found), self.limit, self.source.advice)
            yield batch

    @property
    def too_many(self) -> bool:
        return len(self.found) > self.limit

    def stop_message(self, checkpoint: Any, step: int, total: int) -> str:
        names = list(self.found)
        listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return (f"{len(names)} cache file(s) are damaged, more than data.max_damaged_samples = {self.limit} ({listed}; "
                f"each named in a warning above); checkpoint saved in {checkpoint} at step {step} of {total}; "
                f"{rebuild_advice(self.source.root, 'them')}, then resume with the same command and --resume")

    def samples_read(self) -> str:
        """The samples read since `read` was last cleared, for a message ('' when none)."""
        entries = self.source.entries
        seen = list(dict.fromkeys(self.read))
        named = [f"{entries[i].id} ({self.source.path(entries[i].latent)})" for i in seen[:4]]
        more = f" and {len(seen) - 4} more" if len(seen) > 4 else ""
        return f"{', '.join(named)}{more}"


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    # non_blocking pairs with pin_memory so the copy overlaps the previous step's compute
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
