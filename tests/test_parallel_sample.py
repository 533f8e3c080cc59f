"""`tttv sample` under torchrun on CPU (gloo): Ulysses sp, classifier-free guidance split across ranks, both, and
stories spread over groups of ranks, each against the one-process output; and the sentences a wrong launch gets.

Every launch samples the same tiny random model (fp32) for 3 DPM-Solver++(2M) steps (stochastic: every rank must
draw the same noise) with the guidance ramp 1 -> 3 (the first step runs at scale 1, where no pass is split) on a
3-s, 32x48 layout (94 tokens), and saves its final latents beside the mp4 (`sample.save_latents`). They match the
one-process latents within LATENT_ATOL; the launches differ from it only in summation order (batch 1 instead of the
batch-2 guidance forward, the sp exchanges). Measured on CPU: sp = 2 and story groups bit-identical; a split guidance
(with or without sp) within 2.4e-6 of latents up to 3.7 in magnitude.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tttvideo.cli import main
from tttvideo.config.loader import dump_toml, load_config
from tttvideo.errors import ConfigError
from tttvideo.sample.distributed import resolve_sample_degrees, warn_if_nothing_to_split

from tests.launching import run_launch
from tests.test_sample import RED, TINY  # the one-process sampler tests' tiny model and scene

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("one_thread")

BLUE = {"text": "a blue square moves up on a grey background"}
FLAGS = ("--steps", "3", "--solver", "dpm++2m", "--cfg", "3", "--set", "sample.save_latents=true")
LATENT_ATOL = 1e-5
LAUNCH_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny random model saved as `tttv train` saves a checkpoint, and a story file of two one-scene stories."""
    from tttvideo.models import build_model, save_checkpoint

    work = tmp_path_factory.mktemp("parallel-sample")
    cfg = load_config(None, TINY)
    torch.manual_seed(0)
    folder = work / "run" / "checkpoints" / "step-000001"
    save_checkpoint(build_model(cfg), folder / "model.safetensors")
    (folder / "config.toml").write_text(dump_toml(cfg))
    torch.save({}, folder / "state.pt")
    (work / "stories.json").write_text(json.dumps([[RED], [BLUE]]))
    return work


def cli_args(work: Path, out: str, *sets: str) -> list[str]:
    return ["sample", "--checkpoint", str(work / "run"), "--scenes", str(work / "stories.json"),
            "--out", str(work / out), *FLAGS, *[x for s in sets for x in ("--set", s)]]


def torchrun(ranks: int, logs: Path, args: list[str]) -> list[str]:
    """The torchrun command of `tttv <args>` on `ranks` processes, each rank's stdout and stderr under `logs`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            "--log-dir", str(logs), "--redirects", "3", "-m", "tttvideo", *args]


def rank_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def launch(work: Path, ranks: int, out: str, *sets: str) -> subprocess.CompletedProcess:
    """`tttv sample` on `ranks` processes, each rank's stdout and stderr in work/logs."""
    cmd = torchrun(ranks, work / "logs" / f"{time.monotonic_ns()}", cli_args(work, out, *sets))
    return run_launch(cmd, rank_env(), LAUNCH_TIMEOUT_S)


def rank_log(run: subprocess.CompletedProcess, rank: int, stream: str = "stderr") -> str:
    logs = Path(run.args[run.args.index("--log-dir") + 1])
    return next(logs.glob(f"*/attempt_0/{rank}/{stream}.log")).read_text()


def latents(folder: Path) -> dict[str, torch.Tensor]:
    return {p.name: load_file(p)["latents"] for p in sorted(folder.glob("*.latents.safetensors"))}


@pytest.fixture(scope="module")
def reference(work) -> dict[str, torch.Tensor]:
    """The one-process output, in this process."""
    assert main(cli_args(work, "one")) == 0
    found = latents(work / "one")
    assert list(found) == ["stories-000.latents.safetensors", "stories-001.latents.safetensors"]
    assert found["stories-000.latents.safetensors"].shape == (1, 13, 16, 4, 6)
    return found


def assert_same_output(run: subprocess.CompletedProcess, work: Path, out: str, reference) -> None:
    assert run.returncode == 0, (run.stdout + run.stderr + rank_log(run, 0) + rank_log(run, 1))[-6000:]
    got = latents(work / out)
    assert got.keys() == reference.keys()
    for name, expected in reference.items():
        torch.testing.assert_close(got[name], expected, rtol=0, atol=LATENT_ATOL, msg=name)
    assert sorted(p.name for p in (work / out).glob("*.mp4")) == ["stories-000.mp4", "stories-001.mp4"]
    assert rank_log(run, 1, "stdout").strip() == ""  # one voice: rank 0's


