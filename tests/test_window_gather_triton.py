"""The Triton kernel of local attention's glue before SDPA without gradients (`tttvideo.models.triton_window_gather`)
against the PyTorch reference (`tttvideo.models.attention.gather_windows`), on CPU in the Triton interpreter
(switched on before triton is imported, so the comparison runs in a subprocess with TRITON_INTERPRET=1,
TTT_TRITON_POISON=1 and every memory access bounds-checked: tests/test_ttt_triton.py).

Also the local-attention modules without gradients (the kernel, by `attention.window_glue`), whole and window by
window as the 24-GB mode runs them, against the same module with gradients on (the reference), with one and with
three windows: CogVideoX's and Wan's. Fresh random inputs each run (the seed is in the failure message). fp32: the
kernel computes in fp32 like the reference, in another order, so they agree to ~1e-7; bound 1e-5 relative (||a-b|| /
||b||). bf16: 1e-2 (one bf16 rounding is 4e-3; the reference rounds twice).
"""

from __future__ import annotations

import os

import pytest
import torch

# B, heads, head dim, duration (windows), dtype, q/k norms
CASES = [
    (2, 3, 16, 9, "float32", True),  # three windows sharing frames, heads not a power of two
    (1, 4, 64, 3, "float32", True),  # one window: no gather
    (2, 2, 32, 9, "float32", False),  # without the q/k norms (RoPE only)
    (1, 5, 64, 9, "bfloat16", True),  # the model's dtype
]


def _case(B, H, D, duration, dtype, norms, seed):
    """Relative errors of the kernel's q, k, v windows against the reference's computed in fp32, and whether the
    kernel's outputs have the reference's shape, strides and dtype."""
    from tttvideo.layout import VideoLayout
    from tttvideo.models.attention import gather_windows, window_tensors
    from tttvideo.models.triton_window_gather import window_gather

    layout = VideoLayout.create(duration, height=32, width=48, text_tokens=5)
    index, cos, sin, _ = window_tensors(layout, D, 10000.0, torch.device("cpu"))
    n, L = index.shape[0], layout.total_tokens
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    # one [B, L, 3, H, D] buffer: q, k, v are strided views of it, as after a stacked projection
    qkv = (torch.randn(B, L, 3, H, D, generator=g) + 0.5).to(dt).unbind(2)
    affine = [1 + 0.3 * torch.randn(D, generator=g) if i % 2 == 0 else 0.3 * torch.randn(D, generator=g)
              for i in range(4)]
    norm_q, norm_k = ((affine[0], affine[1], 1e-6), (affine[2], affine[3], 1e-5)) if norms else (None, None)
    got = window_gather(*qkv, index.reshape(-1), n, cos, sin, norm_q, norm_k)
    want = gather_windows(*(t.float() for t in qkv), index.reshape(-1) if n > 1 else None, n, cos, sin, norm_q,
                          norm_k)
    ref_dtype = gather_windows(*qkv, index.reshape(-1) if n > 1 else None, n, cos, sin, norm_q, norm_k)
    alike = all(a.shape == r.shape and a.stride() == r.stride() and a.dtype == r.dtype for a, r in zip(got, ref_dtype))
    return [float((a.float() - b).norm() / b.norm()) for a, b in zip(got, want)], alike


def _sampled_against_trained(make_attention, layout_of, seed, chunked):
    """An attention module (64 wide, fp32) without gradients, whole and by `chunked(attn, x, layout)` (its
    window-by-window path of the 24-GB mode), against the same call with gradients on, at one and three windows
    (3 s, 9 s; `chunked` may return None to skip one): relative errors of the outputs."""
    errors = {}
    for duration in (3, 9):
        layout = layout_of(duration)
        torch.manual_seed(seed)
        attn = make_attention()
        with torch.no_grad():
            for norm in (attn.norm_q, attn.norm_k):
                norm.weight.normal_(1, 0.3)
                if getattr(norm, "bias", None) is not None:
                    norm.bias.normal_(0, 0.3)
        x = torch.randn(2, layout.total_tokens, 64)
        with torch.no_grad():
            sampled = attn(x, layout)
            by_window = chunked(attn, x, layout)
        trained = attn(x, layout).detach()
        errors[f"{duration}s"] = float((sampled - trained).norm() / trained.norm())
        if by_window is not None:
            errors[f"{duration}s chunked"] = float((by_window - trained).norm() / trained.norm())
    return errors


