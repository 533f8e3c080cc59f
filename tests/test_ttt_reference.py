"""The reference TTT scan against a naive autograd version, checkpointing and padding invariance."""

from __future__ import annotations

import pytest
import torch

from tests.ttt_naive import naive_ttt
from tttvideo.ttt.reference import ttt_linear_reference, ttt_mlp_reference


def make_inputs(kind, B=2, H=3, L=48, D=16, dtype=torch.float64, seed=None, eta_scale=1.0):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    q = torch.nn.functional.normalize(r(B, H, L, D), dim=-1)
    k = torch.nn.functional.normalize(r(B, H, L, D), dim=-1)
    v = r(B, H, L, D)
    # learning rates of the size the layer produces (sigmoid * base_lr / D / b) scaled up so updates matter
    eta = torch.rand(B, H, L, generator=g, dtype=dtype) * eta_scale
    norm_w = 1 + 0.1 * r(H, D)
    norm_b = 0.1 * r(H, D)
    E = 4 * D if kind == "mlp" else D
    params = [0.3 * r(H, D, E), 0.1 * r(H, E)]
    if kind == "mlp":
        params += [0.3 * r(H, E, D), 0.1 * r(H, D)]
    tensors = [q, k, v, eta, norm_w, norm_b, *params]
    return [t.requires_grad_() for t in tensors]


def run_reference(kind, tensors, mini_batch_size, group=0):
    fn = ttt_mlp_reference if kind == "mlp" else ttt_linear_reference
    return fn(*tensors, mini_batch_size=mini_batch_size, checkpoint_group_size=group)


def grads_of(out, tensors, seed=0):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * w).sum(), tensors)


NAMES = ["q", "k", "v", "eta", "norm_w", "norm_b", "W1", "b1", "W2", "b2"]


@pytest.mark.parametrize("kind,mb", [("mlp", 16), ("mlp", 7), ("linear", 16), ("linear", 5)])
def test_reference_matches_naive_autograd_float64(kind, mb):
    tensors = make_inputs(kind, L=mb * 3)
    ref = run_reference(kind, tensors, mb)
    naive = naive_ttt(*tensors[:6], tensors[6:], mb, kind)
    torch.testing.assert_close(ref, naive, rtol=1e-9, atol=1e-10)
    for name, a, b in zip(NAMES, grads_of(ref, tensors), grads_of(naive, tensors)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"gradient w.r.t. {name}")


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_reference_fp32_state_for_bf16_inputs(kind):
    tensors = [t.detach() for t in make_inputs(kind, L=32, dtype=torch.float32)]
    exact = run_reference(kind, [t.double() for t in tensors], 16)
    low = list(tensors)
    for i in range(3):  # q, k, v arrive in bf16 as in the model
        low[i] = tensors[i].bfloat16()
    out = run_reference(kind, low, 16)
    assert out.dtype == torch.bfloat16
    rel = (out.double() - exact).norm() / exact.norm()
    assert rel < 2e-2, rel


def test_updates_change_the_output():
    """Guard against a scan that silently skips its inner steps: eta = 0 must differ from eta > 0."""
    tensors = make_inputs("mlp", L=32)
    with_updates = run_reference("mlp", tensors, 16)
    frozen = list(tensors)
    frozen[3] = torch.zeros_like(tensors[3])
    without = run_reference("mlp", frozen, 16)
    assert (with_updates - without).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_checkpointed_scan_equals_plain_scan(kind):
    tensors = make_inputs(kind, L=16 * 5, dtype=torch.float32)
    plain = run_reference(kind, tensors, 16, group=0)
    plain_grads = grads_of(plain, tensors)
    for group in (1, 2, 3, 5, 8):
        ckpt = run_reference(kind, tensors, 16, group=group)
        torch.testing.assert_close(ckpt, plain, rtol=1e-6, atol=1e-6)
        for name, a, b in zip(NAMES, grads_of(ckpt, tensors), plain_grads):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"group {group}: gradient w.r.t. {name}")


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_padding_leaves_real_tokens_unchanged(kind):
    """Real length 37 with mini-batch 16: padded to 48 (and to 64), padded tokens carry eta = 0 and random content.
    Real outputs and every gradient equal the naive scan that processes the short last mini-batch as it is."""
    mb, real = 16, 37
    tensors = make_inputs(kind, L=real)
    naive = naive_ttt(*tensors[:6], tensors[6:], mb, kind)
    naive_grads = grads_of(naive, tensors)
    for total in (48, 64):
        pad = total - real
        q, k, v, eta = tensors[:4]
        junk = [torch.randn(q.shape[0], q.shape[1], pad, q.shape[3], dtype=q.dtype) for _ in range(3)]
        padded = [torch.cat([t, j], dim=2) for t, j in zip((q, k, v), junk)]
        padded.append(torch.cat([eta, torch.zeros(*eta.shape[:2], pad, dtype=eta.dtype)], dim=2))
        out = run_reference(kind, padded + tensors[4:], mb)[:, :, :real]
        torch.testing.assert_close(out, naive, rtol=1e-9, atol=1e-10)
        for name, a, b in zip(NAMES, grads_of(out, tensors), naive_grads):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"pad to {total}: gradient w.r.t. {name}")


