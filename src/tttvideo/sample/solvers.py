"""Samplers of the two objectives (v-prediction on the ZeroSNR schedule, flow matching), and classifier-free
guidance schedules. `make_solver` picks by `sample.solver` and refuses a solver of the other objective.

v-prediction (CogVideoX):

Both solvers walk CogVideoX's "trailing" timesteps (Lin et al. 2023, Table 2): n steps over 1000 training steps
start at t = 999, where the ZeroSNR schedule has alpha_bar = 0 (pure noise, the model's v is -x0), and end by
jumping to alpha_bar = 1 (the clean sample).

- `DDIMSolver`: deterministic DDIM (eta = 0) from the model's v-prediction:
  x0 = sqrt(a_t) x_t - sqrt(1 - a_t) v,  eps = sqrt(1 - a_t) x_t + sqrt(a_t) v,
  x_prev = sqrt(a_prev) x0 + sqrt(1 - a_prev) eps.
  Step for step the same as diffusers' `DDIMScheduler(rescale_betas_zero_snr=True, timestep_spacing="trailing",
  prediction_type="v_prediction")` and `CogVideoXDDIMScheduler`.
- `DPMSolver2M`: DPM-Solver++(2M) in the stochastic (SDE) form that CogVideoX and the original TTT code sample with
  (`CogVideoXDPMScheduler`, sat's `VPSDEDPMPP2MSampler`): with lambda = log sqrt(a / (1 - a)) and h the step in
  lambda, x_prev = sigma_prev/sigma_t e^-h x_t + alpha_prev (1 - e^-2h) D + sigma_prev sqrt(1 - e^-2h) z, where D is
  the second-order (multistep) combination of this and the previous x0 prediction, z fresh Gaussian noise.

Where the step count divides 1000 the timesteps are diffusers' exactly; otherwise diffusers steps to t - 1000 // n,
which is off its own grid, while we always step to the next timestep of the grid.

Coefficients are computed in float64 (the ZeroSNR end points give log(0) = -inf and step sizes of +inf, whose limits
are exact: e^-inf = 0) and applied in the latents' dtype.

Flow matching (Wan; the schedule is `models.wan.diffusion.WanFlowMatching`, the model predicts the velocity
noise - x0 at timestep 1000 sigma):

- `FlowEulerSolver`: x_next = x + (sigma_next - sigma) v on diffusers' FlowMatchEulerDiscreteScheduler grid
  (`euler_sigmas`, `euler_step`).
- `FlowUniPCSolver`: diffusers' UniPCMultistepScheduler with Wan's settings (`diffusers_scheduler("unipc")`, flow
  sigmas, shift 3, its integer timesteps): Wan's own sampler, run by diffusers itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tttvideo.diffusion import ZeroSNRSchedule, is_flow_matching

SOLVERS = ("ddim", "dpm++2m")  # v-prediction
FLOW_SOLVERS = ("unipc", "euler")  # flow matching
CFG_SCHEDULES = ("constant", "ramp")


def trailing_timesteps(num_steps: int, num_train_timesteps: int = 1000) -> list[int]:
    """diffusers' timestep_spacing="trailing": 999, 979, ..., 19 for 50 steps of 1000."""
    if not 1 <= num_steps <= num_train_timesteps:
        raise ValueError(f"steps must be in 1..{num_train_timesteps}, got {num_steps}")
    ratio = num_train_timesteps / num_steps
    return (np.round(np.arange(num_train_timesteps, 0, -ratio)).astype(np.int64) - 1).tolist()


def _lambda(a: torch.Tensor) -> torch.Tensor:
    """Half log-SNR, log sqrt(a / (1 - a)); -inf at a = 0 (ZeroSNR), +inf at a = 1."""
    return 0.5 * (torch.log(a) - torch.log1p(-a))