def _module_case(seed):
    """CogVideoX's LocalAttention, 4 heads of 16 (per-head LayerNorms in the kernel)."""
    from tttvideo.layout import VideoLayout
    from tttvideo.models.attention import LocalAttention

    from tttvideo.sequence.chunks import ChunkPlan

    return _sampled_against_trained(lambda: LocalAttention(64, 4, 16),
                                    lambda d: VideoLayout.create(d, height=32, width=48, text_tokens=5), seed,
                                    lambda attn, x, layout: attn.chunked_forward(x, lambda t: t, layout,
                                                                                 ChunkPlan(tokens=40)))


def _wan_module_case(seed):
    """Wan's WindowSelfAttention, 4 heads of 16 (RMSNorm over all heads before the kernel, RoPE only in it)."""
    from tttvideo.models.wan.attention import WindowSelfAttention
    from tttvideo.models.wan.layout import wan_layout

    from tttvideo.models.wan.attention import window_rope

    def one_window(attn, x, layout):  # the chunked block's call, on the one window of 3 s
        if layout.num_segments > 1:
            return None
        return attn.to_out(attn.window_forward(x, *window_rope(layout, attn.head_dim, attn.rope_theta, x.device)))

    return _sampled_against_trained(lambda: WindowSelfAttention(64, 4, eps=1e-6),
                                    lambda d: wan_layout(d, height=32, width=48), seed, one_window)


def _counting_kernel_calls(case):
    """`case`'s errors plus "kernel calls": how often the module reached the kernel (the errors alone would also be
    small if it never did)."""
    import tttvideo.models.triton_window_gather as kernel

    def run(seed):
        calls, inner = [], kernel.window_gather

        def counted(*args):
            calls.append(1)
            return inner(*args)

        kernel.window_gather = counted
        try:
            errors = case(seed)
        finally:
            kernel.window_gather = inner
        return {**errors, "kernel calls": len(calls)}

    return run


def _interpreter_main() -> None:
    """Entry point of the subprocess: TRITON_INTERPRET=1 is already in its environment."""
    from tests.test_ttt_triton import interpreter_main

    def row(value, fault):
        errors, alike = value or ([], False)
        return {"errors": errors, "alike": alike, "fault": fault}

    interpreter_main(_case, CASES, row,
                     [(_counting_kernel_calls(_module_case), 50), (_counting_kernel_calls(_wan_module_case), 60)])


@pytest.fixture(scope="module")
def interpreter_results():
    from tests.test_ttt_triton import run_in_interpreter

    return run_in_interpreter("tests.test_window_gather_triton", timeout=300)


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[f"B{c[0]}H{c[1]}D{c[2]}-{c[3]}s-{c[4]}{'' if c[5] else '-rope-only'}" for c in CASES])
def test_kernel_matches_reference(interpreter_results, index):
    seed, results = interpreter_results
    r = results[index]
    assert r["fault"] is None, f"seed {seed}, case {CASES[index]}: {r['fault']}"
    bound = 1e-5 if CASES[index][4] == "float32" else 1e-2
    assert len(r["errors"]) == 3 and all(e <= bound for e in r["errors"]), \
        f"seed {seed}, case {CASES[index]}: relative errors (q, k, v) {r['errors']} over {bound}"
    assert r["alike"], f"seed {seed}, case {CASES[index]}: shape, strides or dtype differ from the reference's"


# per module: the outputs compared, and the kernel's calls (a whole forward: one; chunked: one a window)
MODULE_CASES = {"cogvideox": ({"3s", "9s", "3s chunked", "9s chunked"}, 1 + 1 + 1 + 3),
                "wan": ({"3s", "9s", "3s chunked"}, 1 + 1 + 1)}


@pytest.mark.parametrize("offset,module", list(enumerate(MODULE_CASES)))
def test_attention_without_gradients_matches_with(interpreter_results, offset, module):
    seed, results = interpreter_results
    r = results[len(CASES) + offset]
    assert r["fault"] is None, f"seed {seed}: {r['fault']}"
    errors = dict(r["errors"])
    compared, calls = MODULE_CASES[module]
    assert errors.pop("kernel calls", 0) == calls, \
        f"seed {seed}: the kernel ran {r['errors'].get('kernel calls')} times, not {calls}"
    assert set(errors) == compared and all(e <= 1e-5 for e in errors.values()), f"seed {seed}: {r}"


def test_dispatch():
    """The kernel runs without gradients on CUDA or in the interpreter, never with gradients or off them."""
    from tttvideo.models.attention import use_window_kernel

    q = torch.zeros(1, 4, 2, 16)
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    assert not use_window_kernel(q)  # gradients on (the default)
    with torch.no_grad():
        assert use_window_kernel(q) == interpreting
        assert not use_window_kernel(torch.zeros(1, 4, 2, 24))  # head dim not a power of two
