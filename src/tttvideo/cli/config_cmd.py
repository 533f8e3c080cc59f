"""`tttv config show FILE [--set ...]` prints the resolved config; `tttv config keys [SECTION]` lists every key."""

from __future__ import annotations

import argparse
import difflib
import sys

from tttvideo.cli.common import add_config_arguments, config_from_args
from tttvideo.config.loader import describe_keys, dump_toml
from tttvideo.errors import ConfigError


def register(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(name, help="show resolved configs and list every config key")
    actions = p.add_subparsers(dest="config_action", metavar="ACTION", required=True)

    show = actions.add_parser("show", help="print the resolved config (includes + file + --set) as TOML")
    add_config_arguments(show, config_required=False)
    show.add_argument("--comments", action="store_true",
                      help="put each key's help text, type and allowed values above it")
    show.set_defaults(run=run)

    keys = actions.add_parser("keys", help="list every key with its type, default, allowed values and help")
    keys.add_argument("section", nargs="?", help="only this section (e.g. ttt)")
    keys.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return _show(args) if args.config_action == "show" else _keys(args)


def _show(args: argparse.Namespace) -> int:
    text = dump_toml(config_from_args(args), comments=args.comments)
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.syntax import Syntax

        Console().print(Syntax(text.rstrip("\n"), "toml", theme="ansi_dark", background_color="default"))
    else:
        # Plain TOML when piped, so `tttv config show a.toml --set ... > resolved.toml` is a loadable config.
        sys.stdout.write(text)
    return 0


def _keys(args: argparse.Namespace) -> int:
    infos = describe_keys()
    if args.section:
        sections = list(dict.fromkeys(k.key.split(".")[0] for k in infos))
        if args.section not in sections:
            close = difflib.get_close_matches(args.section, sections, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"unknown section {args.section!r}{hint}; valid sections: {', '.join(sections)}")
        infos = [k for k in infos if k.key.split(".")[0] == args.section]
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table()
        table.add_column("key", no_wrap=True)  # keys are what people copy into --set: never cut them
        for column in ("type", "default", "allowed", "help"):
            table.add_column(column)
        for k in infos:
            table.add_row(k.key, k.type, k.default, k.allowed, k.help)
        Console().print(table)
        return 0
    width = max(len(k.key) for k in infos)
    for k in infos:
        parts = [f"{k.key:<{width}}", k.type, f"default {k.default}" if k.default else "no default"]
        if k.allowed:
            parts.append(k.allowed)
        if k.help:
            parts.append(k.help)
        print("  ".join(parts[:1]) + "  " + "; ".join(parts[1:]))
    return 0
