"""Typed configuration: one dataclass per section, one field per knob.

Every field has a type and a default; `Range`/`Choice` metadata in `field(metadata=...)` bounds its values, and the
loader (`tttvideo.config.loader`) rejects unknown keys, wrong types and out-of-range values with a message that
names the key, the file and what is allowed. Sections are owned by the parts of the pipeline that read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args


# The allowed values of the choice fields: their annotations, and the loader's check (`choice`).
Preset = Literal["tiny", "tiny-4ch", "small", "cogvideox-5b", "wan-tiny", "wan2.1-t2v-1.3b"]
WeightDtype = Literal["fp32", "bf16", "fp16"]
SampleDtype = Literal["auto", "fp32", "bf16", "fp16"]
Adapter = Literal["sft", "qkvo", "lora"]
SequenceLayer = Literal["ttt", "none", "full-attention", "mamba2", "gated-deltanet"]
FrozenWeights = Literal["dtype", "fp8"]
SampleFp8Linears = Literal["frozen", "all"]
TTTKind = Literal["mlp", "linear"]
EtaLayout = Literal["per-token", "reference"]
TTTBackend = Literal["auto", "triton", "reference"]
Decay = Literal["cosine", "linear", "constant"]
Optimizer = Literal["adamw", "adamw8bit"]
Precision = Literal["bf16", "fp16", "fp32"]
IfExists = Literal["refuse", "resume", "new", "overwrite"]
OnNonfinite = Literal["stop", "skip"]
TimestepSampling = Literal["uniform", "logit-normal"]
DemoTextEncoder = Literal["auto", "minilm", "table"]
DemoKind = Literal["scenes", "long-range"]
CacheDtype = Literal["bf16", "fp16", "fp32"]
Solver = Literal["ddim", "dpm++2m", "unipc", "euler"]
CfgSchedule = Literal["constant", "ramp"]
TextEncoderDevice = Literal["auto", "cpu"]


def choice(default: Any, *allowed: Any, help: str = "") -> Any:
    # A default outside its own choices would make every config that omits the key invalid: fail at import instead.
    if default not in allowed:
        raise ValueError(f"choice default {default!r} is not one of its choices {allowed!r}")
    return field(default=default, metadata={"choices": tuple(allowed), "help": help})


def bounded(default: Any, lo: float | None = None, hi: float | None = None, help: str = "") -> Any:
    if (lo is not None and default < lo) or (hi is not None and default > hi):
        raise ValueError(f"bounded default {default!r} is outside [{lo}, {hi}]")
    return field(default=default, metadata={"min": lo, "max": hi, "help": help})


def listed(default_factory: Any, help: str = "", choices: tuple = (), lo: float | None = None,
           hi: float | None = None) -> Any:
    """A list field; `choices`/`lo`/`hi` constrain every element (the loader checks each one)."""
    return field(default_factory=default_factory, metadata={"choices": tuple(choices), "min": lo, "max": hi,
                                                            "help": help})


@dataclass
class ModelConfig:
    preset: Preset = choice("tiny", *get_args(Preset), help="backbone and size: CogVideoX (tiny, tiny-4ch: the CPU "
                                                            "demo's, small, cogvideox-5b) or Wan2.1-T2V (wan-tiny, "
                                                            "wan2.1-t2v-1.3b; docs/wan.md)")
    pretrained_path: str = field(default="", metadata={"help": "diffusers transformer/ folder ('' = random init)"})
    dtype: WeightDtype = choice("fp32", *get_args(WeightDtype), help="parameter dtype at load")
    adapter: Adapter = choice("qkvo", *get_args(Adapter), help="what trains: sft = every weight; qkvo = attention "
                                                               "(q/k/v/o and their norms), TTT layers and gates; lora "
                                                               "= LoRA on attention q/k/v/o, TTT layers and gates (the"
                                                               " original: sft at 3 s, qkvo from 9 s)")
    lora_rank: int = bounded(64, 1, 4096)
    lora_alpha: float = bounded(64.0, 0.0)
    use_ttt: bool = field(default=True, metadata={"help": "False: local attention only (the no-TTT baseline; the "
                                                          "same as sequence_layer = 'none')"})
    sequence_layer: SequenceLayer = choice("ttt", *get_args(SequenceLayer),
                                           help="the long-range layer after local attention in every block: ttt "
                                                "(TTT-MLP or TTT-Linear by ttt.kind), none, full attention over the "
                                                "whole video, Mamba 2 or Gated DeltaNet (flash-linear-attention's "
                                                "kernels on CUDA: pip install 'tttvideo[long-range]'); all but ttt are"
                                                " the baselines of benchmarks/long_range.py and run on one GPU")
    frozen_weights: FrozenWeights = choice("dtype", *get_args(FrozenWeights),
                                           help="storage of frozen linear weights (those the adapter does not train): "
                                                "dtype = model.dtype; fp8 = float8 e4m3 with one scale per output "
                                                "channel, upcast layer by layer at compute (half the bytes of bf16, "
                                                "~2.5% output error)")
    fp8_matmul: bool = field(default=False, metadata={
        "help": "with frozen_weights = 'fp8': frozen linear layers multiply in fp8 (torch._scaled_mm: activations "
                "quantised per token, the stored per-channel weight scales, fp32 accumulation) instead of "
                "upcasting their weights to bf16; on Ada and Hopper GPUs (compute capability >= 8.9), at more output "
                "error and little speed (docs/model.md 'fp8 matrix products for frozen weights'; sampling with "
                "sample.fp8_linears = 'all' gains most); backward keeps the upcast weight"})
    compile_attention_glue: bool = field(default=True, metadata={
        "help": "torch.compile local attention's q/k norms, window gather and RoPE on CUDA (one write per tensor "
                "instead of a gather, an fp32 copy and elementwise passes; the overlap merge is two gathers either "
                "way); false = eager"})
    compile_block_glue: bool = field(default=True, metadata={
        "help": "torch.compile each block's adaLN (LayerNorm + text/video modulation) and gated residual adds on "
                "CUDA (one write of the stream where eager makes three, one where each gated add makes two); "
                "false = eager"})


@dataclass
class LayoutConfig:
    duration: str = field(default="3s", metadata={"help": "3 + 3n seconds, e.g. '9s'"})
    height: int = bounded(480, 1)
    width: int = bounded(720, 1)
    fps: int = bounded(16, 1)
    vae_spatial: int = bounded(8, 1)
    vae_temporal: int = bounded(4, 1)
    patch_size: int = bounded(2, 1)
    text_tokens: int = bounded(0, 0, 4096, help="text tokens per segment; 0 = the original's per-duration length")


# Per-kind defaults of the keys whose 0 means "the kind's default", as the reference system (ttt-video-dit) trains
# and samples: TTT-MLP trains with mini-batch 64 and samples with 16, TTT-Linear uses 16 for both; base learning
# rate 0.1 (MLP) and 1.0 (Linear).
TRAIN_MINI_BATCH = {"mlp": 64, "linear": 16}
SAMPLE_MINI_BATCH = {"mlp": 16, "linear": 16}
BASE_LR = {"mlp": 0.1, "linear": 1.0}


@dataclass
class TTTConfig:
    """The TTT layers. Keys whose 0 means "the kind's default" are read through the methods below, never directly,
    so that a config that leaves them out follows `kind` while an explicit value (as every saved run spells out)
    wins."""

    kind: TTTKind = choice("mlp", *get_args(TTTKind), help="inner model: TTT-MLP or TTT-Linear")
    mini_batch_size: int = bounded(0, 0, 4096, help="tokens per inner gradient step in training (the sequence is "
                                                    "padded to a multiple of it); 0 = the kind's default, as the "
                                                    "reference system trains: 64 (MLP), 16 (Linear)")
    sample_mini_batch_size: int = bounded(0, 0, 4096, help="the same for sampling (tttv sample, validation "
                                                           "videos); 0 = the kind's default, as the reference "
                                                           "system samples: 16 (MLP and Linear). The text length "
                                                           "per segment still follows the training mini-batch")
    base_lr: float = bounded(0.0, 0.0, help="inner learning rate scale; 0 = the kind's default: 0.1 (MLP), 1.0 "
                                            "(Linear)")
    eta_layout: EtaLayout = choice("per-token", *get_args(EtaLayout),
                             help="inner learning rates of a mini-batch: per-token = each key's own rate (the "
                                  "paper's math); reference = the reference system's per-mini-batch matrices, "
                                  "whose rows follow the scan order of a multi-segment video and whose columns do "
                                  "not (what its checkpoints were trained with; tttv convert sets it; the PyTorch "
                                  "scan, not the Triton kernels). The same on one segment (docs/model.md)")
    scan_checkpoint_group_size: int = bounded(16, 0, help="mini-batches per scan checkpoint; 0 = no checkpointing")
    backend: TTTBackend = choice("auto", *get_args(TTTBackend), help="the scan and the glue before it: auto = Triton "
                                                                     "on CUDA, the reference elsewhere")
    mlp_hidden: int = bounded(0, 0, 4096, help="TTT-MLP's inner hidden size per head; 0 = 4 x the head dim, as "
                                                "the original (a power of two in [16, 256] keeps the Triton "
                                                "kernels; TTT-Linear ignores it)")
    gate_init: float = bounded(0.1, help="initial value of the tanh gates")
    rope_theta: float = bounded(10000.0, 1.0)
    compile_glue: bool = field(default=True, metadata={
        "help": "torch.compile the PyTorch version of the TTT layer's glue on CUDA where its Triton kernels do not "
                "run (backend reference, compute capability < 8.0); false = eager"})

    def train_mini_batch(self) -> int:
        return self.mini_batch_size or TRAIN_MINI_BATCH[self.kind]

    def sample_mini_batch(self) -> int:
        return self.sample_mini_batch_size or SAMPLE_MINI_BATCH[self.kind]

    def mini_batch(self, phase: str) -> int:
        """The mini-batch of `phase`: "train" or "sample"."""
        if phase not in ("train", "sample"):
            raise ValueError(f"phase must be 'train' or 'sample', got {phase!r}")
        return self.train_mini_batch() if phase == "train" else self.sample_mini_batch()

    def inner_base_lr(self) -> float:
        return self.base_lr or BASE_LR[self.kind]


@dataclass
class TrainConfig:
    output_dir: str = "runs/train"
    steps: int = bounded(1000, 1)
    seed: int = bounded(0, 0)
    # batch (the original recipe: global batch 64)
    batch_size: int = bounded(1, 1, help="micro-batch per GPU per forward pass")
    grad_accum: int = bounded(0, 0, help="micro-batches per optimizer step; 0 = global_batch / (batch_size x GPUs)")
    global_batch: int = bounded(0, 0, help="samples per optimizer step over all GPUs; 0 = batch_size x grad_accum "
                                           "x GPUs (if both are set they must agree)")
    # optimizer: AdamW with two learning rates
    lr: float = bounded(1e-5, 0.0, help="peak learning rate of pretrained weights")
    lr_ssm: float = bounded(1e-4, 0.0, help="peak learning rate of TTT parameters and gates")
    lr_end: float = bounded(1e-5, 0.0, help="learning rate both groups decay to by the last step (the original: "
                                            "1e-5, so lr = 1e-5 stays constant)")
    warmup_steps: int = bounded(0, 0, help="linear warmup from 0 to the peak learning rates")
    decay: Decay = choice("linear", *get_args(Decay), help="decay of lr after warmup, down to lr_end")
    decay_ssm: Decay = choice("cosine", *get_args(Decay), help="decay of lr_ssm after warmup, down to lr_end")
    weight_decay: float = bounded(1e-4, 0.0, help="AdamW weight decay; never applied to biases and norms")
    adam_beta1: float = bounded(0.9, 0.0, 1.0)
    adam_beta2: float = bounded(0.95, 0.0, 1.0)
    adam_eps: float = bounded(1e-8, 0.0)
    optimizer: Optimizer = choice("adamw", *get_args(Optimizer), help="adamw8bit: both AdamW moments in 8 bits with "
                                                                      "one scale per 256 values (torchao's AdamW8bit; "
                                                                      "needs pip install 'tttvideo[memory]'): 2 bytes "
                                                                      "of state per trainable parameter instead of 4 "
                                                                      "(bf16 parameters) or 8 (fp32)")
    bf16_stochastic_round: bool = field(default=False, metadata={
        "help": "with bf16 weights (model.dtype = 'bf16') and train.optimizer = 'adamw8bit': write each updated "
                "weight back to bf16 by stochastic rounding (torchao), so an update smaller than half a bf16 step "
                "(1/256 of the weight) moves it on average instead of vanishing; off: round to nearest"})
    grad_clip: float = bounded(0.1, 0.0, help="max global gradient norm; 0 = no clipping")
    ema_decay: float = bounded(0.0, 0.0, 0.99999, help=(
        "exponential moving average of the trainable weights, kept in fp32 beside them and updated after every "
        "optimizer step at min(ema_decay, (1 + n) / (10 + n)) after n updates (a warm-up, so early weights fade "
        "out); saved as ema.safetensors in each checkpoint, sampled from by default (sample.use_ema) and started "
        "from by train.init_from; 0 = off. Under torchrun each rank averages its shards of the weights"))
    # loss
    text_dropout: float = bounded(0.1, 0.0, 1.0, help="probability of zeroing a sample's text (for CFG)")
    timestep_sampling: TimestepSampling = choice("uniform", *get_args(TimestepSampling), help=(
        "how training draws noise levels, stratified over the optimizer step's batch either way: uniform over the "
        "schedule (the original), or logit-normal: sigmoid(timestep_mean + timestep_std z), z standard normal, as "
        "the fraction of the way from clean to pure noise (SD3's draw; a positive mean trains more at high noise, "
        "where a video's layout is decided; Wan's shift applies on top)"))
    timestep_mean: float = bounded(0.0, help="logit-normal location: 0 centres the draws half-way, > 0 toward noise")
    timestep_std: float = bounded(1.0, 0.01, help="logit-normal scale: larger spreads the draws toward both ends")
    precision: Precision = choice("bf16", *get_args(Precision), help="autocast dtype; fp16 adds a gradient scaler")
    device: str = field(default="auto", metadata={"device": True,
                                                  "help": "'auto' (CUDA if present), 'cpu', 'cuda', 'cuda:1', ..."})
    cpu_threads: int = bounded(0, 0, help="PyTorch CPU threads; 0 = its default (one per core). 1 is faster on a "
                                          "busy machine, where spinning OpenMP threads stall each other")
    # checkpoints
    checkpoint_every: int = bounded(500, 1, help="optimizer steps between checkpoints (the last step always saves)")
    keep_checkpoints: int = bounded(3, 1, help="checkpoints kept; older ones are deleted")
    if_exists: IfExists = choice("refuse", *get_args(IfExists), help="when output_dir already holds a run: refuse "
                                                                     "(naming the flags), resume it, start a new run "
                                                                     "in the first free output_dir-2, -3, ... (the old"
                                                                     " one is kept), or overwrite (delete its "
                                                                     "checkpoints, metrics, TensorBoard logs and "
                                                                     "videos); --resume / --new / --overwrite set it")
    init_from: str = field(default="", metadata={"help": "checkpoint (file or run folder) of the previous stage to "
                                                         "start from, with its EMA weights when it has them "
                                                         "(ema.safetensors); optimizer and step start fresh"})
    # failures
    on_nonfinite: OnNonfinite = choice("stop", *get_args(OnNonfinite), help="NaN/Inf loss: stop naming the last good "
                                                                            "checkpoint, or skip the step")
    max_nonfinite_skips: int = bounded(10, 0, help="with on_nonfinite = 'skip': stop after this many skipped steps")
    # logging
    log_every: int = bounded(10, 1, help="optimizer steps between log lines / TensorBoard points")
    tensorboard: bool = True
    plots: bool = field(default=True, metadata={"help": "when training ends, draw the run's pictures: its loss curve "
                                                        "(loss.png) and, when it made a video, the video's frame "
                                                        "strip (frames.png); false skips both (matplotlib's import "
                                                        "and drawing: about 1.4 s of CPU)"})
    wandb: bool = field(default=False, metadata={"help": "log to Weights & Biases (needs `pip install wandb`)"})
    wandb_project: str = "tttvideo"
    validate_every: int = bounded(0, 0, help="optimizer steps between validation videos; 0 = only at the end (demo)")
    sample_at_end: bool = field(default=False, metadata={"help": "sample one video from the stories of the data "
                                                                 "set when training ends"})


@dataclass
class DataConfig:
    manifest: str = field(default="", metadata={"help": "JSONL manifest of the latent cache ('' = built-in demo set)"})
    num_workers: int = bounded(0, 0, help="loader processes prefetching batches (order does not depend on it)")
    max_damaged_samples: int = bounded(10, 0, help="cache files found damaged mid-run (unreadable, NaN/Inf) are "
                                                   "passed over with a warning; past this many the run saves and stops")
    # the built-in demo set (used when manifest is '')
    demo_videos: int = bounded(32, 1, help="synthetic videos in the demo set")
    demo_dir: str = field(default="", metadata={"help": "where the demo set is written ('' = <output_dir>/data); "
                                                        "runs that share it reuse it"})
    demo_text_encoder: DemoTextEncoder = choice("auto", *get_args(DemoTextEncoder),
                                                help="demo text features: all-MiniLM-L6-v2 if installed (auto), or a "
                                                     "fixed table")
    demo_kind: DemoKind = choice("scenes", *get_args(DemoKind), help="demo videos: scenes (each caption names its "
                                                                     "colour, shape, motion, background) or long-range"
                                                                     " (a cut every segment, the colour named only in "
                                                                     "the first scene and kept through the video: a "
                                                                     "test of memory across scenes)")
    # tttv precompute
    videos: str = field(default="", metadata={"help": "precompute: folder of mp4 clips (16 fps, 16 x seconds + 1 "
                                                      "frames, the layout's resolution)"})
    captions: str = field(default="", metadata={"help": "precompute: JSONL, one line per clip with its captions"})
    cache_dir: str = field(default="", metadata={"help": "precompute: output folder (manifest.jsonl, latents/, text/)"})
    vae_path: str = field(default="", metadata={"help": "precompute: diffusers AutoencoderKLCogVideoX folder (or a "
                                                        "pipeline folder with vae/)"})
    text_encoder_path: str = field(default="", metadata={"help": "precompute: transformers T5 folder (or a pipeline "
                                                                 "folder with text_encoder/ and tokenizer/)"})
    precompute_batch_size: int = bounded(1, 1, help="clips per VAE call")
    text_batch_size: int = bounded(8, 1, help="prompts per T5 call")
    cache_dtype: CacheDtype = choice("bf16", *get_args(CacheDtype), help="dtype of stored latents and text features")
    vae_tiling: bool = field(default=False, metadata={"help": "tiled VAE encoding (less memory, tiny seams)"})
    device: str = field(default="auto", metadata={"device": True,
                                                  "help": "precompute device: 'auto', 'cpu', 'cuda', ..."})


@dataclass
class SampleConfig:
    steps: int = bounded(50, 1, 1000, help="denoising steps (trailing spacing over the 1000 training steps)")
    seed: int = bounded(0, 0, help="initial noise (and DPM noise) seed; the same seed gives the same video")
    solver: Solver = choice("ddim", *get_args(Solver), help="CogVideoX (v-prediction): DDIM (deterministic) or the "
                                                            "stochastic DPM-Solver++(2M) CogVideoX and the original "
                                                            "sample with; Wan (flow matching): UniPC (Wan's default) "
                                                            "or Euler on Wan's shifted grid")
    cfg: float = bounded(4.0, 0.0, help="classifier-free guidance scale (the end value of a ramp)")
    cfg_schedule: CfgSchedule = choice("ramp", *get_args(CfgSchedule), help="constant at cfg, or ramp from cfg_start "
                                                                            "to cfg")
    cfg_start: float = bounded(1.0, 0.0, help="guidance at the first step of a ramp (the paper: 1 -> 4)")
    cfg_ramp_exp: float = bounded(1.0, 0.0, help="shape of the half-cosine ramp: 1 smooth, larger stays low longer")
    use_ema: bool = field(default=True, metadata={"help": "sample with the EMA weights of a checkpoint that has "
                                                          "them (ema.safetensors, train.ema_decay > 0); false: its "
                                                          "last-step weights"})
    cfg_batched: bool = field(default=True, metadata={"help": "conditional and unconditional in one batch of 2 "
                                                              "(faster) instead of two passes (less memory)"})
    device: str = field(default="auto", metadata={"device": True,
                                                  "help": "'auto' (CUDA if present), 'cpu', 'cuda', 'cuda:1', ..."})
    dtype: SampleDtype = choice("auto", *get_args(SampleDtype), help=(
        "dtype the transformer samples in (no autocast): 'auto' is bf16 on a GPU where model.dtype is fp32 (a run's "
        "master weights; the trained weights are cast as they load) and model.dtype otherwise, CPU included"))
    fp8_linears: SampleFp8Linears = choice("frozen", *get_args(SampleFp8Linears), help=(
        "with model.frozen_weights = 'fp8', the transformer's linear layers stored in fp8 when sampling: 'frozen' "
        "those the adapter froze in training; 'all' every one (nothing trains when sampling), multiplied in fp8 "
        "too with model.fp8_matmul (more output error: docs/model.md 'fp8 matrix products for frozen weights')"))
    text_encoder_path: str = field(default="", metadata={"help": "T5 folder ('' = data.text_encoder_path; both "
                                                                 "empty = the demo text encoder)"})
    text_encoder_device: TextEncoderDevice = choice("auto", *get_args(TextEncoderDevice),
                                                    help="'cpu' keeps T5 off the GPU entirely; it always leaves the "
                                                         "GPU before denoising")
    vae_path: str = field(default="", metadata={"help": "CogVideoX VAE folder ('' = data.vae_path; both empty = "
                                                        "identity decode of demo latents)"})
    vae_tiling: bool = field(default=True, metadata={"help": "decode in spatial tiles (bounded memory at 480x720)"})
    offload_blocks: bool = field(default=False, metadata={"help": "keep transformer blocks on the CPU and prefetch "
                                                                  "each onto the GPU on a side stream (CUDA only)"})
    prefetch_blocks: int = bounded(1, 1, 8, help="with offload_blocks: blocks copied ahead of the one running")
    split_guidance: bool = field(default=False, metadata={"help": "under torchrun: half of the ranks run the "
                                                                  "conditional pass, the other half the "
                                                                  "unconditional one, exchanged every step"})
    save_latents: bool = field(default=False, metadata={"help": "also write each story's final latents beside its "
                                                                "mp4 (<video>.latents.safetensors, float32)"})
    write_video: bool = field(default=True, metadata={"help": "decode each story and write its mp4; false skips "
                                                              "the decoder and the mp4 writer and keeps only the "
                                                              "latents (needs save_latents) and scenes.json, for "
                                                              "scoring runs such as benchmarks/long_range.py"})


@dataclass
class ParallelConfig:
    """How the ranks of a torchrun launch split the work (tttvideo.parallel.mesh). The product
    dp_replicate x dp_shard x sp must equal WORLD_SIZE."""

    dp_shard: int = bounded(-1, -1, help="FSDP degree: ranks that shard parameters, gradients and optimizer state "
                                         "(each on its own samples); -1 = WORLD_SIZE / (dp_replicate x sp)")
    dp_replicate: int = bounded(1, 1, help="HSDP replicas: groups of dp_shard x sp ranks that each hold a whole "
                                           "sharded copy and all-reduce their gradients")
    sp: int = bounded(1, 1, help="Ulysses sequence-parallel degree: ranks that split one video's tokens; it must "
                                 "divide the attention heads and WORLD_SIZE")
    tensor_parallel: int = bounded(1, 1, help="tensor parallelism is not implemented; only 1 is accepted")
    timeout_s: float = bounded(600.0, 1.0, help=(
        "seconds a rank waits for the others (in one collective, or without a sign of life from a peer) before it "
        "stops the run naming the rank that stopped answering and the phase (torch's own timeout, 30 min for gloo, "
        "ends a run with a traceback that names no rank)"))
    slow_timeout_s: float = bounded(1200.0, 1.0, help=(
        "the same bound for the phases that are slow on a 5B model: start-up (loading weights, rank 0 preparing the "
        "data), the first step (kernel autotuning, compilation) and checkpoint saves (rank 0 gathers and writes the "
        "whole model while the others wait)"))

    # keys of earlier versions, read by the config loader into the field that replaced them
    RENAMED_KEYS: ClassVar[dict[str, str]] = {"data_parallel_shard": "dp_shard"}


@dataclass
class CheckpointSwitches:
    """What is recomputed in backward: the section's settings for every layer, and each rule's for its range."""

    group_size: int = bounded(1, 1, help="consecutive blocks recomputed together when block = true")
    block: bool = field(default=False, metadata={"help": "checkpoint whole blocks (in groups of group_size)"})
    attention: bool = field(default=False, metadata={"help": "checkpoint adaLN + local attention"})
    forward_ttt: bool = field(default=False, metadata={"help": "checkpoint the forward TTT pass"})
    reverse_ttt: bool = field(default=False, metadata={"help": "checkpoint the reverse TTT pass"})
    mlp: bool = field(default=False, metadata={"help": "checkpoint adaLN + MLP"})
    keep: list[str] = listed(list, choices=("attention", "matmul"), help=(
        "outputs a checkpointed block (or its checkpointed attention / MLP half) saves instead of recomputing in "
        "backward (selective checkpointing): 'attention' the SDPA outputs (the costliest recompute; at 3 s about "
        "0.11 GiB a layer for the 5B), 'matmul' the backbone's matrix products' outputs (about 1 GiB a layer at "
        "3 s; the long-range layer's are recomputed); the "
        "rest of the region is still recomputed"))


# a block's four parts, each checkpointed apart by its CheckpointSwitches field
CHECKPOINT_PARTS = ("attention", "forward_ttt", "reverse_ttt", "mlp")


@dataclass
class CheckpointRule(CheckpointSwitches):
    """Activation checkpointing of a range of layers; replaces the section's settings for those layers."""

    layers: str = field(default=":", metadata={"help": "layer indices as a Python slice: '0:14', '28:', '-4:', ':'"})


