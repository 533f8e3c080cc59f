"""Host memory of Inductor's compile workers: a process forks a pool of them at its first torch.compile and keeps it
for its whole run. The planner counts it per process; the activation offload's host pool leaves room for it, since
the pool forks after the host pool is made (at the first step's first compile) and a host without that room kills
the process in the middle of a step."""

from __future__ import annotations

import os
import sys

from tttvideo.config.schema import Config
from tttvideo.memory.techniques.technique import Phase
from tttvideo.models.backbone import backbone_of

# Inductor's pool of compile workers, which a process forks at its first torch.compile and keeps (resident set,
# summed over the pool): 6.4-7.8 GiB for 16 workers (one H200 host of 16 cores: CogVideoX-5B's five stages and
# Wan2.1's 18-63 s, commits ef6808e and 6d7af6b), 12.2-12.6 GiB for 32 (a 64-core host, per rank under torchrun
# and in one process, 4847a47): a base and a share per worker.
COMPILE_POOL_BASE = int(1.7 * 2**30)
COMPILE_WORKER_BYTES = int(0.33 * 2**30)


def compile_workers() -> int:
    """How many compile workers Inductor starts in a process on this machine: TORCHINDUCTOR_COMPILE_THREADS, else
    one per core the process may run on, at most 32 (torch._inductor.config.decide_compile_threads); 1 = no pool."""
    threads = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    if threads:
        return int(threads)
    if sys.platform == "win32":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(32, cores)


def compiles_on_gpu(cfg: Config, phase: Phase) -> bool:
    """Whether a process of `phase` torch.compiles anything on the GPU: the backbone's glue
    (`BackboneSpec.compiles_glue`), the TTT glue where its Triton kernels do not run (`ttt.backend = "reference"`
    with `ttt.compile_glue`), 8-bit AdamW's update (torchao compiles it) in training."""
    if backbone_of(cfg.model.preset).compiles_glue(cfg.model):
        return True
    if cfg.model.use_ttt and cfg.ttt.backend == "reference" and cfg.ttt.compile_glue:
        return True
    return phase == "train" and cfg.train.optimizer == "adamw8bit"


def compile_pool_bytes(cfg: Config, phase: Phase) -> int:
    """Host memory of Inductor's compile workers for one process of `phase` on this machine (0 when it compiles
    nothing or runs one worker, which compiles in the process itself)."""
    workers = compile_workers()
    if workers <= 1 or not compiles_on_gpu(cfg, phase):
        return 0
    return COMPILE_POOL_BASE + workers * COMPILE_WORKER_BYTES
