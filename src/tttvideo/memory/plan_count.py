"""The part of a setup's GPU memory that can be counted: weights, gradients and optimizer state, per GPU.

The model of a config is built on the meta device (every shape and dtype, no data: a few seconds for CogVideoX-5B
on a CPU) with the config's adapter and weight storage, and its tensors are summed:

- weights: every parameter and buffer (fp8 codes and their scales included) in its storage dtype; when sampling
  streams the blocks from host memory (`sample.offload_blocks`), only `prefetch_blocks + 1` blocks of them;
- gradients: the trainable parameters, in their dtype (training only);
- optimizer state: AdamW's two moments in the parameters' dtype; 8-bit AdamW's (torchao) 1 byte per value plus one
  fp32 scale per 256 values for each tensor of at least 4096 values that is a multiple of 256, two moments in the
  parameter's dtype for the others (training only); the optimizers' scalar step counters are left out;
- with FSDP2 each of these divided by the shard degree (dp_shard x sp: `fsdp_shard_degree`), buffers (fp8 codes
  and scales among them) excepted, which FSDP2 keeps whole on every GPU, plus the all-gathered full weights of the
  two blocks in flight (FSDP's prefetch of the next block while one computes);
- with `memory.stream_frozen_weights` (training) the fp8 codes and scales live in host memory: two blocks' worth
  is counted for the copies in flight.

These are exact for the tensors they name (tests/test_planner.py checks them against a built model); what a step
allocates beyond them is the activation model's job (`tttvideo.memory.plan_costs`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch

from tttvideo.config.schema import Config

# torchao's rule for which tensors get 8-bit state (tttvideo.train.optim says the same)
_Q_MIN_SIZE, _Q_BLOCK = 4096, 256


@dataclass(frozen=True)
class Counted:
    """Bytes per GPU of what is counted; `trainable_params` is a count, not bytes."""

    weights: int
    gradients: int
    optimizer: int
    trainable_params: int
    block_weights: int  # one block's weights, unsharded (the unit that streams or is all-gathered)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def adamw8bit_state_bytes(numel: int, element_size: int) -> int:
    """Both moments of one tensor under torchao's AdamW8bit: 8-bit codes and an fp32 scale per 256 values, or,
    for the tensors it leaves alone, two moments in the parameter's dtype."""
    if numel >= _Q_MIN_SIZE and numel % _Q_BLOCK == 0:
        return 2 * (numel + 4 * (numel // _Q_BLOCK))
    return 2 * element_size * numel


class _ModelBytes(NamedTuple):
    """What `count` needs from one model: bytes unless said otherwise."""

    weights: int  # parameters and buffers
    buffers: int
    block: int  # one block's parameters and buffers
    fp8: int  # fp8 codes and scales
    block_fp8: int
    trainable: int  # a count of values
    gradients: int
    adamw: int
    adamw8bit: int


@lru_cache(maxsize=32)
def _model_bytes(preset: str, dtype: str, adapter: str, lora_rank: int, frozen_weights: str, use_ttt: bool,
                 ttt_kind: str, sequence_layer: str) -> _ModelBytes:
    """The tensors of a model built on the meta device, summed."""
    from tttvideo.models import build_model
    from tttvideo.models.fp8_storage import fp8_code_bytes

    cfg = Config()
    cfg.model.preset, cfg.model.dtype, cfg.model.adapter = preset, dtype, adapter
    cfg.model.lora_rank, cfg.model.frozen_weights, cfg.model.use_ttt = lora_rank, frozen_weights, use_ttt
    cfg.ttt.kind, cfg.ttt.backend = ttt_kind, "reference"  # the backend changes no tensor
    cfg.model.sequence_layer = sequence_layer
    model = build_model(cfg, device="meta")
    block = model.blocks[0]

    trainable = [p for p in model.parameters() if p.requires_grad]
    gradients = _tensor_bytes(trainable)
    return _ModelBytes(
        weights=_tensor_bytes(model.parameters()) + _tensor_bytes(model.buffers()),
        buffers=_tensor_bytes(model.buffers()),
        block=_tensor_bytes(block.parameters()) + _tensor_bytes(block.buffers()),
        fp8=fp8_code_bytes(model), block_fp8=fp8_code_bytes(block),
        trainable=sum(p.numel() for p in trainable), gradients=gradients, adamw=2 * gradients,
        adamw8bit=sum(adamw8bit_state_bytes(p.numel(), p.element_size()) for p in trainable))


def count(cfg: Config, phase: str, gpus: int = 1) -> Counted:
    """The counted memory per GPU of `cfg` for `phase` ("train" or "sample") on `gpus` GPUs."""
    m = cfg.model
    b = _model_bytes(m.preset, m.dtype, m.adapter, m.lora_rank, m.frozen_weights, m.use_ttt, cfg.ttt.kind,
                     m.sequence_layer)
    weights = b.weights
    if phase == "sample":
        from tttvideo.models import get_preset

        if cfg.sample.offload_blocks:
            layers = get_preset(m.preset).num_layers
            weights = weights - layers * b.block + (cfg.sample.prefetch_blocks + 1) * b.block
        return Counted(weights, 0, 0, 0, b.block)
    buffers = b.buffers
    if cfg.memory.stream_frozen_weights and m.frozen_weights == "fp8":
        # the block computing and the one whose backward comes next
        weights = weights - b.fp8 + 2 * b.block_fp8
        buffers = buffers - b.fp8 + 2 * b.block_fp8
    optimizer = b.adamw8bit if cfg.train.optimizer == "adamw8bit" else b.adamw
    shard = fsdp_shard_degree(cfg, gpus)
    if shard > 1:
        # FSDP2 shards parameters; buffers (fp8 codes and scales among them) stay whole on every GPU
        return Counted((weights - buffers) // shard + buffers + 2 * b.block, b.gradients // shard,
                       optimizer // shard, b.trainable, b.block)
    return Counted(weights, b.gradients, optimizer, b.trainable, b.block)


def fsdp_shard_degree(cfg: Config, gpus: int) -> int:
    """How many GPUs FSDP2 shards each parameter over in a training launch on `gpus` GPUs: dp_shard x sp (the sp ranks
    of a group hold the same parameters, so the trainer's FSDP mesh includes them: `parallel.mesh`); HSDP replicas
    (dp_replicate) each hold a whole sharded copy. parallel.dp_shard = -1 fills what sp and dp_replicate leave."""
    par = cfg.parallel
    if gpus <= 1:
        return 1
    dp_shard = max(1, gpus // (par.sp * par.dp_replicate)) if par.dp_shard == -1 else par.dp_shard
    return dp_shard * par.sp


def with_overrides(cfg: Config, overrides: dict[str, object]) -> Config:
    """A copy of `cfg` with dotted keys set (the planner's candidates)."""
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(out, section), name, value)
    return out


def tensor_bytes(dtype: str) -> int:
    return torch.tensor([], dtype={"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
                        ).element_size()
