"""The memory techniques the project offers, each one `MemoryTechnique` (`tttvideo.memory.techniques.technique`).

Training: activation checkpointing (whole blocks, keeping some outputs, or blocks and their four parts), nested
checkpointing (one saved input per span of units), activation offload to host memory (an exact-size pool), fp8
storage of the frozen weights, streaming those from host memory, 8-bit AdamW, the MLP over token chunks, Wan's
window-wise block form, and on several GPUs sequence parallelism. Sampling: fp8 storage (of every linear with
sample.fp8_linears = 'all'), the chunked (bounded-memory) forward, the guidance's two passes batched, in turn, or
split over two groups of GPUs, blocks streamed from host memory, sequence parallelism.
`REGISTRY` holds them in the order the OOM advice lists savings of equal size and the calibration runs its setups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tttvideo.config.schema import CHECKPOINT_PARTS, Config
from tttvideo.errors import ConfigError
from tttvideo.memory.techniques.technique import (CalibrationSetup, Footprint, MemoryTechnique, ModelBytes, Option,
                                                  Phase, Saving)

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


def _setting(label: str, key: str, value: object) -> Option:
    """The option that sets one config key ("section.name") to `value`."""
    section, name = key.split(".")

    def apply(cfg: Config) -> None:
        setattr(getattr(cfg, section), name, value)

    return Option(label, apply, (key,))


def _all_block_inputs(cfg: Config, model: nn.Module) -> int:
    return block_input_bytes(cfg, model, cfg.train.batch_size) * len(getattr(model, "blocks", ()))


# ------------------------------------------------------------------------------------------- activation checkpointing
_CHECKPOINT_KEYS = ("checkpointing.block", "checkpointing.group_size",
                    *(f"checkpointing.{part}" for part in CHECKPOINT_PARTS), "checkpointing.layers",
                    "checkpointing.keep")


def _checkpoint(parts: bool, keep: tuple[str, ...] = ()):
    def apply(cfg: Config) -> None:
        ck = cfg.checkpointing
        ck.block, ck.group_size, ck.layers, ck.keep = True, 1, [], list(keep)
        for part in CHECKPOINT_PARTS:
            setattr(ck, part, parts)

    return apply


# checkpoint_policy's names of the two regimes the planner counts (its block model's, and whole blocks on top of it)
WHOLE_BLOCK_POLICY = "block"
SUB_BLOCK_POLICY = "sub-block"


def checkpoint_policy(cfg: Config) -> str:
    """'none', 'block' (whole blocks), 'block-keep-attention' / 'block-keep-attention+matmul' (whole blocks keeping
    those outputs), 'sub-block' (blocks and their four parts, as the stage configs), or 'custom' (per-layer rules or
    another mix: not a regime the planner proposes)."""
    ck = cfg.checkpointing
    parts = [getattr(ck, part) for part in CHECKPOINT_PARTS]
    if ck.layers or (ck.block and ck.group_size != 1):
        return "custom"
    if ck.keep:
        return "block-keep-" + "+".join(sorted(set(ck.keep))) if ck.block and not any(parts) else "custom"
    if not ck.block and not any(parts):
        return "none"
    if ck.block and not any(parts):
        return WHOLE_BLOCK_POLICY
    if ck.block and all(parts):
        return SUB_BLOCK_POLICY
    return "custom"


def _checkpoint_advice(cfg: Config, model: nn.Module, phase: Phase, gpus: int) -> list[Saving]:
    found = []
    ck = cfg.checkpointing
    if ck.keep:
        # the kept SDPA outputs are the stream's size per layer; the kept products, several times it (not counted)
        kept = _all_block_inputs(cfg, model) if set(ck.keep) == {"attention"} else None
        found.append(Saving("checkpointing.keep = []", f"of the {' and '.join(ck.keep)} outputs kept for backward "
                                                       "(recomputed instead)", kept))
    if not ck.block:
        found.append(Saving("checkpointing.block = true", "of activations: each block is recomputed in backward and "
                                                          "keeps only its input"))
    elif checkpoint_policy(cfg) == WHOLE_BLOCK_POLICY:
        # not counted here (the measured size is the planner's, a layer above): about 27 block inputs' worth for
        # CogVideoX (docs/memory.md, "Whole blocks or every sub-module")
        found.append(Saving("checkpointing.attention, forward_ttt, reverse_ttt and mlp = true",
                            "of the parts' activations in each block's backward, about 27 times a block input for "
                            "CogVideoX: each part recomputed once more, about 1.17x the step"))
    return found


CHECKPOINTING = MemoryTechnique(
    name="activation checkpointing",
    phases=("train",),
    keys=_CHECKPOINT_KEYS,
    mechanism="tttvideo.models.checkpointing.apply_checkpointing, in build_model",
    is_on=lambda cfg: checkpoint_policy(cfg) != "none",
    options=lambda cfg, phase, gpus: (
        Option("block", _checkpoint(False), _CHECKPOINT_KEYS),
        # selective: the block's recompute skips attention (and the backbone's matrix products), whose outputs stay
        Option("block, keeping attention", _checkpoint(False, ("attention",)), _CHECKPOINT_KEYS),
        Option("block, keeping attention and matmul", _checkpoint(False, ("attention", "matmul")), _CHECKPOINT_KEYS),
        Option("sub-block", _checkpoint(True), _CHECKPOINT_KEYS),
    ) if phase == "train" else (),
    regime="activation",
    regime_tag=checkpoint_policy,
    advice=_checkpoint_advice,
    calibration=(
        CalibrationSetup("lora, block ckpt, bf16, AdamW", LORA, "train", BLOCK + BF16_PLAIN, ("3s", "9s"), ("18s",),
                         order=0),
        CalibrationSetup("lora, block ckpt keeping attention, bf16, AdamW", LORA, "train",
                         BLOCK + BF16_PLAIN + ('checkpointing.keep=["attention"]',), ("3s", "9s"), order=3),
        CalibrationSetup("lora, block ckpt keeping attention and matmul, bf16, AdamW", LORA, "train",
                         BLOCK + BF16_PLAIN + ('checkpointing.keep=["attention","matmul"]',), ("3s", "6s"), order=4),
        # last, as the first to go when device time runs short
        CalibrationSetup("qkvo, sub-block ckpt, fp32 weights, AdamW", QKVO, "train", FP32_AUTOCAST, ("3s", "9s"),
                         order=12),
    ),
)


# ------------------------------------------------------------------------------------------- activation offload
ACTIVATION_OFFLOAD = MemoryTechnique(
    name="activation offload",
    phases=("train",),
    keys=("checkpointing.offload_activations", "checkpointing.offload_host_gib"),
    # host memory is exactly what is offloaded: a pool of exact-size pinned buffers (HostPool) bounded by
    # checkpointing.offload_host_gib; what does not fit stays on the GPU (the block model counts both)
    mechanism="tttvideo.models.activation_offload.offload_activations with a HostPool (host_pool_for), around each "
              "micro-batch of tttvideo.train.step.TrainStep",
    is_on=lambda cfg: cfg.checkpointing.offload_activations,
    options=lambda cfg, phase, gpus: (_setting("", "checkpointing.offload_activations", False),
                                      _setting("offload", "checkpointing.offload_activations", True))
    if phase == "train" else (),
    regime="activation",
    regime_tag=lambda cfg: "offload" if cfg.checkpointing.offload_activations else "resident",
    uses_host=True,
    advice=lambda cfg, model, phase, gpus: [] if cfg.checkpointing.offload_activations else [Saving(
        "checkpointing.offload_activations = true",
        "of saved activations to host memory (with block checkpointing: the block inputs)",
        _all_block_inputs(cfg, model))],
    calibration=(
        CalibrationSetup("lora, sub-block ckpt + offload, fp8, 8-bit AdamW", LORA, "train", (), ("3s", "9s"),
                         ("18s",), order=1),
        # held out: a calibrated activation regime with other counted parts (weight storage, optimizer)
        CalibrationSetup("lora, sub-block ckpt + offload, bf16, AdamW", LORA, "train",
                         ("model.frozen_weights=dtype", "train.optimizer=adamw"), (), ("3s", "9s"), order=11),
    ),
)


# ------------------------------------------------------------------------------------------- fp8 frozen weights
def _fp8_advice(cfg: Config, model: nn.Module, phase: Phase, gpus: int) -> list[Saving]:
    if cfg.model.frozen_weights == "fp8":
        return []
    saved = ModelBytes.of(model).frozen_linear_saving
    return [Saving("model.frozen_weights = 'fp8'", "of frozen linear weights", saved)] if saved > 0 else []


def _fp8_storages(cfg: Config, phase: Phase) -> tuple[str, ...]:
    if cfg.model.adapter == "sft":  # it trains every weight: none is frozen
        return ("dtype",)
    if phase == "sample" and cfg.sample.fp8_linears == "all":  # every linear in fp8 needs the fp8 storage
        return ("fp8",)
    return ("dtype", "fp8")


FP8_WEIGHTS = MemoryTechnique(
    name="fp8 frozen weights",
    phases=("train", "sample"),
    keys=("model.frozen_weights",),
    # the planner builds the model with the setting, so its counted weights are the fp8 codes and scales
    mechanism="tttvideo.models.fp8_storage.store_fp8, in build_model",
    is_on=lambda cfg: cfg.model.frozen_weights == "fp8",
    options=lambda cfg, phase, gpus: tuple(_setting(s, "model.frozen_weights", s) for s in _fp8_storages(cfg, phase)),
    advice=_fp8_advice,
    lossy=True,
    calibration=(
        CalibrationSetup("lora, block ckpt, fp8, 8-bit AdamW", LORA, "train",
                         BLOCK + ("checkpointing.offload_activations=false",), (), ("3s", "9s"), order=10),
    ),
)


# ------------------------------------------------------------------------------------------- fp8 every linear
def _fp8_every_linear_footprint(cfg: Config, phase: Phase, b: ModelBytes) -> Footprint:
    if phase != "sample" or cfg.model.frozen_weights != "fp8":
        return Footprint()
    saving = b.trainable_linear_saving
    if cfg.sample.offload_blocks:  # only the blocks on the GPU count there (SAMPLE_BLOCK_OFFLOAD's footprint)
        saving -= (b.blocks - resident_blocks(cfg, b)) * b.block_trainable_linear_saving
    return Footprint(weights=-saving)


FP8_EVERY_LINEAR = MemoryTechnique(
    name="fp8 every linear (sampling)",
    phases=("sample",),
    keys=("sample.fp8_linears",),
    # the planner's model is built for training (the adapter's trainable layers in the model dtype): the footprint
    # takes those to fp8 as the sampler does once the weights are loaded
    mechanism="tttvideo.models.fp8_storage.store_every_linear_fp8, in tttvideo.sample.model.load_model",
    is_on=lambda cfg: cfg.sample.fp8_linears == "all",
    # no options: it trades output error for speed more than for memory (docs/model.md), the user's call
    footprint=_fp8_every_linear_footprint,
    lossy=True,
)


# ------------------------------------------------------------------------------------------- fp8 weight streaming
def _stream_footprint(cfg: Config, phase: Phase, b: ModelBytes) -> Footprint:
    if phase != "train" or cfg.model.frozen_weights != "fp8":
        return Footprint()
    # the block computing and the one whose backward comes next stay on the GPU
    kept = 2 * b.block_fp8
    return Footprint(weights=kept - b.fp8, buffers=kept - b.fp8, host=b.fp8)


def _stream_advice(cfg: Config, model: nn.Module, phase: Phase, gpus: int) -> list[Saving]:
    if phase != "train" or cfg.model.frozen_weights != "fp8" or cfg.memory.stream_frozen_weights or gpus != 1:
        return []
    return [Saving("memory.stream_frozen_weights = true", "of fp8 frozen weights kept in host memory",
                   -_stream_footprint(cfg, phase, ModelBytes.of(model)).weights)]


def _check_stream(cfg: Config, processes: int) -> None:
    from tttvideo.models.fp8_storage import check_weight_streaming

    check_weight_streaming(cfg, processes)


def _stream(cfg: Config, model: nn.Module) -> int:
    from tttvideo.models.fp8_storage import stream_fp8_weights

    return stream_fp8_weights(model)


FP8_STREAMING = MemoryTechnique(
    name="fp8 weight streaming",
    phases=("train",),
    keys=("memory.stream_frozen_weights",),
    mechanism="tttvideo.models.fp8_storage.stream_fp8_weights, applied by tttvideo.train.step.build_train_step",
    is_on=lambda cfg: cfg.memory.stream_frozen_weights,
    # streaming runs in one process
    options=lambda cfg, phase, gpus: (_setting("", "memory.stream_frozen_weights", False),) + (
        (_setting("streamed", "memory.stream_frozen_weights", True),) if gpus == 1 else ())
    if phase == "train" else (),
    footprint=_stream_footprint,
    advice=_stream_advice,
    check=_check_stream,
    prepare=_stream,
    prepared="frozen fp8 weights streamed to pinned host memory",
    streams_weights=True,
    calibration=(
        CalibrationSetup("lora, sub-block ckpt + offload, fp8 streamed, 8-bit AdamW", LORA, "train",
                         ("memory.stream_frozen_weights=true",), (), ("9s",), order=2),
    ),
)


# ------------------------------------------------------------------------------------------- 8-bit AdamW
def _optimizer_footprint(cfg: Config, phase: Phase, b: ModelBytes) -> Footprint:
    return Footprint(optimizer=b.optimizer["adamw8bit"] - b.optimizer["adamw"]) if phase == "train" else Footprint()


STOCHASTIC_ROUND_NEEDS_8BIT = ("train.bf16_stochastic_round needs train.optimizer = 'adamw8bit' (torchao's update "
                               "does the rounding); set it, or set train.bf16_stochastic_round = false")


def check_stochastic_round(cfg: Config, processes: int = 1) -> None:
    if cfg.train.bf16_stochastic_round and cfg.train.optimizer != "adamw8bit":
        raise ConfigError(STOCHASTIC_ROUND_NEEDS_8BIT)


ADAMW_8BIT = MemoryTechnique(
    name="8-bit AdamW",
    phases=("train",),
    keys=("train.optimizer",),
    mechanism="tttvideo.train.optim.build_optimizer (torchao's AdamW8bit)",
    is_on=lambda cfg: cfg.train.optimizer == "adamw8bit",
    # stochastic rounding is torchao's: with it on, only the 8-bit update is a candidate
    options=lambda cfg, phase, gpus: tuple(_setting(n, "train.optimizer", n)
                                           for n in ("adamw", "adamw8bit")
                                           if n == "adamw8bit" or not cfg.train.bf16_stochastic_round)
    if phase == "train" else (),
    footprint=_optimizer_footprint,
    check=check_stochastic_round,
    advice=lambda cfg, model, phase, gpus: [] if phase != "train" or cfg.train.optimizer == "adamw8bit" else [
        Saving("train.optimizer = 'adamw8bit'", "of optimizer state",
               -_optimizer_footprint(cfg, phase, ModelBytes.of(model)).optimizer)],
    lossy=True,
    calibration=(
        CalibrationSetup("qkvo, sub-block ckpt, fp32 weights, 8-bit AdamW", QKVO, "train",
                         FP32_AUTOCAST + ("train.optimizer=adamw8bit",), (), ("9s",), order=13),
    ),
)


# ------------------------------------------------------------------------------------------- chunked inference
_CHUNKED_KEYS = ("memory.chunked_inference", "memory.ttt_head_groups")


def _set_chunked(groups: int):
    def apply(cfg: Config) -> None:
        cfg.memory.chunked_inference = groups > 0
        if groups:
            cfg.memory.ttt_head_groups = groups
            cfg.sample.cfg_batched = False  # the chunked forward runs one pass at a time

    return apply


CHUNKED_INFERENCE = MemoryTechnique(
    name="chunked inference",
    phases=("sample",),
    keys=_CHUNKED_KEYS,
    mechanism="tttvideo.models.chunked_inference, chosen by the model's forward without gradients",
    is_on=lambda cfg: cfg.memory.chunked_inference,
    # plain (off) leaves the head groups as they are; its guidance is the next technique's
    # (the chunked forward runs in one process or with parallel.sp = 1: the planner proposes it on one GPU)
    options=lambda cfg, phase, gpus: (
        Option("plain", _set_chunked(0), ("memory.chunked_inference",)),
        *((Option("chunked", _set_chunked(1), (*_CHUNKED_KEYS, "sample.cfg_batched")),
           Option("chunked, 2 head groups", _set_chunked(2), (*_CHUNKED_KEYS, "sample.cfg_batched")),
           Option("chunked, 4 head groups", _set_chunked(4), (*_CHUNKED_KEYS, "sample.cfg_batched")))
          if gpus == 1 else ()),
    ) if phase == "sample" else (),
    regime="activation",
    regime_tag=lambda cfg: f"chunked-g{cfg.memory.ttt_head_groups}" if cfg.memory.chunked_inference else "",
    calibration=(
        CalibrationSetup("sample: chunked, bf16 resident", SAMPLE, "sample",
                         ("sample.offload_blocks=false", "model.frozen_weights=dtype"), ("9s", "63s"),
                         ("3s", "18s"), order=6),
        CalibrationSetup("sample: chunked, 2 head groups, fp8 streamed", SAMPLE, "sample",
                         ("memory.ttt_head_groups=2",), ("9s", "63s"), order=8),
        CalibrationSetup("sample: chunked, 4 head groups, fp8 streamed", SAMPLE, "sample",
                         ("memory.ttt_head_groups=4",), ("9s", "63s"), ("3s",), order=9),
    ),
)


# ------------------------------------------------------------------------------------------- the guidance's passes
GUIDANCE_PASSES = MemoryTechnique(
    name="guidance passes",
    phases=("sample",),
    keys=("sample.cfg_batched", "sample.split_guidance"),
    mechanism="tttvideo.sample.guidance (batched, in turn, or split over two rank groups under torchrun)",
    is_on=lambda cfg: not cfg.sample.cfg_batched or cfg.sample.split_guidance,
    # one GPU: batched (the memory of batch 2) or two passes; several GPUs: split over two halves of them, each rank
    # running one pass (costed by the measured batched regime)
    options=lambda cfg, phase, gpus: (
        _setting("guidance batched", "sample.cfg_batched", True),
        _setting("two passes", "sample.cfg_batched", False),
        *((_setting("not split", "sample.split_guidance", False),
           _setting("guidance split", "sample.split_guidance", True)) if gpus > 1 else ()),
    ) if phase == "sample" else (),
    regime="activation",
    regime_tag=lambda cfg: "plain-b2" if cfg.sample.cfg_batched else "plain-b1",
    calibration=(
        # sampling is planned up to 63 s, so its curves run to 63 s (the plain forward's per-token cost measured
        # 205-210 KB at 3-18 s and 173 KB at 63 s: a line through 3 and 9 s alone overshoots 63 s by 18%)
        CalibrationSetup("sample: plain, guidance batched, bf16 resident", SAMPLE, "sample", SAMPLE_PLAIN,
                         ("9s", "18s", "63s"), ("3s",), order=5),
    ),
)


# ------------------------------------------------------------------------------------------- sample block offload
def resident_blocks(cfg: Config, b: ModelBytes) -> int:
    """Blocks on the GPU at once with `sample.offload_blocks`: the running one and `prefetch_blocks` copied ahead
    (`tttvideo.sample.offload`), at most the model's blocks."""
    return min(cfg.sample.prefetch_blocks + 1, b.blocks)


