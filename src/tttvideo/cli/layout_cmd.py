"""`tttv layout`: the token arithmetic of long videos, one table per duration."""

from __future__ import annotations

import argparse

DEFAULT_DURATIONS = ["3s", "9s", "18s", "30s", "63s"]


def register(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(name, help="print the sequence layout of long videos")
    p.add_argument("--duration", action="append", help="3 + 3n seconds; repeat for several (default 3/9/18/30/63 s)")
    p.add_argument("--text-tokens", type=int, default=0, help="text tokens per segment (default: the original's)")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=720)
    p.add_argument("--patch-size", type=int, default=2)
    p.add_argument("--mini-batch", type=int, default=64, help="TTT mini-batch the total is padded to")
    p.add_argument("--windows", action="store_true", help="also list every segment's attention window")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # here, not at the top: every command's parser registers this module, and tttvideo.layout imports torch
    from rich.console import Console
    from rich.table import Table

    from tttvideo.layout import VideoLayout

    console = Console()
    for duration in args.duration or DEFAULT_DURATIONS:
        lay = VideoLayout.create(
            duration=duration,
            height=args.height,
            width=args.width,
            patch_size=args.patch_size,
            text_tokens=args.text_tokens,
            mini_batch_size=args.mini_batch,
        )
        table = Table(title=f"{lay.duration_s} s at {lay.height}x{lay.width}, {lay.fps} fps", show_header=False)
        table.add_column("quantity")
        table.add_column("value", justify="right")
        rows = [
            ("segments (3 s each)", lay.num_segments),
            ("pixel frames", lay.num_frames),
            ("latent frames", lay.latent_frames),
            ("tokens per latent frame", lay.tokens_per_frame),
            ("video tokens", lay.video_tokens),
            ("text tokens per segment", lay.text_tokens),
            ("text tokens (all segments)", lay.total_text_tokens),
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
                text = lay.text_slice(i)
                win.add_row(str(i), f"{text.start}-{text.stop - 1}", f"{frames.start}-{frames.stop - 1}",
                            f"{lay.window_tokens:,}")
            console.print(win)
    return 0
