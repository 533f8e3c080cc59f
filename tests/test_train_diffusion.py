"""The ZeroSNR v-prediction schedule against diffusers' DDPMScheduler (the definition we promise to match)."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDPMScheduler

from tttvideo.diffusion import ZeroSNRSchedule, stratified_timesteps


@pytest.fixture(scope="module")
def pair():
    ref = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                        rescale_betas_zero_snr=True, prediction_type="v_prediction")
    return ZeroSNRSchedule(), ref


def test_alphas_cumprod_bitwise_and_zero_terminal_snr(pair):
    ours, ref = pair
    assert torch.equal(ours.alphas_cumprod, ref.alphas_cumprod)
    assert ours.alphas_cumprod[-1].item() == 0.0
    assert ours.snr(999).item() == 0.0
    # Rescaling keeps the first step's signal level (Algorithm 1 of Lin et al.).
    plain = torch.cumprod(1 - torch.linspace(0.00085**0.5, 0.012**0.5, 1000) ** 2, 0)
    assert abs(ours.alphas_cumprod[0].item() - plain[0].item()) < 1e-6
    assert torch.all(ours.alphas_cumprod[1:] < ours.alphas_cumprod[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_add_noise_and_velocity_match_diffusers(pair, dtype):
    ours, ref = pair
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(6, 3, 4, 5, generator=g, dtype=dtype)
    eps = torch.randn(6, 3, 4, 5, generator=g, dtype=dtype)
    t = torch.tensor([0, 1, 250, 500, 998, 999])
    torch.testing.assert_close(ours.add_noise(x0, eps, t), ref.add_noise(x0, eps, t), rtol=0, atol=0)
    torch.testing.assert_close(ours.velocity(x0, eps, t), ref.get_velocity(x0, eps, t), rtol=0, atol=0)
    # At the terminal step x_t is pure noise and v = -x0.
    torch.testing.assert_close(ours.add_noise(x0, eps, t)[-1], eps[-1])
    torch.testing.assert_close(ours.velocity(x0, eps, t)[-1], -x0[-1])


def test_conversions_invert_the_forward_process(pair):
    ours, _ = pair
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(5, 2, 3, dtype=torch.float64, generator=g)
    eps = torch.randn(5, 2, 3, dtype=torch.float64, generator=g)
    t = torch.tensor([0, 10, 400, 900, 999])
    x_t = ours.add_noise(x0, eps, t)
    v = ours.velocity(x0, eps, t)
    torch.testing.assert_close(ours.v_to_x0(x_t, v, t), x0, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.v_to_eps(x_t, v, t), eps, rtol=0, atol=1e-6)
    # A scalar timestep broadcasts over the batch.
    torch.testing.assert_close(ours.add_noise(x0, eps, 400), ours.add_noise(x0, eps, torch.full((5,), 400)))


def test_stratified_timesteps_cover_each_stratum():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        t = stratified_timesteps(8, 1000, g)
        assert torch.equal(t // 125, torch.arange(8))
    # Micro-batch 2 of 4 over an effective batch of 8 lands in strata 4 and 5.
    t = stratified_timesteps(2, 1000, g, first_stratum=4, num_strata=8)
    assert torch.equal(t // 125, torch.tensor([4, 5]))
    with pytest.raises(ValueError):
        stratified_timesteps(2, 1000, g, first_stratum=7, num_strata=8)
