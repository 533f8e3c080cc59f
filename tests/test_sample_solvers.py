"""Our v-prediction DDIM and DPM-Solver++(2M) against diffusers' schedulers, step by step on random inputs.

Each step is fed the same x_t and the same random 'model output' v on both sides, and the next x is compared; the
whole chain is also run end to end. Tolerances: DDIMScheduler builds bitwise the same alphas_cumprod table as
`ZeroSNRSchedule` (float32 betas), so only the float64-vs-float32 coefficient arithmetic differs (rtol 1e-5);
the CogVideoX schedulers build the table in float64 from rescaled alphas_cumprod (a different order of operations,
~1e-7 relative), so they get 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from tttvideo.diffusion import ZeroSNRSchedule
from tttvideo.sample.solvers import (
    DDIMSolver,
    DPMSolver2M,
    GuidanceSchedule,
    guide,
    make_solver,
    trailing_timesteps,
)

diffusers = pytest.importorskip("diffusers")

SHAPE = (2, 3, 4, 5, 6)


def cogvideox_kwargs():
    # THUDM/CogVideoX-5b scheduler/scheduler_config.json
    return dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                num_train_timesteps=1000, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                set_alpha_to_one=True, snr_shift_scale=1.0, steps_offset=0, timestep_spacing="trailing")


@pytest.mark.parametrize("steps", [50, 20])
def test_trailing_timesteps_match_diffusers(steps):
    ref = diffusers.CogVideoXDDIMScheduler(**cogvideox_kwargs())
    ref.set_timesteps(steps)
    assert trailing_timesteps(steps) == ref.timesteps.tolist()
    assert trailing_timesteps(steps)[0] == 999


@pytest.mark.parametrize("reference", ["ddim", "cogvideox"])
@pytest.mark.parametrize("steps", [50, 25])
def test_ddim_matches_diffusers_step_by_step(reference, steps):
    if reference == "ddim":
        ref = diffusers.DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                      rescale_betas_zero_snr=True, timestep_spacing="trailing",
                                      prediction_type="v_prediction", clip_sample=False, set_alpha_to_one=True)
        rtol, atol = 1e-5, 1e-6
    else:
        ref = diffusers.CogVideoXDDIMScheduler(**cogvideox_kwargs())
        rtol, atol = 1e-4, 1e-5
    ref.set_timesteps(steps)
    ours = DDIMSolver(ZeroSNRSchedule(), steps)
    assert ours.timesteps == ref.timesteps.tolist()
    gen = torch.Generator().manual_seed(0)
    x_ours = x_ref = torch.randn(SHAPE, generator=gen)
    for i, t in enumerate(ref.timesteps):
        v = torch.randn(SHAPE, generator=gen)
        x = torch.randn(SHAPE, generator=gen)  # a fresh x_t each step: compares the step map itself
        expected = ref.step(v, t, x, return_dict=False)[0]
        torch.testing.assert_close(ours.step(i, x, v), expected, rtol=rtol, atol=atol)
        # and the chain, fed back on both sides
        x_ref = ref.step(v, t, x_ref, return_dict=False)[0]
        x_ours = ours.step(i, x_ours, v)
    torch.testing.assert_close(x_ours, x_ref, rtol=rtol * 10, atol=atol * 10)


def test_ddim_first_step_is_pure_prediction_and_last_returns_x0():
    ours = DDIMSolver(ZeroSNRSchedule(), 10)
    x, v = torch.randn(SHAPE), torch.randn(SHAPE)
    # at t = 999 ZeroSNR has alpha_bar = 0: the input is pure noise and x0 = -v
    assert ours.alpha(999).item() == 0.0
    torch.testing.assert_close(ours.x0(0, x, v), -v)
    last = len(ours.timesteps) - 1
    torch.testing.assert_close(ours.step(last, x, v), ours.x0(last, x, v))


@pytest.mark.parametrize("steps", [50, 20])
def test_dpm_2m_matches_cogvideox_dpm_scheduler(steps):
    ref = diffusers.CogVideoXDPMScheduler(**cogvideox_kwargs())
    ref.set_timesteps(steps)
    ours = DPMSolver2M(ZeroSNRSchedule(), steps)
    assert ours.timesteps == ref.timesteps.tolist()
    data = torch.Generator().manual_seed(1)
    x_ref = x_ours = torch.randn(SHAPE, generator=data)
    ref_gen = torch.Generator().manual_seed(7)
    our_gen = torch.Generator().manual_seed(7)
    old = None
    timesteps = ref.timesteps
    for i, t in enumerate(timesteps):
        v = torch.randn(SHAPE, generator=data)
        x_ref, old = ref.step(v, old, t, timesteps[i - 1] if i > 0 else None, x_ref, generator=ref_gen,
                              return_dict=False)
        # diffusers draws one noise tensor for the first-order update and, from the second step on, a second one
        # for the multistep update it actually returns (the last step uses no noise): replay its draws
        noise = torch.randn(SHAPE, generator=our_gen)
        if i > 0 and i < len(timesteps) - 1:
            noise = torch.randn(SHAPE, generator=our_gen)
        x_ours = ours.step(i, x_ours, v, noise)
        torch.testing.assert_close(x_ours, x_ref, rtol=1e-4, atol=1e-4, msg=f"step {i} (t={int(t)})")
    assert torch.isfinite(x_ours).all()


def test_dpm_is_second_order_in_the_middle():
    """With the multistep correction removed the result must differ: the test above would not notice a solver
    that silently fell back to first order if diffusers did too; this pins that the correction is used."""
    ours = DPMSolver2M(ZeroSNRSchedule(), 10)
    x, v0, v1, z = torch.randn(SHAPE), torch.randn(SHAPE), torch.randn(SHAPE), torch.randn(SHAPE)
    x1 = ours.step(0, x, v0, z)
    second = ours.step(1, x1, v1, z)
    x1b = ours.step(2, x1, v1, z)  # history now holds x0 of step 1, not of step 0
    ours.reset()
    ours.step(0, x, v0, z)
    ours.reset()  # history cleared: step 2 sees no previous x0 and takes the first-order update
    first = ours.step(2, x1, v1, z)
    assert not torch.allclose(x1b, first)
    assert torch.isfinite(second).all()


def test_make_solver_names():
    s = ZeroSNRSchedule()
    assert isinstance(make_solver("ddim", s, 5), DDIMSolver)
    assert isinstance(make_solver("dpm++2m", s, 5), DPMSolver2M)
    with pytest.raises(ValueError, match="unknown solver"):
        make_solver("euler", s, 5)


def test_guidance_schedules():
    ramp = GuidanceSchedule("ramp", scale=4.0, start=1.0).scales(50)
    assert ramp[0] == pytest.approx(1.0) and ramp[-1] == pytest.approx(4.0)
    assert all(b >= a for a, b in zip(ramp, ramp[1:]))
    assert ramp[25] == pytest.approx(2.5, abs=0.15)
    steep = GuidanceSchedule("ramp", scale=4.0, start=1.0, ramp_exp=5.0).scales(50)
    assert steep[25] < ramp[25]
    assert GuidanceSchedule("constant", scale=6.0).scales(3) == [6.0, 6.0, 6.0]
    u, c = torch.zeros(3), torch.ones(3)
    torch.testing.assert_close(guide(u, c, 4.0), torch.full((3,), 4.0))
    torch.testing.assert_close(guide(u, c, 1.0), c)


@pytest.mark.parametrize("name", ["ddim", "dpm++2m"])
def test_oracle_model_recovers_the_clean_sample(name):
    """A model that knows x0 answers with the exact v of the current x_t; any solver must then end on x0. This pins
    the v-prediction convention itself (sign, sqrt(a) vs sqrt(1 - a)), independently of diffusers."""
    schedule = ZeroSNRSchedule()
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    solver = make_solver(name, schedule, 25)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    ac = schedule.alphas_cumprod.double()
    for i, t in enumerate(solver.timesteps):
        a = ac[t]
        eps = (x - a.sqrt() * x0) / (1 - a).sqrt()
        v = a.sqrt() * eps - (1 - a).sqrt() * x0
        x = solver.step(i, x, v, torch.randn(SHAPE, generator=gen, dtype=torch.float64))
    torch.testing.assert_close(x, x0, rtol=1e-9, atol=1e-9)
