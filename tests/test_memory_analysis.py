"""The profiler's arithmetic on a scripted allocator: every figure of the summary is checked against numbers worked
out by hand from the script (base deltas, phase and block activation peaks, totals, fragmentation, OOM location).

The backend is a toy caching allocator: `allocated` moves with the script, `reserved` grows in 64 MiB segments and
never shrinks, peaks follow `reset_peak`, the driver sees reserved plus a 512 MiB context. Blocks are real
nn.Modules whose forward/backward call the allocator, so the real hook machinery is exercised.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tttvideo.memory.profile.analysis import summarize
from tttvideo.memory.profile.events import MIB, MemorySample, Recording
from tttvideo.memory.profile.profiler import MemoryProfiler

SEGMENT = 64 * MIB
CONTEXT = 512 * MIB


class ScriptedAllocator:
    name = "scripted"
    labels = {"allocated": "scripted allocated", "reserved": "scripted reserved", "unit": "scripted bytes"}

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0
        self.peak = 0
        self.peak_reserved = 0
        self.inactive_split = 0
        self.retries = 5  # counters are process-lifetime totals: the profile reports increases
        self.ooms = 1
        self.clock = 0.0
        self.fail_at: str | None = None

    def alloc(self, mib: int) -> None:
        self.allocated += mib * MIB
        if self.allocated > self.reserved:
            self.reserved = math.ceil(self.allocated / SEGMENT) * SEGMENT
        self.peak = max(self.peak, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, mib: int) -> None:
        self.allocated -= mib * MIB

    def read(self) -> MemorySample:
        self.clock += 1.0
        return MemorySample(t=self.clock, allocated=self.allocated, reserved=self.reserved,
                            peak_allocated=self.peak, peak_reserved=self.peak_reserved,
                            inactive_split=self.inactive_split, alloc_retries=self.retries, num_ooms=self.ooms,
                            driver_used=self.reserved + CONTEXT, driver_total=80 * 1024 * MIB)

    def reset_peak(self) -> None:
        self.peak = self.allocated
        self.peak_reserved = self.reserved

    def synchronize(self) -> None:
        pass

    def describe(self) -> dict[str, object]:
        return {"backend": self.name, "device": "script"}

    def close(self) -> None:
        pass


class ScriptedBlock(nn.Module):
    """Forward keeps `keep` MiB for backward and uses `tmp` MiB transiently; backward uses `bwd_tmp` MiB, then frees
    its transient and the kept activations."""

    def __init__(self, alloc: ScriptedAllocator, name: str, keep: int, tmp: int, bwd_tmp: int) -> None:
        super().__init__()
        self.alloc, self.name, self.keep, self.tmp, self.bwd_tmp = alloc, name, keep, tmp, bwd_tmp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scripted.apply(x, self)


class _Scripted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, blk):  # type: ignore[override]
        ctx.blk = blk
        blk.alloc.alloc(blk.keep + blk.tmp)
        blk.alloc.free(blk.tmp)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        blk = ctx.blk
        if blk.alloc.fail_at == blk.name:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (scripted)")
        blk.alloc.alloc(blk.bwd_tmp)
        blk.alloc.free(blk.bwd_tmp + blk.keep)
        return g, None


def run_script(alloc: ScriptedAllocator) -> MemoryProfiler:
    prof = MemoryProfiler(alloc)
    with prof.component("text encoder"):
        alloc.alloc(100 + 30)  # weights plus a 30 MiB staging buffer
        alloc.free(30)
    with prof.component("transformer"):
        alloc.alloc(200)
    blocks = [ScriptedBlock(alloc, "b0", keep=40, tmp=60, bwd_tmp=50),
              ScriptedBlock(alloc, "b1", keep=40, tmp=60, bwd_tmp=50),
              ScriptedBlock(alloc, "b2", keep=80, tmp=60, bwd_tmp=90)]
    prof.attach_block_hooks(blocks)
    x = torch.zeros(1, requires_grad=True)
    with prof.phase("forward", step=0):  # entry 300
        h = x
        for b in blocks:
            h = b(h)  # b0: 400 peak -> 340; b1: 440 -> 380; b2: 520 -> 460
    prof.mark("after forward")
    with prof.phase("backward", step=0):  # entry 460
        h.sum().backward()  # b2: 550 -> 380; b1: 430 -> 340; b0: 390 -> 300
        alloc.alloc(200)  # gradients of the transformer: 500
        alloc.inactive_split = 30 * MIB
    prof.add_component("gradients", counted_bytes=200 * MIB)
    with prof.phase("optimizer step", step=0):  # entry 500
        with prof.component("optimizer state"):
            alloc.alloc(400 + 100)  # Adam moments plus a transient: 1000 peak, reserved 1024
            alloc.free(100)  # 900
            alloc.retries += 2
        alloc.inactive_split = 12 * MIB
    return prof


def test_scripted_trace_arithmetic(tmp_path):
    alloc = ScriptedAllocator()
    prof = run_script(alloc)
    s = summarize(prof.recording())
    m = MIB

    comps = {c.name: c for c in s.components}
    assert list(comps) == ["text encoder", "transformer", "gradients", "optimizer state"]
    assert comps["text encoder"].measured == 100 * m and comps["text encoder"].load_peak == 130 * m
    assert comps["transformer"].measured == 200 * m and comps["transformer"].load_peak == 200 * m
    assert comps["gradients"].measured == 0 and comps["gradients"].counted == 200 * m
    assert comps["optimizer state"].measured == 400 * m and comps["optimizer state"].load_peak == 500 * m

    ph = {p.name: p for p in s.phases}
    assert [p.name for p in s.phases] == ["forward", "backward", "optimizer step"]
    # The block hooks reset the peak three times inside forward; the phase still sees block 2's 520 MiB.
    assert (ph["forward"].entry, ph["forward"].peak_allocated) == (300 * m, 520 * m)
    assert ph["forward"].activation_peak == 220 * m and ph["forward"].retained == 160 * m
    assert ph["backward"].activation_peak == 90 * m and ph["backward"].retained == 40 * m
    assert ph["optimizer step"].activation_peak == 500 * m and ph["optimizer step"].retained == 400 * m
    assert ph["optimizer step"].peak_reserved == 1024 * m
    assert all(p.occurrences == 1 and p.peak_step == 0 for p in s.phases)

    blk = {(b.name, b.direction): b for b in s.blocks}
    assert [(b.name, b.direction) for b in s.blocks] == [
        ("block 0", "forward"), ("block 0", "backward"), ("block 1", "forward"), ("block 1", "backward"),
        ("block 2", "forward"), ("block 2", "backward")]
    assert blk["block 0", "forward"].activation_peak == 100 * m and blk["block 0", "forward"].retained == 40 * m
    assert blk["block 2", "forward"].activation_peak == 140 * m and blk["block 2", "forward"].retained == 80 * m
    assert blk["block 2", "backward"].activation_peak == 90 * m and blk["block 2", "backward"].retained == -80 * m
    assert blk["block 1", "backward"].activation_peak == 50 * m and blk["block 0", "backward"].retained == -40 * m

    assert s.marks["after forward"] == 460 * m
    t = s.totals
    assert (t.peak_allocated, t.peak_reserved) == (1000 * m, 1024 * m)
    assert (t.final_allocated, t.final_reserved) == (900 * m, 1024 * m)
    assert t.base_total == 700 * m  # 100 + 200 + 0 (gradients only counted) + 400
    assert t.outside_torch_final == CONTEXT and t.outside_torch_max == CONTEXT
    assert t.driver_peak == 1024 * m + CONTEXT

    f = s.fragmentation
    assert f.at_peak == 24 * m  # 1024 MiB peak reserved - 1000 MiB peak allocated
    frags = [x.reserved - x.allocated for x in prof.timeline]
    assert f.max == max(frags) and f.mean == pytest.approx(sum(frags) / len(frags))
    assert f.std == pytest.approx(math.sqrt(sum((v - f.mean) ** 2 for v in frags) / len(frags)))
    assert (f.inactive_split_max, f.inactive_split_final) == (30 * m, 12 * m)
    assert (f.alloc_retries, f.num_ooms) == (2, 0)
    assert s.status == "ok" and s.oom is None

    # A saved recording gives the same summary as the live one.
    path = prof.save(tmp_path / "events.json")
    assert summarize(Recording.load(path)).to_dict() == s.to_dict()


def test_oom_location_text():
    alloc = ScriptedAllocator()
    alloc.fail_at = "b1"
    prof = MemoryProfiler(alloc)
    blocks = [ScriptedBlock(alloc, f"b{i}", keep=10, tmp=10, bwd_tmp=10) for i in range(3)]
    prof.attach_block_hooks(blocks)
    x = torch.zeros(1, requires_grad=True)
    with prof.phase("forward", step=3):
        h = x
        for b in blocks:
            h = b(h)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with prof.phase("backward", step=3):
            h.sum().backward()
    assert prof.oom is not None
    assert prof.oom["location"] == "backward of block 1" and prof.oom["step"] == 3
    assert "Tried to allocate" in prof.oom["error"]
    s = summarize(prof.recording())
    assert s.status == "oom" and s.oom["location"] == "backward of block 1"
    # The backward phase was still closed (by its context manager) and block 2's backward completed before.
    assert [p.name for p in s.phases] == ["forward", "backward"]
    assert ("block 2", "backward") in {(b.name, b.direction) for b in s.blocks}
    assert ("block 1", "backward") not in {(b.name, b.direction) for b in s.blocks}


def test_disabled_profiler_is_a_no_op():
    prof = MemoryProfiler.disabled()
    with prof.component("x") as info:
        info["counted_bytes"] = 1
    with prof.phase("forward"):
        pass
    prof.attach_block_hooks([nn.Linear(2, 2)])
    assert prof.mark("m") is None and prof.events == [] and prof.timeline == []


def test_trace_sums_device_time_by_kind_of_kernel(tmp_path):
    """Kernel names as a Hopper trace of our step shows them, sorted into kinds; the shares add up to one, and the
    markdown table leads the operator lists."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from tttvideo.memory.profile.trace import OTHER_KIND, kernel_kind, top_operators, write_top

    kernels = {
        "_mlp_fwd_kernel": 4.0, "_reverse_kernel": 3.0, "_scan_inputs_fwd_kernel": 0.5,
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": 2.0,
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": 1.0,
        "nvjet_tst_192x192_64x3_2x1_v_bz_coopB_NNT": 2.5, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n": 0.5,
        "triton_poi_fused_add_mul_0": 0.7, "void at::native::vectorized_layer_norm_kernel<c10::BFloat16>": 0.4,
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::OpaqueType<2u>>": 0.3,
        "ncclDevKernel_AllGather_RING_LL": 0.6,
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": 0.2,
    }
    # CPU-side operators report the device time of the kernels they launched: counting them too would count twice
    launchers = {"aten::_cudnn_attention_forward": 2.0, "aten::matmul": 3.0, "TTTMLPFunctionBackward": 3.0}
    averages = [SimpleNamespace(key=k, count=1, self_device_time_total=ms * 1e3, self_cpu_time_total=0.0,
                                self_device_memory_usage=0, device_type=DeviceType.CUDA) for k, ms in kernels.items()]
    averages += [SimpleNamespace(key=k, count=1, self_device_time_total=ms * 1e3, self_cpu_time_total=0.0,
                                 self_device_memory_usage=0, device_type=DeviceType.CPU) for k, ms in launchers.items()]
    # ranges on the device's timeline (torch.compile's graph calls, Inductor's per-kernel ranges) span kernels too
    annotations = {"## Call CompiledFxGraph fe57jryowbm7 ##": 0.7, "triton_poi_fused_add_mul_0": 0.7}
    averages += [SimpleNamespace(key=k, count=1, self_device_time_total=ms * 1e3, self_cpu_time_total=0.0,
                                 self_device_memory_usage=0, device_type=DeviceType.CUDA, is_user_annotation=True)
                 for k, ms in annotations.items()]
    averages.append(SimpleNamespace(key="## Call CompiledFxGraph ab12 ##", count=1, self_device_time_total=5e2,
                                    self_cpu_time_total=0.0, self_device_memory_usage=0, device_type=DeviceType.CUDA))
    top = top_operators(averages, on_cuda=True)
    kinds = {k["kind"]: k["self_time_ms"] for k in top["by_kind"]}
    assert kinds == pytest.approx({"TTT scan (Triton)": 7.0, "TTT glue (Triton)": 0.5, "attention": 3.0,
                                   "matrix products": 3.0, "compiled glue (Inductor)": 0.7, "norms": 0.4,
                                   "copies, gathers, concatenation": 0.3, "collectives (NCCL)": 0.6,
                                   OTHER_KIND: 0.2})
    assert [k["kind"] for k in top["by_kind"]][0] == "TTT scan (Triton)"
    assert sum(k["share"] for k in top["by_kind"]) == pytest.approx(1.0)
    assert kernel_kind("fmha_cutlassF_bf16") == "attention"  # attention before the cutlass GEMMs
    write_top(top, tmp_path)
    md = (tmp_path / "trace_top.md").read_text()
    assert md.index("Device time by kind of kernel (15.7 ms in all)") < md.index("## by own device time")
    assert "| TTT scan (Triton) | 7.0 | 44.6 % |" in md
    assert top_operators(averages, on_cuda=False)["by_kind"] == []
