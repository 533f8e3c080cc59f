"""What the technique modules share: the calibration's configs and overrides, the bytes of a block's input, and
the option that sets one config key."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tttvideo.config.schema import CHECKPOINT_PARTS, Config
from tttvideo.memory.techniques.technique import Option

if TYPE_CHECKING:
    from torch import nn

# the calibration's configs (benchmarks/plan_calibration.py profiles each setup with them) and shared overrides
LORA = "configs/cogvideox-5b/24gb-3s.toml"  # lora, bf16, fp8, 8-bit AdamW, sub-block checkpointing, offload
QKVO = "configs/cogvideox-5b/stage2-9s-1gpu.toml"  # qkvo, sub-block
# the QKVO setups' weights: fp32 under bf16 autocast with AdamW, as measured (the config now stores bf16 weights)
FP32_AUTOCAST = ("model.dtype=fp32", "train.precision=bf16", "train.bf16_stochastic_round=false",
                 "train.optimizer=adamw")
SAMPLE = "configs/cogvideox-5b/24gb-sample-63s.toml"
# whole blocks checkpointed, their four parts not
BLOCK = tuple(f"checkpointing.{part}=false" for part in CHECKPOINT_PARTS)
BF16_PLAIN = ("model.frozen_weights=dtype", "train.optimizer=adamw", "checkpointing.offload_activations=false")
SAMPLE_PLAIN = ("memory.chunked_inference=false", "sample.cfg_batched=true", "sample.offload_blocks=false",
                "model.frozen_weights=dtype")


def block_input_bytes(cfg: Config, model: nn.Module, batch: int) -> int:
    """The residual stream entering one block: what block checkpointing keeps per block for backward."""
    import torch

    from tttvideo.dtypes import torch_dtype
    from tttvideo.models.backbone import layout_of

    layout = layout_of(cfg)
    dim = model.spec.dim if hasattr(model, "spec") else 0
    return batch * layout.total_tokens * dim * torch.tensor([], dtype=torch_dtype(cfg.model.dtype)).element_size()


def setting(label: str, key: str, value: object) -> Option:
    """The option that sets one config key ("section.name") to `value`."""
    section, name = key.split(".")

    def apply(cfg: Config) -> None:
        setattr(getattr(cfg, section), name, value)

    return Option(label, apply, (key,))


def all_block_inputs(cfg: Config, model: nn.Module) -> int:
    return block_input_bytes(cfg, model, cfg.train.batch_size) * len(getattr(model, "blocks", ()))
