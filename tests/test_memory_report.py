"""A real profile on CPU (host RSS + tracemalloc) around a small stack of modules, written as a complete report."""

from __future__ import annotations

import csv
import json

import pytest
import torch
import torch._dynamo  # noqa: F401  (optimizers import it on first use; under tracemalloc that import alone takes ~10 s)
from torch import nn
from torch.utils.checkpoint import checkpoint

from tttvideo.memory.profile.events import Recording
from tttvideo.memory.profile.profiler import MemoryProfiler
from tttvideo.memory.profile.report import REPORT_FILES, write_report


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x), approximate="tanh"))


HELD_HEAP = """
import torch
from tttvideo.memory.profile.backends import make_backend

big = torch.ones(6 * 2**20); del big                # a freed 24 MiB mmap raises glibc's mmap threshold to 24 MiB
freed = [torch.ones(2 * 2**20) for _ in range(60)]  # 8 MiB blocks, now on the heap
kept = freed[-1]; del freed                         # freed, the top one kept: resident, not trimmed
backend = make_backend("cpu", trace_python=False)
before = backend.read().allocated
held = [torch.ones(2 * 2**20) for _ in range(3)]
print((backend.read().allocated - before) / 2**20)
"""


def test_cpu_rss_counts_tensors_in_memory_freed_before_the_profile():
    """A process whose earlier work freed big tensors keeps that memory resident in the heap (glibc); the CPU
    backend hands it back when made, so tensors that reuse it show in RSS as new ones would. Before, 3 x 8 MiB
    allocated in such a process showed as 0 MiB, and the report test below failed when a worker had run other tests
    first (measured in a fresh process here, whose heap this test fills on purpose)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", HELD_HEAP], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.split()[-1]) >= 0.9 * 24, run.stdout


def test_cpu_profile_writes_a_complete_report(tmp_path):
    torch.manual_seed(0)
    dim, tokens, n_blocks = 256, 2048, 3
    prof = MemoryProfiler(device="cpu", meta={"phase": "train", "steps": 2})
    with prof.component("transformer") as info:
        blocks = nn.ModuleList(MLPBlock(dim) for _ in range(n_blocks))
        info["counted_bytes"] = sum(p.numel() * p.element_size() for p in blocks.parameters())
    prof.attach_block_hooks(blocks)
    opt = torch.optim.AdamW(blocks.parameters(), lr=1e-3)
    x = torch.randn(tokens, dim)
    for step in range(2):
        use_ckpt = step == 1  # the second step recomputes blocks in backward
        with prof.phase("forward", step=step):
            h = x
            for b in blocks:
                h = checkpoint(b, h, use_reentrant=False) if use_ckpt else b(h)
            loss = h.square().mean()
        with prof.phase("backward", step=step):
            loss.backward()
        if step == 0:
            prof.add_component("gradients", sum(p.grad.numel() * p.grad.element_size() for p in blocks.parameters()))
        with prof.phase("optimizer step", step=step):
            if step == 0:
                with prof.component("optimizer state"):
                    opt.step()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)

    prof.close()
    paths = write_report(prof.recording(), tmp_path / "report")
    for name in REPORT_FILES:
        assert (tmp_path / "report" / name).is_file() and (tmp_path / "report" / name).stat().st_size > 0, name

    rec = Recording.load(paths["events.json"])
    assert rec.meta["backend"]["backend"] == "cpu" and "RSS" in rec.meta["labels"]["allocated"]
    assert len(rec.timeline) > 20

    summary = json.loads(paths["summary.json"].read_text())
    assert [p["name"] for p in summary["phases"]] == ["forward", "backward", "optimizer step"]
    assert all(p["occurrences"] == 2 for p in summary["phases"])
    got = {(b["name"], b["direction"]) for b in summary["blocks"]}
    for i in range(n_blocks):
        assert (f"block {i}", "forward") in got and (f"block {i}", "backward") in got
    comps = {c["name"]: c for c in summary["components"]}
    assert set(comps) == {"transformer", "gradients", "optimizer state"}
    params = comps["transformer"]["counted"]
    assert comps["gradients"]["counted"] == params
    # Host RSS is coarse (allocator arenas, page granularity) but the forward of 2048 x 1024 fp32 hidden states
    # must show up: each block keeps at least its 8 MiB GELU input for backward.
    fwd = next(p for p in summary["phases"] if p["name"] == "forward")
    assert fwd["activation_peak"] >= n_blocks * 8 * 2**20
    assert summary["totals"]["peak_allocated"] >= summary["totals"]["final_allocated"] > 0

    md = paths["summary.md"].read_text()
    for word in ("forward", "backward", "optimizer step", "block 2", "host RSS", "Fragmentation"):
        assert word in md, word
    rows = list(csv.DictReader(paths["summary.csv"].open()))
    assert {r["section"] for r in rows} >= {"totals", "components", "phases", "blocks", "fragmentation"}
    assert any(r["section"] == "blocks" and r["name"] == "block 1" and r["detail"] == "backward" for r in rows)
    html = paths["report.html"].read_text()
    assert html.count("data:image/png;base64,") == 3 and "block 2" in html
    for png in ("timeline.png", "components.png", "blocks.png"):
        assert paths[png].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_figures_are_exact(tmp_path):
    """On CUDA the allocator counts exact bytes: a 64 MiB load is 64 MiB, and tanh(2x) on a 16 MiB input peaks at
    two 16 MiB tensors above entry and keeps one (its output, saved for backward)."""
    mib = 2**20
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    prof = MemoryProfiler(device="cuda")
    assert prof.start_snapshot()
    with prof.component("weights"):
        w = torch.empty(64 * mib // 4, device=dev)

    class Tanh2(nn.Module):
        def forward(self, x):
            return torch.tanh(x * 2)

    blocks = [Tanh2(), Tanh2()]
    prof.attach_block_hooks(blocks)
    x = torch.randn(1024, 4096, device=dev, requires_grad=True)  # 16 MiB
    with prof.phase("forward", step=0):
        h = x
        for b in blocks:
            h = b(h)
    with prof.phase("backward", step=0):
        h.sum().backward()
    prof.close()
    snap = prof.dump_snapshot(tmp_path / "snapshot.pickle")
    assert snap is not None and snap.stat().st_size > 0

    from tttvideo.memory.profile.analysis import summarize

    s = summarize(prof.recording())
    assert s.backend == "cuda"
    comps = {c.name: c for c in s.components}
    assert comps["weights"].measured == 64 * mib
    fwd = next(p for p in s.phases if p.name == "forward")
    assert fwd.activation_peak == 48 * mib and fwd.retained == 32 * mib
    blk = {(b.name, b.direction): b for b in s.blocks}
    assert blk["block 0", "forward"].activation_peak == 32 * mib and blk["block 0", "forward"].retained == 16 * mib
    assert blk["block 1", "forward"].activation_peak == 32 * mib
    assert ("block 1", "backward") in blk and ("block 0", "backward") in blk
    t = s.totals
    assert t.peak_reserved >= t.peak_allocated >= 64 * mib + 48 * mib
    assert t.outside_torch_max is not None and t.outside_torch_max > 0  # at least the CUDA context
    assert s.fragmentation.max >= 0 and s.fragmentation.alloc_retries == 0
    paths = write_report(prof.recording(), tmp_path / "report")
    assert "CUDA caching allocator" in paths["summary.md"].read_text()
    del w
