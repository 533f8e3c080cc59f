"""An exponential moving average (EMA) of the trainable weights (`train.ema_decay`).

After the n-th optimizer step (n = 0, 1, ...) every trainable parameter p updates its fp32 average e:

    e = d e + (1 - d) p,    d = min(train.ema_decay, (1 + n) / (10 + n))

The warm-up (diffusers' EMAModel default) keeps the average from clinging to the weights the run started from: the
first update takes 90 % of p, and d reaches 0.99 only after 890 updates, so in a run of a few hundred steps the
average spans roughly the last tenth of it whatever the decay. The average starts as a copy of the weights the run
starts from (after `train.init_from`), lives on the parameters' device in fp32 (4 bytes per trainable parameter,
which the planner counts: `tttvideo.memory.plan.count`), and is saved with every checkpoint as ema.safetensors (the
model file's format, trainable parameters only, so any loader of model files reads it) with the update count in the
training state: a resumed run continues the average bit for bit. `tttvideo.sample.model.load_model` and
`train.init_from` load it over the checkpoint's model file (`sample.use_ema`); the trainer's own videos swap it in
for the time of the sample.

One process only: under torchrun the parameters are FSDP2 shards, and the trainer refuses train.ema_decay > 0.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch

WARMUP = 10  # d = min(decay, (1 + n) / (WARMUP + n))


class WeightAverage:
    """The EMA of `model`'s trainable parameters (those with requires_grad when it is made)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay {decay} is not in (0, 1)")
        self.decay = decay
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.average = {n: p.detach().to(torch.float32, copy=True) for n, p in self.params.items()}
        self.updates = 0
        self._spec = model  # save_checkpoint reads spec / use_ttt / sequence_layer from it

    def rate(self) -> float:
        """The decay of the next update."""
        return min(self.decay, (1 + self.updates) / (WARMUP + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current weights in; call once after each optimizer step that changed them."""
        weight = 1.0 - self.rate()
        names = list(self.average)
        averages = [self.average[n] for n in names]
        # lerp: e + w (p - e), the same average as d e + (1 - d) p in one pass over each tensor
        torch._foreach_lerp_(averages, [self.params[n].detach().float() for n in names], weight)
        self.updates += 1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.average.values())

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """What the training state holds besides the tensors (those go to ema.safetensors)."""
        return {"updates": self.updates, "decay": self.decay}

    def save(self, path: Path) -> Path:
        """The average as a partial model file (`tttvideo.models.save_checkpoint`'s format)."""
        from tttvideo.models import save_checkpoint

        return save_checkpoint(_AverageWeights(self._spec, self.average), path, trainable_only=True)

    def load(self, path: Path, state: dict[str, Any]) -> None:
        """Restore the average of a checkpoint (`save`'s file and `state`'s counters), exactly."""
        from safetensors.torch import load_file

        from tttvideo.errors import UserError

        tensors = load_file(str(path))
        if set(tensors) != set(self.average):
            missing, extra = sorted(set(self.average) - set(tensors)), sorted(set(tensors) - set(self.average))
            raise UserError(f"{path} does not hold the EMA of this model's trainable parameters (missing "
                            f"{missing[:4]}, unexpected {extra[:4]}); resume with the adapter the run trained with")
        for n, t in tensors.items():
            self.average[n].copy_(t)
        self.updates = int(state["updates"])

    # ------------------------------------------------------------------ sampling from it
    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The average in the model's parameters for the `with` block, the trained weights back after it (exactly:
        they wait in host memory meanwhile, so the swap needs no second copy on the GPU)."""
        with torch.no_grad():
            kept = {n: p.detach().to("cpu", copy=True) for n, p in self.params.items()}
            for n, p in self.params.items():
                p.copy_(self.average[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(kept[n])


class _AverageWeights:
    """The average in the shape `save_checkpoint` reads a model in (named parameters, spec, use_ttt, ...)."""

    def __init__(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor]):
        self.spec = model.spec
        self.use_ttt = model.use_ttt
        self.sequence_layer = model.sequence_layer
        self._tensors = tensors

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        # requires_grad is what save_checkpoint's trainable_only keeps: every tensor here is a trainable's average
        return iter((n, t.detach().requires_grad_(True)) for n, t in self._tensors.items())
