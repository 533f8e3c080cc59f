"""`tttv train` under torchrun on CPU (gloo): FSDP2, Ulysses sp and both against the one-process run at the same
global batch, DCP checkpoints resumed on another number of processes (4 and 1) and a one-process checkpoint on 2,
the EMA of sharded weights, a rank frozen mid-run and a launcher killed mid-run (tests/test_faults_torchrun.py has
the rest of those faults), and the sentences a wrong launch gets.

Every run trains the tiny model (fp32) for 4 steps on a 3-s, 32x32 layout (76 tokens: no sp padding here;
tests/test_parallel.py covers it at the model level) with a global batch of 2 (one sample per micro-batch:
grad_accum 2 on one process and with sp = 2 alone, 1 with dp_shard = 2). The losses match the one-process run within
LOSS_RTOL and the weights of the last checkpoint within WEIGHT_ATOL; the parallel runs differ from it only in
summation order (gradient reductions, sp exchanges), which the optimizer (Adam, lr 5e-3) carries into the weights.
Measured: losses within 2e-7 relative, weights within 4.4e-5.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tttvideo.config.loader import load_config
from tttvideo.data.video import read_frames
from tttvideo.errors import UserError
from tttvideo.models.backbone import layout_of
from tttvideo.train.dcp import holds_model_state
from tttvideo.train.trainer import Trainer

from tests.launching import run_launch

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("one_thread")

DEMO = str(Path(__file__).parents[1] / "configs" / "demo.toml")
SETTINGS = [
    "layout.duration=3s", "layout.height=32", "layout.width=32", "data.demo_videos=3",
    "data.demo_text_encoder=table", "train.sample_at_end=false", "train.tensorboard=false", "train.batch_size=1",
    "train.grad_accum=0", "train.global_batch=2", "train.steps=4", "train.checkpoint_every=2",
    "train.keep_checkpoints=4", "train.log_every=1", "train.warmup_steps=1", "train.if_exists=refuse",
    # one thread (configs/demo.toml's 2 would override the launches' OMP_NUM_THREADS=1 and the one_thread fixture);
    # no end-of-run pictures (~1.4 s of CPU a launch; tests/test_demo_learns.py checks them)
    "train.cpu_threads=1", "train.plots=false",
]
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 2e-4
LAUNCH_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("parallel-train")


def settings(work: Path, out: str, *extra: str) -> list[str]:
    return [*SETTINGS, f"data.demo_dir={work / 'data'}", f"train.output_dir={work / out}", *extra]


def torchrun(work: Path, ranks: int, *sets: str, flags: tuple[str, ...] = ()) -> list[str]:
    """The command line of `tttv train` on `ranks` processes, each rank's stdout and stderr in work/logs."""
    logs = work / "logs" / f"{time.monotonic_ns()}"
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            "--log-dir", str(logs), "--redirects", "3", "-m", "tttvideo", "train", DEMO,
            *[x for s in sets for x in ("--set", s)], *flags]


def launch(cmd: list[str]) -> subprocess.CompletedProcess:
    # faulthandler: a rank that dies of a signal (SIGABRT from a C++ thread) leaves its Python stacks in its log
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
    return run_launch(cmd, env, LAUNCH_TIMEOUT_S)


def rank_log(cmd: list[str], rank: int, stream: str = "stderr") -> str:
    """What rank `rank` of the newest launch with `cmd`'s log folder wrote to `stream` ('stdout' or 'stderr')."""
    logs = Path(cmd[cmd.index("--log-dir") + 1])
    return max(logs.glob(f"*/attempt_0/{rank}/{stream}.log"), key=lambda p: p.stat().st_mtime).read_text()


def said(text: str) -> str:
    """`text` with the console's line wrapping undone."""
    return " ".join(text.split())


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights(run: Path, step: int = 4) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step-{step:06d}" / "model.safetensors")


