"""`tttv convert --from ttt-video-dit DIR --out RUN`: a checkpoint trained by another system as one of our runs."""

from __future__ import annotations

import argparse

from tttvideo.cli.common import add_config_arguments, config_from_args
from tttvideo.runs import TRUST_FLAG

SOURCES = ("ttt-video-dit",)


def register(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(name, help="import another system's trained checkpoint as a run folder",
                       description="Convert the reference system's (ttt-video-dit) trained model checkpoint into a "
                                   "run folder that tttv sample --checkpoint and train.init_from accept. Its config "
                                   "sets the detected preset and TTT kind and ttt.eta_layout = 'reference'.")
    p.add_argument("--from", dest="source_system", required=True, choices=SOURCES, help="the system that wrote DIR")
    p.add_argument("source", metavar="DIR", help="its checkpoint: a torch.distributed.checkpoint folder (needs "
                                                  f"{TRUST_FLAG}), a .safetensors file or a .pt/.pth/.bin state dict")
    p.add_argument("--out", required=True, metavar="RUN", help="the run folder to write (new or empty)")
    p.add_argument(TRUST_FLAG, dest="trust", action="store_true",
                   help="read a torch.distributed.checkpoint folder: its .metadata index is a Python pickle, which "
                        "can run code when read, so only a checkpoint from a source you trust")
    p.add_argument("--duration", default=None, help="the longest video the checkpoint was trained on, e.g. 63s "
                                                    "(default: layout.duration of the config)")
    add_config_arguments(p, config_required=False)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tttvideo.convert.importer import convert_ttt_video_dit
    from tttvideo.layout import parse_duration

    cfg = config_from_args(args)
    seconds = parse_duration(args.duration) if args.duration is not None else None
    folder = convert_ttt_video_dit(args.source, args.out, cfg, trust=args.trust, trained_duration_s=seconds)
    print(f"wrote {folder} (ttt.eta_layout = 'reference'); sample with: tttv sample --checkpoint {args.out} "
          f"--scenes SCENES --out OUT; continue training with: tttv train {folder / 'config.toml'} --set "
          f"train.output_dir=NEW_RUN --set train.init_from={args.out}")
    return 0