@dataclass
class CheckpointingConfig(CheckpointSwitches):
    """Activation checkpointing of the transformer (torch.utils.checkpoint, non-reentrant). The TTT scan has its own
    knob, ttt.scan_checkpoint_group_size; both compose."""

    layers: list[CheckpointRule] = listed(list, help="per-layer rules ([[checkpointing.layers]]); the last rule "
                                                     "covering a layer wins, uncovered layers use the settings above")
    nested_span: int = bounded(0, 0, help=(
        "nested checkpointing of block-checkpointed layers: keep the input of every nested_span-th block unit only "
        "and, in backward, recompute each span of units from its saved input, unit by unit (each unit keeps its "
        "own input while its span's backward runs); about 2 x sqrt(units) inputs live at once instead of one per "
        "unit, for one more forward of those blocks (sqrt(42) ~ 6 for the 5B; 0 = off)"))
    ffn_chunk_tokens: int = bounded(0, 0, help=(
        "training: run each block's feed-forward MLP (for Wan with its adaLN and gated residual add) over chunks of "
        "this many tokens, each chunk checkpointed on its own, so its hidden layer (tokens x 4 width for CogVideoX, x "
        "5.8 for Wan, plus the GELU input saved for backward) exists for one chunk at a time in forward and backward; "
        "same gradients, one more forward of the MLP. A size in tokens, so the bound does not grow with the video "
        "(e.g. 32768); 0 = off (docs/memory.md)"))
    ttt_chunk_tokens: int = bounded(0, 0, help=(
        "training: run each TTT layer's token-wise parts (the gather into scan order, the q/k/v projection, eta and "
        "the scan-input glue; the post-norm, in fp32 under autocast, and the output projection) over chunks of "
        "this many tokens, each chunk checkpointed on its own, so none of them exists for the whole video; the scan, "
        "its inputs and output stay whole. Same gradients, one more forward of those parts. e.g. 32768; 0 = off "
        "(docs/memory.md)"))
    ttt_head_groups: int = bounded(1, 1, help=(
        "training, with ttt_chunk_tokens: run each TTT layer's scan over this many groups of heads, each group (its "
        "chunked projections, scan inputs, scan checkpoints and backward scratch) checkpointed on its own, so they "
        "exist for one group at a time in backward; same gradients, one more forward of the scan. 1 = all heads "
        "at once (docs/memory.md)"))
    attention_by_window: bool = field(default=False, metadata={
        "help": "training, Wan: run each block's self- and cross-attention one window (segment) at a time, each "
                "window checkpointed on its own, so a window's adaLN input, q/k/v, their fp32 norms and RoPE and "
                "its attention output exist for one window at a time instead of for the whole video (at 63 s the "
                "whole-video form makes ~20 stream-sized tensors at once); same gradients, one more forward of "
                "the attentions (docs/memory.md)"})
    offload_activations: bool = field(default=False, metadata={
        "help": "training: move the tensors autograd saves for backward (1 MiB and larger; with block = true the "
                "block inputs) to host memory in forward and back in backward, around each micro-batch; weights "
                "stay. Same gradients, a copy each way on a side stream (docs/memory.md)"})
    offload_host_gib: float = bounded(0.0, 0.0, help=(
        "with offload_activations: host memory the offloaded tensors may take, in GiB, as exact-size buffers "
        "pinned once and reused every micro-batch; what does not fit stays on the GPU (a partial offload). 0 = 90 "
        "% of the host memory available at start, less what Inductor's compile workers will take on CUDA; more "
        "than is available is an error before the first step"))


