"""The training objective, as the original's: v-prediction MSE on the ZeroSNR DDPM schedule.

Per micro-batch: timesteps stratified over the optimizer step's whole effective batch, Gaussian noise, each
sample's text zeroed with probability `text_dropout` (what classifier-free guidance samples against), x_t =
add_noise(x0, eps, t), target v = velocity(x0, eps, t), loss = mean squared error of the model's v.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from tttvideo.diffusion import ZeroSNRSchedule, stratified_timesteps
from tttvideo.dtypes import torch_dtype
from tttvideo.layout import VideoLayout


class NoiseSource:
    """The random draws of training: timesteps and text dropout from a CPU generator, noise from one on the
    training device (no host-to-device copy of the noise). Both states go into every checkpoint."""

    def __init__(self, seed: int, device: torch.device):
        self.cpu = torch.Generator().manual_seed(seed)
        self.device = device
        self.dev = self.cpu if device.type == "cpu" else torch.Generator(device=device).manual_seed(seed + 1)

    def state(self) -> dict[str, torch.Tensor]:
        return {"cpu": self.cpu.get_state(), "dev": self.dev.get_state()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.cpu.set_state(state["cpu"])
        if self.dev is not self.cpu:
            self.dev.set_state(state["dev"])

    def draw(self, x0: torch.Tensor, num_train_timesteps: int, first_stratum: int, num_strata: int,
             text_dropout: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What one micro-batch of latents `x0` draws, in this order: timesteps (stratified), which samples drop
        their text, the noise (float32, on x0's device). A rank that skips another rank's micro-batch calls this
        too and drops the result, so that the generators advance the same way on every rank."""
        b = x0.shape[0]
        t = stratified_timesteps(b, num_train_timesteps, self.cpu, first_stratum, num_strata)
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
    """Mean v-prediction loss of one micro-batch (float32) and what was drawn for it."""
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
