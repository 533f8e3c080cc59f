"""AdamW with the original's parameter groups and learning-rate schedule.

Groups: `lr` for pretrained weights (backbone, attention, LoRA; groups named "pretrained"), `lr_ssm` for everything
new in the TTT layers (TTT projections, inner model, eta gate, norms) and the tanh gates (groups named "ssm", the
original's name, which checkpoints' optimizer states carry); `tttvideo.models.adapters.is_ttt_parameter` decides
which is which. Each is split again into weight-decayed and not ("_no_decay").
Biases (`*.bias`, the inner model's `b1`/`b2`, `*_bias`) and normalisation weights (LayerNorm / GroupNorm modules,
the TTT layer's `ttt_norm_*`) take no weight decay. Only parameters with requires_grad enter the optimizer, so the
adapter (`model.adapter`) decides what trains.

Schedule (the original's, per group): linear warmup from 0 over `warmup_steps`, then `decay` (linear in the original)
takes `lr` and `decay_ssm` (cosine) takes `lr_ssm` to the same absolute `lr_end` at the last step. A group whose
peak is below lr_end rises to it; a peak of 0 stays 0.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import torch
from torch import nn

from tttvideo.config.schema import TrainConfig
from tttvideo.models.adapters import is_ttt_parameter

PRETRAINED, SSM = "pretrained", "ssm"  # optimizer group names, without the "_no_decay" suffix
_NORM_MODULES = (nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", nn.LayerNorm))
_BIAS = re.compile(r"(^bias$|_bias$|^b\d+$)")
_NORM_PARAM = re.compile(r"(^|_)norm(_|$)")


def decays(module: nn.Module, leaf: str) -> bool:
    """Whether parameter `leaf` of `module` (its direct owner) takes weight decay."""
    if isinstance(module, _NORM_MODULES) or _NORM_PARAM.search(leaf):
        return False
    return not _BIAS.search(leaf)


def param_groups(model: nn.Module, lr: float, lr_ssm: float, weight_decay: float) -> list[dict[str, Any]]:
    groups: dict[tuple[str, bool], dict[str, Any]] = {}
    for module_name, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            name = f"{module_name}.{leaf}" if module_name else leaf
            kind = SSM if is_ttt_parameter(name) else PRETRAINED
            decay = decays(module, leaf)
            group = groups.setdefault((kind, decay), {
                "name": f"{kind}{'' if decay else '_no_decay'}",
                "params": [], "param_names": [],
                "lr": lr_ssm if kind == SSM else lr,
                "weight_decay": weight_decay if decay else 0.0,
            })
            group["params"].append(p)
            group["param_names"].append(name)
    # a fixed group order keeps optimizer state_dicts comparable between runs
    return [groups[k] for k in sorted(groups)]


def is_ssm_group(group: dict[str, Any]) -> bool:
    """Whether an optimizer group holds TTT parameters and gates (trained with lr_ssm)."""
    return group.get("name", "").startswith(SSM)


def group_lr(optimizer: torch.optim.Optimizer, ssm: bool) -> float:
    """The current learning rate of the first TTT (ssm=True) or pretrained group; 0.0 when there is none."""
    return next((g["lr"] for g in optimizer.param_groups if is_ssm_group(g) == ssm), 0.0)


def build_optimizer(model: nn.Module, train: TrainConfig) -> torch.optim.AdamW:
    groups = param_groups(model, train.lr, train.lr_ssm, train.weight_decay)
    if not groups:
        raise ValueError("no parameter requires grad: the adapter froze the whole model")
    return torch.optim.AdamW(groups, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)


def lr_multiplier(step: int, total: int, warmup: int, decay: str, end_ratio: float) -> float:
    """Multiplier of a peak learning rate for optimizer step `step` (0-based) of `total`; `end_ratio` = lr_end / peak
    is reached at the last step."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if decay == "constant":
        return 1.0
    span = max(1, total - 1 - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    if decay == "linear":
        return 1.0 - (1.0 - end_ratio) * progress
    return end_ratio + (1.0 - end_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """One multiplier function per parameter group: `decay` for pretrained groups, `decay_ssm` for TTT groups."""
    fns = []
    for group in optimizer.param_groups:
        ssm = is_ssm_group(group)
        peak = train.lr_ssm if ssm else train.lr
        end_ratio = train.lr_end / peak if peak > 0 else 1.0
        fns.append(functools.partial(lr_multiplier, total=train.steps, warmup=train.warmup_steps,
                                     decay=train.decay_ssm if ssm else train.decay, end_ratio=end_ratio))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fns)