def _offload_blocks_footprint(cfg: Config, phase: Phase, b: ModelBytes) -> Footprint:
    if phase != "sample":
        return Footprint()
    return Footprint(weights=(resident_blocks(cfg, b) - b.blocks) * b.block, host=b.blocks * b.block)


def _offload_blocks_advice(cfg: Config, model: nn.Module, phase: Phase, gpus: int) -> list[Saving]:
    if phase != "sample" or cfg.sample.offload_blocks:
        return []
    freed = -_offload_blocks_footprint(cfg, phase, ModelBytes.of(model)).weights
    return [Saving("sample.offload_blocks = true", "of block weights kept in host memory", freed)] if freed > 0 else []


SAMPLE_BLOCK_OFFLOAD = MemoryTechnique(
    name="sample block offload",
    phases=("sample",),
    keys=("sample.offload_blocks",),
    mechanism="tttvideo.sample.offload.offload_blocks, in tttvideo.sample.model.load_model",
    is_on=lambda cfg: cfg.sample.offload_blocks,
    # streaming runs one process
    options=lambda cfg, phase, gpus: tuple(_setting(label, "sample.offload_blocks", on)
                                           for label, on in (("resident", False), ("streamed", True))
                                           if gpus == 1 or not on) if phase == "sample" else (),
    footprint=_offload_blocks_footprint,
    advice=_offload_blocks_advice,
    streams_weights=True,
    calibration=(
        CalibrationSetup("sample: chunked, fp8 streamed", SAMPLE, "sample", (), (), ("63s",), order=7),
    ),
)


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


