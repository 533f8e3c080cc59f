"""`tttv train CONFIG [--set KEY=VALUE ...] [--resume]`: train one stage; `configs/demo.toml` is the CPU demo."""

from __future__ import annotations

import argparse
import math

from tttvideo.cli.common import add_config_arguments, config_from_args


def register(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(name, help="train (fine-tune) the model on a latent cache or the built-in demo set",
                       description="Train one stage. `tttv train configs/demo.toml` trains the tiny model on the "
                                   "synthetic demo set on CPU in about two minutes.")
    add_config_arguments(p)
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in train.output_dir (exactly: same data, same noise)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tttvideo.train.trainer import Trainer

    console = Console()
    cfg = config_from_args(args)
    trainer = Trainer(cfg, resume=args.resume, console=console)
    result = trainer.run()
    if result.steps_done == 0 or math.isnan(result.first_loss):
        return 0
    change = (1 - result.last_loss / result.first_loss) * 100 if result.first_loss else 0.0
    verdict = f"{change:.0f}% lower" if change > 0 else "did not fall"
    window = len(trainer.first_losses)
    console.print(f"loss: mean of the first {window} steps {result.first_loss:.4f} -> mean of the last {window} "
                  f"steps {result.last_loss:.4f} ({verdict})")
    console.print(f"trained {result.steps_done} steps in {result.seconds:.0f} s; outputs in {result.output_dir}:")
    if result.checkpoints:
        console.print(f"  checkpoints   {result.checkpoints[-1].parent} (newest {result.checkpoints[-1].name})")
    console.print(f"  metrics       {result.output_dir / 'metrics.jsonl'}")
    if cfg.train.tensorboard:
        console.print(f"  tensorboard   {result.output_dir / 'tensorboard'}  (tensorboard --logdir ...)")
    if result.video is not None:
        console.print(f"  video         {result.video}")
    if result.nonfinite_skips:
        console.print(f"  [yellow]{result.nonfinite_skips} step(s) skipped for a non-finite loss")
    return 0
