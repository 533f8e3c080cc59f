"""The `tttv` command line. Each subcommand lives in its own module with `register(subparsers)` and `run(args)`.

What every command shares, set up here: one-sentence errors (`UserError`, exit status 2), a quiet end when stdout is
closed early (`tttv config keys | head`), no third-party import noise (`library_noise`), output to a pipe or a
file that is never wrapped (rich wraps at 80 columns when it cannot ask a terminal for its width, which breaks
printed commands and paths mid-line), and every thread's Python stack on stderr at SIGUSR1 (`kill -USR1 PID`: where
a run that seems stuck is, without stopping it; under torchrun each rank's log gets its own).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import faulthandler
import importlib
import logging
import os
import signal
import sys
import traceback

from tttvideo import __version__
from tttvideo.cli.common import setup_logging
from tttvideo.cli.library_noise import quiet_library_noise
from tttvideo.errors import UserError
from tttvideo.memory.guard.allocator import use_tttv_allocator

# subcommand -> module; modules are imported lazily so `tttv layout` does not pay for diffusers.
COMMANDS: dict[str, str] = {
    "layout": "tttvideo.cli.layout_cmd",
    "config": "tttvideo.cli.config_cmd",
    "train": "tttvideo.cli.train_cmd",
    "precompute": "tttvideo.cli.precompute_cmd",
    "profile": "tttvideo.cli.profile_cmd",
    "plan": "tttvideo.cli.plan_cmd",
    "sample": "tttvideo.cli.sample_cmd",
    "convert": "tttvideo.cli.convert_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tttv", description="Long video generation with Test-Time Training layers.")
    parser.add_argument("--version", action="version", version=f"tttvideo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        importlib.import_module(module).register(sub, name)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, with a mistyped command named with its nearest ('trian' -> 'train') and an unknown option shown
    with its own command's usage, not tttv's."""
    first = next((a for a in argv if not a.startswith("-")), None)
    if first is not None and first not in COMMANDS and not any(a in ("-h", "--help", "--version") for a in argv):
        close = difflib.get_close_matches(first, COMMANDS, n=1)
        parser.error(f"unknown command {first!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                     + f"; the commands: {', '.join(COMMANDS)}")
    args, extra = parser.parse_known_args(argv)
    if extra:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


# rich's width when stdout is no terminal: wide enough that no line of ours is wrapped
UNWRAPPED_COLUMNS = 10_000


def main(argv: list[str] | None = None) -> int:
    use_tttv_allocator()
    if hasattr(signal, "SIGUSR1") and sys.__stderr__ is not None:  # not on Windows, nor without a stderr
        with contextlib.suppress(OSError, ValueError):  # a stderr without a file descriptor
            faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    quiet_library_noise()
    try:
        parser = build_parser()
        args = _parse(parser, sys.argv[1:] if argv is None else argv)
        setup_logging(args.command)
        with _unwrapped_output():
            try:
                code = int(args.run(args) or 0)
            except UserError as err:
                print(f"tttv {args.command}: error: {err}", file=sys.stderr)
                code = 2
            except KeyboardInterrupt:
                print(f"tttv {args.command}: interrupted", file=sys.stderr)
                code = 130
            except Exception as err:
                if not _is_rank() or isinstance(err, BrokenPipeError):  # a closed stdout ends quietly (below)
                    raise
                traceback.print_exc()  # a bug on a torchrun rank: its traceback, then no teardown either
                code = 1
            sys.stdout.flush()  # inside the try: a reader that went away is found here, not at exit
        _leave_rank_at_once(code)
        return code
    except BrokenPipeError:
        code = _stdout_closed()
        _leave_rank_at_once(code)
        return code


def _is_rank() -> bool:
    """Whether this process is a rank of a torchrun launch (`start_group` ran here)."""
    group = sys.modules.get("tttvideo.parallel.group")
    return group is not None and group.started_group()


def _leave_rank_at_once(code: int) -> None:
    """A torchrun rank (a process that started a process group, whether or not it is still up) ends here with
    os._exit, without the interpreter's teardown, once its output is flushed. Leaving on an error the group may be
    up and the peers anywhere: tearing down a gloo group whose peer already closed its connections now and then
    aborted the process after its sentence ("terminate called without an active exception": torchrun then reported
    exit -6, not the error's status). A complete run has closed its group, but objects that still hold its process
    groups (meshes, FSDP's state) are destroyed in the teardown, with gloo's threads: a rank that had finished
    and written everything once died there with SIGABRT. The run folder's lock was let go when the command left."""
    dist = sys.modules.get("torch.distributed")  # a command that never imported torch has no group
    group_up = dist is not None and dist.is_available() and dist.is_initialized()
    # a complete command ends so only on a launch's rank: an in-process caller with a group of its own goes on
    if not (_is_rank() or (code and group_up)):
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    logging.shutdown()
    os._exit(code)


def _stdout_closed() -> int:
    """The reader of stdout went away (`tttv config keys | head`): end quietly, as Python's docs recommend. Later
    writes and the flush at exit go to /dev/null; exit status 1, as Python's own on EPIPE."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 1


@contextlib.contextmanager
def _unwrapped_output():
    """While a command runs with stdout not a terminal (a pipe, a log file), rich consoles get COLUMNS wide enough
    that nothing is wrapped; a COLUMNS the user set wins. Given back afterwards (in-process callers, the tests)."""
    if "COLUMNS" in os.environ or sys.stdout.isatty():
        yield
        return
    os.environ["COLUMNS"] = str(UNWRAPPED_COLUMNS)
    try:
        yield
    finally:
        os.environ.pop("COLUMNS", None)
