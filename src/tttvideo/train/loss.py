"""The training objective of the model's backbone (`BackboneSpec.objective`), one micro-batch at a time.

- v-prediction on a DDPM schedule (CogVideoX's ZeroSNR one, as the original trains): integer timesteps stratified
  over the optimizer step's whole effective batch, x_t = add_noise(x0, eps, t), target v = velocity(x0, eps, t).
- flow matching (Wan, `models.wan.diffusion.WanFlowMatching`): a uniform draw stratified the same way, turned into a
  noise level sigma by the schedule (shifted, or logit-normal then shifted), x_sigma = (1 - sigma) x0 + sigma eps,
  model timestep 1000 sigma, target the velocity eps - x0.

Where in the schedule the draws fall is `train.timestep_sampling` (`TimestepDensity`): uniform, or logit-normal
through its quantile function, so a stratified uniform draw stays stratified.

Both: Gaussian noise, each sample's text zeroed with probability `text_dropout` (what classifier-free guidance
samples against), loss = mean squared error of the model's prediction in float32.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tttvideo.diffusion import FlowMatchingSchedule, ZeroSNRSchedule, is_flow_matching, stratified_timesteps
from tttvideo.dtypes import torch_dtype
from tttvideo.layout import VideoLayout


def stratified_uniform(batch: int, generator: torch.Generator, first_stratum: int, num_strata: int) -> torch.Tensor:
    """One float64 draw in [0, 1) per sample, sample i uniform in stratum first_stratum + i of `num_strata`: the
    continuous counterpart of `stratified_timesteps` (the same random draws)."""
    if not 0 <= first_stratum <= num_strata - batch:
        raise ValueError(f"strata {first_stratum}..{first_stratum + batch - 1} do not fit in {num_strata}")
    index = torch.arange(batch, dtype=torch.float64) + first_stratum
    return (index + torch.rand(batch, generator=generator, dtype=torch.float64)) / num_strata


@dataclass(frozen=True)
class TimestepDensity:
    """Where training's noise levels fall, as a fraction of the way from clean (0) to pure noise (1): "uniform", or
    "logit-normal" sigmoid(mean + std z) with z standard normal (`train.timestep_sampling`, `timestep_mean`,
    `timestep_std`). Applied to the stratified uniform draws through its quantile function, so each stratum of
    the batch keeps its share of the distribution."""

    kind: str = "uniform"
    mean: float = 0.0
    std: float = 1.0

    @classmethod
    def from_config(cls, train: Any) -> "TimestepDensity":
        return cls(train.timestep_sampling, float(train.timestep_mean), float(train.timestep_std))

    def warp(self, u: torch.Tensor) -> torch.Tensor:
        """Uniform draws in [0, 1) -> draws of this density in [0, 1) (float64 stays float64)."""
        if self.kind == "uniform":
            return u
        if self.kind != "logit-normal":
            raise ValueError(f"unknown timestep density {self.kind!r}")
        z = torch.special.ndtri(u.clamp(1e-12, 1 - 1e-12))
        return torch.sigmoid(self.mean + self.std * z).clamp(max=1 - 1e-12)


class NoiseSource:
    """The random draws of training: timesteps (spread by `density`) and text dropout from a CPU generator, noise
    from one on the training device (no host-to-device copy of the noise). Both states go into every checkpoint."""

    def __init__(self, seed: int, device: torch.device, density: TimestepDensity = TimestepDensity()):
        self.cpu = torch.Generator().manual_seed(seed)
        self.density = density
        self.device = device
        self.dev = self.cpu if device.type == "cpu" else torch.Generator(device=device).manual_seed(seed + 1)

    def state(self) -> dict[str, torch.Tensor]:
        return {"cpu": self.cpu.get_state(), "dev": self.dev.get_state()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.cpu.set_state(state["cpu"])
        if self.dev is not self.cpu:
            self.dev.set_state(state["dev"])

    def draw(self, x0: torch.Tensor, num_train_timesteps: int, first_stratum: int, num_strata: int,
             text_dropout: float, continuous: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What one micro-batch of latents `x0` draws, in this order: timesteps (stratified; with `continuous`,
        float64 draws in [0, 1) instead, for flow matching), which samples drop their text, the noise (float32, on
        x0's device). A rank that skips another rank's micro-batch calls this too and drops the result, so that the
        generators advance the same way on every rank."""
        b = x0.shape[0]
        if continuous:
            t = self.density.warp(stratified_uniform(b, self.cpu, first_stratum, num_strata))
        elif self.density.kind == "uniform":
            t = stratified_timesteps(b, num_train_timesteps, self.cpu, first_stratum, num_strata)
        else:  # the same random draws as stratified_timesteps, through the density's quantile function
            u = self.density.warp(stratified_uniform(b, self.cpu, first_stratum, num_strata))
            t = (u * num_train_timesteps).floor().long().clamp_(0, num_train_timesteps - 1)
        dropped = torch.rand(b, generator=self.cpu) < text_dropout
        eps = torch.randn(x0.shape, generator=self.dev, device=x0.device, dtype=torch.float32)
        return t, dropped, eps


