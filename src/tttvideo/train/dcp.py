"""Checkpoints of a multi-process run, through torch.distributed.checkpoint (DCP).

The folder is the one-process checkpoint's (`tttvideo.train.checkpoint`): assembled in a temporary folder beside
the final one, its manifest written last, renamed into place by rank 0, pruned to the newest `keep`. It holds:

- `dcp/`: the model and optimizer state as every rank's shards (`get_state_dict`, keyed by parameter name), which
  DCP can load into any other sharding: a run saved on N processes resumes on M, and on one process (DCP then
  reads every shard into the whole model, no process group needed);
- `model.safetensors`: the whole model, gathered to rank 0, so that `tttv sample`, `train.init_from` and every
  tool that reads a checkpoint's weights use it as they use a one-process one;
- `state.pt` (rank 0): step, data position, scheduler, scaler, RNG and noise-generator states, counters; every
  rank holds the same ones (they draw the same random numbers), so rank 0's are every rank's;
- `config.toml` and `manifest.json` (with every file under `dcp/`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from tttvideo.train.checkpoint import publish_checkpoint, staging_folder

if TYPE_CHECKING:
    from tttvideo.models.presets import ModelSpec
    from tttvideo.models.transformer import CogVideoXTTT
    from tttvideo.train.distributed import TrainRanks

DCP_DIR = "dcp"


def is_sharded_checkpoint(folder: Path) -> bool:
    """Whether checkpoint `folder` was written by a multi-process run (its model and optimizer are in `dcp/`)."""
    return (Path(folder) / DCP_DIR / ".metadata").is_file()


class _WholeWeights:
    """The gathered state dict in the shape `tttvideo.models.save_checkpoint` reads a model in (named parameters,
    spec, use_ttt, sequence_layer): the sharded model's own parameters are DTensors."""

    def __init__(self, model: CogVideoXTTT, tensors: dict[str, torch.Tensor]):
        self.spec: ModelSpec = model.spec
        self.use_ttt: bool = model.use_ttt
        self.sequence_layer: str = model.sequence_layer
        names = {n for n, _ in model.named_parameters()}
        self._tensors = {n: t for n, t in tensors.items() if n in names}

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._tensors.items())


def save_sharded_checkpoint(output_dir: str | Path, step: int, model: CogVideoXTTT,
                            optimizer: torch.optim.Optimizer, state: dict[str, Any], config_text: str, keep: int,
                            meta: dict[str, Any], trained_duration_s: int | None, ranks: TrainRanks) -> Path:
    """Write checkpoint `step` from every rank (a collective: all ranks call it) and return its folder."""
    with ranks.phase("checkpoint save", step - 1, slow=True):  # the watch counts steps from 0, as the loop
        tmp = ranks.on_main(lambda: staging_folder(output_dir, step))
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp / DCP_DIR)
        whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return ranks.on_main(lambda: publish_checkpoint(output_dir, step, _WholeWeights(model, whole), state,
                                                        config_text, keep, meta, trained_duration_s, tmp))


def load_sharded_checkpoint(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read `dcp/` of checkpoint `folder` into `model` and `optimizer`, sharded or not, whatever the number of
    processes that wrote it (a collective when distributed)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    loaded = {"model": model_sd, "optimizer": optim_sd}
    with warnings.catch_warnings():
        # on one process DCP reads every shard itself, and warns that it assumes this is meant: it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(loaded, checkpoint_id=Path(folder) / DCP_DIR, no_dist=not torch.distributed.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
