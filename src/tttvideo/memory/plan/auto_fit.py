"""`--auto-fit` for `tttv train` and `tttv sample`: the planner's fastest measured setup that fits the GPUs of this
launch, and after an out-of-memory error in the first step the next one, re-planned with the activations scaled by
what the failed setup measured against its prediction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tttvideo.config.schema import Config
from tttvideo.errors import UserError
from tttvideo.memory.plan.costs import gpu_kind
from tttvideo.memory.plan.planner import CUDA_CONTEXT, GIB, MARGIN, Prediction, best, card_holds, plan, rank


@dataclass
class AutoFit:
    """What --auto-fit chose and what it chose among: the re-plan after an out-of-memory error starts from it."""

    chosen: Prediction
    preds: list[Prediction]
    gpu_mem: int
    gpus: int
    phase: str
    config_path: str | None

    @property
    def config(self) -> Config:
        return self.chosen.config


def this_gpu() -> tuple[str, int]:
    """(name, total bytes) of this process's CUDA GPU; a UserError without one."""
    import torch

    if not torch.cuda.is_available():
        raise UserError("--auto-fit plans for a CUDA GPU and this machine has none; drop --auto-fit (on a CPU the "
                        "memory switches do not matter), or run `tttv plan` to see what a GPU would need")
    return torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory


def auto_fit_plan(cfg: Config, phase: str, config_path: str | None, duration: str | None = None) -> AutoFit:
    """`--auto-fit`: the fastest measured setup that fits this launch's GPUs (their memory, or memory.max_gpu_gib
    when set), with the predictions it was chosen from; one sentence when none fits."""
    import logging

    from tttvideo.memory.plan.costs import known_gpus, load_costs
    from tttvideo.models.activation_offload import available_host_bytes
    from tttvideo.parallel.launch import launch_world_size, local_world_size

    log = logging.getLogger(__name__)
    gpus = launch_world_size()
    name, total = this_gpu()
    cap = cfg.memory.max_gpu_gib
    gpu_mem = int(cap * GIB) + CUDA_CONTEXT if cap > 0 else total
    kind = gpu_kind(name)
    if kind not in known_gpus():
        log.warning("--auto-fit: no measured costs for %s; using the H100's", name)
        kind = "h100"
    if duration:
        cfg.layout.duration = duration
    # this host's memory, shared by the launch's processes on it
    local = local_world_size()
    host_mem = available_host_bytes()
    if host_mem is not None and local > 1:
        # every rank plans alone and their configs must agree (they are compared at the start): a coarse figure, so
        # that ranks reading a little more or less available memory choose alike
        host_mem = host_mem // (8 * GIB) * 8 * GIB
    preds = plan(cfg, phase, gpu_mem, load_costs(kind), gpus, host_mem=host_mem,
                 processes_per_host=min(local, gpus))
    chosen = best(preds)
    if chosen is None:
        raise UserError(f"--auto-fit: no measured {phase} setup fits {gpu_mem / GIB:.1f} GiB per GPU on {gpus} "
                        f"GPU(s) at {cfg.layout.duration}; `tttv plan {config_path or 'CONFIG'} --gpu-mem "
                        f"{gpu_mem / GIB:.0f}GiB --gpus {gpus} --phase {phase}` lists the candidates")
    log.info("--auto-fit: %s (predicted peak %.1f GiB per GPU%s)", chosen.candidate.label, chosen.peak / GIB,
             "" if chosen.step_s is None else f", {chosen.step_s:.2f} s per step")
    return AutoFit(chosen, preds, gpu_mem, gpus, phase, config_path)


def auto_fit(cfg: Config, phase: str, config_path: str | None, duration: str | None = None) -> Config:
    """`--auto-fit`: `cfg` with the switches of the fastest measured setup that fits this launch's GPUs."""
    return auto_fit_plan(cfg, phase, config_path, duration).config


def replan_after_oom(fit: AutoFit, needed: int) -> tuple[AutoFit, float]:
    """The next setup after `fit.chosen` ran out of memory needing at least `needed` bytes per GPU (what was
    reserved when it failed plus the allocation that failed): every candidate's activations (and reserved memory)
    are scaled by what the failed one measured against its prediction (at least 1.1x), the failed setup is left
    out, and the fastest that still fits is chosen. Returns it and the scale; a UserError when none fits."""
    failed = fit.chosen
    predicted = max(1, failed.reserved - failed.counted.total)
    scale = max(1.1, (needed - failed.counted.total) / predicted)
    margin = MARGIN
    preds = []
    for p in fit.preds:
        if p is failed or p.candidate.label == failed.candidate.label or p.activation is None:
            continue
        activation = int(p.activation * scale)
        reserved = p.counted.total + int((p.reserved - p.counted.total) * scale)
        gpu_fits = card_holds(reserved, fit.gpu_mem, margin)
        preds.append(dataclasses.replace(p, activation=activation, reserved=reserved,
                                         fits=gpu_fits and p.host_fits is not False, gpu_fits=gpu_fits,
                                         notes=p.notes + [f"activations x{scale:.2f} after an out-of-memory error"]))
    preds.sort(key=rank)
    chosen = best(preds)
    if chosen is None:
        raise UserError(f"--auto-fit: {failed.candidate.label} ran out of memory and, with its activations measured "
                        f"{scale:.2f}x the prediction, no other setup fits {fit.gpu_mem / GIB:.1f} GiB per GPU; "
                        f"shorten layout.duration or use more GPUs")
    return AutoFit(chosen, preds, fit.gpu_mem, fit.gpus, fit.phase, fit.config_path), scale
