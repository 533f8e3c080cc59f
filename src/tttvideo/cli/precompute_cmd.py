"""`tttv precompute [CONFIG] --videos DIR --captions FILE --vae PATH --t5 PATH --out DIR`: encode clips and captions
into the latent cache that `tttv train` reads (set data.manifest to OUT/manifest.jsonl).

The layout (duration, resolution, text tokens per segment) comes from the config, as for training: a cache fits one
layout. Flags override the matching data.* keys of the config.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tttvideo.cli.common import add_config_arguments, check_component_folders, config_from_args
from tttvideo.errors import ConfigError

FLAGS = {  # flag -> data.* key
    "videos": "videos",
    "captions": "captions",
    "out": "cache_dir",
    "vae": "vae_path",
    "t5": "text_encoder_path",
}


def register(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(name, help="encode mp4 clips + captions into the latent cache (VAE latents, T5 features)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(p, config_required=False)
    p.add_argument("--videos", help="folder of mp4 clips (data.videos)")
    p.add_argument("--captions", help="captions JSONL, one line per clip (data.captions)")
    p.add_argument("--out", help="cache folder to write (data.cache_dir)")
    p.add_argument("--vae", help="diffusers AutoencoderKLCogVideoX folder or pipeline folder (data.vae_path)")
    p.add_argument("--t5", help="transformers T5 encoder folder or pipeline folder (data.text_encoder_path)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tttvideo.data.precompute import PrecomputeOptions, run_precompute
    from tttvideo.models.backbone import backbone_of, layout_of
    from tttvideo.outputs import check_writable_dir

    cfg = config_from_args(args)
    data = cfg.data
    for flag, key in FLAGS.items():
        value = getattr(args, flag)
        if value:
            setattr(data, key, value)
    for flag, key in FLAGS.items():
        if not getattr(data, key):
            raise ConfigError(f"precompute needs --{flag} (or data.{key} in the config)")
    layout = layout_of(cfg)
    backbone = backbone_of(cfg.model.preset)
    # data.precompute encodes with the components CogVideoX and Wan name
    if (backbone.vae, backbone.text_encoder) not in (("cogvideox", "t5"), ("wan", "umt5")):
        raise ConfigError(f"precompute encodes with CogVideoX's VAE and T5 or Wan's VAE and umT5, but model.preset "
                          f"{cfg.model.preset!r} is a {backbone.name!r} model (VAE {backbone.vae!r}, text encoder "
                          f"{backbone.text_encoder!r}); precompute with a cogvideox or wan preset")
    check_writable_dir(data.cache_dir, "--out (data.cache_dir)")
    check_component_folders(cfg.model.preset, data.vae_path, data.text_encoder_path, "--vae (data.vae_path)",
                            "--t5 (data.text_encoder_path)")
    opts = PrecomputeOptions(
        videos=Path(data.videos), captions=Path(data.captions), out=Path(data.cache_dir),
        vae_path=Path(data.vae_path), text_encoder_path=Path(data.text_encoder_path), layout=layout,
        batch_size=data.precompute_batch_size, text_batch_size=data.text_batch_size, cache_dtype=data.cache_dtype,
        device=data.device, vae_tiling=data.vae_tiling, vae_kind=backbone.vae, text_encoder_kind=backbone.text_encoder,
    )
    console = Console()
    report = run_precompute(opts, console)
    if report.problems:
        table = Table(title=f"{len(report.problems)} clip(s) skipped")
        table.add_column("video")
        table.add_column("problem")
        for p in report.problems:
            table.add_row(p["video"], p["problem"])
        console.print(table)
    for w in report.warnings:
        console.print(f"[yellow]warning[/]: {w['video']}: {w['warning']}")
    console.print(
        f"cache: {len(report.samples)} sample(s) in {opts.out / 'manifest.jsonl'} "
        f"({len(report.encoded_latents)} latent(s) encoded, {len(report.reused_latents)} reused; "
        f"{report.encoded_texts} prompt(s) encoded, {report.reused_texts} reused); report in {opts.out / 'report.json'}"
    )
    if report.samples:
        console.print(f"train on it with: tttv train CONFIG --set data.manifest={opts.out / 'manifest.jsonl'}")
    return 0 if report.samples else 1
