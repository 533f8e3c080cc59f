"""What `tttv profile` runs when it profiles a diffusers video pipeline instead of our own: one `[pipeline]` table.

A pipeline profile file is TOML like our configs (`include = "base.toml"`, `--set pipeline.key=value`), validated by
the same loader; `configs/profile/wan21/` holds one file per variant of the Wan2.1 study. The switches are the
memory levers diffusers offers for any pipeline: precision, loading, where the text encoder runs, CPU offloading
(whole models, layer by layer, or groups of blocks on a side stream), VAE tiling and slicing, the attention backend,
fp8 layerwise weight storage, resolution and frame count; and, over several GPUs, its context parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal, get_args

from tttvideo.config.schema import bounded, choice

PipelineName = Literal["wan2.1-t2v-1.3b", "cogvideox-5b-diffusers"]
PIPELINE_NAMES = get_args(PipelineName)
Precision = Literal["fp32", "fp16", "bf16"]
Loading = Literal["whole", "blockwise"]
TextEncoderDevice = Literal["gpu", "cpu"]
Offload = Literal["none", "model", "sequential", "group"]


@dataclass
class PipelineProfile:
    name: PipelineName = choice("wan2.1-t2v-1.3b", *PIPELINE_NAMES,
                                help="the diffusers pipeline, at its published sizes")
    weights: str = field(default="", metadata={
        "help": "a local diffusers pipeline folder (text_encoder/, vae/, transformer/); '' = random weights of the "
                "published sizes, built on the device (memory figures stay valid; the report says so)"})
    tiny: bool = field(default=False, metadata={
        "help": "scaled-down random components (CPU tests and rehearsals; figures meaningless)"})
    precision: Precision = choice("bf16", *get_args(Precision), help="dtype of the transformer and the text encoder")
    vae_precision: Precision = choice("fp32", *get_args(Precision), help="dtype of the VAE (Wan's reference decodes "
                                                                         "in fp32)")
    loading: Loading = choice("whole", *get_args(Loading),
                              help="whole: each model built (or loaded) then moved at once; blockwise: built on the "
                                   "meta device and materialised on the GPU one block at a time (no host copy)")
    text_encoder_device: TextEncoderDevice = choice("gpu", *get_args(TextEncoderDevice),
                                                    help="cpu: the text encoder runs on the CPU in fp32 and only its "
                                                         "output moves to the GPU")
    offload: Offload = choice("none", *get_args(Offload),
                              help="none: every model on the GPU; model: diffusers' enable_model_cpu_offload (a whole "
                                   "model on the GPU while it runs); sequential: enable_sequential_cpu_offload (layer "
                                   "by layer); group: enable_group_offload, one block at a time with copies on a side "
                                   "stream")
    vae_tiling: bool = False
    vae_slicing: bool = False
    attention_backend: str = field(default="", metadata={
        "help": "diffusers attention backend for the transformer ('' = its default, e.g. 'flash', "
                "'_native_cudnn', 'native')"})
    fp8_weights: bool = field(default=False, metadata={
        "help": "diffusers' enable_layerwise_casting: transformer weights stored as float8 e4m3, upcast per layer"})
    height: int = bounded(480, 16)
    width: int = bounded(832, 16)
    frames: int = bounded(81, 1, help="video frames (4k + 1 for both pipelines' VAEs)")
    guidance_scale: float = bounded(5.0, 0.0)
    text_tokens: int = bounded(0, 0, help="text length; 0 = the pipeline's own (Wan 512, CogVideoX 226)")
    seed: int = 0
    max_gpu_gib: float = bounded(0.0, 0.0, help="cap this process's CUDA allocator at this many GiB (0: no cap), "
                                                "to rehearse a smaller card; the CUDA context is outside the cap")
    context_parallel: int = bounded(1, 1, help="Ulysses degree of diffusers' context parallelism for the transformer "
                                               "(enable_parallelism): > 1 runs under torchrun with that many "
                                               "processes, one GPU each (`tttv profile --matrix` launches them); "
                                               "every rank runs the whole pipeline, rank 0 writes the report")


@dataclass
class PipelineProfileFile:
    pipeline: PipelineProfile = field(default_factory=PipelineProfile)


def load_pipeline_profile(path: str | Path | None, overrides: Iterable[str] = ()) -> PipelineProfile:
    from tttvideo.config.loader import load_config

    return load_config(path, overrides, schema=PipelineProfileFile).pipeline


def is_pipeline_profile(path: str | Path) -> bool:
    """A config file (or one it includes) with a [pipeline] table is a pipeline profile."""
    from tttvideo.config.loader import tomllib

    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return False  # the config loader reports it properly
    if "pipeline" in data:
        return True
    includes = data.get("include", [])
    return any(is_pipeline_profile(p.parent / i) for i in ([includes] if isinstance(includes, str) else includes)
               if isinstance(i, str))
