"""`tttv layout`: the token arithmetic of long videos, one table per duration.

Without a config the layout is CogVideoX's at the flags' resolution, text length and TTT mini-batch; with one it is
the layout that config's model trains (or, with `--phase sample`, samples) on: its backbone's window, patch and VAE
factors (Wan keeps the text out of the stream), its `[layout]` and `[ttt]` keys, as `tttv train` builds it."""

from __future__ import annotations

import argparse
from pathlib import Path

from tttvideo.cli.common import SET_HELP

DEFAULT_DURATIONS = ["3s", "9s", "18s", "30s", "63s"]
# flag -> (default without a config, the config key that takes its place with one)
LAYOUT_FLAGS = {"height": (480, "layout.height"), "width": (720, "layout.width"),
                "patch_size": (2, "layout.patch_size"), "text_tokens": (0, "layout.text_tokens"),
                "mini_batch": (64, "ttt.mini_batch_size")}


def register(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(name, help="print the sequence layout of long videos",
                       description="The token arithmetic of long videos: CogVideoX's at the flags' sizes, or, given "
                                   "a config, the layout its model trains on (its backbone, [layout] and [ttt]).")
    p.add_argument("config", metavar="CONFIG", nargs="?", default=None,
                   help="TOML config: the layout of its model (default durations: the config's own)")
    p.add_argument("--set", dest="overrides", action="append", default=None, metavar="KEY=VALUE", help=SET_HELP)
    p.add_argument("--phase", choices=("train", "sample"), default="train",
                   help="with a config: the TTT mini-batch of training (default) or of sampling")
    p.add_argument("--duration", action="append", help="3 + 3n seconds; repeat for several (default 3/9/18/30/63 s)")
    p.add_argument("--text-tokens", type=int, help="text tokens per segment (default: the original's)")
    p.add_argument("--height", type=int, help="pixels (default 480)")
    p.add_argument("--width", type=int, help="pixels (default 720)")
    p.add_argument("--patch-size", type=int, help="default 2")
    p.add_argument("--mini-batch", type=int, help="TTT mini-batch the total is padded to (default 64)")
    p.add_argument("--windows", action="store_true", help="also list every segment's attention window")
    p.set_defaults(run=run)


def _layouts(args: argparse.Namespace) -> tuple[str, list]:
    """(what the tables show, one layout per duration)."""
    from tttvideo.errors import UserError
    from tttvideo.layout import DURATION_TEXT, VideoLayout

    if args.config is None:
        if args.overrides:
            raise UserError("--set needs a CONFIG: give one, or use the layout flags (--height, --text-tokens, ...)")
        sizes = {flag: default if getattr(args, flag) is None else getattr(args, flag)
                 for flag, (default, _) in LAYOUT_FLAGS.items()}
        return "CogVideoX", [VideoLayout.create(duration=d, height=sizes["height"], width=sizes["width"],
                                                patch_size=sizes["patch_size"], text_tokens=sizes["text_tokens"],
                                                mini_batch_size=sizes["mini_batch"])
                             for d in args.duration or DEFAULT_DURATIONS]
    given = [flag for flag in LAYOUT_FLAGS if getattr(args, flag) is not None]
    if given:
        flag, key = given[0], LAYOUT_FLAGS[given[0]][1]
        raise UserError(f"--{flag.replace('_', '-')} is for the layout without a config; with {args.config} set "
                        f"--set {key}=...")
    from tttvideo.config.loader import load_config
    from tttvideo.models.backbone import layout_of

    if DURATION_TEXT.fullmatch(args.config.strip().lower()) and not Path(args.config).exists():
        raise UserError(f"CONFIG is a TOML file; for the layout of a {args.config} video give --duration {args.config}")
    cfg = load_config(args.config, args.overrides or [])
    return (f"{cfg.model.preset} ({args.config}, {args.phase})",
            [layout_of(cfg, d, phase=args.phase) for d in args.duration or [cfg.layout.duration]])


def run(args: argparse.Namespace) -> int:
    # here, not at the top: every command's parser registers this module
    from rich.console import Console
    from rich.table import Table

    model, layouts = _layouts(args)
    console = Console()
    for lay in layouts:
        title = f"{model}: {lay.duration_s} s at {lay.height}x{lay.width}, {lay.fps} fps"
        # a line of its own: as the table's title it wrapped mid-value wherever the table is narrower than it
        console.print(title, style="bold", soft_wrap=True, highlight=False)
        table = Table(show_header=False)
        table.add_column("quantity")
        table.add_column("value", justify="right")
        text = "text tokens per segment" + ("" if lay.text_in_stream else " (cross-attended, not in the stream)")
        rows = [
            ("segments (3 s each)", lay.num_segments),
            ("pixel frames", lay.num_frames),
            ("latent frames", lay.latent_frames),
            ("tokens per latent frame", lay.tokens_per_frame),
            ("video tokens", lay.video_tokens),
            (text, lay.text_tokens),
            ("text tokens in the stream (all segments)", lay.total_text_tokens),
            ("total tokens", lay.total_tokens),
            ("attention window tokens", lay.window_tokens),
            (f"TTT mini-batches of {lay.mini_batch_size}", lay.ttt_tokens // lay.mini_batch_size),
            ("TTT padding tokens", lay.ttt_padding),
        ]
        for key, value in rows:
            table.add_row(key, f"{value:,}")
        console.print(table)
        if args.windows:
            win = Table(title="attention windows")
            for col in ("segment", "text tokens", "latent frames", "tokens"):
                win.add_column(col, justify="right")
            for i in range(lay.num_segments):
                frames = lay.segment_frames(i)
                text_slice = lay.text_slice(i)
                texts = f"{text_slice.start}-{text_slice.stop - 1}" if text_slice.stop > text_slice.start else "-"
                win.add_row(str(i), texts, f"{frames.start}-{frames.stop - 1}", f"{lay.window_tokens:,}")
            console.print(win)
    return 0