def assert_same_run(run: Path, reference: Path) -> None:
    """`run` logged the reference's losses for all 4 steps and ended with its weights."""
    assert losses(run) == pytest.approx(losses(reference), rel=LOSS_RTOL)
    mine, theirs = weights(run), weights(reference)
    assert mine.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(mine[name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=name)


def assert_ok(run: subprocess.CompletedProcess) -> None:
    if run.returncode != 0:  # torchrun's summary, then what each rank wrote to its log
        ranks = int(run.args[run.args.index("--nproc_per_node") + 1])
        logs = []
        for rank in range(ranks):
            with contextlib.suppress(ValueError, OSError):  # a rank that never started has no log
                logs.append(f"\n--- rank {rank}:\n{rank_log(run.args, rank)[-3000:]}")
        raise AssertionError((run.stdout + run.stderr)[-4000:] + "".join(logs))


@pytest.fixture(scope="module")
def reference(work) -> Path:
    """The one-process run, in this process (it also writes the demo set the launches share)."""
    Trainer(load_config(DEMO, settings(work, "one")), quiet=True).run()
    return work / "one"


@pytest.fixture(scope="module")
def sp_run(work, reference) -> Path:
    """2 processes, sp = 2 (one data-parallel rank: FSDP shards over the sp pair)."""
    assert_ok(launch(torchrun(work, 2, *settings(work, "sp2", "parallel.sp=2"))))
    return work / "sp2"


def test_sp_and_fsdp_on_two_processes_match_one(work, reference, sp_run):
    assert_same_run(sp_run, reference)
    assert (sp_run / "checkpoints/step-000004/dcp/.metadata").is_file()
    # the model is written once, whole (model.safetensors); dcp/ holds the optimizer's shards
    assert not holds_model_state(sp_run / "checkpoints/step-000004")
    cmd = torchrun(work, 2, *settings(work, "fsdp2", "parallel.dp_shard=2", "train.sample_at_end=true",
                                      "sample.steps=2"))
    assert_ok(launch(cmd))
    assert_same_run(work / "fsdp2", reference)
    # the end-of-run video under torchrun: both ranks run the sampler with the FSDP-sharded model (its forward
    # gathers from both), rank 0 alone decodes and writes it and says where
    videos = sorted((work / "fsdp2" / "samples").glob("*.mp4"))
    assert [v.name for v in videos] == ["step-000004.mp4"]
    assert f"video {videos[0]}" in said(rank_log(cmd, 0, "stdout"))
    assert "video" not in rank_log(cmd, 1, "stdout")
    # train.plots = false: neither the loss curve nor the video's frame strip, and no line naming them; the demo
    # set's score of the video is printed all the same
    assert not any((work / "fsdp2" / name).exists() for name in ("loss.png", "frames.png"))
    assert "look at what it learned" not in said(rank_log(cmd, 0, "stdout"))
    assert "demo score" in said(rank_log(cmd, 0, "stdout"))
    frames = read_frames(videos[0])
    layout = layout_of(load_config(DEMO, settings(work, "fsdp2")))
    assert frames.shape[0] == layout.num_frames and frames.shape[1:3] == (32, 32)
    # trained with sp = 2, sampled without it (each rank's forward takes the whole sequence), a validation video in
    # mid-run as well as the last
    assert_ok(launch(torchrun(work, 2, *settings(work, "sp2video", "parallel.sp=2", "train.steps=3",
                                                 "train.validate_every=2", "train.sample_at_end=true",
                                                 "sample.steps=2"))))
    videos = sorted((work / "sp2video" / "samples").glob("*.mp4"))
    assert [v.name for v in videos] == ["step-000002.mp4", "step-000003.mp4"]
    assert all(read_frames(v).shape == frames.shape for v in videos)


def copy_at(run: Path, to: Path, step: int) -> Path:
    """A copy of `run` as if it had stopped after checkpoint `step` (later checkpoints removed)."""
    shutil.copytree(run, to)
    for folder in (to / "checkpoints").iterdir():
        if int(folder.name.split("-")[1]) > step:
            shutil.rmtree(folder)
    return to


def test_two_process_checkpoint_resumes_on_four_and_on_one(work, reference, sp_run):
    """Saved at step 2 on 2 processes (sp = 2); resumed on 4 (sp = 2 x dp_shard = 2) and on 1 (DCP reads every
    shard into the whole model without a process group): the same steps 3 and 4 as the uninterrupted run."""
    copy_at(sp_run, work / "on4", 2)
    run = launch(torchrun(work, 4, *settings(work, "on4", "parallel.sp=2", "parallel.dp_shard=2"),
                          flags=("--resume",)))
    assert_ok(run)
    assert "resumed from" in said(rank_log(run.args, 0, "stdout"))
    assert_same_run(work / "on4", reference)

    copy_at(sp_run, work / "on1", 2)
    result = Trainer(load_config(DEMO, settings(work, "on1")), quiet=True, if_exists="resume").run()
    assert result.steps_done == 4
    assert_same_run(work / "on1", reference)
    # another train.optimizer: the shards hold the other's state (AdamW's into the 8-bit one loaded, the other way
    # stopped in DCP with a traceback); one sentence (a one-process checkpoint converts: tests/test_train_loop.py)
    copy_at(sp_run, work / "on1-8bit", 2)
    with pytest.raises(UserError, match=r"holds the state of train.optimizer = 'adamw' in shards, this config has "
                                        r"'adamw8bit'.*train.init_from"):
        Trainer(load_config(DEMO, settings(work, "on1-8bit", "train.optimizer=adamw8bit")), quiet=True,
                if_exists="resume").run()
    # other trainable parameters (DCP stopped with "Missing key in checkpoint state_dict" and a traceback)
    copy_at(sp_run, work / "on1-qkvo", 2)
    with pytest.raises(UserError, match=r"holds the optimizer state of \d+ trained tensors, this config trains \d+"):
        Trainer(load_config(DEMO, settings(work, "on1-qkvo", "model.adapter=qkvo")), quiet=True,
                if_exists="resume").run()


def test_four_processes_sp_and_dp_shard_match_one(work, reference):
    assert_ok(launch(torchrun(work, 4, *settings(work, "sp2dp2", "parallel.sp=2", "parallel.dp_shard=2"))))
    assert_same_run(work / "sp2dp2", reference)


def rank_pids(launcher: int, world: int, timeout_s: float = 60) -> dict[int, int]:
    """{rank: pid} of the workers torchrun `launcher` started."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {}
        for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                found[rank] = int(child)
        if len(found) == world:
            return found
        time.sleep(0.1)
    raise AssertionError(f"torchrun did not start {world} workers in {timeout_s} s")


def gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie no one reaped yet counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except (OSError, IndexError):
        return True


def wait_until(what: str, done, proc: subprocess.Popen | None = None, timeout_s: float = LAUNCH_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert proc is None or proc.poll() is None, f"the launch ended before {what}"
        assert time.monotonic() < deadline, f"no {what} in {timeout_s} s"
        time.sleep(0.02)


def test_frozen_rank_and_killed_launcher_stop_with_a_sentence_and_resume(work, reference):
    """docs/reliability.md, several processes. Rank 1 frozen (SIGSTOP) after the first checkpoint, with
    parallel.timeout_s = 5: rank 0 names it and the phase, and exits 3; rank 1 is then killed. A resume on 2
    processes starts from the newest published checkpoint; its launcher SIGKILLed mid-run, both ranks save, stop
    (rank 0 alone printing the SIGTERM line), let the run folder's lock go and print the launch's own torchrun
    command; the run, resumed from that checkpoint (on one process: the cheapest), ends as the uninterrupted one."""
    from tttvideo.locks import current_holder

    out = work / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = torchrun(work, 2, *settings(work, "killed", "parallel.dp_shard=2", "train.checkpoint_every=1",
                                      "parallel.timeout_s=5"))
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        pids = rank_pids(proc.pid, 2)
        wait_until("first checkpoint", (out / "checkpoints/step-000001").is_dir, proc)
        os.kill(pids[1], signal.SIGSTOP)
        wait_until("stop of rank 0", lambda: gone(pids[0]), timeout_s=60)
        os.kill(pids[1], signal.SIGKILL)  # torchrun would wait 30 s for the frozen rank to obey its SIGTERM
        log, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode != 0 and "exitcode  : 3" in log, log[-4000:]
    err = said(rank_log(cmd, 0))
    assert err.startswith("tttv train: error: rank 1 stopped answering: its process (pid "
                          f"{pids[1]} on this host) is stopped (SIGSTOP, or a debugger holds it)"), err
    assert "(parallel.timeout_s = 5)" in err and "no checkpoint can be saved now" in err and "Traceback" not in err
    published = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert published and published[-1] != "step-000004", published  # stopped mid-run
    assert f"the newest checkpoint is {out / 'checkpoints' / published[-1]}" in err

    cmd = torchrun(work, 2, *settings(work, "killed", "parallel.dp_shard=2"), flags=("--resume",))
    lines = lambda: len((out / "metrics.jsonl").read_text().splitlines())  # noqa: E731
    before = lines()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        pids = rank_pids(proc.pid, 2)
        wait_until("step of the resumed run", lambda: lines() > before, proc)
        proc.kill()  # the launcher: SIGKILL
        proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    wait_until("stop of the ranks", lambda: gone(pids[0]) and gone(pids[1]), timeout_s=60)
    assert current_holder(out) is None  # no orphan holds the run folder
    assert f"resumed from {out / 'checkpoints' / published[-1]}" in said(rank_log(cmd, 0, "stdout"))
    err = rank_log(cmd, 0)
    assert "tttv train: SIGTERM: finishing the current step, then saving a checkpoint" in err, err
    assert "SIGTERM" not in rank_log(cmd, 1)
    stopped = next(line for line in err.splitlines() if "; resume with: " in line)
    assert stopped.startswith("tttv train: stopped by SIGTERM after step "), stopped
    assert stopped.split("; resume with: ", 1)[1] == shlex.join(cmd), stopped  # cmd ends with --resume

    Trainer(load_config(DEMO, settings(work, "killed")), quiet=True, if_exists="resume").run()
    assert_same_run(out, reference)


def test_wrong_launches_are_one_sentence(work, reference):
    """torchrun reports the failed rank (exit status 2) in its own summary; the rank itself prints one sentence."""
    cmd = torchrun(work, 2, *settings(work, "bad", "parallel.sp=3"))
    run = launch(cmd)
    assert run.returncode != 0 and "exitcode  : 2" in run.stderr, run.stderr[-4000:]
    err = rank_log(cmd, 0)
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    assert "parallel.sp = 3 does not divide the model's 2 attention heads" in err


def test_ema_of_sharded_weights_and_a_one_process_checkpoint_resumed_on_two(work):
    """train.ema_decay under FSDP (dp_shard = 2): each rank averages its shards, a checkpoint gathers them into
    the one-process run's ema.safetensors, and the validation video at step 2 swaps the average in and the weights
    back (steps 3 and 4 equal the one-process run's). Then the one-process run's step-2 checkpoint resumed on 2
    processes: the model read whole before sharding, each rank's part of the whole optimizer state and of the
    average copied into its shards; the same steps 3 and 4 as the uninterrupted run (fresh Adam moments would move
    the weights by about lr = 5e-3)."""
    ema = ("train.ema_decay=0.9", "train.validate_every=2", "sample.steps=2")
    Trainer(load_config(DEMO, settings(work, "one-ema", *ema)), quiet=True).run()
    for out, flags in (("ema-2", ()), ("one-ema-on-2", ("--resume",))):
        if flags:
            copy_at(work / "one-ema", work / out, 2)
        cmd = torchrun(work, 2, *settings(work, out, *ema, "parallel.dp_shard=2"), flags=flags)
        assert_ok(launch(cmd))
        assert ("resumed from" in said(rank_log(cmd, 0, "stdout"))) == bool(flags)
        assert_same_run(work / out, work / "one-ema")
        average = load_file(work / out / "checkpoints/step-000004/ema.safetensors")
        theirs = load_file(work / "one-ema/checkpoints/step-000004/ema.safetensors")
        assert average.keys() == theirs.keys() and average.keys() <= weights(work / out).keys()
        for name, tensor in theirs.items():
            torch.testing.assert_close(average[name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=name)
    # it is an average, not a copy of the weights (measured: 3.4e-4 apart at most)
    assert max((average[n] - weights(work / "ema-2")[n].float()).abs().max() for n in average) > 1e-4
    assert sorted(p.name for p in (work / "ema-2" / "samples").glob("*.mp4")) == ["step-000002.mp4",
                                                                                "step-000004.mp4"]


def test_eight_bit_adamw_under_fsdp_tracks_one_process_and_resumes_bitwise(work, reference):
    """train.optimizer = "adamw8bit" with FSDP2 (dp_shard = 2): torchao's 8-bit state lives per shard (its blocks
    of 256 values then group differently than on one process, so the losses match within 1e-4, not 1e-5), goes into
    the DCP checkpoint, and a resume on 2 processes continues bitwise."""
    pytest.importorskip("torchao.optim")
    eight = "train.optimizer=adamw8bit"
    Trainer(load_config(DEMO, settings(work, "one-8bit", eight)), quiet=True).run()
    assert_ok(launch(torchrun(work, 2, *settings(work, "fsdp-8bit", eight, "parallel.dp_shard=2"))))
    whole = losses(work / "fsdp-8bit")
    assert whole == pytest.approx(losses(work / "one-8bit"), rel=1e-4)
    # the 8-bit state did run: its quantisation moves the losses 4e-6 relative from fp32 AdamW's by step 3, beyond
    # the 2e-7 that summation order alone gives a parallel run
    assert whole != pytest.approx(losses(reference), rel=1e-6)

    # the one-process run's checkpoint resumed on two: its 8-bit moments quantised again in the shards' blocks
    copy_at(work / "one-8bit", work / "one-8bit-on-2", 2)
    assert_ok(launch(torchrun(work, 2, *settings(work, "one-8bit-on-2", eight, "parallel.dp_shard=2"),
                              flags=("--resume",))))
    assert losses(work / "one-8bit-on-2") == pytest.approx(losses(work / "one-8bit"), rel=1e-4)
    for name, tensor in weights(work / "one-8bit").items():
        torch.testing.assert_close(weights(work / "one-8bit-on-2")[name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=name)

    copy_at(work / "fsdp-8bit", work / "fsdp-8bit-resumed", 2)
    run = launch(torchrun(work, 2, *settings(work, "fsdp-8bit-resumed", eight, "parallel.dp_shard=2"),
                          flags=("--resume",)))
    assert_ok(run)
    assert "resumed from" in said(rank_log(run.args, 0, "stdout"))
    assert losses(work / "fsdp-8bit-resumed") == whole
    for name, tensor in weights(work / "fsdp-8bit").items():
        assert torch.equal(weights(work / "fsdp-8bit-resumed")[name], tensor), name


@pytest.mark.parametrize("adapter,ranks,degrees", [
    ("qkvo", 4, ("parallel.dp_replicate=2", "parallel.sp=2")),  # HSDP: sharded over each sp pair, replicated across
    ("lora", 2, ("parallel.dp_shard=2",)),
], ids=["qkvo-hsdp", "lora-fsdp"])
def test_frozen_parameters_under_fsdp_match_one_process(work, adapter, ranks, degrees):
    """The adapters of stages 2-5 and the 24 GB configs freeze most weights; FSDP2 shards them with the trainable
    ones (mixed requires_grad inside one fully_shard unit), and the run equals the one-process run of that adapter."""
    one = f"one-{adapter}"
    Trainer(load_config(DEMO, settings(work, one, f"model.adapter={adapter}")), quiet=True).run()
    out = f"{adapter}-{ranks}"
    assert_ok(launch(torchrun(work, ranks, *settings(work, out, f"model.adapter={adapter}", *degrees))))
    assert_same_run(work / out, work / one)


def test_fp8_frozen_run_resumes_from_its_own_checkpoint_on_two_and_on_one(work):
    """A run that stores its frozen weights in fp8 (qkvo adapter, random init: no base weights, no init_from) saves
    its trained parameters in model.safetensors and the fp8 codes in dcp/ beside the optimizer's shards, so its
    checkpoint resumes by itself: on 2 processes bitwise, and on one (DCP reads the shards without a process
    group) to the same step-4 weights."""
    fp8 = ("model.adapter=qkvo", "model.frozen_weights=fp8", "parallel.dp_shard=2")
    assert_ok(launch(torchrun(work, 2, *settings(work, "fp8", *fp8))))
    step2 = work / "fp8" / "checkpoints" / "step-000002"
    assert not holds_model_state(step2) and any(k.startswith("buffers.") for k in dcp_keys(step2))
    copy_at(work / "fp8", work / "fp8-on2", 2)
    run = launch(torchrun(work, 2, *settings(work, "fp8-on2", *fp8), flags=("--resume",)))
    assert_ok(run)
    assert losses(work / "fp8-on2") == losses(work / "fp8")
    for name, tensor in weights(work / "fp8").items():
        assert torch.equal(weights(work / "fp8-on2")[name], tensor), name

    # resumed with the frozen weights stored otherwise: one sentence, not frozen layers left as built
    copy_at(work / "fp8", work / "fp8-as-bf16", 2)
    with pytest.raises(UserError, match=r"stored its frozen weights in fp8 .*model.frozen_weights = 'fp8'"):
        Trainer(load_config(DEMO, settings(work, "fp8-as-bf16", fp8[0])), quiet=True, if_exists="resume").run()

    copy_at(work / "fp8", work / "fp8-on1", 2)
    one = settings(work, "fp8-on1", *fp8[:2])
    result = Trainer(load_config(DEMO, one), quiet=True, if_exists="resume").run()
    assert result.steps_done == 4
    assert losses(work / "fp8-on1") == pytest.approx(losses(work / "fp8"), rel=LOSS_RTOL)
    for name, tensor in weights(work / "fp8").items():
        torch.testing.assert_close(weights(work / "fp8-on1")[name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=name)


def dcp_keys(checkpoint: Path) -> list[str]:
    from tttvideo.train.dcp import read_dcp_metadata

    return list(read_dcp_metadata(checkpoint / "dcp" / ".metadata").state_dict_metadata)
