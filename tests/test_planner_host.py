"""`tttv plan` checks host memory too: the offload pool is the one the trainer would make on the host (90 % of what
the processes leave, shared), what it cannot take stays on the GPU and is counted there, and a setup whose processes
need more host memory than the host has does not fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tttvideo.cli import main
from tttvideo.config.loader import load_config
from tttvideo.memory.plan.costs import load_costs
from tttvideo.memory.plan.planner import CUDA_CONTEXT, MARGIN, Candidate, best, plan, predict
from tttvideo.models.activation_offload import pool_share

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
STAGE5 = ROOT / "configs/cogvideox-5b/stage5-63s-1gpu.toml"


@pytest.fixture(autouse=True)
def _two_compile_workers(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "2")


def test_the_planners_pool_is_the_trainers(monkeypatch):
    """The runtime sizes its pool from what is available once each process holds its own memory (the planner's
    `held`) and its compile workers (`held_back`): both give the same bytes."""
    from tttvideo.models import activation_offload

    host_mem, process, workers, ranks = 200 * GIB, 16 * GIB, 3 * GIB, 4
    monkeypatch.setattr(activation_offload, "available_host_bytes", lambda: host_mem - process * ranks)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    pool = activation_offload.host_pool_for(0.0, pin=False, held_back=workers)
    assert pool.capacity_bytes == pytest.approx(pool_share(host_mem, process + workers, ranks), abs=ranks)
    assert pool_share(10 * GIB, 16 * GIB, 1) == 0


def test_a_small_host_keeps_block_inputs_on_the_gpu_and_the_plan_moves_off_offload():
    cfg = load_config(STAGE5, [])
    costs = load_costs("h100")
    shipped = Candidate("as configured", ())
    unchecked = predict(cfg, "train", shipped, costs, gpu_mem=int(79.6 * GIB))
    small = predict(cfg, "train", shipped, costs, gpu_mem=int(79.6 * GIB), host_mem=64 * GIB)
    # the shipped 63-s stage offloads all 42 inputs (88 GiB); 64 GiB of host memory takes 19 of them
    assert unchecked.host / GIB > 80 and unchecked.fits and unchecked.host_fits is None
    assert small.host < 64 * GIB * 0.9 and small.host_fits
    assert small.peak > unchecked.peak + 40 * GIB and not small.fits
    assert any("host pool" in n for n in small.notes)
    assert "offload" in best(plan(cfg, "train", int(79.6 * GIB), costs)).candidate.label
    chosen = best(plan(cfg, "train", int(79.6 * GIB), costs, host_mem=64 * GIB))
    assert chosen is not None and "offload" not in chosen.candidate.label and chosen.host_fits


def test_processes_that_need_more_than_the_host_do_not_fit(tmp_path, capsys):
    cfg = load_config(STAGE5, [])
    preds = plan(cfg, "train", int(79.6 * GIB), load_costs("h100"), host_mem=8 * GIB)
    assert preds and all(p.host_fits is False and not p.fits for p in preds)
    assert any("host: 1 process(es) need" in n for n in preds[0].notes)
    # the card's verdict stays apart from the host's: what `--explain` prints on the GPU line
    fitting = [p for p in preds if p.gpu_fits]
    assert fitting and all(p.reserved + CUDA_CONTEXT <= 79.6 * GIB * (1 - MARGIN) for p in fitting)
    code = main(["plan", str(STAGE5), "--gpu-mem", "79.6GiB", "--host-mem", "8GiB"])
    out, err = capsys.readouterr()
    assert code == 1 and "no (host)" in out and "8 GiB of host memory" in out
    assert "and 8.0 GiB of host memory" in err
    # planning for another machine's card without --host-mem leaves host memory unchecked
    assert main(["plan", str(STAGE5), "--gpu-mem", "79.6GiB"]) == 0
    assert "host memory not checked" in capsys.readouterr().out
    assert main(["plan", str(STAGE5), "--gpu-mem", "79.6GiB", "--host-mem", "lots"]) == 2
    assert "--host-mem 'lots' is not a size" in capsys.readouterr().err


def test_two_processes_share_the_host():
    cfg = load_config(ROOT / "configs/cogvideox-5b/stage5-63s-2gpu.toml", [])
    costs, shipped = load_costs("h100"), Candidate("as configured", ())
    one = predict(cfg, "train", shipped, costs, gpus=2, gpu_mem=int(79.6 * GIB), host_mem=160 * GIB,
                  processes_per_host=1)
    two = predict(cfg, "train", shipped, costs, gpus=2, gpu_mem=int(79.6 * GIB), host_mem=160 * GIB)
    assert two.host < one.host and two.peak > one.peak


def test_auto_fit_plans_for_this_hosts_memory_and_ranks_agree(monkeypatch):
    """--auto-fit checks the machine it runs on; torchrun's ranks each plan alone and must choose alike, so they
    plan with the available memory rounded down to 8 GiB."""
    from tttvideo.memory.plan import auto_fit
    from tttvideo.models import activation_offload

    monkeypatch.setattr(auto_fit, "this_gpu", lambda: ("NVIDIA H100 80GB HBM3", int(79.6 * GIB)))
    monkeypatch.setattr(activation_offload, "available_host_bytes", lambda: 64 * GIB)
    fit = auto_fit.auto_fit_plan(load_config(STAGE5, []), "train", str(STAGE5))
    assert "offload" not in fit.chosen.candidate.label and fit.chosen.host_fits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    chosen = []
    for available in (100.9, 97.1):  # two ranks reading a little apart
        monkeypatch.setattr(activation_offload, "available_host_bytes", lambda a=available: int(a * GIB))
        chosen.append(auto_fit.auto_fit_plan(load_config(ROOT / "configs/cogvideox-5b/stage5-63s-2gpu.toml", []),
                                            "train", None))
    assert chosen[0].chosen.candidate.label == chosen[1].chosen.candidate.label
    assert all(any("of the 96 GiB available" in n for p in fit_.preds for n in p.notes) for fit_ in chosen)
