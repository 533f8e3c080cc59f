"""`tttv sample --checkpoint PATH --scenes story.json --out out.mp4`: stories in, videos out.

The config is the checkpoint's own (`config.toml` in its folder, written by `tttv train`) unless a CONFIG file is
given; `--set` and the flags below override it. The duration follows the scene count (one scene per 3-s segment).

Under torchrun (`torchrun --nproc_per_node N -m tttvideo sample ...`) every rank runs this command: rank 0 alone
prints, and the ranks split the work as `tttvideo.sample.distributed` describes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from tttvideo.cli.common import SET_HELP, check_component_folders
from tttvideo.errors import ConfigError, UserError

if TYPE_CHECKING:
    from tttvideo.config.loader import Override

# flag -> config key it overrides
FLAG_KEYS = {
    "steps": "sample.steps",
    "cfg": "sample.cfg",
    "cfg_schedule": "sample.cfg_schedule",
    "seed": "sample.seed",
    "solver": "sample.solver",
    "text_encoder": "sample.text_encoder_path",
    "vae": "sample.vae_path",
    "device": "sample.device",
}


def register(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(name, help="generate videos from stories (one scene per 3-s segment)",
                       description="Generate one mp4 per story. A story is a JSON/JSONL list of scenes "
                                   "{text, requires_scene_transition, neg_text}; see docs/sampling.md.")
    p.add_argument("config", metavar="CONFIG", nargs="?", default=None,
                   help="TOML config (default: the config.toml saved with the checkpoint, else the defaults)")
    p.add_argument("--checkpoint", required=True,
                   help="model file, checkpoint folder or training run folder (its newest checkpoint)")
    p.add_argument("--scenes", required=True, help="story file (.json / .jsonl) or a folder of them")
    p.add_argument("--out", required=True, help="output .mp4 (one story) or folder (several stories)")
    p.add_argument("--duration", default=None, help="video length, e.g. 63s; must match the scene count")
    p.add_argument("--steps", type=int,
                   help="denoising steps (default: the config's sample.steps, 50 unless it sets them)")
    p.add_argument("--cfg", type=float, help="guidance scale (end of the ramp; default: the config's sample.cfg)")
    p.add_argument("--cfg-schedule", choices=("ramp", "constant"),
                   help="guidance ramp 1 -> cfg or constant (default: the config's sample.cfg_schedule)")
    p.add_argument("--seed", type=int, help="noise seed (same seed, same video)")
    p.add_argument("--solver", choices=("ddim", "dpm++2m", "unipc", "euler"),
                   help="sampler: ddim or dpm++2m for CogVideoX, unipc or euler for Wan (default: the config's "
                        "sample.solver)")
    p.add_argument("--text-encoder", help="local text encoder folder of the model's backbone, T5 for CogVideoX, "
                                          "umT5 for Wan (default: the demo text encoder)")
    p.add_argument("--vae", help="local VAE folder of the model's backbone, CogVideoX or Wan2.1 (default: identity "
                                 "decode of demo latents)")
    p.add_argument("--device", help="'auto', 'cpu', 'cuda', ...")
    p.add_argument("--offload-blocks", action="store_true", help="keep transformer blocks on the CPU, prefetched")
    p.add_argument("--text-encoder-on-cpu", action="store_true", help="run T5 on the CPU")
    p.add_argument("--no-vae-tiling", action="store_true", help="decode whole frames (more memory)")
    p.add_argument("--auto-fit", action="store_true",
                   help="set the memory switches (chunked forward, block streaming, fp8 weights, guidance batching) "
                        "to the fastest setup `tttv plan --phase sample` predicts to fit this GPU")
    p.add_argument("--set", dest="overrides", action="append", default=None, metavar="KEY=VALUE", help=SET_HELP)
    p.set_defaults(run=run)


def _config_file(args: argparse.Namespace) -> str | None:
    if args.config:
        return args.config
    from tttvideo.runs import config_for_checkpoint

    found = config_for_checkpoint(args.checkpoint)
    return str(found) if found is not None else None


def _overrides(args: argparse.Namespace) -> list[Override]:
    out: list[Override] = list(args.overrides or [])
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag)
        if value is not None:
            # a JSON string is a valid TOML basic string: paths with quotes or backslashes survive; a bad value is
            # named by the flag the user typed, not as the --set it becomes
            text = f"{key}={json.dumps(value) if isinstance(value, str) else value}"
            out.append((text, f"--{flag.replace('_', '-')}"))
    if args.offload_blocks:
        out.append("sample.offload_blocks=true")
    if args.text_encoder_on_cpu:
        out.append('sample.text_encoder_device="cpu"')
    if args.no_vae_tiling:
        out.append("sample.vae_tiling=false")
    return out


def run(args: argparse.Namespace) -> int:
    from tttvideo.parallel.launch import exit_on_rank, launch_rank, launch_world_size

    rank = launch_rank()
    if rank != 0:  # one voice: the other ranks print only errors of their own
        logging.getLogger("tttvideo").setLevel(logging.ERROR)
    # one process: a mistake in the inputs is said before torch and the sampler load (seconds); under torchrun the
    # ranks check them in _sample, where rank 0 alone says so
    checked = _checked_inputs(args) if launch_world_size() == 1 else None
    from tttvideo.parallel.watchdog import advise, peer_failure

    advise(lambda: f"the videos written before it are in {args.out}; run the same command again for the others")
    try:
        return _sample(args, quiet=rank != 0, checked=checked)
    except UserError as err:  # a SharedError is the same sentence on every rank: rank 0 prints it once
        return exit_on_rank(err, "sample")
    except Exception as err:  # under torchrun: a peer that died closed its connections mid-collective
        lost = peer_failure(err)
        if lost is None:
            raise
        return lost.exit("sample")


def _checked_inputs(args: argparse.Namespace):
    """The stories and the config, every input checked before anything heavy is loaded."""
    from tttvideo.config.loader import load_config
    from tttvideo.outputs import check_mp4_writer, check_writable_file
    from tttvideo.sample.scenes import load_stories, output_paths

    if not Path(args.checkpoint).exists():
        raise UserError(f"checkpoint {args.checkpoint} does not exist; give a model file, checkpoint folder or run "
                        f"folder written by tttv train")
    stories = load_stories(args.scenes)  # scene errors before the config and model are even read
    for path in output_paths(stories, args.out):  # and an unwritable --out before hours of denoising
        check_writable_file(path, "--out")
    cfg_path = _config_file(args)
    cfg = load_config(cfg_path, _overrides(args))
    check_component_folders(cfg.model.preset, cfg.sample.vae_path or cfg.data.vae_path,
                            cfg.sample.text_encoder_path or cfg.data.text_encoder_path,
                            "--vae (sample.vae_path)", "--text-encoder (sample.text_encoder_path)")
    if cfg.sample.write_video:  # latents only (sample.write_video = false) write no mp4
        check_mp4_writer()
    _check_one_process(cfg, cfg_path)
    if args.auto_fit:
        from tttvideo.memory.plan.auto_fit import auto_fit

        cfg = auto_fit(cfg, "sample", cfg_path, args.duration or f"{stories[0].duration_s}s")
    return stories, cfg_path, cfg


def _check_one_process(cfg, cfg_path: str | None) -> None:
    """Without torchrun, parallel.sp > 1 is refused as `tttv train` refuses it: the sequence parallelism the config
    asks for needs that many processes (a config saved by a torchrun training run carries its parallel.sp)."""
    from tttvideo.parallel.launch import launch_world_size

    sp = cfg.parallel.sp
    if sp > 1 and launch_world_size() == 1:
        where = f" (in {cfg_path})" if cfg_path else ""
        raise ConfigError(f"parallel.sp = {sp}{where} does not divide the world size 1 (WORLD_SIZE): sample with "
                          f"torchrun --nproc_per_node {sp} -m tttvideo sample ..., or in one process with --set "
                          f"parallel.sp=1")


def _sample(args: argparse.Namespace, quiet: bool, checked: tuple | None = None) -> int:
    """The stories sampled; `checked`: what _checked_inputs returned already (one process), else checked here."""
    from rich.console import Console

    from tttvideo.models.backbone import get_preset
    from tttvideo.parallel.launch import SharedError, launch_world_size
    from tttvideo.outputs import output_lock
    from tttvideo.sample.distributed import start_sample_ranks
    from tttvideo.parallel.watchdog import active_watch
    from tttvideo.sample.pipeline import sample_stories
    from tttvideo.sample.scenes import output_paths

    # status and progress on stdout; stderr carries only problems (a bad input or a warning is one line there)
    console = Console(quiet=quiet)
    launched = launch_world_size() > 1
    try:
        stories, cfg_path, cfg = checked or _checked_inputs(args)
    except UserError as err:
        if not launched:
            raise
        raise SharedError(str(err)) from None  # every rank read the same inputs: rank 0 alone says so
    with contextlib.ExitStack() as stack:
        if not quiet:  # rank 0 (or the one process) holds --out: a second sample to the same outputs refuses
            stack.enter_context(output_lock(output_paths(stories, args.out), args.out))
        console.print(f"config: {cfg_path or 'defaults'}; {len(stories)} story(ies) from {args.scenes}")
        ranks = start_sample_ranks(cfg, get_preset(cfg.model.preset).num_attention_heads) if launched else None
        watch = active_watch()
        try:
            # named for the messages of a rank that stops answering; not bounded as a whole (a story can take an
            # hour): a frozen or dead peer is still found by its silence
            with watch.phase("sampling its stories", bounded=False) if watch else contextlib.nullcontext():
                results = sample_stories(cfg, stories, args.out, checkpoint=args.checkpoint, duration=args.duration,
                                         console=console, progress=not quiet, ranks=ranks)
        finally:
            if ranks is not None:
                ranks.close()
    for r in results:
        name = r.video if cfg.sample.write_video else r.story  # latents only: no mp4 was written
        console.print(f"{name}: {r.frames} frames ({r.duration_s} s), denoise {r.denoise_s:.1f} s, decode "
                      f"{r.decode_s:.1f} s; scenes in {r.scenes}" + (f"; latents in {r.latents}" if r.latents else ""))
    return 0
