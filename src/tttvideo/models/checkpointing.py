"""Activation checkpointing policy of the transformer: what each layer recomputes in backward.

Per layer: whole-block checkpointing in groups of `group_size` consecutive blocks, and per-module switches for
adaLN + attention, the forward TTT pass, the reverse TTT pass and adaLN + MLP. A list of rules
(``[[checkpointing.layers]]``, each with a Python-slice ``layers``) gives different settings to different layers,
e.g. the first, middle and last thirds; the last rule covering a layer wins. Everything uses
torch.utils.checkpoint non-reentrant, so it nests with itself and with the TTT scan's own checkpointing
(`ttt.scan_checkpoint_group_size`).

`nested_span` nests that once more (nested checkpointing): a span of consecutive checkpointed units is itself
checkpointed, so forward keeps only each span's input, and the span's recompute in backward keeps its units'
inputs while their backward runs. With n units and spans of k, about n / k + k inputs live at once instead of n
(2 x sqrt(n) at k = sqrt(n): 13 of the 5B's 42 at 63 s, where each is 2.1 GiB), for one more forward of the blocks.

`keep` makes a checkpointed block, or its checkpointed attention / MLP half, selective (torch's
`create_selective_checkpoint_contexts`): the outputs of the named kinds of operator (SDPA, matrix products) are
saved in forward and reused by the recompute, everything else is recomputed. Attention is the recompute that costs
most per byte kept: at 3 s its output is 0.11 GiB a layer for the 5B and its kernels more than half the backbone's
forward time. "matmul" keeps the backbone's products only (attention projections, MLP, adaLN): inside the long-range
layer (`long_range_layer`) they are recomputed, since the TTT layer's eight projections per block and its scan's
products would double what is kept (with them, the 5B's 3-s step does not fit 80 GB).

`ffn_chunk_tokens` runs each block's feed-forward MLP (Wan: with its adaLN and gated residual add) over chunks of that
many tokens in training, each chunk checkpointed on its own (`models.layers.token_chunked`): the MLP's hidden layer
exists for one chunk at a time, in forward and in backward, for one more forward of the MLP.

`ttt_chunk_tokens` runs the TTT layer's token-wise parts in training (its gather into scan order, q/k/v projection,
eta and scan-input glue; its post-norm and output projection) over chunks of that many tokens, each chunk
checkpointed (`tttvideo.ttt.layer.TTTLayer._chunked`), and with `ttt_head_groups` the scan over groups of heads,
each group checkpointed.

`attention_by_window` (Wan) runs a block's self- and cross-attention one window at a time, each window under its
own checkpoint (`models.wan.block.WanBlock._by_window`): the whole-video q/k/v, their fp32 RMSNorms, the gathered
windows and their fp32 RoPE are never made at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tttvideo.config.schema import CHECKPOINT_PARTS, CheckpointingConfig, CheckpointRule
from tttvideo.errors import ConfigError
from tttvideo.models.layers import MLP

if TYPE_CHECKING:  # the transformer imports this module
    from tttvideo.models.backbone import Backbone


def _ops(*names: str) -> frozenset[Any]:
    aten = torch.ops.aten
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))  # some exist only in newer torch


# the operator packets whose outputs `keep` saves, by the name the config uses
KEPT_OPS: dict[str, frozenset[Any]] = {
    "attention": _ops("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
                      "_flash_attention_forward", "_efficient_attention_forward"),
    "matmul": _ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm"),
}


# set while the block runs its long-range layer: the forward and the recompute both run it, so the policy below
# decides the same way in both, as selective checkpointing requires
_IN_LONG_RANGE_LAYER = contextvars.ContextVar("in_long_range_layer", default=False)


@contextlib.contextmanager
def long_range_layer() -> Any:
    """Marks the operators run inside as the long-range layer's: `keep = ["matmul"]` does not save their products."""
    token = _IN_LONG_RANGE_LAYER.set(True)
    try:
        yield
    finally:
        _IN_LONG_RANGE_LAYER.reset(token)


@functools.lru_cache(maxsize=None)
def _selective(keep: tuple[str, ...]) -> Callable[[], Any]:
    """The `context_fn` of torch.utils.checkpoint that saves the outputs of `keep`'s operators (matrix products
    only outside the long-range layer)."""
    saved = frozenset().union(*(KEPT_OPS[k] for k in keep))
    backbone_only = KEPT_OPS["matmul"]

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        packet = op.overloadpacket
        if packet in saved and not (packet in backbone_only and _IN_LONG_RANGE_LAYER.get()):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def checkpointed(fn: Callable[..., Any], *args: Any, keep: tuple[str, ...] = ()) -> Any:
    """fn(*args) under non-reentrant checkpointing, saving the outputs of `keep`'s operators (none: all
    recomputed)."""
    if keep:
        return checkpoint(fn, *args, use_reentrant=False, context_fn=_selective(tuple(sorted(keep))))
    return checkpoint(fn, *args, use_reentrant=False)


def maybe_checkpoint(fn: Callable[..., Any], enabled: bool, *args: Any, keep: tuple[str, ...] = ()) -> Any:
    """fn(*args), recomputed in backward instead of keeping its activations (but those of `keep`) when enabled and
    grad is on."""
    if enabled and torch.is_grad_enabled():
        return checkpointed(fn, *args, keep=keep)
    return fn(*args)


