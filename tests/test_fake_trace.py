"""The memory trace of a block unit on the CPU (tttvideo.memory.trace: live_bytes, gpu_stand_ins, fake_trace):
live bytes equal a hand count, on real and on fake tensors; the fake trace of a Wan unit equals the same trace on
real tensors; the CPU emulation of CUDA autocast gives a Wan block the dtypes CUDA autocast gives it, op by op; a
forward without gradients takes the sampling glue kernels' wrappers, unlaunched."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tttvideo.config.loader import load_config
from tttvideo.memory.trace.fake_trace import format_trace, main, trace_unit
from tttvideo.memory.trace.gpu_stand_ins import cuda_autocast_policy
from tttvideo.memory.trace.live_bytes import LiveBytes

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["model.preset=wan-tiny", "model.dtype=fp32", "train.precision=bf16", "layout.duration=6s",
        "layout.height=64", "layout.width=64", "ttt.mini_batch_size=16", "ttt.backend=auto", "model.adapter=qkvo",
        "checkpointing.block=true", "checkpointing.attention=true", "checkpointing.forward_ttt=true",
        "checkpointing.reverse_ttt=true", "checkpointing.mlp=true"]


def tiny(*extra: str):
    return load_config("configs/wan2.1-1.3b/demo-tiny.toml", TINY + list(extra))


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_live_bytes_hand_count(fake):
    """x @ w then sin: forward keeps x (saved by mm), the product (saved by sin) and the output; backward adds the
    scalar loss and its gradient, cos of the product and the product's gradient, then w's gradient replaces them."""
    n = 300 * 200 * 4
    with FakeTensorMode() if fake else torch.device("cpu"):
        w = torch.randn(200, 200, requires_grad=True) if not fake else torch.empty(200, 200, requires_grad=True)
        with LiveBytes() as live:
            x = torch.ones(300, 200)
            y = (x @ w).sin()
            del x
            assert live.current == 3 * n  # x (saved by mm though deleted here), x @ w, sin
            y.sum().backward()
            peak = live.peak
            del y
            after = live.current
    assert peak == 3 * n + 2 * n + 4 + 4  # + cos(x @ w), its product with the gradient, two scalars
    assert after == 200 * 200 * 4  # w.grad
    assert w.grad is not None


def test_fake_trace_equals_real_trace():
    """The fake trace of a tiny Wan unit (two segments, sub-block checkpointing, FFN chunks) allocates exactly what
    the same unit does on real CPU tensors, phase by phase; the table names the phases."""
    cfg = tiny("checkpointing.ffn_chunk_tokens=40")
    real, fake = trace_unit(cfg, fake=False), trace_unit(cfg, fake=True)
    assert [p.phase for p in fake.phases] == ["forward", "backward"]
    for r, f in zip(real.phases, fake.phases):
        assert f.peak == r.peak > 0
        assert sum(p.nbytes for p in f.parts) == f.peak
    assert "backward: peak" in format_trace(fake)


def test_attention_by_window_lowers_the_traced_peak():
    """With one window at a time, the forward peak of a two-segment unit without TTT layers (attention's is then the
    largest working set) drops: the whole video's q/k, their fp32 norms and RoPE are no longer made at once."""
    plain = trace_unit(tiny("model.use_ttt=false"), fake=True).phases[0].peak
    windowed = trace_unit(tiny("model.use_ttt=false", "checkpointing.attention_by_window=true"), fake=True)
    assert windowed.phases[0].peak < 0.8 * plain


def _op_dtypes(device: str) -> dict[str, torch.dtype]:
    """Output dtypes of the operators a Wan block calls under autocast, on fake `device` tensors (no grad: autograd
    cannot touch fake CUDA tensors on a CPU-only build)."""
    F = torch.nn.functional
    a = torch.empty(4, 8, device=device)
    w = torch.empty(8, 8, device=device)
    h = a.bfloat16()
    one = torch.ones(8, device=device)
    return {
        "linear": F.linear(a, w).dtype,
        "layer_norm": F.layer_norm(h, (8,)).dtype,
        "layer_norm affine": F.layer_norm(h, (8,), one, one).dtype,
        "rms_norm": F.rms_norm(h, (8,), weight=one).dtype,
        "softmax": torch.softmax(h, -1).dtype,
        "gelu": F.gelu(h, approximate="tanh").dtype,
        "sigmoid": torch.sigmoid(h).dtype,
        "addcmul": torch.addcmul(a, h, a).dtype,
        "mul": (h * a).dtype,
        "conv3d": F.conv3d(torch.empty(1, 2, 2, 2, 2, device=device), torch.empty(3, 2, 1, 1, 1, device=device)).dtype,
    }


