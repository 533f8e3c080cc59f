"""model.compile_attention_glue on CUDA (skipped without it): local attention's q/k norms, window gather and RoPE
compiled by torch.compile against the same functions eager (the overlap merge after them eager in both), at 9 s (3
windows, 5B shapes: 48 heads of 64), bf16, forward and the gradients of q, k, v and of the norms' weights and biases
through the gather, and of the attention output through the merge; the merge against the scatter it replaced, bit
for bit; and the sampling path's window-glue kernel (`triton_window_gather`) against the references. The glue's two
versions are held to the same fp32 computation: the compiled glue's error, relative to each tensor's largest value,
must be at most 1.5x the eager glue's plus 1e-3 (bf16: the compiled version keeps the norm and RoPE in fp32 and
rounds once where eager rounds after each, so it is usually the closer of the two; a wrong fusion is off by far
more).

Run: `pytest tests/gpu/test_attention_glue_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for CUDA")


def test_compiled_glue_equals_eager_forward_and_backward():
    from tttvideo.device import compiled_on_cuda
    from tttvideo.layout import VideoLayout
    from tttvideo.models import attention

    layout = VideoLayout.create(9, 480, 720)
    index, cos, sin, inv_count = attention.window_tensors(layout, 64, 10000.0, torch.device("cuda"))
    n, flat, L = index.shape[0], index.reshape(-1), layout.total_tokens
    covers = attention.window_covers(layout, torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = [torch.randn(1, L, 48, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
    affine = [1 + 0.1 * torch.randn(64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]

    def run(compile_glue: bool, dtype: torch.dtype = torch.bfloat16):
        inputs = [t.detach().to(dtype).clone().requires_grad_() for t in qkv + affine]
        q, k, v, wq, bq, wk, bk = inputs
        q, k, v = compiled_on_cuda(attention.gather_windows, q, compile_glue)(q, k, v, flat, n, cos, sin,
                                                                             (wq, bq, 1e-6), (wk, bk, 1e-6))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        merged = attention.merge_windows(out, flat, n, inv_count, L, covers)  # eager either way: two gathers
        w = torch.randn(merged.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        (merged.float() * w).sum().backward()
        return [merged, *[t.grad for t in inputs]]

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.float() - want).abs().max() / want.abs().max()).item()

    names = ["output", "dq", "dk", "dv", "dnorm_q weight", "dnorm_q bias", "dnorm_k weight", "dnorm_k bias"]
    for name, fast, eager, exact in zip(names, run(True), run(False), run(False, torch.float32)):
        assert error(fast, exact) <= 1.5 * error(eager, exact) + 1e-3, (name, error(fast, exact), error(eager, exact))


def test_merge_equals_the_atomic_scatter_on_cuda():
    """The overlap merge's gathers against the index_add scatter it replaced, at the 5B's 9-s shapes in bf16: equal
    bit for bit, forward and gradient (a shared frame's two outputs are added once in either)."""
    from tttvideo.layout import VideoLayout
    from tttvideo.models import attention

    layout = VideoLayout.create(9, 480, 720)
    index, _, _, inv_count = attention.window_tensors(layout, 64, 10000.0, torch.device("cuda"))
    n, flat, L = index.shape[0], index.reshape(-1), layout.total_tokens
    gen = torch.Generator(device="cuda").manual_seed(2)
    out = torch.randn(n, 48, index.shape[1], 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad = torch.randn(1, L, 48 * 64, device="cuda", dtype=torch.bfloat16, generator=gen)

    scatter_merge = load_benchmark("window_merge").scatter_merge  # the merge as it was

    got = []
    for merge in (lambda o: attention.merge_windows(o, flat, n, inv_count, L, attention.window_covers(
            layout, torch.device("cuda"))), lambda o: scatter_merge(o, flat, n, inv_count, L)):
        o = out.clone().requires_grad_()
        merged = merge(o)
        merged.backward(grad)
        got.append((merged.detach(), o.grad))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


@pytest.mark.parametrize("duration", [9, 63])
def test_window_kernel_matches_the_reference(duration):
    """The window-glue Triton kernel (sampling: no gradients) against gather_windows in fp32 and compiled (9 s, whole;
    the kernel within 1.5x the compiled glue's error plus 1e-3), and at 63 s (guided batch 2, windows past 2^31
    elements) on the first and last windows, each tensor's error relative to its largest value under 1e-2."""
    from tttvideo.layout import VideoLayout
    from tttvideo.models import attention
    from tttvideo.models.triton_window_gather import window_gather

    layout = VideoLayout.create(duration, 480, 720)
    index, cos, sin, _ = attention.window_tensors(layout, 64, 10000.0, torch.device("cuda"))
    n, flat, L = index.shape[0], index.reshape(-1), layout.total_tokens
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = torch.randn(2, L, 3, 48, 64, device="cuda", dtype=torch.bfloat16, generator=gen).unbind(2)
    norms = [(1 + 0.1 * torch.randn(64, device="cuda", generator=gen), 0.1 * torch.randn(64, device="cuda",
                                                                                         generator=gen), 1e-6)
             for _ in range(2)]
    low = [tuple(t.bfloat16() if torch.is_tensor(t) else t for t in norm) for norm in norms]

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()

    with torch.no_grad():
        assert attention.use_window_kernel(q)
        got = window_gather(q, k, v, flat, n, cos, sin, *low)
        if duration == 9:
            exact = attention.gather_windows(q.float(), k.float(), v.float(), flat, n, cos, sin, *norms)
            compiled = torch.compile(attention.gather_windows)(q, k, v, flat, n, cos, sin, *low)
            for name, fast, ref, want in zip("qkv", got, compiled, exact):
                assert error(fast, want) <= 1.5 * error(ref, want) + 1e-3, (name, error(fast, want), error(ref, want))
        else:
            assert got[2].numel() > 2**31
            for w in (0, 2 * n - 1):  # sample 0's first window, sample 1's last
                b, i = divmod(w, n)
                rows = index[i]
                want = attention.gather_windows(q[b:b + 1, rows].float(), k[b:b + 1, rows].float(),
                                                v[b:b + 1, rows].float(), None, 1, cos, sin, *norms)
                for name, fast, ref in zip("qkv", got, want):
                    assert error(fast[w:w + 1], ref) < 1e-2, (w, name)


def test_wan_window_attention_takes_the_kernel():
    """Wan2.1-1.3B's windowed self-attention (12 heads of 128, 3 windows at 9 s, bf16) without gradients, where
    `window_glue` runs the kernel with RoPE only (Wan's q/k RMSNorms span all heads and run before it), against the
    same module with gradients (eager gather_windows) and in fp32: the kernel's output within 1.5x the eager
    module's error plus 1e-3, relative to the largest value."""
    import copy

    from tttvideo.models import attention
    from tttvideo.models.wan.attention import WindowSelfAttention
    from tttvideo.models.wan.layout import wan_layout

    layout = wan_layout(9)
    assert layout.num_segments == 3
    torch.manual_seed(4)
    exact = WindowSelfAttention(1536, 12, eps=1e-6).cuda()
    with torch.no_grad():
        for norm in (exact.norm_q, exact.norm_k):
            norm.weight.normal_(1, 0.1)
    attn = copy.deepcopy(exact).bfloat16()
    x = torch.randn(1, layout.total_tokens, 1536, device="cuda")
    calls = []
    kernel = attention.use_window_kernel
    attention.use_window_kernel = lambda q: calls.append(kernel(q)) or calls[-1]
    try:
        with torch.no_grad():
            got = attn(x.bfloat16(), layout).float()
        want = exact(x, layout).detach()  # with gradients: the eager glue in fp32, not the kernel
        eager = attn(x.bfloat16(), layout).detach().float()
    finally:
        attention.use_window_kernel = kernel
    assert calls == [True, False, False]
    scale = want.abs().max()
    err, ref = ((got - want).abs().max() / scale).item(), ((eager - want).abs().max() / scale).item()
    assert err <= 1.5 * ref + 1e-3, (err, ref)