def test_sp_on_two_processes_matches_one(work, reference):
    assert_same_output(launch(work, 2, "sp2", "parallel.sp=2"), work, "sp2", reference)


def test_split_guidance_on_two_processes_matches_one(work, reference):
    assert_same_output(launch(work, 2, "split", "sample.split_guidance=true"), work, "split", reference)


def test_sp_and_split_guidance_on_four_processes_match_one(work, reference):
    run = launch(work, 4, "sp2split", "parallel.sp=2", "sample.split_guidance=true")
    assert_same_output(run, work, "sp2split", reference)


def test_story_groups_on_two_processes_match_one(work, reference):
    """sp 1, no split: two story groups of one rank, each sampling and writing one of the two stories."""
    assert_same_output(launch(work, 2, "groups"), work, "groups", reference)


def test_bad_degree_is_one_sentence(work):
    run = launch(work, 2, "bad", "parallel.sp=2", "sample.split_guidance=true")
    assert run.returncode != 0
    said = rank_log(run, 0).strip()
    assert said.startswith("tttv sample: error: 2 (sample.split_guidance) x parallel.sp = 2 x 2 = 4 does not "
                           "divide the world size 2 (WORLD_SIZE)"), said
    assert "Traceback" not in said and len(said.splitlines()) == 1
    assert rank_log(run, 1).strip() == ""
    assert not list((work / "bad").glob("*.mp4")) if (work / "bad").exists() else True


def degrees_of(world: int, *sets: str):
    return resolve_sample_degrees(load_config(None, [*TINY, *sets]), heads=2, world_size=world)


def test_degree_checks_name_the_key():
    d = degrees_of(8, "parallel.sp=2", "sample.split_guidance=true")
    assert (d.guidance, d.sp, d.story_groups) == (2, 2, 2)
    cases = {
        "parallel.sp = 4 does not divide the model's 2 attention heads": ("parallel.sp=4",),
        "2 (sample.split_guidance) x parallel.sp = 2 x 1 = 2 does not divide the world size 3": (
            "sample.split_guidance=true",),
        "story groups (parallel.dp_replicate x dp_shard = 2) = 4, but the world size (WORLD_SIZE) is 2": (
            "parallel.sp=2", "parallel.dp_shard=2"),
        "sample.offload_blocks is not supported with several processes": ("sample.offload_blocks=true",),
    }
    for sentence, sets in cases.items():
        with pytest.raises(ConfigError, match="^") as err:
            degrees_of(3 if "world size 3" in sentence else 2, *sets)
        assert sentence in str(err.value)


def test_split_guidance_at_scale_one_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="tttvideo"):
        warn_if_nothing_to_split(load_config(None, [*TINY, "sample.split_guidance=true", "sample.cfg=1"]))
        warn_if_nothing_to_split(load_config(None, [*TINY, "sample.split_guidance=true", "sample.cfg=3"]))
    assert len(caplog.records) == 1 and "does nothing at guidance scale 1" in caplog.text


def test_killed_rank_ends_the_launch_at_once(work):
    """SIGKILL of rank 1 in the denoising loop (sp = 2: the ranks exchange in every block): torchrun ends rank 0 and
    exits non-zero within seconds, not after the process group's timeout (gloo's and NCCL's default: 10 minutes),
    and no video is left half-written."""
    import signal

    from tests.test_parallel_train import rank_pids

    out = work / "killed"
    logs = work / "logs" / "killed"
    cmd = torchrun(2, logs, [*cli_args(work, "killed", "parallel.sp=2"), "--steps", "1000"])
    env = rank_env(PYTHONUNBUFFERED="1")  # rank 0's "encoder released" reaches its log at once
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        pids = rank_pids(proc.pid, 2)
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        said = lambda: "".join(p.read_text() for p in logs.glob("*/attempt_0/0/stdout.log"))  # noqa: E731
        while "encoder released" not in said():  # the text phase is over: the ranks are denoising
            assert proc.poll() is None and time.monotonic() < deadline, "the launch ended before denoising"
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        log, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode != 0, log[-4000:]
    assert time.monotonic() - killed < 60
    assert not out.exists() or not list(out.glob("*.mp4"))
