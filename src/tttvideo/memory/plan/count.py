"""The part of a setup's GPU memory that can be counted: weights, gradients and optimizer state, per GPU.

The model of a config is built on the meta device (every shape and dtype, no data: a few seconds for CogVideoX-5B
on a CPU) with the config's adapter and weight storage, and its tensors are summed:

- weights: every parameter and buffer (fp8 codes and their scales included) in its storage dtype; then each memory
  technique that is on changes them by its `footprint`: when sampling streams the blocks from host memory
  (`sample.offload_blocks`), only `prefetch_blocks + 1` blocks of them;
- the EMA of the trainable parameters when `train.ema_decay` > 0 (training only): 4 bytes (fp32) per trainable
  parameter, counted in `weights` (it lives beside them from the start of the run to its end) and shown as `ema`;
- gradients: the trainable parameters, in their dtype (training only);
- optimizer state: both moments of every trainable tensor as `tttvideo.memory.techniques.optimizer_state_bytes`
  counts them (AdamW's in the parameters' dtype; 8-bit AdamW's 8-bit codes and fp32 scales, as torchao stores them;
  the OOM advice counts with the same function), training only;
- with FSDP2 each of these divided by the shard degree (dp_shard x sp: `fsdp_shard_degree`), buffers (fp8 codes
  and scales among them) excepted, which FSDP2 keeps whole on every GPU, plus the all-gathered full weights of the
  two blocks in flight (FSDP's prefetch of the next block while one computes);
- with `memory.stream_frozen_weights` (training) the fp8 codes and scales live in host memory: two blocks' worth
  is counted for the copies in flight.

These are exact for the tensors they name (tests/test_planner.py checks them against a built model); what a step
allocates beyond them is counted block by block (`tttvideo.memory.plan.activations`) or measured per token
(`tttvideo.memory.plan.costs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tttvideo.config.schema import Config
from tttvideo.memory.guard.disk import EMA_BYTES
from tttvideo.memory.techniques import ModelBytes, techniques
from tttvideo.memory.techniques.technique import Phase


@dataclass(frozen=True)
class Counted:
    """Bytes per GPU of what is counted; `trainable_params` is a count, not bytes."""

    weights: int
    gradients: int
    optimizer: int
    trainable_params: int
    block_weights: int  # one block's weights, unsharded (the unit that streams or is all-gathered)
    ema: int = 0  # of `weights`: the fp32 moving average of the trainable parameters (train.ema_decay > 0)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


@lru_cache(maxsize=32)
def _model_bytes(preset: str, dtype: str, adapter: str, lora_rank: int, frozen_weights: str, use_ttt: bool,
                 ttt_kind: str, sequence_layer: str) -> ModelBytes:
    """The tensors of a model built on the meta device, summed."""
    from tttvideo.models import build_model

    cfg = Config()
    cfg.model.preset, cfg.model.dtype, cfg.model.adapter = preset, dtype, adapter
    cfg.model.lora_rank, cfg.model.frozen_weights, cfg.model.use_ttt = lora_rank, frozen_weights, use_ttt
    cfg.ttt.kind, cfg.ttt.backend = ttt_kind, "reference"  # the backend changes no tensor
    cfg.model.sequence_layer = sequence_layer
    return ModelBytes.of(build_model(cfg, device="meta"))


def model_bytes(cfg: Config) -> ModelBytes:
    """The tensors of `cfg`'s model (adapter and weight storage as configured), summed on the meta device."""
    m = cfg.model
    return _model_bytes(m.preset, m.dtype, m.adapter, m.lora_rank, m.frozen_weights, m.use_ttt, cfg.ttt.kind,
                        m.sequence_layer)


def count(cfg: Config, phase: Phase, gpus: int = 1) -> Counted:
    """The counted memory per GPU of `cfg` for `phase` ("train" or "sample") on `gpus` GPUs: the model's tensors
    as built (weight storage included), changed by the footprint of every technique of `phase` that is on."""
    b = model_bytes(cfg)
    weights, buffers = b.weights, b.buffers
    optimizer = b.optimizer["adamw"] if phase == "train" else 0
    for technique in techniques(phase):
        if technique.footprint is not None and technique.is_on(cfg):
            change = technique.footprint(cfg, phase, b)
            weights, buffers, optimizer = (weights + change.weights, buffers + change.buffers,
                                           optimizer + change.optimizer)
    if phase == "sample":
        return Counted(weights, 0, 0, 0, b.block)
    ema = EMA_BYTES * b.trainable if cfg.train.ema_decay > 0 else 0
    shard = fsdp_shard_degree(cfg, gpus)
    if shard > 1:
        # FSDP2 shards parameters; buffers (fp8 codes and scales among them) stay whole on every GPU
        return Counted((weights - buffers + ema) // shard + buffers + 2 * b.block, b.gradients // shard,
                       optimizer // shard, b.trainable, b.block, ema // shard)
    return Counted(weights + ema, b.gradients, optimizer, b.trainable, b.block, ema)


def fsdp_shard_degree(cfg: Config, gpus: int) -> int:
    """How many GPUs FSDP2 shards each parameter over in a training launch on `gpus` GPUs: dp_shard x sp (the sp ranks
    of a group hold the same parameters, so the trainer's FSDP mesh includes them: `parallel.mesh`); HSDP replicas
    (dp_replicate) each hold a whole sharded copy. parallel.dp_shard = -1 fills what sp and dp_replicate leave."""
    par = cfg.parallel
    if gpus <= 1:
        return 1
    dp_shard = max(1, gpus // (par.sp * par.dp_replicate)) if par.dp_shard == -1 else par.dp_shard
    return dp_shard * par.sp


# What a training process holds in host memory besides what it offloads and its compile workers
# (`tttvideo.memory.guard.compile_pool`), its own VmHWM, measured at full size: 15.3-15.9 GiB at 3-18 s (no
# offload) on one H100 and one H200, and per rank under FSDP2 on two H200s, of which the weights folder read
# through safetensors' memory map is 10.4 GiB (CogVideoX-5B in bf16; a rank reads it once, then shards) and the rest
# (Python, torch, CUDA's host side) this constant.
PROCESS_HOST_BYTES = 5 * 2**30


def weights_folder_bytes(cfg: Config) -> int:
    """The backbone's pretrained weights as a diffusers folder holds them (bf16, no TTT layers, no adapter)."""
    m = cfg.model
    return _model_bytes(m.preset, "bf16", "sft", m.lora_rank, "dtype", False, cfg.ttt.kind, "none").weights


def process_host_bytes(cfg: Config) -> int:
    """Host memory of one training process beside its offloaded tensors and compile workers: the libraries and the
    weights it loads (once, under FSDP2 too)."""
    return PROCESS_HOST_BYTES + weights_folder_bytes(cfg)
