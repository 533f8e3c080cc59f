"""The `tttv` command line. Each subcommand lives in its own module with `register(subparsers)` and `run(args)`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from tttvideo import __version__
from tttvideo.cli.common import setup_logging
from tttvideo.errors import UserError

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


def main(argv: list[str] | None = None) -> int:
    # Segments that grow in place keep a long video's varying activation sizes from fragmenting the cache; the
    # planner's costs were measured with it. Read at the first CUDA allocation; a value the user set wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.command)
    try:
        return int(args.run(args) or 0)
    except UserError as err:
        print(f"tttv {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tttv {args.command}: interrupted", file=sys.stderr)
        return 130