class Solver:
    """Shared timestep bookkeeping. Call `step(i, x, v)` for i = 0 .. len(timesteps) - 1."""

    stochastic = False

    def __init__(self, schedule: ZeroSNRSchedule, num_steps: int):
        self.schedule = schedule
        self.num_steps = num_steps
        self.timesteps = trailing_timesteps(num_steps, schedule.num_train_timesteps)
        self._ac = schedule.alphas_cumprod.double()

    def alpha(self, t: int) -> torch.Tensor:
        """alpha_bar at t; t < 0 is the clean end of the chain (alpha_bar = 1)."""
        return self._ac[t] if t >= 0 else torch.tensor(1.0, dtype=torch.float64)

    def prev_timestep(self, i: int) -> int:
        return self.timesteps[i + 1] if i + 1 < len(self.timesteps) else -1

    def x0(self, i: int, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        a = self.alpha(self.timesteps[i])
        return float(a.sqrt()) * x - float((1 - a).sqrt()) * v

    def reset(self) -> None:
        """Forget multistep history (a new video)."""


class DDIMSolver(Solver):
    def step(self, i: int, x: torch.Tensor, v: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        a_t = self.alpha(self.timesteps[i])
        a_prev = self.alpha(self.prev_timestep(i))
        x0 = float(a_t.sqrt()) * x - float((1 - a_t).sqrt()) * v
        eps = float((1 - a_t).sqrt()) * x + float(a_t.sqrt()) * v
        return float(a_prev.sqrt()) * x0 + float((1 - a_prev).sqrt()) * eps


class DPMSolver2M(Solver):
    """Stochastic DPM-Solver++(2M); needs `noise` (standard normal, x's shape) on every step but the last."""

    stochastic = True

    def __init__(self, schedule: ZeroSNRSchedule, num_steps: int):
        super().__init__(schedule, num_steps)
        self.reset()

    def reset(self) -> None:
        self._old_x0: torch.Tensor | None = None

    def step(self, i: int, x: torch.Tensor, v: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        t, t_prev = self.timesteps[i], self.prev_timestep(i)
        a_t, a_prev = self.alpha(t), self.alpha(t_prev)
        x0 = float(a_t.sqrt()) * x - float((1 - a_t).sqrt()) * v
        if t_prev < 0:
            # the jump to alpha_bar = 1 has h = +inf: the multipliers' limits give exactly x0, with no noise
            self._old_x0 = x0
            return x0
        if noise is None:
            raise ValueError("the stochastic DPM-Solver++(2M) step needs a noise tensor")
        lam_t, lam_prev = _lambda(a_t), _lambda(a_prev)
        h = lam_prev - lam_t
        m1 = float(((1 - a_prev) / (1 - a_t)).sqrt() * torch.exp(-h))
        m2 = float(torch.expm1(-2 * h) * a_prev.sqrt())
        m_noise = float((1 - a_prev).sqrt() * (-torch.expm1(-2 * h)).sqrt())
        d = x0
        if self._old_x0 is not None and i > 0:
            h_last = lam_t - _lambda(self.alpha(self.timesteps[i - 1]))
            r = h_last / h
            # r = +inf after the ZeroSNR first step (h_last = +inf): the correction vanishes, D = x0
            half_inv_r = float(1 / (2 * r))
            d = (1 + half_inv_r) * x0 - half_inv_r * self._old_x0
        self._old_x0 = x0
        return m1 * x - m2 * d + m_noise * noise.to(device=x.device, dtype=x.dtype)


class FlowEulerSolver:
    """First-order flow-ODE steps on diffusers' Euler grid; `timesteps` are the model's (1000 sigma, floats)."""

    stochastic = False

    def __init__(self, schedule, num_steps: int):
        if not 1 <= num_steps <= schedule.num_train_timesteps:
            raise ValueError(f"steps must be in 1..{schedule.num_train_timesteps}, got {num_steps}")
        self.schedule = schedule
        self.sigmas = schedule.euler_sigmas(num_steps)
        self.timesteps = (self.sigmas[:-1] * schedule.num_train_timesteps).tolist()

    def step(self, i: int, x: torch.Tensor, v: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        return self.schedule.euler_step(x, v, float(self.sigmas[i]), float(self.sigmas[i + 1]))

    def reset(self) -> None:
        """Nothing to forget: the step is one-step."""


class FlowUniPCSolver:
    """diffusers' UniPC multistep scheduler with Wan's settings; `timesteps` are its (integers, 1000 sigma
    truncated). One solver per video: the scheduler keeps the previous steps' predictions."""

    stochastic = False

    def __init__(self, schedule, num_steps: int):
        if not 1 <= num_steps <= schedule.num_train_timesteps:
            raise ValueError(f"steps must be in 1..{schedule.num_train_timesteps}, got {num_steps}")
        self.schedule, self.num_steps = schedule, num_steps
        self.reset()

    def reset(self) -> None:
        self.scheduler = self.schedule.diffusers_scheduler("unipc")
        self.scheduler.set_timesteps(self.num_steps)
        self.timesteps = [int(t) for t in self.scheduler.timesteps]

    def step(self, i: int, x: torch.Tensor, v: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        return self.scheduler.step(v, self.scheduler.timesteps[i], x, return_dict=False)[0]


def make_solver(name: str, schedule, num_steps: int) -> Solver | FlowEulerSolver | FlowUniPCSolver:
    """The solver `name` on `schedule`: a v-prediction solver on a `ZeroSNRSchedule`, a flow solver on a
    flow-matching schedule (`diffusion.is_flow_matching`)."""
    if is_flow_matching(schedule):
        if name == "unipc":
            return FlowUniPCSolver(schedule, num_steps)
        if name == "euler":
            return FlowEulerSolver(schedule, num_steps)
        raise ValueError(f"unknown solver {name!r} for a flow-matching model; use one of {', '.join(FLOW_SOLVERS)}")
    if name == "ddim":
        return DDIMSolver(schedule, num_steps)
    if name == "dpm++2m":
        return DPMSolver2M(schedule, num_steps)
    raise ValueError(f"unknown solver {name!r} for a v-prediction model; use one of {', '.join(SOLVERS)}")


@dataclass(frozen=True)
class GuidanceSchedule:
    """Classifier-free guidance scale per step: `constant` at `scale`, or `ramp` from `start` (first step) to `scale`
    (last step) along a half-cosine raised to `ramp_exp` (1: smooth S-curve; larger: stays low longer). The paper
    ramps 1 -> 4. A step with scale 1 needs no unconditional pass."""

    kind: str = "ramp"
    scale: float = 4.0
    start: float = 1.0
    ramp_exp: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in CFG_SCHEDULES:
            raise ValueError(f"unknown guidance schedule {self.kind!r}; use one of {', '.join(CFG_SCHEDULES)}")

    def scales(self, num_steps: int) -> list[float]:
        if self.kind == "constant" or num_steps == 1:
            return [float(self.scale)] * num_steps
        out = []
        for i in range(num_steps):
            p = (i / (num_steps - 1)) ** self.ramp_exp
            out.append(self.start + (self.scale - self.start) * (1 - math.cos(math.pi * p)) / 2)
        return out


def guide(v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float) -> torch.Tensor:
    """CFG on the model's prediction, as CogVideoX (v) and Wan (flow velocity) do: v_u + s (v_c - v_u)."""
    return v_uncond + scale * (v_cond - v_uncond)
