"""Arguments shared by every command that takes a config (train, sample, profile, plan, config show, ...).

    def register(sub, name):
        p = sub.add_parser(name, help="...")
        add_config_arguments(p)
        p.set_defaults(run=run)

    def run(args):
        cfg = config_from_args(args)   # ConfigError -> one sentence, exit 2 (tttvideo.cli.main)
"""

from __future__ import annotations

import argparse
from typing import Any

from tttvideo.config.loader import load_config

SET_HELP = (
    "override one config key, e.g. --set ttt.kind=linear --set train.steps=10; the value is a TOML literal "
    "(unquoted text that is not one is taken as a string); repeatable, applied in order after the file"
)


def add_config_arguments(parser: argparse.ArgumentParser, config_required: bool = True) -> None:
    """Positional CONFIG (a TOML file; optional when `config_required` is False: defaults are used) and --set."""
    parser.add_argument(
        "config",
        metavar="CONFIG",
        nargs=None if config_required else "?",
        default=None,
        help="TOML config file (see configs/base.toml)" + ("" if config_required else "; omit for the defaults"),
    )
    parser.add_argument("--set", dest="overrides", action="append", default=None, metavar="KEY=VALUE",
                        help=SET_HELP)


def config_from_args(args: argparse.Namespace) -> Any:
    """The resolved `Config` of a command line parsed with `add_config_arguments`."""
    return load_config(getattr(args, "config", None), getattr(args, "overrides", None) or [])
