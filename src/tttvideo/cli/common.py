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
import logging
import sys
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


TRUST_HELP = (
    "read a checkpoint file that only Python's unpickler can read, which runs any code the file holds: a state.pt "
    "of an earlier tttvideo version that names more than tensors, numbers and numpy arrays (converted to "
    "state.safetensors once), or DCP files naming types outside their allow-list; only for checkpoints you trust "
    "(docs/security.md)"
)


def add_trust_argument(parser: argparse.ArgumentParser) -> None:
    """--trust-checkpoint (args.trust_checkpoint): the one way to read a checkpoint file that could run code."""
    parser.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)


def config_from_args(args: argparse.Namespace) -> Any:
    """The resolved `Config` of a command line parsed with `add_config_arguments`."""
    return load_config(getattr(args, "config", None), getattr(args, "overrides", None) or [])


class CommandLogHandler(logging.Handler):
    """Log records in the format of the command's own lines: INFO as a plain line on stdout, warnings and errors as
    `tttv COMMAND: warning: ...` on stderr (the format of its error line). The streams are looked up at each record,
    so a rich progress bar that redirects them keeps its place."""

    def __init__(self, command: str):
        super().__init__(logging.INFO)
        self.command = command

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.levelno >= logging.WARNING:
                print(f"tttv {self.command}: {record.levelname.lower()}: {text}", file=sys.stderr, flush=True)
            else:
                print(text, file=sys.stdout, flush=True)
        except Exception:  # logging must never take the command down
            self.handleError(record)


def setup_logging(command: str) -> None:
    """The `tttvideo` loggers print through `CommandLogHandler` (INFO and up), once per process. Records still
    propagate to the root logger, which has no handler in the CLI (and pytest's capture in the tests)."""
    logger = logging.getLogger("tttvideo")
    logger.setLevel(logging.INFO)
    for handler in logger.handlers:
        if isinstance(handler, CommandLogHandler):
            handler.command = command
            return
    logger.addHandler(CommandLogHandler(command))


# how the VAE folder of each backbone's VAE kind (`BackboneSpec.vae`) is named in messages
VAE_NAMES = {"cogvideox": "CogVideoX", "wan": "Wan2.1"}


def check_component_folders(preset: str, vae: str, text_encoder: str, vae_field: str, text_field: str) -> None:
    """A mistyped VAE or text encoder folder, said in one sentence before the model loads and any encoding or
    denoising runs (their loaders would say so only once they are reached)."""
    from pathlib import Path

    from tttvideo.errors import UserError
    from tttvideo.models.backbone import backbone_of
    from tttvideo.sample.decode import vae_folder

    kind = backbone_of(preset).vae
    if vae and kind in VAE_NAMES:
        try:
            vae_folder(vae, VAE_NAMES[kind])
        except UserError as err:
            raise UserError(f"{vae_field}: {err}") from None
    if text_encoder and not Path(text_encoder).exists():
        raise UserError(f"{text_field}: text encoder folder {text_encoder} does not exist; give the model's text "
                        f"encoder folder or the pipeline folder above it")
