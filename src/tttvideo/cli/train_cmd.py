"""`tttv train CONFIG [--set KEY=VALUE ...] [--resume | --new | --overwrite] [--trust-checkpoint]`: train one stage;
`configs/demo.toml` is the CPU demo. Under torchrun (`torchrun --nproc_per_node N -m tttvideo train CONFIG ...`)
every rank runs it and rank 0 alone prints (docs/parallel.md)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import shlex
import sys

from tttvideo.cli.common import add_config_arguments, add_trust_argument, config_from_args

# flag -> train.if_exists
IF_EXISTS_FLAGS = {"resume": "resume", "new": "new", "overwrite": "overwrite"}


def register(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(name, help="train (fine-tune) the model on a latent cache or the built-in demo set",
                       description="Train one stage. `tttv train configs/demo.toml` trains the tiny model on the "
                                   "synthetic demo set on CPU in about two minutes. When train.output_dir already "
                                   "holds a run, train.if_exists (or one of the flags below) says what happens.")
    add_config_arguments(p)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true",
                       help="continue from the newest intact checkpoint in train.output_dir (exactly: same data, "
                            "same noise); train.if_exists = 'resume'")
    group.add_argument("--new", action="store_true",
                       help="keep an earlier run in train.output_dir and train in the first free output_dir-2, "
                            "-3, ...; train.if_exists = 'new'")
    group.add_argument("--overwrite", action="store_true",
                       help="delete an earlier run's checkpoints, metrics, TensorBoard logs and videos in "
                            "train.output_dir and start over; train.if_exists = 'overwrite'")
    add_trust_argument(p)
    p.add_argument("--auto-fit", action="store_true",
                   help="set the memory switches (checkpointing, offload, fp8 weights, 8-bit AdamW, sp) to the "
                        "fastest setup `tttv plan` predicts to fit this GPU (docs/memory.md)")
    p.set_defaults(run=run)


def resume_command(args: argparse.Namespace, output_dir: str, configured_dir: str,
                   launcher: list[str] | None = None, nodes: int = 1) -> str:
    """The command line that resumes this run: the same config and overrides, the folder it actually wrote to (with
    --new it may differ from the config's), and --resume. Under torchrun `launcher` is the launch's command up to
    the program (`tttvideo.parallel.launch.launcher_prefix`), which replaces `tttv`; a launch of several `nodes`
    runs it on each."""
    parts = [*(launcher or ["tttv"]), "train", args.config]
    for item in args.overrides or []:
        parts += ["--set", item]
    if output_dir != configured_dir:
        parts += ["--set", f"train.output_dir={output_dir}"]
    if getattr(args, "auto_fit", False):
        parts.append("--auto-fit")
    command = shlex.join([*parts, "--resume"])
    if nodes > 1:
        return f"{command} (on each of the {nodes} nodes, as the run was started)"
    return command


def launch_resume_command(args: argparse.Namespace, output_dir: str, configured_dir: str) -> str:
    """`resume_command` for this process: with torchrun's command when torchrun started it."""
    from tttvideo.parallel.launch import launcher_prefix, nodes_of_launch

    launcher = launcher_prefix(sys.argv[1:])
    return resume_command(args, output_dir, configured_dir, launcher, nodes_of_launch() if launcher else 1)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)  # first: a mistake in the config is reported before the trainer's imports (~2 s)
    from rich.console import Console

    from tttvideo.errors import UserError
    from tttvideo.memory.guard.oom import OutOfMemory
    from tttvideo.parallel.launch import exit_on_rank, launch_rank, launch_world_size
    from tttvideo.parallel.watchdog import advise, finish, peer_failure
    from tttvideo.train.stop import TrainingStopped
    from tttvideo.train.trainer import Trainer

    console = Console()
    fit = None
    if args.auto_fit:
        from tttvideo.memory.plan.auto_fit import auto_fit_plan

        fit = auto_fit_plan(cfg, "train", args.config)
        cfg = fit.config
    configured_dir = cfg.train.output_dir
    if_exists = next((value for flag, value in IF_EXISTS_FLAGS.items() if getattr(args, flag, False)), None)
    started: dict = {}  # the trainer, once built: a rank that loses a peer names its newest checkpoint
    advise(lambda: _after_lost_peer(args, configured_dir, started.get("trainer")))
    try:
        while True:
            trainer = started["trainer"] = Trainer(cfg, console=console, if_exists=if_exists,
                                                   trust_checkpoint=args.trust_checkpoint)
            try:
                result = trainer.run()
                break
            except OutOfMemory as err:
                if fit is None or getattr(trainer, "first_step", None) != trainer.step or launch_world_size() > 1:
                    raise
                fit, cfg, if_exists = replan(fit, err, trainer)
            del trainer  # its model and optimizer go before the next setup's are built
            started.pop("trainer", None)
            _free_gpu_memory()
    except TrainingStopped as stop:
        finish()
        if launch_rank() == 0:
            command = launch_resume_command(args, str(stop.output_dir), configured_dir)
            with contextlib.suppress(OSError):  # a launcher that died took the pipe with it
                print(f"tttv train: {stop.describe(command)}", file=sys.stderr, flush=True)
        return stop.exit_code
    except UserError as err:  # under torchrun: a sentence every rank raised is printed once, by rank 0
        return exit_on_rank(err, "train")
    except Exception as err:  # under torchrun: a peer that died closed its connections mid-collective
        lost = peer_failure(err)
        if lost is None:
            raise
        return lost.exit("train")
    if launch_rank() != 0:
        return 0
    if result.steps_done == 0 or math.isnan(result.first_loss):
        return 0
    change = (1 - result.last_loss / result.first_loss) * 100 if result.first_loss else 0.0
    verdict = f"{change:.0f}% lower" if change > 0 else "did not fall"
    window = result.loss_window
    if result.steps_done < 2:
        console.print(f"loss: {result.last_loss:.4f} (one step: nothing to compare)")
    else:
        first, last = (f"mean of the {end} {window} steps" if window > 1 else f"{end} step"
                       for end in ("first", "last"))
        console.print(f"loss: {first} {result.first_loss:.4f} -> {last} {result.last_loss:.4f} ({verdict})")
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
    pictures = _pictures(cfg, result, console)
    if pictures:
        console.print(f"look at what it learned: {' and '.join(str(p) for p in pictures)}")
    return 0


