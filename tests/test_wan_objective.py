"""Wan's flow matching in the project's trainer and sampler: the training loss's inputs and target, and the solvers'
steps, against the definitions of tttvideo.models.wan.diffusion (and diffusers' schedulers behind them)."""

from __future__ import annotations

import pytest
import torch

from tttvideo.diffusion import ZeroSNRSchedule, is_flow_matching
from tttvideo.models.wan.diffusion import WanFlowMatching
from tttvideo.sample.solvers import FlowEulerSolver, FlowUniPCSolver, make_solver
from tttvideo.train.loss import NoiseSource, diffusion_loss, stratified_uniform

pytestmark = pytest.mark.usefixtures("one_thread")


class Recorder(torch.nn.Module):
    """Returns a fixed random 'prediction' and keeps what it was called with."""

    def __init__(self, shape):
        super().__init__()
        self.out = torch.randn(shape)
        self.calls = []

    def forward(self, x, text, t, layout):
        self.calls.append((x.clone(), text.clone(), t.clone()))
        return self.out


@pytest.mark.parametrize("sampling", ["shifted-uniform", "logit-normal"])
def test_flow_loss_noises_times_and_targets_as_wan_defines(sampling):
    fm = WanFlowMatching(timestep_sampling=sampling)
    assert is_flow_matching(fm) and not is_flow_matching(ZeroSNRSchedule())
    x0 = torch.randn(3, 13, 4, 2, 2)
    batch = {"latents": x0, "text": torch.randn(3, 1, 5, 8)}
    model = Recorder(x0.shape)
    loss, drawn = diffusion_loss(model, batch, fm, NoiseSource(7, torch.device("cpu")), None, 0.0, 3, 6)
    # the same draws again: stratified uniforms (strata 3..5 of 6), then dropout, then the noise
    gen = torch.Generator().manual_seed(7)
    u = stratified_uniform(3, gen, 3, 6)
    assert ((u >= torch.tensor([0.5, 4 / 6, 5 / 6], dtype=torch.float64)) & (u < torch.tensor([4 / 6, 5 / 6, 1.0],
                                                                                                dtype=torch.float64))).all()
    torch.rand(3, generator=gen)
    eps = torch.randn(x0.shape, generator=gen)
    sigma = fm.sigmas_from_uniform(u.float())
    torch.testing.assert_close(drawn["sigmas"], sigma)
    x_t, _, t = model.calls[0]
    s = sigma.view(3, 1, 1, 1, 1)
    torch.testing.assert_close(x_t, (1 - s) * x0 + s * eps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(t, 1000 * sigma)
    torch.testing.assert_close(loss, ((model.out - (eps - x0)) ** 2).mean())
    torch.testing.assert_close(loss, fm.loss(model.out, x0, eps))


def test_logit_normal_levels_are_its_quantiles():
    """A stratified u through `sigmas_from_uniform` is the logit-normal quantile, shifted: the median u = 0.5 is
    sigmoid(mean) shifted, and 20,000 draws match `sample_sigmas`' distribution (mean within 0.01)."""
    fm = WanFlowMatching(timestep_sampling="logit-normal", logit_mean=0.3, logit_std=0.8)
    torch.testing.assert_close(fm.sigmas_from_uniform(torch.tensor([0.5])),
                               fm.shifted(torch.sigmoid(torch.tensor([0.3]))))
    grid = fm.sigmas_from_uniform((torch.arange(20_000) + 0.5) / 20_000)
    drawn = fm.sample_sigmas(20_000, torch.Generator().manual_seed(1))
    assert abs(grid.mean() - drawn.mean()) < 0.01


def test_euler_solver_is_diffusers_euler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    fm = WanFlowMatching()
    ours = make_solver("euler", fm, 6)
    assert isinstance(ours, FlowEulerSolver)
    ref = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    ref.set_timesteps(6)
    torch.testing.assert_close(torch.tensor(ours.timesteps), ref.timesteps.float())
    x = x_ref = torch.randn(1, 13, 4, 2, 2)
    for i, t in enumerate(ref.timesteps):
        v = torch.randn_like(x)
        x = ours.step(i, x, v)
        x_ref = ref.step(v, t, x_ref).prev_sample
        torch.testing.assert_close(x, x_ref, rtol=1e-6, atol=1e-6)


def test_unipc_solver_is_wans_scheduler():
    fm = WanFlowMatching()
    ours = make_solver("unipc", fm, 5)
    assert isinstance(ours, FlowUniPCSolver)
    assert ours.timesteps == fm.sampling_timesteps(5).tolist()
    ref = fm.diffusers_scheduler("unipc")
    ref.set_timesteps(5)
    x = x_ref = torch.randn(1, 13, 4, 2, 2)
    for i, t in enumerate(ref.timesteps):
        v = torch.randn_like(x)
        x, x_ref = ours.step(i, x, v), ref.step(v, t, x_ref).prev_sample
        torch.testing.assert_close(x, x_ref, rtol=0, atol=0)


def test_solvers_of_the_other_objective_are_refused():
    with pytest.raises(ValueError, match="unknown solver 'ddim' for a flow-matching model; use one of unipc, euler"):
        make_solver("ddim", WanFlowMatching(), 4)
    with pytest.raises(ValueError, match="unknown solver 'unipc' for a v-prediction model"):
        make_solver("unipc", ZeroSNRSchedule(), 4)


@pytest.mark.parametrize("solver", ["euler", "unipc"])
def test_denoise_integrates_the_flow_to_its_end(solver):
    """The sampler's loop on a model whose velocity field is exact for one clean sample c, (x - c) / sigma at
    timestep 1000 sigma: every solver lands on c (Euler exactly, as (x - c) shrinks by sigma_next / sigma each step;
    UniPC to the rounding of its integer timesteps, 3e-3 here). Guidance between two equal fields changes nothing."""

    from tttvideo.config.schema import SampleConfig
    from tttvideo.layout import VideoLayout
    from tttvideo.models.backbone import get_preset
    from tttvideo.sample.guidance import denoise

    layout = VideoLayout.create(3, 16, 16, text_tokens=2, mini_batch_size=16, text_in_stream=False)
    c = torch.randn(1, 13, 4, 2, 2)

    class Exact(torch.nn.Module):
        spec = get_preset("wan-tiny")

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, x, text, t, layout):
            sigma = torch.as_tensor(t, dtype=torch.float32) / 1000
            return (x - c) / sigma

    cfg = SampleConfig(steps=8, solver=solver, cfg=3.0, cfg_schedule="constant")
    out = denoise(Exact(), layout, torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), cfg, torch.device("cpu"))
    torch.testing.assert_close(out, c, rtol=0, atol=1e-5 if solver == "euler" else 1e-2)
