"""`train.timestep_sampling`: where training's noise levels fall. Uniform draws exactly what it drew before the
option existed; logit-normal draws follow sigmoid(mean + std z), stay inside their strata's quantile ranges, and
reach the loss (DDPM timesteps and flow-matching noise levels alike) and the trainer's noise source."""

from __future__ import annotations

import math

import pytest
import torch

from tttvideo.config.loader import load_config
from tttvideo.diffusion import ZeroSNRSchedule, stratified_timesteps
from tttvideo.errors import ConfigError
from tttvideo.train.loss import NoiseSource, TimestepDensity, diffusion_loss

CPU = torch.device("cpu")


def _draw_t(noise: NoiseSource, first: int, strata: int, b: int = 4) -> torch.Tensor:
    t, _, _ = noise.draw(torch.zeros(b, 2, 1, 1, 1), 1000, first, strata, 0.0)
    return t


def test_uniform_draws_what_stratified_timesteps_draws():
    noise = NoiseSource(3, CPU, TimestepDensity())
    gen = torch.Generator().manual_seed(3)
    for first in (0, 4):
        t = _draw_t(noise, first, 8)
        want = stratified_timesteps(4, 1000, gen, first, 8)
        torch.rand(4, generator=gen)  # the text dropout draw
        torch.randn(4, 2, 1, 1, 1, generator=gen)  # the noise
        assert torch.equal(t, want)


def _logit_normal_cdf(x: float, mean: float, std: float) -> float:
    return 0.5 * (1 + math.erf((math.log(x / (1 - x)) - mean) / (std * math.sqrt(2))))


@pytest.mark.parametrize("mean,std", [(0.0, 1.0), (1.0, 0.8)])
def test_logit_normal_follows_its_distribution_and_its_strata(mean, std):
    density = TimestepDensity("logit-normal", mean, std)
    noise = NoiseSource(11, CPU, density)
    draws = []
    for _ in range(500):  # 2,000 draws, 4 strata of a batch of 4
        t = _draw_t(noise, 0, 4)
        frac = (t.double() + 0.5) / 1000
        for j in range(4):  # each stratum's draw stays between its quantiles (up to the timestep grid)
            lo, hi = density.warp(torch.tensor([j / 4, (j + 1) / 4], dtype=torch.float64))
            assert lo - 1e-3 <= frac[j] <= hi + 1e-3
        draws.append(frac)
    x = torch.cat(draws)
    for q in (0.2, 0.5, 0.8):  # the empirical CDF within 0.03 of the logit-normal's (sampling error about 0.01)
        assert float((x < q).double().mean()) == pytest.approx(_logit_normal_cdf(q, mean, std), abs=0.03)
    if mean > 0:  # a positive mean trains mostly at high noise
        assert float((x > 0.5).double().mean()) > 0.8


def test_logit_normal_reaches_the_loss_and_the_trainer(tmp_path):
    density = TimestepDensity("logit-normal", 2.0, 0.5)
    seen = []

    def model(x, text, t, layout):
        seen.append(t.clone())
        return torch.zeros_like(x)

    batch = {"latents": torch.randn(8, 13, 2, 2, 3), "text": torch.ones(8, 1, 2, 5)}
    uniform, shifted = NoiseSource(0, CPU), NoiseSource(0, CPU, density)
    for noise in (uniform, shifted):
        diffusion_loss(model, batch, ZeroSNRSchedule(), noise, None, 0.0, 0, 8)
    assert seen[0].float().mean() < 700 < seen[1].float().mean()  # uniform ~500; sigmoid(2) ~ 0.88 of the way

    cfg = load_config(None, ['train.timestep_sampling="logit-normal"', "train.timestep_mean=0.5",
                             "train.timestep_std=1.5"])
    assert TimestepDensity.from_config(cfg.train) == TimestepDensity("logit-normal", 0.5, 1.5)
    assert TimestepDensity.from_config(load_config(None).train) == TimestepDensity()
    with pytest.raises(ConfigError, match="timestep_sampling"):
        load_config(None, ['train.timestep_sampling="normal"'])
    with pytest.raises(ConfigError, match="timestep_std"):
        load_config(None, ["train.timestep_std=0"])


def test_the_trainer_draws_from_the_configured_density(tmp_path, monkeypatch):
    """A 4-step run of the tiny model: with a logit-normal of mean 3 and std 0.1 every timestep the loss sees is
    about 1000 sigmoid(3) = 953 (four uniform draws all land in (920, 980) with probability about 1e-5)."""
    import tttvideo.train.step as step_mod
    from tests.test_train_loop import tiny_config
    from tttvideo.train.trainer import Trainer

    seen: list[torch.Tensor] = []
    real = step_mod.diffusion_loss

    def loss(*args, **kwargs):
        value, info = real(*args, **kwargs)
        seen.append(info["timesteps"])
        return value, info

    monkeypatch.setattr(step_mod, "diffusion_loss", loss)
    Trainer(tiny_config(tmp_path, 'train.timestep_sampling="logit-normal"', "train.timestep_mean=3.0",
                        "train.timestep_std=0.1"), quiet=True).run()
    t = torch.cat(seen)
    assert len(t) == 4 and ((t > 920) & (t < 980)).all(), t
