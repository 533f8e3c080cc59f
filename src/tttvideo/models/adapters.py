"""What trains: `sft` (everything), `qkvo` (attention q/k/v/o and their norms, all TTT parameters
and gates; the rest frozen) and `lora` (peft LoRA on attention q/k/v/o, TTT parameters and gates fully trained).

Every parameter falls in one group (`parameter_group`): backbone, attention, ttt, gates, lora. The TTT layers and
their gates (`is_ttt_parameter`) are what this model adds to CogVideoX: the weight loader initialises them instead of
reading them, and the optimizer trains them with `lr_ssm` instead of `lr`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tttvideo.errors import ConfigError

ADAPTERS = ("sft", "qkvo", "lora")
GROUPS = ("backbone", "attention", "ttt", "gates", "lora")
TTT_GROUPS = ("ttt", "gates")
# attention linear layers LoRA wraps; a regex so that nothing outside the blocks' attention matches
LORA_TARGETS = r".*blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out)"


def parameter_group(name: str) -> str:
    """The group of a parameter, from its name in `model.named_parameters()`."""
    n = f".{name}"
    if "lora_" in n:
        return "lora"
    if ".ttt." in n:
        return "gates" if "_gate_" in n else "ttt"
    if ".attn." in n:
        return "attention"
    return "backbone"


def is_ttt_parameter(name: str) -> bool:
    """A parameter of a TTT layer or its gates: absent from CogVideoX checkpoints, trained with lr_ssm."""
    return parameter_group(name) in TTT_GROUPS


def trains_in(adapter: str, group: str) -> bool:
    if adapter == "sft":
        return True
    if adapter == "qkvo":
        return group in ("attention", "ttt", "gates")
    return group in ("lora", "ttt", "gates")  # lora


def apply_adapter(model: nn.Module, adapter: str, lora_rank: int = 64, lora_alpha: float = 64.0) -> nn.Module:
    """Set requires_grad per group (and inject LoRA layers for `lora`, in place). Returns the model."""
    if adapter not in ADAPTERS:
        raise ConfigError(f"model.adapter {adapter!r} is not one of {', '.join(ADAPTERS)}")
    if adapter == "lora":
        if any(parameter_group(n) == "lora" for n, _ in model.named_parameters()):
            raise ValueError("LoRA layers are already injected into this model")
        from peft import LoraConfig, inject_adapter_in_model

        config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=LORA_TARGETS, lora_dropout=0.0,
                            bias="none")
        inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_(trains_in(adapter, parameter_group(name)))
    return model


def trainable_summary(model: nn.Module) -> list[dict[str, Any]]:
    """Per group: parameter count and how many train."""
    rows = {g: {"group": g, "params": 0, "trainable": 0} for g in GROUPS}
    for name, p in model.named_parameters():
        row = rows[parameter_group(name)]
        row["params"] += p.numel()
        row["trainable"] += p.numel() if p.requires_grad else 0
    out = [r for r in rows.values() if r["params"]]
    out.append({"group": "total", "params": sum(r["params"] for r in out),
                "trainable": sum(r["trainable"] for r in out)})
    return out


def print_trainable_summary(model: nn.Module, console: Any = None, title: str = "parameters") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("group", "parameters", "trainable", "frozen"):
        table.add_column(col, justify="left" if col == "group" else "right")
    for r in trainable_summary(model):
        table.add_row(r["group"], f"{r['params']:,}", f"{r['trainable']:,}", f"{r['params'] - r['trainable']:,}")
    (console or Console()).print(table)
