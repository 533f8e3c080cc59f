"""One classifier-free-guided prediction of the transformer, and the solver loop built on it.

The guided prediction is v_u + s (v_c - v_u) on the model's output: CogVideoX's CFG on the v-prediction, and Wan's on
the flow velocity. The solver is `sample.solver` on the backbone's schedule (`sample.solvers.make_solver`).
Conditional and unconditional predictions go through ONE forward at batch 2 (`sample.cfg_batched`, the fastest) or
two forwards at batch 1 (half the activations). When the batch-2 forward runs out of GPU memory the prediction
falls back to two passes, says so once, and stays there for the rest of the video. At guidance 1 the unconditional
pass is skipped. Under torchrun the forward takes the rank's sequence-parallel group (`sp`), and with a
`GuidanceSplit` each rank of a pair runs one of the two passes and the pair exchanges them
(`tttvideo.sample.distributed`). `tttv sample`, `tttv profile --phase sample` and benchmarks/sample.py all run this
step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from tttvideo.config.schema import SampleConfig
from tttvideo.layout import VideoLayout
from tttvideo.models.backbone import backbone_of
from tttvideo.sample.solvers import GuidanceSchedule, guide, make_solver

if TYPE_CHECKING:
    from tttvideo.parallel.sequence import SequenceParallel
    from tttvideo.sample.distributed import GuidanceSplit

log = logging.getLogger(__name__)


class GuidedPrediction:
    """`step(x, t, scale)` -> the guided prediction (float32, v or flow velocity) of latents x [1, T, C, h, w] at
    timestep t.

    cond / uncond: text features [1, segments, tokens, dim] on the model's device and dtype. With
    `fall_back_on_oom=False` an out-of-memory error of the batch-2 forward propagates (benchmarks record it).
    `sp`: the sequence-parallel group every forward runs over; `split`: this rank runs only its half of the
    guidance (one pass at batch 1, whatever `batched` says) and gets the other from its partner."""

    def __init__(self, model: torch.nn.Module, layout: VideoLayout, cond: torch.Tensor, uncond: torch.Tensor,
                 batched: bool = True, fall_back_on_oom: bool = True, sp: SequenceParallel | None = None,
                 split: GuidanceSplit | None = None):
        self.model, self.layout = model, layout
        self.cond, self.uncond = cond, uncond
        self.sp, self.split = sp, split
        self.batched = batched and split is None
        self.both = torch.cat([uncond, cond]) if self.batched else None
        self.fall_back_on_oom = fall_back_on_oom

    def _predict(self, x: torch.Tensor, text: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        if self.sp is None:  # the one-process call, unchanged (stand-in models in tests take no `sp`)
            return self.model(x, text, t, self.layout).float()
        return self.model(x, text, t, self.layout, sp=self.sp).float()

    def __call__(self, x: torch.Tensor, t: int | torch.Tensor, scale: float) -> torch.Tensor:
        if scale == 1.0:  # guidance 1 is the conditional prediction alone (with a split: on both ranks, no exchange)
            return self._predict(x, self.cond, t)
        if self.split is not None:
            v_u, v_c = self.split.exchange(self._predict(x, self.cond if self.split.conditional else self.uncond, t))
            return guide(v_u, v_c, scale)
        if self.batched:
            try:
                v_u, v_c = self._predict(torch.cat([x, x]), self.both, t).chunk(2)
                return guide(v_u, v_c, scale)
            except torch.OutOfMemoryError:
                if not self.fall_back_on_oom:
                    raise
                self._fall_back(x.device)
        v_u = self._predict(x, self.uncond, t)
        return guide(v_u, self._predict(x, self.cond, t), scale)

    def _fall_back(self, device: torch.device) -> None:
        # batch 2 does not fit (CogVideoX-5B + TTT at 63 s on 80 GB): the same guidance in two passes, which halves
        # the activations, for the rest of this video
        self.batched, self.both = False, None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log.warning("guidance at batch 2 ran out of memory; continuing with two passes of batch 1 "
                    "(set sample.cfg_batched = false to start that way)")


@torch.no_grad()
def denoise(model: torch.nn.Module, layout: VideoLayout, cond: torch.Tensor, uncond: torch.Tensor,
            sample_cfg: SampleConfig, device: torch.device,
            on_step: Callable[[int, int], None] | None = None, sp: SequenceParallel | None = None,
            split: GuidanceSplit | None = None) -> torch.Tensor:
    """The solver loop for one story. cond/uncond: [segments, text_tokens, text_dim]. Returns the clean latents
    [1, T, C, h, w] float32 on the CPU. `sp` / `split`: see `GuidedPrediction`.

    The initial noise and every noise draw of a stochastic solver come from one CPU generator seeded with
    `sample_cfg.seed`, so a seed gives the same latents on any device, whether a story is sampled alone or not,
    and on every rank of a torchrun launch."""
    spec = model.spec
    gen = torch.Generator(device="cpu").manual_seed(int(sample_cfg.seed))
    shape = (1, layout.latent_frames, spec.in_channels, layout.latent_height, layout.latent_width)
    x = torch.randn(shape, generator=gen, dtype=torch.float32).to(device)
    solver = make_solver(sample_cfg.solver, backbone_of(spec).objective.schedule(), sample_cfg.steps)
    scales = GuidanceSchedule(sample_cfg.cfg_schedule, sample_cfg.cfg, sample_cfg.cfg_start,
                              sample_cfg.cfg_ramp_exp).scales(len(solver.timesteps))
    dtype = next(model.parameters()).dtype
    predict = GuidedPrediction(model, layout, cond[None].to(device=device, dtype=dtype),
                               uncond[None].to(device=device, dtype=dtype), batched=sample_cfg.cfg_batched, sp=sp,
                               split=split)
    last = len(solver.timesteps) - 1
    for i, t in enumerate(solver.timesteps):
        v = predict(x, t, scales[i])
        noise = torch.randn(shape, generator=gen, dtype=torch.float32) if solver.stochastic and i < last else None
        x = solver.step(i, x, v, noise)
        if on_step is not None:
            on_step(i, len(solver.timesteps))
    return x.cpu()
