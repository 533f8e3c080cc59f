"""Wan's flow matching against diffusers' schedulers: the UniPC and Euler grids, Euler steps, the noising, and that
the training target is the velocity the schedulers integrate ("flow_prediction")."""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tttvideo.models.wan.diffusion import WanFlowMatching  # noqa: E402

FM = WanFlowMatching(shift=3.0)


@pytest.mark.parametrize("steps", [4, 7])
def test_grids_equal_diffusers(steps):
    unipc = FM.diffusers_scheduler("unipc")
    unipc.set_timesteps(steps)
    torch.testing.assert_close(FM.sampling_sigmas(steps), unipc.sigmas.float(), rtol=0, atol=1e-7)
    assert torch.equal(FM.sampling_timesteps(steps), unipc.timesteps)
    euler = FM.diffusers_scheduler("euler")
    euler.set_timesteps(steps)
    torch.testing.assert_close(FM.euler_sigmas(steps), euler.sigmas, rtol=0, atol=1e-7)
    torch.testing.assert_close(FM.timestep(FM.euler_sigmas(steps)[:-1]), euler.timesteps, rtol=0, atol=1e-4)


def test_euler_steps_and_noising_equal_diffusers():
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    euler = FM.diffusers_scheduler("euler")
    euler.set_timesteps(5)
    sigmas = FM.euler_sigmas(5)
    ours = theirs = noise.clone()
    for i, t in enumerate(euler.timesteps):
        velocity = torch.tanh(theirs) * (1 + i)  # any function of the state
        theirs = euler.step(velocity, t, theirs).prev_sample
        ours = FM.euler_step(ours, velocity, float(sigmas[i]), float(sigmas[i + 1]))
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    t = euler.timesteps[2:3]
    torch.testing.assert_close(FM.add_noise(x0, noise, sigmas[2:3]), euler.scale_noise(x0, t, noise))


def test_target_is_the_velocity_the_sampler_integrates():
    """With the exact velocity of a single data point, UniPC (Wan's sampler) lands on it in a few steps, and one
    Euler step from any noise level to 0 with the training target returns x0 exactly."""
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)
    sigma = torch.tensor([0.37])
    x = FM.add_noise(x0, noise, sigma)
    torch.testing.assert_close(FM.euler_step(x, FM.target(x0, noise), 0.37, 0.0), x0)
    assert FM.loss(FM.target(x0, noise), x0, noise) == 0
    torch.testing.assert_close(FM.loss(noise, x0, noise), x0.square().mean())

    unipc = FM.diffusers_scheduler("unipc")
    unipc.set_timesteps(6)
    x = noise.clone()
    for i, t in enumerate(unipc.timesteps):
        s = float(unipc.sigmas[i])
        velocity = (x - x0) / s  # the straight path's velocity through (x, s) toward x0
        assert torch.allclose(velocity, FM.target(x0, (x - (1 - s) * x0) / s), atol=1e-5)
        x = unipc.step(velocity, t, x).prev_sample
    torch.testing.assert_close(x, x0, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sampling", ["shifted-uniform", "logit-normal"])
def test_training_sigmas_are_shifted(sampling):
    fm = WanFlowMatching(shift=3.0, timestep_sampling=sampling)
    s = fm.sample_sigmas(20_000, torch.Generator().manual_seed(2))
    assert s.min() > 0 and s.max() < 1
    # the shift moves the median from 0.5 to 3 * 0.5 / (1 + 2 * 0.5) = 0.75 (both draws have median 0.5 unshifted)
    assert abs(s.median().item() - 0.75) < 0.01
    assert abs(WanFlowMatching(shift=1.0, timestep_sampling=sampling).sample_sigmas(
        20_000, torch.Generator().manual_seed(2)).median().item() - 0.5) < 0.01
    with pytest.raises(ValueError, match="timestep_sampling"):
        WanFlowMatching(timestep_sampling="cosine")
