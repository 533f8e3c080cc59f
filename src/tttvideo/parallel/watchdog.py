"""The liveness watch of a torchrun launch: no rank waits without bound, and when one must stop waiting it says
which rank stopped answering and what both were doing.

Each rank runs a daemon thread that, every second or so, writes a heartbeat (a counter, its phase, its step) into
the launch's key-value store (torchrun's agent hosts it, so it answers while any rank is frozen or dead) and reads
the others'. The main thread names its phases (`PeerWatch.phase`: "forward", "backward", "checkpoint save", ...).
The thread stops the run when

- a peer on this host has ended without finishing (SIGKILL, the OOM killer: at once, because NCCL's collectives
  wait for a dead peer instead of failing),
- a peer's heartbeat has not changed for `parallel.timeout_s` (a rank frozen by SIGSTOP or a debugger, a lost node:
  its threads are all stopped), or
- this rank has been in one bounded phase longer than its budget: `parallel.timeout_s`, or
  `parallel.slow_timeout_s` for start-up, the first step and checkpoint saves (a collective that never completes
  although every rank is alive: ranks that called different collectives, a network or driver fault).

Then the lowest rank that is still answering prints one sentence (`tttv COMMAND: error: rank 1 stopped answering
...`): the peer (its pid and state when it runs on this host: stopped, exited, running), the phase it was last seen
in, the phase this rank waited in and for how long, and what the command advises (for training: why no checkpoint
can be saved now, the newest one, the command that resumes). Every rank exits with status `EXIT_PEER_LOST` at once:
its main thread is blocked inside a collective that will not return. Before it does, it writes a last heartbeat
that says it left because of a peer and whether it spoke, and no heartbeat follows it: a rank that decides later
(with four ranks, the last survivor sees the first ones gone) neither blames the ranks that only followed nor says
the sentence again. Within a rank the thread and the main thread (a collective that failed) may both see the loss;
whichever decides first decides alone.

The process group's own timeout is set above the watch's budgets (`backstop_timeout`), so that torch's error comes
only if the watch could not run.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

# the exit status of a rank that stopped because a peer stopped answering (2 is a user's mistake, 128 + n a signal)
EXIT_PEER_LOST = 3
# the process group's timeout is this much above the longest budget of the watch
BACKSTOP_MARGIN_S = 60.0

_active: PeerWatch | None = None
_advice: Callable[[], str] | None = None
# words of the errors a collective raises when a peer is gone (gloo, NCCL, the store), for errors torch does not
# type as DistError
_PEER_ERROR_WORDS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer", "broken pipe",
                     "timed out", "socket")


def active_watch() -> PeerWatch | None:
    """The watch of this process's launch, once `start_group` started it (None with one process)."""
    return _active


def advise(fn: Callable[[], str] | None) -> None:
    """What the command advises when a peer is lost (called then; e.g. the newest checkpoint and the resume
    command): the end of the sentence."""
    global _advice
    _advice = fn


