"""AdamW with the original's parameter groups and learning-rate schedule.

Groups: `lr` for pretrained weights (backbone, attention, LoRA; groups named "pretrained"), `lr_ssm` for everything
new in the TTT layers (TTT projections, inner model, eta gate, norms) and the tanh gates (groups named "ssm", the
original's name, which checkpoints' optimizer states carry); `tttvideo.models.adapters.is_ttt_parameter` decides
which is which. Each is split again into weight-decayed and not ("_no_decay").
Biases (`*.bias`, the inner model's `b1`/`b2`, `*_bias`) and normalisation weights (LayerNorm / GroupNorm modules,
the TTT layer's `ttt_norm_*`) take no weight decay. Only parameters with requires_grad enter the optimizer, so the
adapter (`model.adapter`) decides what trains.

`train.optimizer` picks the update: "adamw" (torch.optim.AdamW, moments in the parameters' dtype) or "adamw8bit"
(torchao's AdamW8bit: both moments as 8-bit codes with one fp32 scale per 256 values, ~2 bytes per trainable
parameter instead of AdamW's 4 for bf16 or 8 for fp32 parameters; the update itself is computed in fp32). With bf16
weights, `train.bf16_stochastic_round` writes that fp32 result back by stochastic rounding: at the recipe's lr 1e-5
most updates are below half a bf16 step of their weight and round-to-nearest drops every one of them. Tensors
under 4096 values, or not a multiple of 256, keep plain moments in the parameter's dtype (torchao's rule, after
bitsandbytes).

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
from tttvideo.errors import ConfigError
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
    return next((float(g["lr"]) for g in optimizer.param_groups if is_ssm_group(g) == ssm), 0.0)


def build_optimizer(model: nn.Module, train: TrainConfig) -> torch.optim.Optimizer:
    """`train.optimizer` over `param_groups(model)` with the config's betas and eps."""
    groups = param_groups(model, train.lr, train.lr_ssm, train.weight_decay)
    if not groups:
        raise ValueError("no parameter requires grad: the adapter froze the whole model")
    betas = (train.adam_beta1, train.adam_beta2)
    if train.optimizer == "adamw8bit":
        return adamw8bit_class()(groups, betas=betas, eps=train.adam_eps,
                                 bf16_stochastic_round=train.bf16_stochastic_round)
    if train.bf16_stochastic_round:  # the trainer refuses this before building the model; here for direct callers
        from tttvideo.memory.techniques.weights import STOCHASTIC_ROUND_NEEDS_8BIT

        raise ConfigError(STOCHASTIC_ROUND_NEEDS_8BIT)
    return torch.optim.AdamW(groups, betas=betas, eps=train.adam_eps)


@functools.cache
def adamw8bit_class() -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit, adapted: learning rates stay Python floats in the param groups (as with
    torch.optim.AdamW), and parameters on the CPU are updated eagerly."""
    try:
        from torchao.optim import AdamW8bit
        from torchao.optim.adam import single_param_adam
        from torchao.optim.subclass_8bit import OptimState8bit
    except ImportError:
        raise ConfigError("train.optimizer = 'adamw8bit' needs torchao: run pip install 'tttvideo[memory]' (or "
                          "pip install torchao), or set train.optimizer = 'adamw'") from None

    class FloatLrAdamW8bit(AdamW8bit):
        @staticmethod
        def _subclass_zeros(p: torch.Tensor, signed: bool, block_size: int) -> torch.Tensor:
            # The 8-bit state's dtype is only its appearance (codes are uint8, scales fp32). torchao gives it the
            # parameter's dtype, but its view op (which DTensor.from_local applies under FSDP2) forgets it and
            # answers float32, so a bf16 parameter's state became a float32 view of a bf16 base; the compiled
            # update then fakeified it with base.view(float32), an op the state lacks ("OptimState8bit has no
            # aten.view.dtype"). A float32 appearance throughout keeps base and view alike.
            return OptimState8bit.zeros(p.shape, signed, block_size, p.device)

        def add_param_group(self, param_group: dict[str, Any]) -> None:
            lr = param_group.get("lr", self.defaults["lr"])
            super().add_param_group(param_group)
            # torchao turns lr into an fp32 tensor (so that compiled steps do not recompile when it changes); the
            # float keeps the groups what the scheduler, the trainer's logging and saved states expect
            self.param_groups[-1]["lr"] = float(lr)

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            floats = [g["lr"] for g in self.param_groups]
            for g in self.param_groups:
                g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32)
            try:
                if any(p.grad is not None and p.device.type == "cpu" for g in self.param_groups for p in g["params"]):
                    self._eager_step()
                else:
                    super().step()
            finally:
                for g, lr in zip(self.param_groups, floats):
                    g["lr"] = lr
            return loss

        def _eager_step(self) -> None:
            # torchao compiles the per-parameter update (torch.compile, fullgraph); on the CPU that is a C++ build
            # per parameter shape (about a minute each on a 2-core machine), so the same function runs eagerly
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                    state["step"] += 1
                    single_param_adam(p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                                      None, group["lr"], group["betas"][0], group["betas"][1],
                                      group["weight_decay"], group["eps"], True,
                                      self.bf16_stochastic_round and p.dtype is torch.bfloat16)

    return FloatLrAdamW8bit


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


def schedule_change(old_steps: int, train: TrainConfig, step: int) -> str | None:
    """What resuming at optimizer step `step` (0-based) with train.steps changed from `old_steps` does to the learning
    rates, as a sentence; None when nothing changes (same steps, or both decays constant). The schedule is a
    function of train.steps, so from the resumed step on the rates follow the new one."""
    if old_steps == train.steps or (train.decay == "constant" and train.decay_ssm == "constant"):
        return None

    def lr(peak: float, decay: str, total: int) -> float:
        end_ratio = train.lr_end / peak if peak > 0 else 1.0
        return peak * lr_multiplier(step, total, train.warmup_steps, decay, end_ratio)

    def change(name: str, peak: float, decay: str) -> str:
        new, old = lr(peak, decay, train.steps), lr(peak, decay, old_steps)
        # both ends of a schedule are train.lr_end: there the rate does not move, and "x instead of x" misleads
        if f"{new:.3g}" == f"{old:.3g}":
            return f"{name} stays {new:.3g}"
        return f"{name} is {new:.3g} instead of {old:.3g}"

    return (f"the learning rates ({train.decay} decay of train.lr, {train.decay_ssm} of train.lr_ssm, down to "
            f"train.lr_end at the last step) now follow a {train.steps}-step schedule, so at step {step + 1} "
            f"{change('train.lr', train.lr, train.decay)} and {change('train.lr_ssm', train.lr_ssm, train.decay_ssm)}"
            f"; keep train.steps = {old_steps} to continue the old schedule")
