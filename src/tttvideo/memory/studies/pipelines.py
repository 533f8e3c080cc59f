"""diffusers video pipelines under our memory profiler: `tttv profile --pipeline wan2.1-t2v-1.3b` (or a
`[pipeline]` file, `tttvideo.memory.studies.pipeline_config`).

The pipeline is diffusers' own (`WanPipeline`, `CogVideoXPipeline`) with its own memory switches; we build its
components, mark what happens, and run its `__call__`:
- components, each a base-memory row: the text encoder (umT5-XXL for Wan, T5-XXL for CogVideoX), the VAE, the
  transformer; from a local pipeline folder (`pipeline.weights`), or random weights of the published sizes created
  on the device directly (values do not change memory; the report says "random weights");
- phases: text encoding (the encoder on random token ids of the pipeline's text length, conditional and negative:
  there is no tokenizer without the hub, and the tokens' values do not change memory), denoise (every transformer
  call a nested phase, every block a block event, a `denoise step k/n` mark after each step for step times), and
  VAE decode (diffusers' `vae.decode`, wrapped).
With model / sequential / group offload the components are built in host memory and diffusers' hooks move them; the
moves show inside the phases that trigger them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tttvideo.errors import UserError
from tttvideo.memory.studies.pipeline_config import PipelineProfile

if TYPE_CHECKING:
    import torch
    from torch import nn

    from tttvideo.memory.profile.profiler import MemoryProfiler


@dataclass(frozen=True)
class PipelineSpec:
    pipeline_class: str  # diffusers class name
    text_encoder_label: str
    text_tokens: int  # the pipeline's max_sequence_length
    blocks_attr: str  # the transformer's list of blocks
    build: Callable[[bool], dict[str, Callable[[], Any]]]  # tiny -> component factories
    context_parallel: bool  # the transformer has a diffusers context-parallel plan (`_cp_plan`)


def _wan(tiny: bool) -> dict[str, Callable[[], Any]]:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers: transformer/config.json, text_encoder (google/umt5-xxl), vae, scheduler
    dit = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
               text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
    t5 = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
              layer_norm_epsilon=1e-6, tie_word_embeddings=False)
    vae: dict[str, Any] = {}
    if tiny:
        dit.update(num_attention_heads=2, attention_head_dim=8, text_dim=32, freq_dim=16, ffn_dim=32, num_layers=2,
                   rope_max_seq_len=1024)  # the rope table covers the published sizes too
        t5.update(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
        vae = dict(base_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    return {"text_encoder": lambda: UMT5EncoderModel(UMT5Config(**t5)),
            "vae": lambda: AutoencoderKLWan(**vae),
            "transformer": lambda: WanTransformer3DModel(**dit),
            "scheduler": lambda: UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                         num_train_timesteps=1000, flow_shift=3.0)}


def _cogvideox(tiny: bool) -> dict[str, Callable[[], Any]]:
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDPMScheduler, CogVideoXTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    from tttvideo.models.backbone import get_preset

    # THUDM/CogVideoX-5b: transformer as our preset, text_encoder (T5 v1.1 XXL), vae (scaling 0.7), scheduler
    dit = get_preset("tiny" if tiny else "cogvideox-5b").to_diffusers_config()
    t5 = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
              layer_norm_epsilon=1e-6)
    vae: dict[str, Any] = dict(scaling_factor=0.7)
    if tiny:
        t5.update(vocab_size=100, d_model=dit["text_embed_dim"], d_kv=8, d_ff=64, num_layers=2, num_heads=4)
        vae.update(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=2)
    return {"text_encoder": lambda: T5EncoderModel(T5Config(**t5)),
            "vae": lambda: AutoencoderKLCogVideoX(**vae),
            "transformer": lambda: CogVideoXTransformer3DModel(**dit),
            "scheduler": lambda: CogVideoXDPMScheduler(
                beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                prediction_type="v_prediction", rescale_betas_zero_snr=True, set_alpha_to_one=True,
                snr_shift_scale=1.0, timestep_spacing="trailing")}


PIPELINES = {
    "wan2.1-t2v-1.3b": PipelineSpec("WanPipeline", "umT5-XXL", 512, "blocks", _wan, True),
    "cogvideox-5b-diffusers": PipelineSpec("CogVideoXPipeline", "T5-XXL", 226, "transformer_blocks", _cogvideox,
                                           False),
}


def check_pipeline_profile(pc: PipelineProfile) -> None:
    """Combinations diffusers refuses deep inside a run, refused up front with the field to change (on every rank
    of a launch alike)."""
    from tttvideo.parallel.launch import SharedError

    if pc.context_parallel > 1:
        if not PIPELINES[pc.name].context_parallel:
            raise SharedError(f"pipeline.context_parallel = {pc.context_parallel}: diffusers has no context-parallel "
                              f"plan for {pc.name}'s transformer; set it to 1")
        if pc.offload != "none":
            raise SharedError(f"pipeline.context_parallel = {pc.context_parallel} with pipeline.offload = "
                              f"{pc.offload!r}: each rank keeps its whole pipeline on its GPU; set offload = 'none'")


def join_context_parallel(pc: PipelineProfile, device: torch.device) -> tuple[torch.device, int]:
    """Under torchrun with pipeline.context_parallel = N processes: this rank's device and rank, the default
    process group started (NCCL on GPUs, gloo on the CPU). Without it: `device` and rank 0."""
    import torch
    import torch.distributed as dist

    from tttvideo.parallel.launch import SharedError, check_launch, launch_rank, rank_device

    world = check_launch("profile", "profiling")
    if pc.context_parallel == 1:
        if world > 1:
            raise SharedError(f"this launch has {world} processes but pipeline.context_parallel is 1: set "
                              f"--set pipeline.context_parallel={world}, or run one process")
        return device, 0
    if world != pc.context_parallel:
        raise SharedError(f"pipeline.context_parallel = {pc.context_parallel} needs as many processes: torchrun "
                          f"--nproc_per_node {pc.context_parallel} -m tttvideo profile ... (this launch has {world}; "
                          "`tttv profile --matrix` starts them itself)")
    device = rank_device(device)
    if device.type == "cuda":
        if torch.cuda.device_count() < world:
            raise SharedError(f"pipeline.context_parallel = {world} needs {world} GPUs, one a process; this host "
                              f"shows {torch.cuda.device_count()}")
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device, launch_rank()


# ------------------------------------------------------------------------------------------------ components
@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# random values for made-up weights: one tile of N(0, 0.02) per dtype and device, copied over every tensor (filling
# 5.7 B umT5 parameters with fresh random numbers on the CPU takes minutes in bf16; a copy takes seconds)
_TILE_ELEMENTS = 1 << 22
_tiles: dict[tuple[Any, Any], torch.Tensor] = {}


def _fill_random(t: torch.Tensor) -> None:
    import torch

    key = (t.dtype, t.device)
    if key not in _tiles:
        gen = torch.Generator().manual_seed(0)
        _tiles[key] = (torch.randn(_TILE_ELEMENTS, generator=gen) * 0.02).to(t.device, t.dtype)
    tile, flat = _tiles[key], t.view(-1)
    for start in range(0, flat.numel(), tile.numel()):
        chunk = flat[start:start + tile.numel()]
        chunk.copy_(tile[:chunk.numel()])


def _materialize(model: nn.Module, device: torch.device) -> None:
    """A meta-device model made real on `device` one module at a time, each tensor filled at once (random values for
    matrices, ones / zeros for norms and biases), so no moment holds more than the model itself. A tensor that
    several modules share (T5's token embedding is `shared` and `encoder.embed_tokens`) is made once and stays
    shared. Buffers computed in `__init__` (rotary tables) get the same placeholder values: the outputs mean
    nothing, the memory and time do not depend on them."""
    import torch
    from torch import nn

    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta tensor) -> (it, its real twin); kept alive
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in list(store.items()):
                if t is None:
                    continue
                if id(t) not in made:
                    real = torch.empty_like(t, device=device)
                    with torch.no_grad():
                        if real.is_floating_point() and real.dim() >= 2:
                            _fill_random(real)
                        elif real.is_floating_point():
                            real.fill_(1.0 if "weight" in name else 0.0)
                        else:
                            real.zero_()
                    if isinstance(t, nn.Parameter):
                        real = nn.Parameter(real, requires_grad=t.requires_grad)
                    made[id(t)] = (t, real)
                store[name] = made[id(t)][1]
    _tiles.clear()  # a tile on the GPU would count as the component's memory


def _build(name: str, factory: Callable[[], Any], pc: PipelineProfile, device: torch.device,
           dtype: torch.dtype) -> Any:
    """One component: loaded from `pc.weights`/<name> or random, on `device` in `dtype`."""
    import torch

    if pc.weights:
        folder = Path(pc.weights) / name
        if not folder.is_dir():
            raise UserError(f"pipeline.weights = {pc.weights!r} has no {name}/ folder; point it at a diffusers "
                            f"pipeline folder (model_index.json, text_encoder/, vae/, transformer/)")
        cls = type(_on_meta(factory, dtype))  # the class that loads this component
        if pc.loading == "blockwise" and device.type == "cuda":
            return cls.from_pretrained(str(folder), torch_dtype=dtype, device_map={"": str(device)}).eval()
        return cls.from_pretrained(str(folder), torch_dtype=dtype).to(device).eval()
    if pc.loading == "blockwise" or device.type == "cpu":
        # a component kept in host memory (offload, the text encoder on the CPU) is built the blockwise way too:
        # PyTorch's own initialisation of billions of parameters on the CPU takes minutes, and no GPU figure
        # depends on how host memory was filled
        model = _on_meta(factory, dtype)
        _materialize(model, device)
        return model.eval()
    with torch.device(device), _default_dtype(dtype):
        return factory().eval()


def _on_meta(factory: Callable[[], Any], dtype: torch.dtype) -> Any:
    import torch

    with torch.device("meta"), _default_dtype(dtype):
        return factory()


def build_pipeline(pc: PipelineProfile, prof: MemoryProfiler, device: torch.device) -> tuple[Any, Any]:
    """(the diffusers pipeline of `pc`, its text encoder), each component a base-memory row, the memory switches
    applied."""
    import diffusers
    import torch

    from tttvideo.dtypes import torch_dtype

    spec = PIPELINES[pc.name]
    factories = spec.build(pc.tiny)
    host = torch.device("cpu")
    home = host if pc.offload != "none" else device  # diffusers' offload hooks start from host memory
    source = "local weights" if pc.weights else "random weights"
    text_on_cpu = pc.text_encoder_device == "cpu"
    with prof.component(f"text encoder ({spec.text_encoder_label}, {source}{', on CPU' if text_on_cpu else ''})"):
        text_encoder = _build("text_encoder", factories["text_encoder"], pc, host if text_on_cpu else home,
                              torch.float32 if text_on_cpu else torch_dtype(pc.precision))
    with prof.component(f"VAE ({source})"):
        vae = _build("vae", factories["vae"], pc, home, torch_dtype(pc.vae_precision))
    with prof.component(f"transformer ({source})") as info:
        transformer = _build("transformer", factories["transformer"], pc, home, torch_dtype(pc.precision))
        info["counted_bytes"] = sum(p.numel() * p.element_size() for p in transformer.parameters())
    prof.meta["parameters"] = {"transformer": sum(p.numel() for p in transformer.parameters()),
                               "text_encoder": sum(p.numel() for p in text_encoder.parameters()), "trainable": 0}
    prof.meta["weights"] = pc.weights or "random (published sizes)" + (", tiny" if pc.tiny else "")
    # the encoder runs outside the pipeline (no tokenizer here); on the CPU it stays out of diffusers' offload too
    pipe = getattr(diffusers, spec.pipeline_class)(
        tokenizer=None, text_encoder=None if text_on_cpu else text_encoder, vae=vae, transformer=transformer,
        scheduler=factories["scheduler"]())
    _apply_switches(pipe, pc, prof, device)
    return pipe, text_encoder


def _apply_switches(pipe: Any, pc: PipelineProfile, prof: MemoryProfiler, device: torch.device) -> None:
    import torch

    from tttvideo.dtypes import torch_dtype

    if pc.fp8_weights:
        with prof.component("transformer weights to fp8 (layerwise casting)"):
            pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn,
                                                      compute_dtype=torch_dtype(pc.precision))
    if pc.attention_backend:
        try:
            pipe.transformer.set_attention_backend(pc.attention_backend)
        except (ValueError, RuntimeError, ImportError) as err:
            raise UserError(f"pipeline.attention_backend = {pc.attention_backend!r}: {err}") from None
    if pc.context_parallel > 1:
        from diffusers import ContextParallelConfig

        # after the attention backend: diffusers checks that the chosen one supports context parallelism
        with prof.component(f"context parallelism (Ulysses over {pc.context_parallel} ranks)"):
            try:
                with _cpu_counts_as_one_accelerator(device):
                    pipe.transformer.enable_parallelism(
                        config=ContextParallelConfig(ulysses_degree=pc.context_parallel))
            except ValueError as err:
                raise UserError(f"pipeline.context_parallel = {pc.context_parallel}: {err}") from None
    if pc.vae_tiling:
        pipe.vae.enable_tiling()
    if pc.vae_slicing:
        pipe.vae.enable_slicing()
    if pc.offload == "none":
        return
    with prof.component(f"offload hooks ({pc.offload})"):
        if pc.offload == "model":
            pipe.enable_model_cpu_offload(device=device)
        elif pc.offload == "sequential":
            pipe.enable_sequential_cpu_offload(device=device)
        else:
            # CogVideoX's VAE decodes through its decoder's own calls (frame batches with a conv cache), which
            # block-level hooks never see: its weights stayed in host memory and the decode failed on a GPU. It is
            # the smallest component (0.4 GB in bf16), so it stays on the device.
            keep = ["vae"] if type(pipe).__name__.startswith("CogVideoX") else None
            pipe.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                                      offload_type="block_level", num_blocks_per_group=1,
                                      use_stream=device.type == "cuda", exclude_modules=keep)


@contextlib.contextmanager
def _cpu_counts_as_one_accelerator(device: torch.device) -> Iterator[None]:
    """diffusers gives each rank the device `rank % torch.accelerator.device_count()`, a division by zero on a host
    without GPUs; on the CPU (gloo: the tests) the count reads 1 while parallelism is set up."""
    import torch

    if device.type != "cpu":
        yield
        return
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = count


class _Phases:
    """Phases opened and closed by hooks: `denoise` from the first transformer call to the VAE decode, inside it one
    `transformer forward` phase per call, and a `denoise step k/n` mark after each step."""

    def __init__(self, prof: MemoryProfiler, steps: int):
        self.prof, self.steps, self.step = prof, steps, 0
        self.stack = contextlib.ExitStack()
        self.denoise: contextlib.ExitStack | None = None
        self.call: Any = None

    def before_transformer(self, module: Any, args: Any) -> None:
        if self.denoise is None:
            self.denoise = contextlib.ExitStack()
            self.denoise.enter_context(self.prof.phase("denoise"))
            self.stack.push(self.denoise)
        self.call = self.prof.phase("transformer forward", step=self.step)
        self.call.__enter__()

    def after_transformer(self, module: Any, args: Any, output: Any) -> None:
        call, self.call = self.call, None
        if call is not None:
            call.__exit__(None, None, None)

    def on_step_end(self, pipe: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        self.prof.end_step(f"denoise step {i + 1}/{self.steps}")
        self.step = i + 1
        return {}

    def wrap_decode(self, vae: Any) -> Callable[..., Any]:
        decode = vae.decode

        def wrapped(latents: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.denoise is not None:
                self.denoise.close()
            with self.prof.phase("VAE decode"):
                # CogVideoXPipeline hands the transformer's dtype over as is; a VAE kept in another precision
                # (pipeline.vae_precision) needs its own
                return decode(latents.to(vae.dtype), *args, **kwargs)
        return wrapped

    def fail(self, exc: BaseException) -> None:
        """Unwind the open phases with the exception, innermost first, so an OOM records where it happened."""
        if self.call is not None:
            self.call.__exit__(type(exc), exc, exc.__traceback__)
            self.call = None
        self.stack.__exit__(type(exc), exc, exc.__traceback__)


def drive_pipeline(pc: PipelineProfile, prof: MemoryProfiler, steps: int, device: torch.device) -> None:
    """Build the pipeline, encode random tokens, run its `__call__` for `steps` denoising steps with the VAE
    decode, every stage marked."""
    import torch

    spec = PIPELINES[pc.name]
    torch.manual_seed(pc.seed)
    pipe, text_encoder = build_pipeline(pc, prof, device)
    cond, uncond = _encode(text_encoder, pc, spec, prof, device)
    phases = _Phases(prof, steps)
    prof.attach_block_hooks(list(getattr(pipe.transformer, spec.blocks_attr)), backward=False)
    hooks = [pipe.transformer.register_forward_pre_hook(phases.before_transformer),
             pipe.transformer.register_forward_hook(phases.after_transformer)]
    pipe.vae.decode = phases.wrap_decode(pipe.vae)
    try:
        with torch.no_grad():
            video = pipe(prompt_embeds=cond, negative_prompt_embeds=uncond, height=pc.height, width=pc.width,
                         num_frames=pc.frames, num_inference_steps=steps, guidance_scale=pc.guidance_scale,
                         generator=torch.Generator().manual_seed(pc.seed), output_type="pt", return_dict=False,
                         callback_on_step_end=phases.on_step_end)[0]
        prof.meta["video_shape"] = list(video.shape)
        # the values mean nothing with random weights, but two runs of one pipeline (one GPU against context
        # parallelism, say) must agree on them
        prof.meta["video_stats"] = {"mean": video.float().mean().item(), "std": video.float().std().item()}
    except BaseException as exc:
        phases.fail(exc)
        raise
    finally:
        for h in hooks:
            h.remove()
        prof.detach_hooks()


def _encode(text_encoder: Any, pc: PipelineProfile, spec: PipelineSpec, prof: MemoryProfiler,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The text encoder on random token ids of the pipeline's text length: conditional, and negative when guidance
    is on (as the pipeline's encode_prompt runs them: batch 1 each)."""
    import torch

    from tttvideo.dtypes import torch_dtype

    tokens = pc.text_tokens or spec.text_tokens
    run_on = torch.device("cpu") if pc.text_encoder_device == "cpu" else device
    g = torch.Generator().manual_seed(pc.seed)
    out = []
    with prof.phase("text encoding"), torch.no_grad():
        for _ in range(2 if pc.guidance_scale > 1 else 1):
            ids = torch.randint(0, text_encoder.config.vocab_size, (1, tokens), generator=g).to(run_on)
            hidden = text_encoder(ids, attention_mask=torch.ones_like(ids))[0]
            out.append(hidden.to(device, torch_dtype(pc.precision)))
    return out[0], (out[1] if len(out) > 1 else None)


def profile_pipeline(pc: PipelineProfile, steps: int, out_dir: str | Path, *, device: str = "auto",
                     snapshot: bool = False, trace: bool = False,
                     meta: dict[str, Any] | None = None) -> tuple[dict[str, Any], int]:
    """`tttvideo.memory.profile.drivers.profile` for a diffusers pipeline: inference, `steps` denoising steps, under a
    fresh profiler, the report written to `out_dir`."""
    from dataclasses import asdict

    from tttvideo.config.schema import MemoryConfig
    from tttvideo.device import resolve_device
    from tttvideo.memory.profile.drivers import run_profiled
    from tttvideo.parallel.mesh import close_parallel

    check_pipeline_profile(pc)
    dev, rank = join_context_parallel(pc, resolve_device(device, "--device"))
    if dev.type == "cpu" and not pc.tiny:
        # a full-size pipeline does run on the CPU, but for hours: say so before the first model is built
        logging.getLogger(__name__).warning(
            f"profiling {pc.name} at {pc.height}x{pc.width}, {pc.frames} frames on the CPU: its full-size models "
            f"take many minutes a denoising step here; for a quick rehearsal add --set pipeline.tiny=true and small "
            f"pipeline.height / width / frames (64, 64, 9), for real figures run it on a GPU")
    meta = {"phase": f"pipeline {pc.name}", "steps": steps, **(meta or {}), "pipeline": asdict(pc)}
    if pc.context_parallel > 1:
        meta["context_parallel"] = f"Ulysses over {pc.context_parallel} GPUs; the figures are rank {rank}'s"
        out_dir = Path(out_dir) / f"rank{rank}" if rank else out_dir  # rank 0's report is the variant's
    try:
        result = run_profiled(lambda prof, d: drive_pipeline(pc, prof, steps, d), dev,
                              MemoryConfig(max_gpu_gib=pc.max_gpu_gib), steps, out_dir, meta=meta,
                              snapshot=snapshot, trace=trace)
    except BaseException:
        close_parallel(wait=False)
        raise
    close_parallel(wait=result[1] == 0)
    return result