def autocast_context(device: torch.device, precision: str):
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch_dtype(precision))


def diffusion_loss(model: torch.nn.Module, batch: dict[str, Any], schedule: ZeroSNRSchedule, noise: NoiseSource,
                   layout: VideoLayout, text_dropout: float, first_stratum: int, num_strata: int,
                   precision: str = "fp32") -> tuple[torch.Tensor, dict[str, Any]]:
    """Mean loss of one micro-batch (float32) and what was drawn for it: v-prediction on a ZeroSNR-like schedule,
    or flow matching when `schedule` is a `FlowMatchingSchedule`."""
    if is_flow_matching(schedule):
        return flow_matching_loss(model, batch, schedule, noise, layout, text_dropout, first_stratum, num_strata,
                                  precision)
    x0 = batch["latents"]
    text = batch["text"]
    b = x0.shape[0]
    t, dropped, eps = noise.draw(x0, schedule.num_train_timesteps, first_stratum, num_strata, text_dropout)
    eps = eps.to(x0.dtype)
    if dropped.any():
        keep = (~dropped).to(device=text.device, dtype=text.dtype).view(b, *([1] * (text.dim() - 1)))
        text = text * keep
    t_dev = t.to(x0.device)
    x_t = schedule.add_noise(x0, eps, t_dev)
    target = schedule.velocity(x0, eps, t_dev)
    with autocast_context(x0.device, precision):
        pred = model(x_t, text, t_dev, layout)
    loss = F.mse_loss(pred.float(), target.float())
    return loss, {"timesteps": t, "text_dropped": dropped}


def _drop_text(text: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    keep = (~dropped).to(device=text.device, dtype=text.dtype).view(dropped.shape[0], *([1] * (text.dim() - 1)))
    return text * keep


def flow_matching_loss(model: torch.nn.Module, batch: dict[str, Any], schedule: FlowMatchingSchedule,
                       noise: NoiseSource, layout: VideoLayout, text_dropout: float, first_stratum: int,
                       num_strata: int, precision: str = "fp32") -> tuple[torch.Tensor, dict[str, Any]]:
    """Mean flow-matching loss of one micro-batch (float32) and what was drawn for it ("sigmas": the noise levels,
    "timesteps": what the model was given, 1000 sigma)."""
    x0 = batch["latents"]
    text = batch["text"]
    u, dropped, eps = noise.draw(x0, schedule.num_train_timesteps, first_stratum, num_strata, text_dropout,
                                 continuous=True)
    eps = eps.to(x0.dtype)
    if dropped.any():
        text = _drop_text(text, dropped)
    sigma = schedule.sigmas_from_uniform(u.float()).to(x0.device)
    x_t = schedule.add_noise(x0, eps, sigma)
    target = schedule.target(x0, eps)
    t = schedule.timestep(sigma)
    with autocast_context(x0.device, precision):
        pred = model(x_t, text, t, layout)
    loss = F.mse_loss(pred.float(), target.float())
    return loss, {"sigmas": sigma.cpu(), "timesteps": t.cpu(), "text_dropped": dropped}