@dataclass
class MemoryConfig:
    """Limits that make a run behave like one on a smaller card."""

    max_gpu_gib: float = bounded(0.0, 0.0, help="cap this process's CUDA caching allocator at this many GiB (to "
                                                "rehearse a 24 GB card on a larger one: 24); 0 = no cap. The CUDA "
                                                "context and other processes are outside the cap; ignored off CUDA")
    stream_frozen_weights: bool = field(default=False, metadata={
        "help": "training with model.frozen_weights = 'fp8': keep the frozen fp8 weights in pinned host memory and "
                "copy each layer's to the GPU when it runs (forward, and the recompute of checkpointed blocks), so "
                "the GPU holds only the layers in flight; one process (sampling streams whole blocks with "
                "sample.offload_blocks)"})
    chunked_inference: bool = field(default=False, metadata={
        "help": "without gradients (sampling, validation), run each block in bounded memory: attention one window "
                "at a time, projections, TTT glue and MLP over chunks of inference_chunk_tokens tokens, in place on "
                "the residual stream; same results up to matmul summation order (docs/memory.md). One process or "
                "parallel.sp = 1"})
    inference_chunk_tokens: int = bounded(16384, 256, help="tokens per chunk of the chunked inference forward")
    ttt_head_groups: int = bounded(1, 1, help="chunked inference: scan the TTT heads in this many groups (1 is the "
                                              "fastest; each group costs about one full scan's time and holds 1/G "
                                              "of its inputs)")

    # keys of earlier versions that no code read: the config loader warns and ignores them, so the config.toml
    # saved with an older run still loads
    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "gpu_memory_gib": "it was never read; memory.max_gpu_gib caps the allocator"}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    ttt: TTTConfig = field(default_factory=TTTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
