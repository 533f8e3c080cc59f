"""ffmpeg is started without Python code in the forked child (tttvideo.ffmpeg): a preexec_fn can deadlock the child
of a process with threads, as a torchrun rank is (imageio-ffmpeg issue 58), and it still runs in its own process
group, so a Ctrl-C in the terminal reaches the trainer, which saves, and not ffmpeg mid-video."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

pytest.importorskip("imageio_ffmpeg")
if os.name != "posix":
    pytest.skip("process groups are POSIX", allow_module_level=True)

from tests.launching import processes  # noqa: E402
from tttvideo.data.video import read_frames  # noqa: E402
from tttvideo.ffmpeg import imageio_ffmpeg  # noqa: E402
from tttvideo.sample.video import Mp4Writer  # noqa: E402


def ffmpeg_children() -> list[int]:
    """The running ffmpeg processes this process started."""
    return [pid for pid, parent, name, state in processes()
            if parent == os.getpid() and name.startswith("ffmpeg") and state not in "ZX"]


def test_no_preexec_fn_and_isolation_by_the_childs_own_code():
    from imageio_ffmpeg import _io

    imageio_ffmpeg()
    kwargs = _io._popen_kwargs(prevent_sigint=True)
    assert "preexec_fn" not in kwargs or kwargs["preexec_fn"] is None
    assert kwargs.get("process_group") == 0 or kwargs.get("start_new_session") is True
    assert _io._popen_kwargs() == {}  # the calls that did not isolate ffmpeg still do not


def test_ffmpeg_writes_in_its_own_process_group_beside_a_busy_thread(tmp_path):
    """A thread allocating and taking a lock the whole time (as gloo's and the watchdog's do in a rank): the
    writer starts ffmpeg, which runs in a process group of its own, and the video reads back frame for frame."""
    stop = threading.Event()
    lock = threading.Lock()

    def busy() -> None:
        while not stop.is_set():
            with lock:
                _ = [bytes(1024) for _ in range(64)]

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    frames = np.random.default_rng(0).integers(0, 256, (9, 32, 48, 3), dtype=np.uint8)
    try:
        for i in range(3):  # several starts, each a fork beside the busy thread
            out = tmp_path / f"v{i}.mp4"
            with Mp4Writer(out, quality=10) as writer:
                writer.append(frames)
                children = ffmpeg_children()
                assert children, "ffmpeg is not running while the writer is open"
                for pid in children:
                    assert os.getpgid(pid) == pid != os.getpgid(0)
            back = read_frames(out)
            assert back.shape == frames.shape
    finally:
        stop.set()
        thread.join(5)