# ------------------------------------------------------------------------------------------- nested checkpointing
def nested_span_for(cfg: Config) -> int:
    """The span the planner tries: about the square root of the block units (6 for the 5B's 42 blocks), where
    n / k + k inputs live at once is smallest."""
    from tttvideo.models import get_preset

    return max(2, round(get_preset(cfg.model.preset).num_layers ** 0.5))


def _nested_advice(cfg: Config, model: nn.Module, phase: Phase, gpus: int) -> list[Saving]:
    if phase != "train" or not cfg.checkpointing.block or cfg.checkpointing.nested_span > 1:
        return []
    n = len(getattr(model, "blocks", ()))
    k = max(2, round(n ** 0.5))
    live = -(-n // k) + k
    if n <= live:
        return []
    per_block = block_input_bytes(cfg, model, cfg.train.batch_size)
    return [Saving(f"checkpointing.nested_span = {k}",
                   f"of saved block inputs ({live} of {n} live at once, for one more forward of the blocks)",
                   (n - live) * per_block)]


NESTED_CHECKPOINTING = MemoryTechnique(
    name="nested checkpointing",
    phases=("train",),
    keys=("checkpointing.nested_span",),
    # the model's forward checkpoints each span of units (models/cogvideox/transformer.py), set by apply_checkpointing
    mechanism="tttvideo.models.checkpointing.nested_spans, in the backbone's forward (apply_checkpointing sets "
              "model.nested_span)",
    is_on=lambda cfg: cfg.checkpointing.nested_span > 1,
    options=lambda cfg, phase, gpus: (
        _setting("", "checkpointing.nested_span", 0),
        _setting(f"nested {nested_span_for(cfg)}", "checkpointing.nested_span", nested_span_for(cfg)),
    ) if phase == "train" else (),
    # counted by the block model (tttvideo.memory.plan.activations): n / k + k saved inputs instead of n, and
    # one more forward of the blocks (measured 1.13x step time at 9 s on an H100)
    regime="activation",
    regime_tag=lambda cfg: f"nested{cfg.checkpointing.nested_span}" if cfg.checkpointing.nested_span > 1 else "",
    advice=_nested_advice,
)


# ------------------------------------------------------------------------------------------- FFN over token chunks
# the chunk the planner tries: the hidden layer of 32,768 tokens is 0.55 GiB for Wan2.1-1.3B (8960 wide) and
# 0.75 GiB for CogVideoX-5B (12,288) in bf16, and a product of 32,768 rows keeps the GPU as busy as a longer one
FFN_CHUNK_TOKENS = 32768


def mlp_hidden(model: nn.Module) -> int:
    """The hidden width of the model's feed-forward MLPs (0 without one)."""
    from tttvideo.models.layers import MLP

    return next((m.fc1.out_features for m in model.modules() if isinstance(m, MLP)), 0)


def ffn_chunk_saving(cfg: Config, model: nn.Module, chunk: int) -> int:
    """What running the MLP over chunks of `chunk` tokens frees in the block that runs: the hidden layer of every
    other token of a micro-batch (once: what the planner's block model counts)."""
    import torch

    from tttvideo.dtypes import torch_dtype
    from tttvideo.models.backbone import layout_of

    rows = cfg.train.batch_size * layout_of(cfg).total_tokens
    autocast = cfg.train.precision in ("bf16", "fp16")
    act = 2 if autocast else torch.tensor([], dtype=torch_dtype(cfg.model.dtype)).element_size()
    return max(0, rows - cfg.train.batch_size * chunk) * mlp_hidden(model) * act


def _ffn_chunk_advice(cfg: Config, model: nn.Module, phase: Phase, gpus: int) -> list[Saving]:
    if phase != "train" or cfg.checkpointing.ffn_chunk_tokens > 0:
        return []
    saved = ffn_chunk_saving(cfg, model, FFN_CHUNK_TOKENS)
    return [Saving(f"checkpointing.ffn_chunk_tokens = {FFN_CHUNK_TOKENS}",
                   "of the MLP's hidden layer in the block that runs (one chunk's instead of the whole video's, for "
                   "one more forward of the MLP)", saved)] if saved > 0 else []


FFN_CHUNKS = MemoryTechnique(
    name="FFN over token chunks",
    phases=("train",),
    keys=("checkpointing.ffn_chunk_tokens",),
    mechanism="tttvideo.models.layers.token_chunked, on every block's MLP (apply_checkpointing sets its chunk)",
    is_on=lambda cfg: cfg.checkpointing.ffn_chunk_tokens > 0,
    options=lambda cfg, phase, gpus: (
        _setting("", "checkpointing.ffn_chunk_tokens", 0),
        _setting(f"FFN chunks of {FFN_CHUNK_TOKENS}", "checkpointing.ffn_chunk_tokens", FFN_CHUNK_TOKENS),
    ) if phase == "train" else (),
    # counted by the block model (tttvideo.memory.plan.activations): the MLP's hidden layer of one chunk instead of
    # every token's; its measured curves are its own (none measured yet)
    regime="activation",
    regime_tag=lambda cfg: f"ffn{cfg.checkpointing.ffn_chunk_tokens}" if cfg.checkpointing.ffn_chunk_tokens > 0 else "",
    advice=_ffn_chunk_advice,
)


# ------------------------------------------------------------------------------------------- window-wise block form
# what the planner tries: the 30- and 63-s Wan stages' settings (the TTT layer's chunks as the FFN's; four groups of
# Wan2.1-1.3B's 24 TTT heads)
WINDOW_TTT_CHUNK_TOKENS, WINDOW_HEAD_GROUPS = 32768, 4
_WINDOW_KEYS = ("checkpointing.attention_by_window", "checkpointing.ttt_chunk_tokens", "checkpointing.ttt_head_groups")


def _window_form(on: bool) -> Option:
    def apply(cfg: Config) -> None:
        ck = cfg.checkpointing
        ck.attention_by_window = on
        ck.ttt_chunk_tokens = WINDOW_TTT_CHUNK_TOKENS if on else 0
        ck.ttt_head_groups = WINDOW_HEAD_GROUPS if on else 1

    label = f"window-wise, TTT chunks of {WINDOW_TTT_CHUNK_TOKENS} x {WINDOW_HEAD_GROUPS} head groups" if on else ""
    return Option(label, apply, _WINDOW_KEYS)


def _window_options(cfg: Config, phase: Phase, gpus: int) -> tuple[Option, ...]:
    from tttvideo.models.backbone import backbone_of

    if phase != "train":
        return ()
    if not backbone_of(cfg.model.preset).has_window_form:
        # another backbone's settings stay the config's (CogVideoX has no window-wise form)
        return (Option("", lambda cfg: None, ()),)
    return _window_form(False), _window_form(True)


def window_form(cfg: Config) -> bool:
    """Whether a training step runs the window-wise form of a backbone that has one (`BackboneSpec.has_window_form`,
    Wan's: checkpointing.attention_by_window with the TTT passes over token chunks, ttt_chunk_tokens)."""
    from tttvideo.models.backbone import backbone_of

    ck = cfg.checkpointing
    return backbone_of(cfg.model.preset).has_window_form and ck.attention_by_window and ck.ttt_chunk_tokens > 0


WINDOW_FORM = MemoryTechnique(
    name="window-wise block form",
    phases=("train",),
    keys=_WINDOW_KEYS,
    # Wan's block in training: both attentions one window at a time, each window checkpointed (WanBlock._by_window),
    # and the TTT passes as gated passes over token chunks, their scans over groups of heads (TTTLayer._chunked)
    mechanism="tttvideo.models.wan.block.WanBlock (attention_by_window) and tttvideo.ttt.layer.TTTLayer's chunked "
              "passes, set by apply_checkpointing",
    is_on=window_form,
    options=_window_options,
    # counted by the block model: its own stream copies and time factor (BlockConstants.window_stream_copies,
    # window_time, measured on Wan2.1-1.3B at 63 s)
    regime="activation",
    regime_tag=lambda cfg: "window" if window_form(cfg) else "",
)


REGISTRY: tuple[MemoryTechnique, ...] = (FP8_WEIGHTS, ADAMW_8BIT, FP8_STREAMING, CHECKPOINTING, ACTIVATION_OFFLOAD,
                                         NESTED_CHECKPOINTING, FFN_CHUNKS, WINDOW_FORM, SEQUENCE_PARALLEL,
                                         CHUNKED_INFERENCE, GUIDANCE_PASSES, SAMPLE_BLOCK_OFFLOAD, FP8_EVERY_LINEAR)


def check_techniques(cfg: Config, processes: int) -> None:
    """A ConfigError naming the key when a technique that is on cannot apply to a launch of `processes`."""
    for technique in REGISTRY:
        if technique.check is not None:
            technique.check(cfg, processes)


def techniques(phase: Phase) -> tuple[MemoryTechnique, ...]:
    """The registered techniques that apply to `phase`, in registry order."""
    return tuple(t for t in REGISTRY if phase in t.phases)


def calibration_setups() -> list[CalibrationSetup]:
    """Every technique's calibration setups, in run order."""
    return sorted((s for t in REGISTRY for s in t.calibration), key=lambda s: s.order)
