"""tests/launching.run_launch past its time limit: the stacks of the processes that print them, a log file named by the
caller, and no signal sent to a process that would die of it."""

from __future__ import annotations

import os
import signal
import sys
import textwrap

import pytest

from tests import launching
from tests.launching import catches

# a "rank" that prints its stacks at SIGUSR1 and hangs in a function whose name the failure must show, started by a
# "launcher" that catches nothing and waits for it (SIGUSR1 would end it at once, before the rank had printed)
RANK = textwrap.dedent("""
    import faulthandler, signal, sys, time
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    def waiting_in_a_collective():
        open(sys.argv[1], "w").write("rank log line\\n")
        while True:
            time.sleep(0.05)
    waiting_in_a_collective()
""")
LAUNCHER = textwrap.dedent("""
    import subprocess, sys
    sys.exit(subprocess.call([sys.executable, "-c", sys.argv[1], sys.argv[2]]))
""")


def test_catches_reads_the_handler_mask():
    previous = signal.signal(signal.SIGUSR2, lambda *_: None)
    try:
        assert catches(os.getpid(), signal.SIGUSR2)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert not catches(os.getpid(), signal.SIGUSR2)
    assert not catches(2**22 + 12345, signal.SIGUSR1)  # no such process


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_launch_past_its_limit_fails_with_the_stacks_and_the_logs(tmp_path, monkeypatch):
    sent: list[tuple[int, int]] = []
    kill = os.kill
    monkeypatch.setattr(launching.os, "kill", lambda pid, sig: (sent.append((pid, sig)), kill(pid, sig)))
    log = tmp_path / "stage.log"
    cmd = [sys.executable, "-c", LAUNCHER, RANK, str(log)]
    with pytest.raises(AssertionError) as failed:
        launching.run_launch(cmd, None, 3.0, cwd=tmp_path, logs=lambda: [log])
    message = str(failed.value)
    assert "did not end in 3 s" in message
    assert "waiting_in_a_collective" in message  # the rank's stack, on the launch's stderr
    assert f"--- {log}:\nrank log line" in message
    # both processes killed, SIGUSR1 to the rank alone: the launcher catches nothing and would have died of it
    killed = {pid for pid, sig in sent if sig == signal.SIGKILL}
    asked = {pid for pid, sig in sent if sig == signal.SIGUSR1}
    assert len(killed) == 2 and len(asked) == 1 and asked < killed
