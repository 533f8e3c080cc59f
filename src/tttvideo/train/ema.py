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

Under torchrun the parameters are FSDP2 shards (DTensors): each rank averages its own shard (the fp32 average
costs a GPU its share of 4 bytes per trainable parameter), a checkpoint gathers the shards one tensor at a time and
rank 0 writes the whole average, the same file a one-process run writes, and a resume on any number of processes
reads each rank's part back from it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch

from tttvideo.parallel.shards import gather_whole, local, local_part, reshard

WARMUP = 10  # d = min(decay, (1 + n) / (WARMUP + n))


class WeightAverage:
    """The EMA of `model`'s trainable parameters (those with requires_grad when it is made)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay {decay} is not in (0, 1)")
        self.decay = decay
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        # this rank's part: the local shard of a sharded parameter
        self.average = {n: local(p).detach().to(torch.float32, copy=True) for n, p in self.params.items()}
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
        torch._foreach_lerp_(averages, [local(self.params[n]).detach().float() for n in names], weight)
        self.updates += 1

    def nbytes(self) -> int:
        """This rank's bytes of the average."""
        return sum(t.numel() * t.element_size() for t in self.average.values())

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """What the training state holds besides the tensors (those go to ema.safetensors)."""
        return {"updates": self.updates, "decay": self.decay}

    def whole(self, keep: bool = True) -> "_AverageWeights | None":
        """The whole average, ready to save, for the rank that writes it (`keep`; None elsewhere). Sharded
        parameters' averages are gathered one tensor at a time into host memory: a collective, every rank calls
        it."""
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in self.params.values()):
            tensors = {n: gather_whole(self.average[n], p, keep) for n, p in self.params.items()}
        else:
            tensors = self.average
        return _AverageWeights(self._spec, tensors) if keep else None

    def save(self, path: Path) -> Path:
        """The average as a partial model file (`tttvideo.models.save_checkpoint`'s format). With sharded
        parameters every rank calls `whole` instead, and the writer saves what it returns."""
        return self.whole().save(path)

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
            try:
                part = local_part(t, self.params[n])
            except ValueError as err:
                raise UserError(f"{path} holds the EMA of {n} as {err}; resume with the model settings the run "
                                f"trained with") from None
            self.average[n].copy_(part)
        self.updates = int(state["updates"])

    # ------------------------------------------------------------------ sampling from it
    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The average in the model's parameters for the `with` block, the trained weights back after it (exactly:
        they wait in host memory meanwhile, so the swap needs no second copy on the GPU)."""
        with torch.no_grad():
            reshard(self._spec)  # sharded parameters: write into the shards every forward gathers from
            kept = {n: local(p).detach().to("cpu", copy=True) for n, p in self.params.items()}
            for n, p in self.params.items():
                local(p).copy_(self.average[n])
        try:
            yield
        finally:
            with torch.no_grad():
                reshard(self._spec)
                for n, p in self.params.items():
                    local(p).copy_(kept[n])


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

    def save(self, path: Path) -> Path:
        from tttvideo.models import save_checkpoint

        return save_checkpoint(self, path, trainable_only=True)
