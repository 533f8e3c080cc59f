"""The block model's working sets from a fake-tensor trace of the setup's block unit instead of counted parts
(`tttv plan --trace`): `traced_working_sets(cfg)`.

The counted working set (`activations.working_set`) carries constants measured on CogVideoX-5B's blocks; for a
backbone without measured blocks (Wan) the trace of its own unit (`memory.trace.fake_trace`: its forward and its
backward recompute at full size, on fake tensors that allocate as a CUDA step would) says what the block that runs
holds. Forward and backward get their own working set: the unit's forward can peak above the saved inputs' end of
forward (the 63-s Wan stage's did, in block 0). A trace takes seconds at 63 s, so traces are kept per setup, keyed
by the config with the settings that do not change a unit's allocations (where saved inputs go, the optimizer)
reset.
"""

from __future__ import annotations

import copy

from tttvideo.config.schema import CheckpointingConfig, Config, TrainConfig
from tttvideo.memory.plan.activations import Part

HOW = "traced (fake tensors, memory.trace.fake_trace)"
ROWS = 6  # the largest groups of a traced peak named one by one; the rest in one row

_TRACES: dict[str, tuple[list[Part], list[Part]]] = {}


def _key(cfg: Config) -> str:
    """The config without the settings that move or keep saved inputs or change the optimizer: they do not change
    what one unit allocates."""
    c = copy.deepcopy(cfg)
    defaults, train = CheckpointingConfig(), TrainConfig()
    for name in ("offload_activations", "offload_host_gib", "nested_span"):
        setattr(c.checkpointing, name, getattr(defaults, name))
    for name in ("optimizer", "bf16_stochastic_round", "output_dir", "init_from", "steps"):
        if hasattr(train, name):
            setattr(c.train, name, getattr(train, name))
    return repr(c)


def _parts(phase: str, total: int, groups) -> list[Part]:
    named = groups[:ROWS]
    parts = [Part(f"working set ({phase}, traced): {p.count} x {p.dtype} {list(p.shape)} from {p.site}", p.nbytes,
                  HOW) for p in named]
    rest = total - sum(p.nbytes for p in named)
    if rest > 0:
        parts.append(Part(f"working set ({phase}, traced): the other {len(groups) - len(named)} groups", rest, HOW))
    return parts


def traced_working_sets(cfg: Config) -> tuple[list[Part], list[Part]]:
    """(forward, backward) working-set parts of the block unit of `cfg` that peaks: unit 0's forward and backward
    (every unit of a model is the same), less the unit's input, which the block model counts among the saved
    inputs."""
    from tttvideo.memory.trace.fake_trace import trace_unit

    key = _key(cfg)
    if key not in _TRACES:
        trace = trace_unit(cfg)
        _TRACES[key] = tuple(_parts(phase, *trace.working_set(phase)) for phase in ("forward", "backward"))
    return _TRACES[key]
