"""The ZeroSNR DDPM training schedule with v-prediction (CogVideoX's own), shared by training and sampling, and what
training and sampling ask of a flow-matching schedule instead (`FlowMatchingSchedule`; Wan's is
`tttvideo.models.wan.diffusion.WanFlowMatching`).

Betas run from 0.00085 to 0.012 linearly in sqrt ("scaled_linear") over 1000 steps and are then rescaled so the
last timestep has exactly zero signal-to-noise ratio (Lin et al. 2023, Algorithm 1). The arithmetic mirrors
diffusers' `DDPMScheduler(beta_schedule="scaled_linear", rescale_betas_zero_snr=True)` step for step in float32,
so `alphas_cumprod` is bitwise the same table and checkpoints trained here sample with diffusers' schedulers too.

With a_t = alphas_cumprod[t]:  x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps,  v = sqrt(a_t) eps - sqrt(1 - a_t) x0,
and back: x0 = sqrt(a_t) x_t - sqrt(1 - a_t) v,  eps = sqrt(1 - a_t) x_t + sqrt(a_t) v.
At the terminal step a_t = 0, so x_t is pure noise and v = -x0: the model learns to predict the clean sample
from nothing but the text, which is why ZeroSNR fixes the brightness bias of the plain schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


def scaled_linear_betas(num_steps: int, beta_start: float, beta_end: float) -> torch.Tensor:
    # float32 on purpose: the table must match diffusers' bit for bit.
    return torch.linspace(beta_start**0.5, beta_end**0.5, num_steps, dtype=torch.float32) ** 2


def rescale_zero_terminal_snr(betas: torch.Tensor) -> torch.Tensor:
    """Shift and scale sqrt(alphas_cumprod) so the last entry is 0 and the first is unchanged; return new betas."""
    alphas_bar_sqrt = torch.cumprod(1.0 - betas, dim=0).sqrt()
    first = alphas_bar_sqrt[0].clone()
    last = alphas_bar_sqrt[-1].clone()
    alphas_bar_sqrt -= last
    alphas_bar_sqrt *= first / (first - last)
    alphas_bar = alphas_bar_sqrt**2
    alphas = torch.cat([alphas_bar[0:1], alphas_bar[1:] / alphas_bar[:-1]])
    return 1.0 - alphas


def _expand(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-sample coefficients [B] -> [B, 1, 1, ...] broadcastable against `like`."""
    values = values.flatten()
    return values.reshape(values.shape[0], *([1] * (like.dim() - 1)))


@dataclass
class ZeroSNRSchedule:
    """alphas_cumprod of the training schedule plus the conversions between x0, eps, x_t and v."""

    num_train_timesteps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012

    def __post_init__(self) -> None:
        betas = rescale_zero_terminal_snr(scaled_linear_betas(self.num_train_timesteps, self.beta_start,
                                                              self.beta_end))
        self.betas = betas
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)

    def _coefficients(self, t: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """sqrt(a_t) and sqrt(1 - a_t) in `like`'s dtype and device, shaped to broadcast over a batch."""
        if not torch.is_tensor(t):
            t = torch.tensor(t)
        t = t.to(device=like.device, dtype=torch.long)
        if t.dim() == 0:
            t = t.expand(like.shape[0])
        a = self.alphas_cumprod.to(device=like.device, dtype=like.dtype)[t]
        return _expand(a**0.5, like), _expand((1 - a) ** 0.5, like)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        sa, s1a = self._coefficients(t, x0)
        return sa * x0 + s1a * noise

    def velocity(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The v-prediction target for clean sample x0 and noise eps at timestep t."""
        sa, s1a = self._coefficients(t, x0)
        return sa * noise - s1a * x0

    def v_to_x0(self, x_t: torch.Tensor, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        sa, s1a = self._coefficients(t, x_t)
        return sa * x_t - s1a * v

    def v_to_eps(self, x_t: torch.Tensor, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        sa, s1a = self._coefficients(t, x_t)
        return s1a * x_t + sa * v

    def snr(self, t: torch.Tensor) -> torch.Tensor:
        a = self.alphas_cumprod[torch.as_tensor(t, dtype=torch.long)]
        return a / (1 - a)


def stratified_timesteps(batch: int, num_train_timesteps: int, generator: torch.Generator | None = None,
                         first_stratum: int = 0, num_strata: int | None = None) -> torch.Tensor:
    """One timestep per sample, stratified over a larger batch of `num_strata` samples (default: this batch).

    Stratum j covers [j/S, (j+1)/S) of the timestep range; sample i draws uniformly inside stratum first_stratum + i.
    The trainer stratifies over the effective batch (micro-batches x accumulation steps x data-parallel ranks), as
    the original stratifies across ranks: compared with i.i.d. draws this lowers the variance of each optimizer
    step's loss while keeping every timestep equally likely over a run.
    """
    num_strata = batch if num_strata is None else num_strata
    if not 0 <= first_stratum <= num_strata - batch:
        raise ValueError(f"strata {first_stratum}..{first_stratum + batch - 1} do not fit in {num_strata}")
    index = torch.arange(batch, dtype=torch.float64) + first_stratum
    u = torch.rand(batch, generator=generator, dtype=torch.float64)
    t = ((index + u) / num_strata * num_train_timesteps).floor().long()
    return t.clamp_(0, num_train_timesteps - 1)


@runtime_checkable
class FlowMatchingSchedule(Protocol):
    """What the flow-matching loss (`train.loss`) and samplers (`sample.solvers`) ask of a schedule
    (`models.wan.diffusion.WanFlowMatching` is one): noise levels sigma in [0, 1] (1 = pure noise), the noised
    latents, the velocity target, the model's timestep of a level, and the sampling grids."""

    num_train_timesteps: int

    def sigmas_from_uniform(self, u: torch.Tensor) -> torch.Tensor: ...

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor: ...

    def target(self, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor: ...

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor: ...

    def euler_sigmas(self, steps: int) -> torch.Tensor: ...

    def euler_step(self, x: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor: ...

    def diffusers_scheduler(self, solver: str = "unipc") -> Any: ...


def is_flow_matching(schedule: Any) -> bool:
    return isinstance(schedule, FlowMatchingSchedule)