def test_rejects_unpadded_length():
    tensors = make_inputs("mlp", L=20)
    with pytest.raises(ValueError, match="multiple of the mini-batch"):
        run_reference("mlp", tensors, 16)


def test_scan_inputs_are_not_pinned_under_an_outer_checkpoint():
    """Under an enclosing activation checkpoint (a checkpointed block) the scan must keep nothing of the sequence
    alive after forward: its checkpoint groups take their inputs as arguments, which the outer checkpoint drops.
    A closure over the inputs would pin the fp32 copies of q/k/v (seen on the GPU as +1.5 GiB per 5B block)."""
    import gc

    from torch.utils.checkpoint import checkpoint

    tensors = make_inputs("mlp", B=1, H=2, L=64, D=16, dtype=torch.bfloat16)

    def fn(*ts):
        return run_reference("mlp", list(ts), 16, group=2)

    def live_tensors():
        gc.collect()
        return {id(o): o for o in gc.get_objects() if isinstance(o, torch.Tensor)}

    before = live_tensors()
    out = checkpoint(fn, *tensors, use_reentrant=False)
    big = tensors[0].numel()
    pinned = [  # fp32 tensors of sequence size created by the call and still alive (the output aside)
        o for key, o in live_tensors().items()
        if key not in before and o is not out and o.dtype == torch.float32 and o.numel() >= big
    ]
    assert not pinned, [tuple(p.shape) for p in pinned]
    out.float().sum().backward()  # and the recomputation still works
    assert tensors[0].grad is not None and torch.isfinite(tensors[0].grad.float()).all()


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_operand_dtype_of_the_inputs_changes_nothing(kind):
    """The rounded-operand path with the inputs' own dtype is the plain scan: its hand-written matmul backward is
    the true gradient."""
    tensors = make_inputs(kind, L=16 * 3)
    plain = run_reference(kind, tensors, 16)
    fn = ttt_mlp_reference if kind == "mlp" else ttt_linear_reference
    same = fn(*tensors, mini_batch_size=16, checkpoint_group_size=2, operand_dtype=torch.float64)
    torch.testing.assert_close(same, plain, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(NAMES, grads_of(same, tensors), grads_of(plain, tensors)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"gradient w.r.t. {name}")


def test_rounded_operand_matmul_rounds_every_operand():
    from tttvideo.ttt.reference import _rounded_matmul

    g = torch.Generator().manual_seed(0)
    a, b, up = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((5, 7), (7, 3), (5, 3)))
    a.requires_grad_(), b.requires_grad_()
    r = lambda x: x.to(torch.bfloat16).double()  # noqa: E731
    out = _rounded_matmul(torch.bfloat16)(a, b)
    da, db = torch.autograd.grad(out, (a, b), up)
    torch.testing.assert_close(out, r(a) @ r(b), rtol=0, atol=1e-14)
    torch.testing.assert_close(da, r(up) @ r(b).T, rtol=0, atol=1e-14)
    torch.testing.assert_close(db, r(a).T @ r(up), rtol=0, atol=1e-14)
    assert (out - a.detach() @ b.detach()).abs().max() > 1e-4  # it did round
