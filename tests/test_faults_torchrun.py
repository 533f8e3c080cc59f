"""The faults of a torchrun launch (docs/reliability.md, "Several processes (torchrun)"): what can be checked without
a launch is checked here in this process (the resume command rebuilt from a launcher's command line and
environment, the sentence naming differing config keys, the signals, the sentence of a lost peer); one 2-process
launch shows the config check end to end. tests/test_parallel_train.py launches the frozen rank and the killed
launcher, and checks the resume command printed under torchrun."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.launching import run_launch
from tttvideo.cli.train_cmd import resume_command
from tttvideo.config.schema import Config
from tttvideo.parallel import watchdog
from tttvideo.parallel.group import config_differences, flat_config
from tttvideo.parallel.launch import launcher_prefix
from tttvideo.parallel.watchdog import EXIT_PEER_LOST, PeerWatch, peer_failure
from tttvideo.train import stop
from tttvideo.train.stop import StopSignals, uninterrupted

ROOT = Path(__file__).resolve().parents[1]
TRAIN_ARGS = ["train", "configs/demo.toml", "--set", "parallel.sp=2"]
TORCHRUN_ENV = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "node0",
                "MASTER_PORT": "29500"}


# ---------------------------------------------------------------------------------------------- resume command
def test_resume_command_under_torchrun_is_the_launchers_own():
    """The launcher's command line (its /proc cmdline) ends with this rank's arguments: what comes before is
    reused as typed; without it the command is rebuilt from torchrun's variables; without torchrun there is none."""
    python = ["/venv/bin/python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "-m", "tttvideo"]
    env = {**TORCHRUN_ENV, "WORLD_SIZE": "2"}
    assert launcher_prefix(TRAIN_ARGS, [*python, *TRAIN_ARGS], env) == python
    script = ["/venv/bin/python", "/venv/bin/torchrun", "--nproc-per-node=2", "--no-python", "tttv"]
    assert launcher_prefix(TRAIN_ARGS, [*script, *TRAIN_ARGS], env) == ["torchrun", *script[2:]]
    # a wrapper in between (its command line is not this rank's): rebuilt, one node, then two
    assert launcher_prefix(TRAIN_ARGS, ["srun", "wrapper.sh"], env) == [
        "torchrun", "--standalone", "--nproc-per-node", "2", "-m", "tttvideo"]
    assert launcher_prefix(TRAIN_ARGS, None, TORCHRUN_ENV)[:3] == ["torchrun", "--nnodes", "2"]
    assert launcher_prefix(TRAIN_ARGS, [*python, *TRAIN_ARGS], {"WORLD_SIZE": "2"}) is None  # not torchrun
    assert launcher_prefix(TRAIN_ARGS, [*python, *TRAIN_ARGS], {}) is None

    args = argparse.Namespace(config="configs/demo.toml", overrides=["parallel.sp=2"], auto_fit=False)
    assert resume_command(args, "runs/x-2", "runs/x", python) == (
        "/venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 -m tttvideo train "
        "configs/demo.toml --set parallel.sp=2 --set train.output_dir=runs/x-2 --resume")
    assert resume_command(args, "runs/x", "runs/x").startswith("tttv train configs/demo.toml --set parallel.sp=2")
    assert resume_command(args, "runs/x", "runs/x", ["torchrun", "--nnodes", "2"], nodes=2).endswith(
        "--resume (on each of the 2 nodes, as the run was started)")


# ---------------------------------------------------------------------------------------------- config check
def test_config_differences_name_each_key_its_values_and_ranks():
    same = flat_config(Config())
    other = flat_config(Config())
    assert config_differences([same, other]) == ""
    other["train.lr"], other["parallel.sp"] = "0.001", "2"
    text = config_differences([same, same, other])
    assert text.startswith("the ranks were started with different configs: parallel.sp is 1 on ranks 0, 1 but 2 "
                           "on rank 2; train.lr is 1e-05 on ranks 0, 1 but 0.001 on rank 2;"), text
    assert text.endswith("start every rank with the same config file and --set flags")
    many = dict(same, **{f"train.extra_{i}": "1" for i in range(5)})
    assert "(and 2 more key(s))" in config_differences([same, many])


# ---------------------------------------------------------------------------------------------- signals
def test_repeated_sigterm_and_a_signal_during_a_save_do_not_abort(monkeypatch):
    """Two SIGTERMs (a scheduler's, then torchrun's) are one request; during a save even Ctrl-C waits for it;
    a second Ctrl-C outside a save still aborts."""
    monkeypatch.setenv("RANK", "0")
    saved = []

    @uninterrupted
    def save() -> None:
        os.kill(os.getpid(), signal.SIGINT)  # handled here, between bytecodes: must not raise
        saved.append(stop._saving)

    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.signum == signal.SIGTERM
        save()
        assert saved == [1] and stop._saving == 0
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_stop_line_is_printed_by_rank_zero_only(monkeypatch, capfd):
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        with StopSignals():
            os.kill(os.getpid(), signal.SIGTERM)
        assert ("SIGTERM: finishing the current step" in capfd.readouterr().err) is printed, rank


# ---------------------------------------------------------------------------------------------- a lost peer
@pytest.fixture
def watch(monkeypatch):
    """Rank 0 of 2 watching through an in-process store; its thread is not started (it would end the process)."""
    w = PeerWatch(0, 2, timeout_s=2.0, slow_timeout_s=4.0, command="train", store=dist.HashStore())
    monkeypatch.setattr(watchdog, "_active", w)
    monkeypatch.setattr(watchdog, "_advice", lambda: "resume with: torchrun ... --resume")
    yield w
    monkeypatch.setattr(watchdog, "_advice", None)


def as_peer(w: PeerWatch, rank: int, pid: int, phase: str, step: int) -> None:
    """Write what rank `rank`'s own watch would have written."""
    other = PeerWatch(rank, w.world, w.timeout_s, w.slow_timeout_s, "train", w.store)
    other._publish("info", {"pid": pid, "host": os.uname().nodename})
    other._publish("hb", {"beat": 1, "phase": phase, "step": step})


def test_a_dead_peer_is_one_sentence_naming_it(watch):
    dead = subprocess.Popen(["true"])
    dead.wait()
    as_peer(watch, 1, dead.pid, "backward", 3)
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1234: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging")
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(RuntimeError), watch.phase("all-reduce of the loss", 2):
            raise gloo
        lost = peer_failure(gloo)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert lost is not None and lost.speaks
    assert lost.sentence == (
        f"rank 1 stopped answering: its process (pid {dead.pid} on this host) has exited, last seen in 'backward' "
        f"of step 3; this rank's collective in 'all-reduce of the loss' of step 3 failed (RuntimeError: Read error "
        f"[127.0.0.1]:1234: Connection reset by peer); resume with: torchrun ... --resume")
    assert peer_failure(ValueError("a bug")) is None  # keeps its traceback


def test_a_frozen_peer_is_named_stopped_and_the_lowest_answering_rank_speaks(watch):
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        time.sleep(0.1)
        as_peer(watch, 1, frozen.pid, "forward", 5)
        suspects = watch.suspects()
        assert [p.rank for p in suspects] == [1] and watch.speaks(suspects)
        assert watch.sentence("this rank waited", suspects).startswith(
            f"rank 1 stopped answering: its process (pid {frozen.pid} on this host) is stopped (SIGSTOP, or a "
            f"debugger holds it), last seen in 'forward' of step 5; this rank waited")
        rank1 = PeerWatch(1, 2, 2.0, 4.0, "train", watch.store)
        assert not rank1.speaks([]) and rank1.speaks([suspects[0].__class__(0)])  # rank 0 gone: rank 1 speaks
    finally:
        frozen.kill()
        frozen.wait()


def test_phase_budgets_slow_for_start_up_first_step_and_saves(watch):
    def budget() -> float | None:
        return watch._phases[-1][3]

    with watch.phase("rank 0's decision"):
        assert budget() == 4.0  # start-up
    with watch.phase("forward", 0):
        assert budget() == 4.0  # the first step this process runs
    with watch.phase("forward", 1):
        assert budget() == 2.0
        with watch.phase("inner"):
            assert budget() == 2.0 and watch._phases[-1][0] == "forward: inner"
    with watch.phase("checkpoint save", 1, slow=True), watch.phase("waiting for rank 0's decision"):
        assert budget() == 4.0
    with watch.phase("waiting", bounded=False), watch.phase("inner"):
        assert budget() is None


def beating(w: PeerWatch, rank: int, phase: str, step: int, beats: int) -> threading.Thread:
    """A thread that writes `beats` heartbeats of rank `rank` (another host) 0.05 s apart, then falls silent."""
    peer = PeerWatch(rank, w.world, w.timeout_s, w.slow_timeout_s, "train", w.store)
    peer._publish("info", {"pid": 1, "host": "elsewhere"})

    def beat() -> None:
        for n in range(beats):
            peer._publish("hb", {"beat": n, "phase": phase, "step": step})
            time.sleep(0.05)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return thread


def fired(w: PeerWatch, capfd, timeout_s: float = 10) -> str:
    """Run `w`'s thread until it ends the process (recorded instead); what it printed."""
    codes: list[int] = []
    w.exit = codes.append
    w.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not codes and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        w._stop.set()
    assert codes == [EXIT_PEER_LOST]
    return capfd.readouterr().err


def test_a_collective_past_its_budget_stops_the_rank_with_a_sentence(watch, capfd):
    """Every rank answers, but rank 0 waits in a collective rank 1 is not in: past parallel.timeout_s the watch's
    thread says so and ends the process with status 3 (its main thread would never come back)."""
    watch.timeout_s, watch.tick_s = 0.5, 0.1
    beating(watch, 1, "forward", 4, 200)
    with watch.phase("forward", 1):  # the first step: the slow budget
        pass
    with watch.phase("all-reduce of the loss", 2):
        err = fired(watch, capfd)
    assert re.fullmatch(
        r"tttv train: error: the ranks are in different phases \(rank 1 in 'forward' of step 4\), so a collective "
        r"cannot complete; this rank waited \d s in 'all-reduce of the loss' of step 3 \(parallel.timeout_s = 0.5\); "
        r"resume with: torchrun ... --resume", err.strip()), err


def test_a_silent_peer_on_another_host_stops_the_rank_with_a_sentence(watch, capfd):
    watch.timeout_s, watch.tick_s = 0.5, 0.1
    beating(watch, 1, "backward", 7, 3).join()
    with watch.phase("forward", 6), watch.phase("all-reduce of the loss", 6):
        err = fired(watch, capfd)
    assert re.fullmatch(
        r"tttv train: error: rank 1 stopped answering: its process \(pid 1 on elsewhere\) sends no sign of life, "
        r"last seen in 'backward' of step 7; this rank, in 'forward: all-reduce of the loss' of step 7, heard "
        r"nothing from it for \d s \(parallel.timeout_s = 0.5\); resume with: torchrun ... --resume", err.strip()), err


def test_a_peer_killed_on_this_host_stops_the_rank_at_once(watch, capfd):
    """NCCL's collectives wait for a dead peer instead of failing: on two GPUs, rank 1 killed (kill -9) left rank 0
    in a collective until torchrun's SIGKILL 30 s later, without a word. A peer whose process ended on this host
    is now said within a heartbeat or two, long before parallel.timeout_s."""
    watch.timeout_s, watch.tick_s = 60.0, 0.1
    dead = subprocess.Popen(["true"])
    dead.wait()
    as_peer(watch, 1, dead.pid, "backward", 2)
    started = time.monotonic()
    with watch.phase("forward", 0), watch.phase("checkpoint save", 1):  # waiting in a collective that never ends
        err = fired(watch, capfd)
    assert time.monotonic() - started < 5
    assert err.strip() == (
        f"tttv train: error: rank 1 stopped answering: its process (pid {dead.pid} on this host) has exited, last "
        f"seen in 'backward' of step 2; this rank, in 'forward: checkpoint save' of step 2, saw that process end; "
        f"resume with: torchrun ... --resume")


def test_with_four_ranks_only_the_first_to_decide_speaks_and_followers_are_not_blamed(monkeypatch):
    """Rank 1 of 4 killed: rank 0 says the sentence and leaves, rank 2 leaves quietly; rank 3 decides last and sees
    all three gone. It names rank 1 first (the others only followed) and says nothing, since rank 0 spoke: on four
    CPU processes (benchmarks/stage_chain.py --gpus 4) the last survivor printed a second sentence that blamed
    rank 0. Had no rank spoken (each expecting a lower one to), rank 3 would."""
    monkeypatch.setattr(watchdog, "_advice", None)
    store = dist.HashStore()
    last = PeerWatch(3, 4, timeout_s=2.0, slow_timeout_s=4.0, command="train", store=store)
    ended = []
    for rank in range(3):
        proc = subprocess.Popen(["true"])
        proc.wait()
        ended.append(proc.pid)
        as_peer(last, rank, proc.pid, "backward", 2)
    for rank, spoke in ((0, True), (2, False)):
        leaver = PeerWatch(rank, 4, 2.0, 4.0, "train", store)
        leaver._beat = 5
        leaver._leaving(spoke, follower=True)
    suspects = last.suspects()
    assert sorted(p.rank for p in suspects) == [0, 1, 2]
    assert not last.speaks(suspects)
    assert last.sentence("this rank saw them end", suspects).startswith(
        f"rank 1 stopped answering: its process (pid {ended[1]} on this host) has exited, last seen in 'backward' "
        f"of step 2 (rank(s) 0, 2 stopped after it); this rank saw them end")
    # nobody spoke (rank 0 left quietly, expecting another to): the last one does, whichever suspects it was given
    PeerWatch(0, 4, 2.0, 4.0, "train", store)._publish("hb", {"beat": 9, "left": True, "spoke": False})
    assert last.speaks([])
    # a rank that stopped on its own phase budget, every peer answering, is no follower: named as a cause
    budget = PeerWatch(2, 4, 2.0, 4.0, "train", store)
    budget._beat = 20
    budget._leaving(False, follower=False)
    assert last.sentence("x", last.suspects()).startswith("rank 1 (and rank(s) 2) stopped answering")


def test_a_rank_says_the_sentence_once_and_its_last_heartbeat_stays_last(watch):
    """Two sentences came from one launch of four CPU processes (CI, tests/test_stage_chain_cpu.py): a rank's
    collective failed while its thread was stopping the run too, or the thread beat once more after the rank's last
    heartbeat, erasing the `spoke` a later deciding peer reads. Whichever path decides first decides alone, and no
    heartbeat follows the last one."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    as_peer(watch, 1, dead.pid, "backward", 2)
    watch._fired.acquire()  # the thread is in `fire`: it says the sentence, the main thread's failure stays quiet
    sentence, speaks = watch.failure(RuntimeError("Connection reset by peer"))
    assert (sentence, speaks) == ("", False)
    watch._fired.release()

    watch._leaving(True, follower=True)
    watch._heartbeat({"beat": watch._beat + 1, "phase": "forward", "step": 3})  # the thread, one beat late
    watch.stop()  # and the end of the run
    last = PeerWatch(1, 2, 2.0, 4.0, "train", watch.store)
    last._listen(time.monotonic())
    assert last.peers[0].spoke and last.peers[0].left and not last.peers[0].done
    assert not last.speaks([last.peers[0]])


def test_a_peer_that_finished_and_exited_is_not_a_lost_one(watch):
    finished = subprocess.Popen(["true"])
    finished.wait()
    as_peer(watch, 1, finished.pid, "", 3)
    PeerWatch(1, 2, 2.0, 4.0, "train", watch.store)._publish("hb", {"beat": 2, "done": True})
    watch._listen(time.monotonic())
    assert watch._ended_here() == []


# ---------------------------------------------------------------------------------------------- one launch
def test_ranks_with_different_configs_stop_with_one_sentence(tmp_path):
    """Rank 1 started with another train.lr and a parallel.sp that fails the checks on its own (a wrapper adds
    them): the configs are compared first, so rank 0 names both keys and exits 2 before any data or model work."""
    wrapper = tmp_path / "rank.sh"
    wrapper.write_text(f'#!/bin/sh\nif [ "$RANK" = 1 ]; then set -- "$@" --set train.lr=0.001 --set parallel.sp=3; fi\n'
                       f'exec {sys.executable} -m tttvideo "$@"\n')
    wrapper.chmod(0o755)
    logs = tmp_path / "logs"
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--log-dir",
           str(logs), "--redirects", "3", "--no-python", str(wrapper), "train", "configs/demo.toml",
           "--set", f"train.output_dir={out}", "--set", f"data.demo_dir={tmp_path / 'data'}",
           "--set", "train.tensorboard=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    run = run_launch(cmd, env, 120, cwd=ROOT)
    assert run.returncode != 0 and "exitcode  : 2" in run.stderr, run.stderr[-4000:]
    err = next(logs.glob("*/attempt_0/0/stderr.log")).read_text()
    assert err.strip().count("\n") == 0 and "Traceback" not in err, err
    assert ("tttv train: error: the ranks were started with different configs: parallel.sp is 1 on rank 0 but 3 on "
            "rank 1; train.lr is 0.005 on rank 0 but 0.001 on rank 1; start every rank with the same config file "
            "and --set flags") in err, err
    assert not (tmp_path / "data").exists() and not (out / "checkpoints").exists()


def test_a_peer_that_speaks_and_exits_between_the_reads_is_heard(monkeypatch):
    """Rank 2 of 4 decides while rank 0 says the sentence, writes its last heartbeat and exits: rank 2 read the
    heartbeats just before that write and the process states just after the exit. It must read rank 0's `spoke`
    before counting rank 0 gone (CI, four CPU processes: two sentences)."""
    monkeypatch.setattr(watchdog, "_advice", None)
    store = dist.HashStore()
    deciding = PeerWatch(2, 4, timeout_s=2.0, slow_timeout_s=4.0, command="train", store=store)
    alive, dead = subprocess.Popen(["sleep", "30"]), subprocess.Popen(["true"])
    dead.wait()
    try:
        for rank, pid in ((0, alive.pid), (1, dead.pid), (3, alive.pid)):
            as_peer(deciding, rank, pid, "backward", 2)
        deciding._listen(time.monotonic())
        rank0 = PeerWatch(0, 4, 2.0, 4.0, "train", store)
        rank0._beat = 5
        real_state = watchdog.Peer.state

        def state(peer):
            if peer.rank == 0:  # rank 0 speaks and exits after the heartbeats were read
                rank0._leaving(True, follower=True)
                return "exited"
            return real_state(peer)

        monkeypatch.setattr(watchdog.Peer, "state", state)
        assert not deciding.speaks([deciding.peers[1]])
        # the same order with a rank 0 that left without speaking: rank 2 is the lowest one left, and speaks
        rank0._left = False
        rank0._leaving(False, follower=True)
        assert deciding.speaks([deciding.peers[1]])
    finally:
        alive.kill()
        alive.wait()