def replan(fit, err, trainer):
    """--auto-fit after an out-of-memory error in the first step: one sentence on stderr naming the setup, the phase
    and the block, and the next setup, planned with the activations the failed one measured. The run goes on in the
    same folder (nothing was saved by the failed step; an earlier checkpoint is resumed from)."""
    from tttvideo.memory.plan.auto_fit import replan_after_oom
    from tttvideo.memory.plan.planner import GIB

    failed = fit.chosen
    fit, scale = replan_after_oom(fit, err.needed or fit.gpu_mem)
    needed = f"needed more than {err.needed / GIB:.1f} GiB, " if err.needed else ""
    print(f"tttv train: --auto-fit: {failed.candidate.label} ran out of GPU memory in the {err.where} ({needed}"
          f"predicted {failed.reserved / GIB:.1f} GiB); re-planned with its activations measured {scale:.2f}x the "
          f"prediction: {fit.chosen.candidate.label} (predicted {fit.chosen.reserved / GIB:.1f} GiB)",
          file=sys.stderr, flush=True)
    cfg = fit.config
    cfg.train.output_dir = str(trainer.output_dir)
    return fit, cfg, "resume"


def _free_gpu_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _pictures(cfg, result, console) -> list:
    """The loss curve, and the frames of the end-of-run video with its captions (and, on the demo set, how well
    the video shows them: printed whether or not pictures are drawn); none with train.plots = false or without
    matplotlib."""
    if result.video is not None and not cfg.data.manifest:
        from tttvideo.data.demo_score import score_video_file

        score = score_video_file(result.video, long_range=cfg.data.demo_kind == "long-range")
        console.print(f"  {score.summary()}")
    if not cfg.train.plots or importlib.util.find_spec("matplotlib") is None:  # figures imports it when drawing
        return []
    from tttvideo.train.figures import frame_strip, loss_curve

    pictures = []
    if result.video is not None:
        pictures.append(frame_strip(result.video, None, result.output_dir / "frames.png"))
    pictures.append(loss_curve(result.output_dir / "metrics.jsonl", result.output_dir / "loss.png"))
    return pictures


def _after_lost_peer(args: argparse.Namespace, configured_dir: str, trainer) -> str:
    """The end of the sentence of a run that lost a peer: why no checkpoint is saved now, the newest one, the
    command that resumes."""
    from tttvideo import runs

    output_dir = str(trainer.output_dir) if trainer is not None else configured_dir
    newest = runs.latest_checkpoint(output_dir)
    kept = f"the newest checkpoint is {newest}" if newest else "no checkpoint was written yet"
    return (f"no checkpoint can be saved now: the model and optimizer are sharded over the ranks (FSDP), so no rank "
            f"holds a whole copy without the lost one; {kept}; resume with: "
            f"{launch_resume_command(args, output_dir, configured_dir)}")
