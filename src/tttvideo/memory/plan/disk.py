"""`tttv plan`'s disk line: the checkpoints of a config's training run (`tttvideo.memory.guard.disk`), counted on
the meta device."""

from __future__ import annotations

from tttvideo.config.schema import Config
from tttvideo.memory.guard.disk import CheckpointDisk, checkpoint_disk
from tttvideo.memory.plan.count import model_bytes


def planned_disk(cfg: Config, processes: int = 1) -> CheckpointDisk:
    """`checkpoint_disk` of `cfg`'s model built on the meta device (a few seconds for CogVideoX-5B on a CPU)."""
    return checkpoint_disk(model_bytes(cfg), cfg, processes)


def describe(disk: CheckpointDisk, cfg: Config, setup: str = "") -> str:
    """One paragraph for `tttv plan`: a checkpoint's size, the output folder's peak and what must stay beside it;
    `setup` names the candidate it counts (weight storage and optimizer change the size)."""
    from tttvideo.memory.profile.report import fmt_bytes

    parts = [f"model file {fmt_bytes(disk.model_file)}", f"optimizer state {fmt_bytes(disk.optimizer_state)}"]
    if disk.ema_file:
        parts.append(f"EMA {fmt_bytes(disk.ema_file)}")
    if disk.sharded_buffers:
        parts.append(f"fp8 codes in dcp/ {fmt_bytes(disk.sharded_buffers)}")
    named = f" ({setup})" if setup else ""
    text = (f"disk{named}: a checkpoint {fmt_bytes(disk.each)} ({', '.join(parts)}); train.output_dir holds up to "
            f"{disk.at_once} at once (train.keep_checkpoints = {cfg.train.keep_checkpoints} and the one being "
            f"written): {fmt_bytes(disk.peak)}")
    if disk.partial:
        start = cfg.train.init_from or cfg.model.pretrained_path
        text += (f"; its model files leave out the fp8-stored frozen layers, read from where the run starts "
                 f"({start!r}), which must stay")
    return text