def test_cpu_emulation_has_cuda_autocast_dtypes():
    """The operators' dtypes on CPU under `cuda_autocast_policy` are those of fake CUDA tensors under CUDA autocast
    (switched on below torch.autocast's availability check: this CPU build has no CUDA); plain CPU autocast keeps
    the norms in bf16, so the check can fail."""
    with FakeTensorMode(), torch.no_grad():
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        torch.autocast_increment_nesting()
        try:
            cuda = _op_dtypes("cuda")
        finally:
            torch.autocast_decrement_nesting()
            torch.set_autocast_enabled("cuda", False)
        with torch.autocast("cpu", torch.bfloat16):
            plain = _op_dtypes("cpu")
            with cuda_autocast_policy():
                emulated = _op_dtypes("cpu")
            after = _op_dtypes("cpu")
    assert cuda["rms_norm"] == torch.float32 and cuda["linear"] == torch.bfloat16
    assert emulated == cuda
    assert plain != cuda and after == plain  # the policy is gone on leaving


def test_cli_error_is_one_sentence(capsys):
    assert main(["configs/cogvideox-5b/24gb-3s.toml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fake_trace: error:") and "Wan" in err


def test_planner_takes_the_traced_working_sets():
    """`tttv plan --trace`: the block model's backward phases carry the traced backward working set (the unit's
    peak less its input, which the saved inputs count), the end of forward the traced forward one."""
    from tttvideo.memory.plan.activations import BlockConstants, train_peak
    from tttvideo.memory.plan.count import Counted
    from tttvideo.memory.plan.traced import HOW, traced_working_sets

    cfg = tiny("checkpointing.attention_by_window=true")
    trace = trace_unit(cfg)
    forward, backward = traced_working_sets(cfg)
    assert sum(p.nbytes for p in forward) == trace.working_set("forward")[0] == trace.phases[0].peak - \
        trace.input_bytes
    assert sum(p.nbytes for p in backward) == trace.phases[1].peak - trace.input_bytes > 0
    k = BlockConstants(stream_copies=9.5, saved_extra_per_token=296.0, reserved_fraction=0.07,
                       offload_reserved_units=2.5)
    nothing = Counted(weights=0, gradients=0, optimizer=0, trainable_params=0, block_weights=0)
    b = train_peak(cfg, nothing, k, traced=(forward, backward))
    traced = [p for p in b.parts if p.how == HOW]
    assert traced == (forward if b.phase == "end of forward" else backward)
    assert any("traced" in n for n in b.notes)


def test_sampling_forward_takes_the_glue_kernels_without_launching(monkeypatch):
    """Under `cuda_like` without gradients, the TTT layer's post-norm and local attention's window glue take their
    Triton wrappers (what a GPU runs when sampling), with no kernel launched: the outputs have the shapes the
    references give, and each wrapper runs once per pass."""
    from tttvideo.config.schema import TTTConfig
    from tttvideo.layout import VideoLayout
    from tttvideo.memory.trace.gpu_stand_ins import cuda_like
    from tttvideo.models import triton_window_gather
    from tttvideo.models.attention import LocalAttention
    from tttvideo.ttt import triton_post_norm
    from tttvideo.ttt.layer import BidirectionalTTT

    calls = []
    for module, name in ((triton_post_norm, "post_norm_rows_forward"), (triton_window_gather, "window_gather")):
        wrapped = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=wrapped, _n=name: calls.append(_n) or _f(*a))
    lay = VideoLayout.create("9s", height=32, width=48, text_tokens=5, mini_batch_size=16)
    x = torch.randn(2, lay.total_tokens, 64)
    ttt = BidirectionalTTT(64, 4, TTTConfig(kind="mlp", scan_checkpoint_group_size=0))
    attn = LocalAttention(64, 4, 16)
    with cuda_like(), torch.no_grad():
        assert ttt(x, lay).shape == x.shape and attn(x, lay).shape == x.shape
    assert calls == ["post_norm_rows_forward"] * 2 + ["window_gather"]
