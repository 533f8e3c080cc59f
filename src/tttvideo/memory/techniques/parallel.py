"""Sequence parallelism (Ulysses) over the GPUs of a torchrun launch, in training and sampling."""

from __future__ import annotations

from tttvideo.config.schema import Config
from tttvideo.memory.techniques.technique import MemoryTechnique, Option, Phase, Saving


# ------------------------------------------------------------------------------------------- sequence parallelism
def sp_degrees(gpus: int, heads: int) -> list[int]:
    """The sequence-parallel degrees a launch on `gpus` GPUs can use: they divide the GPUs and the heads."""
    return [d for d in range(1, gpus + 1) if gpus % d == 0 and heads % d == 0]


def _set_sp(sp: int, gpus: int, phase: Phase):
    def apply(cfg: Config) -> None:
        cfg.parallel.sp = sp
        if phase == "train":  # the rest shards (FSDP2)
            cfg.parallel.dp_shard, cfg.parallel.dp_replicate = gpus // sp, 1

    return apply


def _sp_options(cfg: Config, phase: Phase, gpus: int) -> tuple[Option, ...]:
    from tttvideo.models import get_preset

    keys = ("parallel.sp", "parallel.dp_shard", "parallel.dp_replicate") if phase == "train" else ("parallel.sp",)
    return tuple(Option(f"sp {sp}", _set_sp(sp, gpus, phase), keys)
                 for sp in sp_degrees(gpus, get_preset(cfg.model.preset).num_attention_heads))


SEQUENCE_PARALLEL = MemoryTechnique(
    name="sequence parallelism",
    phases=("train", "sample"),
    keys=("parallel.sp", "parallel.dp_shard", "parallel.dp_replicate"),
    mechanism="tttvideo.parallel.sequence (Ulysses), under torchrun",
    is_on=lambda cfg: cfg.parallel.sp > 1,
    options=_sp_options,
    regime="parallel",
    advice=lambda cfg, model, phase, gpus: [Saving(
        f"parallel.sp = {gpus} under torchrun",
        f"of activations: each of the {gpus} GPUs holds 1/{gpus} of a video's tokens")]
    if phase == "train" and gpus > 1 and cfg.parallel.sp == 1 else [],
)
