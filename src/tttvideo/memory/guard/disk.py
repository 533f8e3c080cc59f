"""The disk a training run's checkpoints take, counted from the model's tensors as the GPU memory is
(`tttvideo.memory.plan.count`); the trainer checks its output folder with it and `tttv plan` prints it
(`tttvideo.memory.plan.disk`).

A checkpoint (`tttvideo.train.checkpoint`) holds:

- the model file: every parameter in its storage dtype. Frozen layers stored in fp8 are buffers, not parameters,
  so a run with `model.frozen_weights = "fp8"` writes a partial file: whoever reads it takes the frozen layers from
  where the run started (`train.init_from`, followed back), so that checkpoint must stay on the disk too;
- the state file: the optimizer's state (`optimizer_state_bytes`: AdamW's two moments in the parameters' dtype,
  8-bit AdamW's codes and scales), step counters and random states (a few KiB, not counted);
- with `train.ema_decay` > 0, the average of the trainable parameters in fp32;
- under torchrun (several processes), DCP's shards of the optimizer state (the same tensors over all ranks, in
  place of the state file's) and of the model's buffers, which the gathered model file does not hold. DCP adds its
  metadata and some bytes per tensor: 0.8 MiB over the count for the tiny model's 68 trainable tensors on two
  processes (tests/test_stage_chain_cpu.py), nothing that shows at full size.

A run keeps the newest `train.keep_checkpoints` and assembles the next one beside them before it prunes, so at its
peak the output folder holds one checkpoint more than it keeps (fewer when the run saves fewer). Measured against
this count: tests/test_disk.py (a CPU run's checkpoints, byte for byte up to the files' headers), and the full-size
stages of `benchmarks/stage_chain.py` (`predicted_checkpoint_gib` beside `checkpoint_gib` in its rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tttvideo.config.schema import Config, TrainConfig
from tttvideo.memory.techniques import ModelBytes
from tttvideo.outputs import free_bytes

GIB = 2**30
EMA_BYTES = 4  # per trainable parameter: the trainer keeps its moving average in fp32 (tttvideo.train.ema)


@dataclass(frozen=True)
class CheckpointDisk:
    """Bytes of one checkpoint of a run, by file, and how many of them its output folder holds at once."""

    model_file: int
    optimizer_state: int
    ema_file: int
    sharded_buffers: int  # DCP's copy of the buffers (fp8 codes and scales) under torchrun
    at_once: int
    partial: bool  # the model file leaves out fp8-stored frozen layers

    @property
    def each(self) -> int:
        return self.model_file + self.optimizer_state + self.ema_file + self.sharded_buffers

    @property
    def peak(self) -> int:
        return self.each * self.at_once


def checkpoints_written(train: TrainConfig) -> int:
    """How many checkpoints a run of `train.steps` saves from step 0: every `checkpoint_every`, and the last step."""
    return train.steps // train.checkpoint_every + (1 if train.steps % train.checkpoint_every else 0)


def checkpoints_at_once(train: TrainConfig) -> int:
    """The most checkpoints in the output folder at one time: those kept and the one being written."""
    return max(1, min(train.keep_checkpoints + 1, checkpoints_written(train)))


def checkpoint_disk(model: ModelBytes, cfg: Config, processes: int = 1) -> CheckpointDisk:
    """One checkpoint of `cfg`'s training run of a model whose tensors `model` sums, written by `processes`."""
    optimizer = model.optimizer.get(cfg.train.optimizer, model.optimizer["adamw"])
    return CheckpointDisk(
        model_file=model.weights - model.buffers,
        optimizer_state=optimizer,
        ema_file=EMA_BYTES * model.trainable if cfg.train.ema_decay > 0 else 0,
        sharded_buffers=model.fp8 if processes > 1 else 0,
        at_once=checkpoints_at_once(cfg.train),
        partial=model.fp8 > 0,
    )


def space_warning(output_dir: str | Path, disk: CheckpointDisk, held: int = 0) -> str | None:
    """A sentence when the disk of `output_dir` cannot take the run's checkpoints, else None. `held`: bytes of the
    run's checkpoints already there (a resume), which count toward its peak."""
    free = free_bytes(output_dir)
    if free is None:
        return None
    need = max(0, disk.peak - held)
    if free >= need:
        return None
    where = f"train.output_dir {output_dir} has {free / GIB:.1f} GiB free"
    if free < disk.each:
        return (f"{where} and one checkpoint of this run takes {disk.each / GIB:.1f} GiB: its first save will fail. "
                f"Make room there or move train.output_dir")
    return (f"{where}; up to {disk.at_once} checkpoints of {disk.each / GIB:.1f} GiB (train.keep_checkpoints and the "
            f"one being written) need {need / GIB:.1f} GiB more: older ones will be pruned early to make room "
            f"(lower train.keep_checkpoints to say so)")
