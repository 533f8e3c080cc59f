"""Deterministic, resumable data order: everything a batch holds is a function of (seed, data position).

The trainer counts samples consumed across the whole run (the data position, saved in every checkpoint). Position
p belongs to epoch p // N and is sample perm_epoch[p % N] of the cache, where perm_epoch is a permutation seeded by
(seed, epoch); the latent drawn from that sample's posterior is seeded by (seed, p). So a run resumed at position p
sees exactly the batches an uninterrupted run would, whatever the number of loader workers, and without saving any
iterator state.

With data parallelism, optimizer step s consumes positions [s * G, (s + 1) * G) for the global batch G; micro-step
m of rank r takes the `batch_size` positions starting at s * G + (m * world + r) * batch_size.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from tttvideo.data.cache import LatentCache, position_seed

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
        index = self.index(position)
        item = self.source.sample(index, position_seed(self.seed, position))
        item["index"] = index
        item["position"] = position
        return item


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


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    # non_blocking pairs with pin_memory so the copy overlaps the previous step's compute
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
