"""Wan2.1's objective and sampling schedule: rectified flow with a shifted time.

    x_sigma = (1 - sigma) x0 + sigma noise            sigma in [0, 1]; sigma = 1 is pure noise
    target  = d x_sigma / d sigma = noise - x0        the model predicts this velocity ("flow_prediction")
    timestep given to the model = 1000 sigma

The shift s bends time toward the noisy end: sigma = s u / (1 + (s - 1) u) for u in [0, 1]. Training draws u
uniformly ("shifted-uniform") or from a logit-normal ("logit-normal", SD3's choice) and shifts it; sampling walks a
shifted grid from 1 to 0. Wan's default sampler in diffusers (its Wan documentation) is UniPCMultistepScheduler with
`use_flow_sigmas`, `prediction_type = "flow_prediction"` and `flow_shift = 3.0` (diffusers' advice: 3.0 at 480p, 5.0
at 720p); `diffusers_scheduler` builds it, or the first-order FlowMatchEulerDiscreteScheduler, with these settings.
`sampling_sigmas` is UniPC's grid and `euler_sigmas` Euler's (diffusers shifts Euler's already-shifted end point a
second time, so the two grids differ); `tests/test_wan_diffusion.py` checks both against diffusers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TIMESTEP_SAMPLING = ("shifted-uniform", "logit-normal")


@dataclass(frozen=True)
class WanFlowMatching:
    shift: float = 3.0
    num_train_timesteps: int = 1000
    timestep_sampling: str = "shifted-uniform"
    logit_mean: float = 0.0  # logit-normal only
    logit_std: float = 1.0

    def __post_init__(self) -> None:
        if self.timestep_sampling not in TIMESTEP_SAMPLING:
            raise ValueError(f"timestep_sampling must be one of {TIMESTEP_SAMPLING}, got {self.timestep_sampling!r}")
        if self.shift <= 0:
            raise ValueError(f"shift must be positive, got {self.shift}")

    # ------------------------------------------------------------------ time
    def shifted(self, u: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        """u in [0, 1] -> s u / (1 + (s - 1) u)."""
        return self.shift * u / (1 + (self.shift - 1) * u)

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The model's timestep input for noise level sigma."""
        return sigma * self.num_train_timesteps

    # ------------------------------------------------------------------ training
    def sigmas_from_uniform(self, u: torch.Tensor) -> torch.Tensor:
        """Noise levels for uniform draws u in [0, 1) (the trainer's, stratified over a batch): shifted u, or
        for "logit-normal" the logit-normal quantile of u (sigmoid(mean + std Phi^-1(u))) shifted, so that a
        stratified u gives a stratified logit-normal draw."""
        if self.timestep_sampling == "logit-normal":
            u = torch.sigmoid(self.logit_mean + self.logit_std * torch.special.ndtri(u.clamp(1e-7, 1 - 1e-7)))
        return self.shifted(u)

    def sample_sigmas(self, batch: int, generator: torch.Generator | None = None,
                      device: torch.device | str = "cpu") -> torch.Tensor:
        """Noise levels [batch] for a training step (fp32)."""
        if self.timestep_sampling == "shifted-uniform":
            u = torch.rand(batch, generator=generator, device=device)
        else:
            u = torch.sigmoid(self.logit_mean + self.logit_std * torch.randn(batch, generator=generator, device=device))
        return self.shifted(u)

    @staticmethod
    def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """x_sigma = (1 - sigma) x0 + sigma noise, sigma [B] broadcast over x0's other dims."""
        s = sigma.reshape(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
        return x0 + s * (noise - x0)

    @staticmethod
    def target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The velocity the model is trained to predict."""
        return noise - x0

    def loss(self, prediction: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Mean squared error against the velocity in fp32, every noise level weighted alike (Wan-AI released no
        training code; this is the plain rectified-flow loss)."""
        return (prediction.float() - self.target(x0, noise).float()).square().mean()

    # ------------------------------------------------------------------ sampling
    def _unipc_grid(self, steps: int) -> np.ndarray:
        """The shifted grid in float64, as diffusers computes it (1 - 1e-6 first: log(1 - sigma) stays finite in
        UniPC's first update)."""
        sigmas = self.shifted(np.linspace(1, 1 / self.num_train_timesteps, steps + 1)[:-1])
        if abs(sigmas[0] - 1) < 1e-6:
            sigmas[0] -= 1e-6
        return sigmas

    def sampling_sigmas(self, steps: int) -> torch.Tensor:
        """[steps + 1] noise levels down to 0: diffusers' UniPC grid with flow sigmas, Wan's sampler."""
        return torch.from_numpy(np.concatenate([self._unipc_grid(steps), [0.0]]).astype(np.float32))

    def sampling_timesteps(self, steps: int) -> torch.Tensor:
        """[steps] model timesteps on the UniPC grid (diffusers truncates them to integers)."""
        return torch.from_numpy(self._unipc_grid(steps) * self.num_train_timesteps).to(torch.int64)

    def euler_sigmas(self, steps: int) -> torch.Tensor:
        """[steps + 1] noise levels of diffusers' FlowMatchEulerDiscreteScheduler(shift) with `steps` steps."""
        T = self.num_train_timesteps
        sigma_min = float(self.shifted(np.float32(1.0 / T)))
        u = np.linspace(T, sigma_min * T, steps) / T
        return torch.from_numpy(np.concatenate([self.shifted(u), [0.0]]).astype(np.float32))

    @staticmethod
    def euler_step(x: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
        """One first-order step of the flow ODE from sigma to sigma_next (fp32, returned in x's dtype)."""
        return (x.float() + (sigma_next - sigma) * velocity.float()).to(x.dtype)

    def diffusers_scheduler(self, solver: str = "unipc"):
        """diffusers' scheduler with Wan's settings: "unipc" (the Wan2.1 Diffusers default) or "euler"."""
        if solver == "unipc":
            from diffusers import UniPCMultistepScheduler

            return UniPCMultistepScheduler(num_train_timesteps=self.num_train_timesteps, use_flow_sigmas=True,
                                           prediction_type="flow_prediction", flow_shift=self.shift)
        if solver == "euler":
            from diffusers import FlowMatchEulerDiscreteScheduler

            return FlowMatchEulerDiscreteScheduler(num_train_timesteps=self.num_train_timesteps, shift=self.shift)
        raise ValueError(f"solver must be 'unipc' or 'euler', got {solver!r}")