@dataclass
class LostPeer:
    """A collective of this rank failed because a peer is gone: the sentence, and whether this rank says it."""

    sentence: str
    speaks: bool

    def exit(self, command: str) -> int:
        if self.speaks:
            with contextlib.suppress(OSError):
                print(f"tttv {command}: error: {self.sentence}", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST


def finish() -> None:
    """This rank's part ended (completed, stopped by a signal, or on a shared error): stop the watch, if any."""
    if _active is not None:
        _active.stop()


def peer_failure(err: BaseException) -> LostPeer | None:
    """`err` as a lost peer, when it is a collective's error under a launch with a watch; else None (a bug: its
    traceback stays)."""
    watch = _active
    if watch is None:
        return None
    text = f"{type(err).__name__} {err}".lower()
    if not (isinstance(err, dist.DistError) or any(word in text for word in _PEER_ERROR_WORDS)):
        return None
    # torchrun SIGTERMs the survivors as soon as it sees a rank die: this rank is leaving anyway, and says why first
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return LostPeer(*watch.failure(err))


def backstop_timeout(timeout_s: float, slow_timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(timeout_s, slow_timeout_s) + BACKSTOP_MARGIN_S)


@dataclass
class Peer:
    """What this rank knows about another: its process, and when its heartbeat last changed (monotonic time)."""

    rank: int
    pid: int = 0
    host: str = ""
    beat: int = -1
    phase: str = ""
    step: int | None = None
    done: bool = False
    left: bool = False  # it stopped because another rank stopped answering: a follower, not a cause
    spoke: bool = False  # and it said the sentence
    heard: float = field(default_factory=time.monotonic)

    def state(self) -> str | None:
        """The process's state when it runs on this host: 'stopped', 'exited' or 'running'; None elsewhere."""
        if not self.pid or self.host != socket.gethostname():
            return None
        try:
            stat = open(f"/proc/{self.pid}/stat", encoding="ascii", errors="replace").read()
        except OSError:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return "exited"
            except OSError:
                return None
            return "running"
        code = stat.rsplit(")", 1)[-1].split()[0]
        return {"T": "stopped", "t": "stopped", "Z": "exited", "X": "exited"}.get(code, "running")

    def where(self) -> str:
        return where(self.phase, self.step)


def where(phase: str, step: int | None) -> str:
    if not phase:
        return "start-up"
    return f"'{phase}'" + (f" of step {step}" if step is not None else "")


def error_gist(err: BaseException) -> str:
    """The first sentence of a collective's error, without the source location gloo puts first: "Read error
    [127.0.0.1]:12710: Connection reset by peer"."""
    text = (str(err).strip().splitlines() or [""])[0]
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    text = text.split(". ")[0].rstrip(".")
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__


def describe_state(peer: Peer) -> str:
    state = peer.state()
    pid = f"pid {peer.pid} on this host"
    if state == "stopped":
        return f"its process ({pid}) is stopped (SIGSTOP, or a debugger holds it)"
    if state == "exited":
        return f"its process ({pid}) has exited"
    if state == "running":
        return f"its process ({pid}) is running but does not answer"
    host = f" on {peer.host}" if peer.host else ""
    return f"its process (pid {peer.pid}{host}) sends no sign of life"


class PeerWatch:
    """The watch of one rank (see the module docstring). `advice` is set by the command: called when the run
    stops, it returns the end of the sentence (what was kept, what to do)."""

    def __init__(self, rank: int, world: int, timeout_s: float, slow_timeout_s: float, command: str,
                 store: dist.Store | None, prefix: str = "tttv/"):
        self.rank, self.world = rank, world
        self.timeout_s, self.slow_timeout_s = timeout_s, slow_timeout_s
        self.command = command
        self.store = store
        self.prefix = prefix
        self.advice: Callable[[], str] | None = None
        self.peers = {r: Peer(r) for r in range(world) if r != rank}
        self.tick_s = min(1.0, timeout_s / 4)
        # (name, step, started, budget or None): the innermost open phase; replaced whole, so the thread reads one
        self._phases: list[tuple[str, int | None, float, float | None]] = []
        self._step: int | None = None
        self._first_step: int | None = None
        self._beat = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._parent = os.getppid()
        self._fired = threading.Lock()
        self.exit: Callable[[int], Any] = os._exit  # how the thread ends the process (a test records it instead)
        self._known = 0  # peers whose pid and host are known
        self._waits = 0
        # one store connection, used by the thread and (waits, the end) the main thread: one request at a time
        self._store_lock = threading.Lock()
        self._failed_in: tuple[str, int | None] | None = None
        self._left = False  # the last heartbeat is out (`_leaving`): no other follows it

    # ------------------------------------------------------------------ the main thread's side
    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None, slow: bool = False,
              bounded: bool = True) -> Iterator[None]:
        """Name what this rank does for the messages; a bounded phase stops the run past its budget (slow: the
        slow budget; so is the first step this process runs and anything inside a slow phase). `step` is
        0-based as the training loop counts; the messages count from 1."""
        if step is not None:
            self._step = step + 1
            if self._first_step is None:
                self._first_step = self._step
        outer = self._phases[-1] if self._phases else None
        slow = slow or (outer is not None and outer[3] == self.slow_timeout_s) or self._step == self._first_step
        budget = (self.slow_timeout_s if slow else self.timeout_s) if bounded else None
        if outer is not None and outer[3] is None:
            budget = None
        label = name if outer is None else f"{outer[0]}: {name}"
        self._phases = [*self._phases, (label, self._step, time.monotonic(), budget)]
        try:
            yield
        except BaseException:
            if self._failed_in is None:  # the innermost phase an error left: where a collective failed
                self._failed_in = (label, self._step)
            raise
        finally:
            self._phases = self._phases[:-1]

    def start(self) -> "PeerWatch":
        global _active
        self._publish("info", {"pid": os.getpid(), "host": socket.gethostname()})
        self._thread = threading.Thread(target=self._run, name="tttv-peer-watch", daemon=True)
        self._thread.start()
        _active = self
        return self

    def stop(self) -> None:
        """The end of this rank's part (a complete run): its peers no longer expect heartbeats from it."""
        global _active
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self._heartbeat({"beat": self._beat + 1, "done": True}, last=True)
        if _active is self:
            _active = None

    def wait_for_all(self, name: str, poll_s: float = 0.2) -> None:
        """Block until every rank has called `wait_for_all(name)`, however long that takes, as long as every rank
        keeps answering (the thread stops the run otherwise). For waits with no sensible time bound: a story group
        waiting for another that samples one more story."""
        if self.store is None:
            return
        self._waits += 1
        kind = f"arrived/{self._waits}"
        self._publish(kind, {"rank": self.rank})
        keys = [f"{self.prefix}{kind}/{r}" for r in range(self.world)]
        with self.phase(f"waiting for every rank to finish {name}", bounded=False):
            while not self._ask(lambda store: store.check(keys)):
                time.sleep(poll_s)

    # ------------------------------------------------------------------ the thread
    def _ask(self, request: Callable[[dist.Store], Any]) -> Any:
        with self._store_lock:
            store = self.store
            if store is None:
                raise ConnectionError("no store")
            return request(store)

    def _publish(self, kind: str, value: dict) -> None:
        if self.store is not None:
            self._ask(lambda store: store.set(f"{self.prefix}{kind}/{self.rank}", json.dumps(value)))

    def _heartbeat(self, value: dict, last: bool = False) -> None:
        """Publish this rank's heartbeat, unless it has published its last one (`_leaving`): a beat the thread
        sends after that would erase what the last one said (left, spoke), and a peer deciding later would speak
        again. Checked and sent under the store's lock (`_ask`), so that no beat passes the last one."""
        def send(store: dist.Store) -> None:
            if self._left:
                return
            self._left = last
            store.set(f"{self.prefix}hb/{self.rank}", json.dumps(value))

        self._ask(send)

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            self._beat += 1
            top = self._phases[-1] if self._phases else None
            if self.store is not None and os.getppid() != self._parent:
                # the launcher died, and the store with it: the kernel sent SIGTERM (PR_SET_PDEATHSIG; sent here
                # too where it cannot), the run stops after its step with a checkpoint; the peers go the same way
                with self._store_lock:
                    self.store = None
                os.kill(os.getpid(), signal.SIGTERM)
            try:
                self._heartbeat({"beat": self._beat, "phase": top[0] if top else "", "step": self._step})
            except Exception:  # a store that does not answer: the peers' silence shows it
                pass
            now = time.monotonic()
            if top is not None and top[3] is not None and now - top[2] > top[3]:
                self.fire(f"this rank waited {now - top[2]:.0f} s in {where(top[0], top[1])} "
                          f"({self._budget_key(top[3])})")
            silent = self._listen(now)
            here = where(top[0], top[1]) if top else "start-up"
            if silent:
                self.fire(f"this rank, in {here}, heard nothing from it for {now - silent[0].heard:.0f} s "
                          f"(parallel.timeout_s = {self.timeout_s:g})", silent)
            ended = self._ended_here()
            if ended:
                self.fire(f"this rank, in {here}, saw that process end", ended)

    def _ended_here(self) -> list[Peer]:
        """The peers on this host whose process has ended without finishing its part (SIGKILL, the OOM killer, a
        crash). Said at once: NCCL's collectives do not fail when a peer dies, they wait, so without this a rank
        would wait parallel.timeout_s, and torchrun, which SIGTERMs the survivors at once, kills them 30 s later
        without a word. A peer that finished publishes `done` before it exits: read again before deciding."""
        gone = [p for p in self.peers.values() if not p.done and p.state() == "exited"]
        if gone:
            self._listen(time.monotonic())
            gone = [p for p in gone if not p.done]
        return gone

    def _budget_key(self, budget: float) -> str:
        key = "parallel.slow_timeout_s" if budget == self.slow_timeout_s else "parallel.timeout_s"
        return f"{key} = {budget:g}"

    def _listen(self, now: float) -> list[Peer]:
        """Read the peers' heartbeats; the peers silent for longer than timeout_s."""
        if self.store is None:
            return []

        def read(store: dist.Store) -> dict[str, bytes]:
            if self._known < len(self.peers):  # start-up: each peer's record once it is there
                for r, peer in self.peers.items():
                    key = f"{self.prefix}info/{r}"
                    if not peer.pid and store.check([key]):
                        data = json.loads(store.get(key))
                        peer.pid, peer.host = int(data["pid"]), str(data["host"])
                        self._known += 1
            hb = [f"{self.prefix}hb/{r}" for r in self.peers]
            present = hb if store.check(hb) else [k for k in hb if store.check([k])]
            return dict(zip(present, store.multi_get(present))) if present else {}

        try:
            values = self._ask(read)
        except Exception:
            return []
        for r, peer in self.peers.items():
            hb = values.get(f"{self.prefix}hb/{r}")
            if hb is not None:
                data = json.loads(hb)
                if data["beat"] != peer.beat:
                    peer.beat, peer.heard = data["beat"], now
                    peer.phase, peer.step = data.get("phase", peer.phase), data.get("step", peer.step)
                    peer.done = bool(data.get("done"))
                    peer.left, peer.spoke = bool(data.get("left")), bool(data.get("spoke"))
        return sorted((p for p in self.peers.values() if not p.done and now - p.heard > self.timeout_s),
                      key=lambda p: p.heard)

    # ------------------------------------------------------------------ stopping
    def suspects(self) -> list[Peer]:
        """The peers that look gone: stopped or exited on this host, or silent for a few heartbeats."""
        self._listen(time.monotonic())
        now = time.monotonic()
        found = []
        for peer in self.peers.values():
            state = peer.state()
            if state in ("stopped", "exited") or (state is None and not peer.done
                                                  and now - peer.heard > 3 * self.tick_s + 1):
                found.append(peer)
        return found

    def sentence(self, what: str, suspects: list[Peer] | None = None) -> str:
        """One sentence: who stopped answering and in which phase, what this rank saw (`what`), the advice."""
        suspects = self.suspects() if suspects is None else suspects
        # the ranks that stopped because of another are named after it, not as the cause
        causes = [p for p in suspects if not p.left] or suspects
        followers = [p.rank for p in suspects if p not in causes]
        if suspects:
            first = causes[0]
            others = [p.rank for p in causes[1:]]
            who = (f"rank {first.rank}" + (f" (and rank(s) {', '.join(map(str, others))})" if others else "")
                   + f" stopped answering: {describe_state(first)}, last seen in {first.where()}"
                   + (f" (rank(s) {', '.join(map(str, followers))} stopped after {'them' if others else 'it'})"
                      if followers else ""))
        else:
            ahead = [p for p in self.peers.values() if (p.phase, p.step) != self._where_tuple()]
            if ahead:
                who = ("the ranks are in different phases (" + ", ".join(
                    f"rank {p.rank} in {p.where()}" for p in ahead[:4]) + "), so a collective cannot complete")
            else:
                who = "every rank answers but a collective does not complete (a network or driver fault)"
        advice = self.advice or _advice
        tail = ""
        if advice is not None:
            with contextlib.suppress(Exception):  # advice is a courtesy: the sentence goes out without it
                tail = advice()
        return f"{who}; {what}" + (f"; {tail}" if tail else "")

    def _where_tuple(self) -> tuple[str, int | None]:
        top = self._phases[-1] if self._phases else None
        return (top[0], top[1]) if top else ("", None)

    def speaks(self, suspects: list[Peer]) -> bool:
        """Whether this rank prints the sentence: the lowest rank that is neither a suspect (the ones given, and
        any this rank sees gone now) nor one that left without speaking, unless a rank that left before this one
        decided has said it already."""
        seen = self.suspects()
        # the heartbeats again, read after the processes' states: a peer seen exited wrote its last heartbeat
        # (`spoke`) before it exited, but the read inside suspects() may have come just before that write (four CPU
        # processes on two cores: rank 0 spoke and exited in between, and rank 2 spoke too)
        self._listen(time.monotonic())
        if any(p.spoke for p in self.peers.values()):
            return False
        gone = {p.rank for p in suspects} | {p.rank for p in seen}
        gone |= {p.rank for p in self.peers.values() if p.left}  # left without speaking: it cannot any more
        return self.rank == min(r for r in range(self.world) if r not in gone)

    def _leaving(self, spoke: bool, follower: bool) -> None:
        """The last heartbeat of a rank that stops (see the module docstring): whether it stops because of a peer
        it saw gone (`follower`; a rank stopping on its own phase budget, every peer answering, is not one) and
        whether it said the sentence."""
        top = self._phases[-1] if self._phases else None
        self._beat += 1
        with contextlib.suppress(Exception):  # a store that is gone: the peers decide without it
            self._heartbeat({"beat": self._beat, "phase": top[0] if top else "", "step": self._step,
                             "left": follower, "spoke": spoke}, last=True)

    def failure(self, err: BaseException) -> tuple[str, bool]:
        """(the sentence, whether this rank says it) for a collective that raised `err` in the main thread (a peer
        that died closes its connections). The thread stops first: the main thread now decides how to end."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)  # its store connection is this thread's from now on
        if not self._fired.acquire(blocking=False):
            # the thread is stopping the process (`fire`): it decides whether this rank speaks, and says it
            return "", False
        here = self._failed_in or self._where_tuple()
        # a peer on another host shows itself by its silence: give it a few heartbeats
        deadline = time.monotonic() + 3 * self.tick_s + 1.5
        suspects = self.suspects()
        while not suspects and time.monotonic() < deadline:
            time.sleep(self.tick_s / 2)
            suspects = self.suspects()
        what = f"this rank's collective in {where(*here)} failed ({error_gist(err)})"
        speaks = self.speaks(suspects)
        self._leaving(speaks, follower=bool(suspects))
        return self.sentence(what, suspects), speaks

    def fire(self, what: str, suspects: list[Peer] | None = None) -> None:
        """Say it (if this rank speaks) and end the process at once: the main thread is stuck in a collective."""
        if not self._fired.acquire(blocking=False):
            return
        try:
            suspects = self.suspects() if suspects is None else suspects
            text = self.sentence(what, suspects)
            speaks = self.speaks(suspects)
            if speaks:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                os.write(2, f"tttv {self.command}: error: {text}\n".encode())
            self._leaving(speaks, follower=bool(suspects))
        finally:
            self.exit(EXIT_PEER_LOST)
