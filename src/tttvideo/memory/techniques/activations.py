"""Techniques on training activations: activation checkpointing (whole blocks, keeping some outputs, or blocks and
their four parts), activation offload to host memory, nested checkpointing, the MLP over token chunks, and Wan's
window-wise block form."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tttvideo.config.schema import CHECKPOINT_PARTS, Config
from tttvideo.memory.techniques.common import (BF16_PLAIN, BLOCK, FP32_AUTOCAST, LORA, QKVO, all_block_inputs,
                                               block_input_bytes, setting)
from tttvideo.memory.techniques.technique import CalibrationSetup, MemoryTechnique, Option, Phase, Saving

if TYPE_CHECKING:
    from torch import nn


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
        kept = all_block_inputs(cfg, model) if set(ck.keep) == {"attention"} else None
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
    options=lambda cfg, phase, gpus: (setting("", "checkpointing.offload_activations", False),
                                      setting("offload", "checkpointing.offload_activations", True))
    if phase == "train" else (),
    regime="activation",
    regime_tag=lambda cfg: "offload" if cfg.checkpointing.offload_activations else "resident",
    uses_host=True,
    advice=lambda cfg, model, phase, gpus: [] if cfg.checkpointing.offload_activations else [Saving(
        "checkpointing.offload_activations = true",
        "of saved activations to host memory (with block checkpointing: the block inputs)",
        all_block_inputs(cfg, model))],
    calibration=(
        CalibrationSetup("lora, sub-block ckpt + offload, fp8, 8-bit AdamW", LORA, "train", (), ("3s", "9s"),
                         ("18s",), order=1),
        # held out: a calibrated activation regime with other counted parts (weight storage, optimizer)
        CalibrationSetup("lora, sub-block ckpt + offload, bf16, AdamW", LORA, "train",
                         ("model.frozen_weights=dtype", "train.optimizer=adamw"), (), ("3s", "9s"), order=11),
    ),
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
        setting("", "checkpointing.nested_span", 0),
        setting(f"nested {nested_span_for(cfg)}", "checkpointing.nested_span", nested_span_for(cfg)),
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
        setting("", "checkpointing.ffn_chunk_tokens", 0),
        setting(f"FFN chunks of {FFN_CHUNK_TOKENS}", "checkpointing.ffn_chunk_tokens", FFN_CHUNK_TOKENS),
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
