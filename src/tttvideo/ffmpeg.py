"""imageio-ffmpeg, with its ffmpeg processes started safely from a process that has threads.

imageio-ffmpeg starts ffmpeg for reading and writing frames with `preexec_fn=os.setpgrp`, so that a Ctrl-C in the
terminal does not reach ffmpeg while Python still feeds it. A `preexec_fn` runs Python code in the forked child
before exec, which Python documents as unsafe in a process with other threads: a lock another thread held at the
fork (the allocator's, a module's) stays locked in the child forever, and the parent waits on its pipe
(imageio/imageio-ffmpeg issue 58). A `tttv` process under torchrun has such threads (gloo's, the rank watchdog's
heartbeat), and writes validation videos and frame strips from them.

`imageio_ffmpeg()` returns the module with its process start changed to the same isolation done by the child's C
code: `process_group=0` (Python 3.11+, setpgid: what os.setpgrp did) or `start_new_session=True` (3.10, setsid). A
version of imageio-ffmpeg without the private `_popen_kwargs` this replaces gets its documented switch instead
(IMAGEIO_FFMPEG_NO_PREVENT_SIGINT=1: no preexec_fn, and ffmpeg shares the terminal's process group).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any


def _popen_kwargs(prevent_sigint: bool = False, **_: Any) -> dict[str, Any]:
    """imageio-ffmpeg's Popen keywords (`imageio_ffmpeg._utils._popen_kwargs`), POSIX, without a preexec_fn (any
    argument a later version adds is taken and ignored)."""
    if not prevent_sigint:
        return {}
    return {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}


def imageio_ffmpeg() -> ModuleType:
    """The imageio_ffmpeg module (ImportError when it is not installed), its ffmpeg processes started without
    Python code in the child."""
    import imageio_ffmpeg as module

    if os.name == "posix":
        from imageio_ffmpeg import _io

        if callable(getattr(_io, "_popen_kwargs", None)):
            _io._popen_kwargs = _popen_kwargs
        else:
            os.environ.setdefault("IMAGEIO_FFMPEG_NO_PREVENT_SIGINT", "1")
    return module