@dataclass(frozen=True)
class LayerPolicy:
    group_size: int = 1
    block: bool = False
    attention: bool = False
    forward_ttt: bool = False
    reverse_ttt: bool = False
    mlp: bool = False
    keep: tuple[str, ...] = ()

    @classmethod
    def of(cls, section: CheckpointingConfig | CheckpointRule) -> "LayerPolicy":
        """From a CheckpointingConfig or a CheckpointRule (same field names)."""
        fields = {f: getattr(section, f) for f in cls.__dataclass_fields__}
        fields["keep"] = tuple(sorted(set(fields["keep"])))
        return cls(**fields)

    def label(self) -> str:
        parts = [f"block x{self.group_size}"] if self.block else []
        parts += [name for name in CHECKPOINT_PARTS if getattr(self, name)]
        if parts and self.keep:
            parts.append("keeping " + " and ".join(self.keep))
        return ", ".join(parts) or "none"


_SLICE = re.compile(r"\s*(-?\d+)?\s*(:)?\s*(-?\d+)?\s*")


def parse_layers(text: str, num_layers: int) -> range:
    """'0:14', '28:', '-4:', ':', '7' -> the layer indices it covers."""
    m = _SLICE.fullmatch(text)
    if m is None or (m.group(2) is None and m.group(1) is None):
        raise ConfigError(
            f"checkpointing.layers: {text!r} is not a layer range; write a Python slice such as '0:14', '28:' or '-4:'"
        )
    if m.group(2) is None:  # a single index
        i = int(m.group(1))
        covered = range(num_layers)[i : i + 1 if i != -1 else None]
    else:
        start = int(m.group(1)) if m.group(1) else None
        stop = int(m.group(3)) if m.group(3) else None
        covered = range(num_layers)[start:stop]
    if len(covered) == 0:
        raise ConfigError(f"checkpointing.layers: {text!r} covers none of the model's {num_layers} layers "
                          f"(0..{num_layers - 1})")
    return covered


def resolve_policy(cfg: CheckpointingConfig, num_layers: int) -> list[LayerPolicy]:
    """One LayerPolicy per layer from a CheckpointingConfig."""
    policies = [LayerPolicy.of(cfg)] * num_layers
    for rule in cfg.layers:
        policy = LayerPolicy.of(rule)
        for i in parse_layers(rule.layers, num_layers):
            policies[i] = policy
    idle = [i for i, p in enumerate(policies) if p.keep and not (p.block or p.attention or p.mlp)]
    if idle:
        which = f"layers {idle[0]}..{idle[-1]}" if len(idle) > 1 else f"layer {idle[0]}"
        raise ConfigError(
            f"checkpointing.keep = {list(policies[idle[0]].keep)} keeps outputs of checkpointed blocks (or attention "
            f"/ MLP halves), and {which} checkpoint none; set checkpointing.block = true (or attention / mlp) for "
            "them, or keep = []")
    return policies


def block_units(policies: list[LayerPolicy]) -> list[tuple[int, int, bool]]:
    """(start, stop, checkpointed) runs of blocks: consecutive layers of one block-checkpointing policy are grouped by
    its group_size; every other layer is its own unchecked unit."""
    units, i, n = [], 0, len(policies)
    while i < n:
        p = policies[i]
        if not p.block:
            units.append((i, i + 1, False))
            i += 1
            continue
        j = i
        while j < n and j - i < p.group_size and policies[j] == p:
            j += 1
        units.append((i, j, True))
        i = j
    return units


def apply_checkpointing(model: Backbone, cfg: CheckpointingConfig) -> list[LayerPolicy]:
    """Set the switches of every block of a Backbone model from a CheckpointingConfig; returns the per-layer
    policies (for logging)."""
    policies = resolve_policy(cfg, len(model.blocks))
    for block, p in zip(model.blocks, policies):
        block.checkpoint_attention = p.attention
        block.checkpoint_mlp = p.mlp
        block.checkpoint_keep = p.keep
        if block.ttt is not None:
            block.ttt.checkpoint_forward = p.forward_ttt
            block.ttt.checkpoint_reverse = p.reverse_ttt
    if cfg.attention_by_window:
        if not all(hasattr(b, "attention_by_window") for b in model.blocks):
            raise ConfigError("checkpointing.attention_by_window runs Wan's windowed attentions one window at a "
                              "time; this model's blocks have no such form: set it to false")
        for b in model.blocks:
            b.attention_by_window = True
    model.block_units = block_units(policies)
    model.nested_span = cfg.nested_span
    from tttvideo.ttt.layer import TTTLayer

    if cfg.ttt_head_groups > 1 and cfg.ttt_chunk_tokens <= 0:
        raise ConfigError(f"checkpointing.ttt_head_groups = {cfg.ttt_head_groups} groups the heads of the TTT "
                          "layer's chunked training form; set checkpointing.ttt_chunk_tokens too (e.g. 32768), or "
                          "ttt_head_groups = 1")
    for m in model.blocks.modules():
        if isinstance(m, MLP):
            m.chunk_tokens = cfg.ffn_chunk_tokens
        elif isinstance(m, TTTLayer):
            m.chunk_tokens, m.head_groups = cfg.ttt_chunk_tokens, cfg.ttt_head_groups
    return policies


def nested_spans(units: list[tuple[int, int, bool]], span: int) -> list[tuple[int, int]]:
    """[first, last) ranges over `units` for nested checkpointing: runs of up to `span` consecutive checkpointed
    units, and every other unit alone (span <= 1: each unit alone)."""
    spans, i = [], 0
    while i < len(units):
        j = i + 1
        if span > 1 and units[i][2]:
            while j < len(units) and j - i < span and units[j][2]:
                j += 1
        spans.append((i, j))
        i = j
    return spans


def describe_policy(policies: list[LayerPolicy]) -> list[str]:
    """Runs of layers with the same policy: ['0-13: block x2', '14-41: attention, mlp']."""
    out, start = [], 0
    for i in range(1, len(policies) + 1):
        if i == len(policies) or policies[i] != policies[start]:
            out.append(f"{start}-{i - 1}: {policies[start].label()}")
            start = i
    return out
