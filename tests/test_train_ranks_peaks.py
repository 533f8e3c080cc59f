"""The memory peaks a torchrun step logs are the largest of any rank's (`TrainRanks.largest_floats`), not rank 0's:
two gloo processes on CPU, each with its own values."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tttvideo.train.distributed import TrainRanks


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        ranks = TrainRanks(SimpleNamespace(distributed=True), rank, 2, torch.device("cpu"))  # type: ignore[arg-type]
        # rank 1 holds the larger first value, rank 0 the larger second one
        got = ranks.largest_floats([1.5 + rank, 70.25 - rank, 3.0])
        Path(f"{out}.{rank}").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def test_each_peak_is_the_largest_of_any_rank(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path / "got")), nprocs=2, join=True)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"got.{rank}").read_text()) == [2.5, 70.25, 3.0]


def test_one_process_keeps_its_values():
    ranks = TrainRanks(SimpleNamespace(distributed=False), 0, 1, torch.device("cpu"))  # type: ignore[arg-type]
    assert ranks.largest_floats([4.0, 1.0]) == [4.0, 1.0]
