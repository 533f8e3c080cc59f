"""Device tests of the Triton TTT kernels at full size (skipped without CUDA).

B=1, H=48 heads of 64, L=18,048 tokens, bf16 inputs, checkpoint group 16: the output and every gradient against the
fp32 reference on the same (upcast) inputs, relative error ||a-b|| / ||b|| <= 2e-2. Fresh random inputs each run;
kernel outputs start as NaN (TTT_TRITON_POISON=1) so an unwritten element fails. Also a small uncovered-by-default
shape (head dim 32) to check that the kernels are right off the 64/64 path.

Run: `pytest tests/gpu/test_ttt_triton_gpu.py`, or `python tests/gpu/test_ttt_triton_gpu.py` (prints the errors).
"""

from __future__ import annotations

import os

import torch

try:
    import pytest
except ImportError:  # the device image may lack pytest: the module also runs as a script
    pytest = None

TOL = 2e-2
NAMES = ["out", "q", "k", "v", "eta", "norm_w", "norm_b", "W1", "b1", "W2", "b2"]


def make_inputs(kind, B, H, L, D, m, dtype=torch.bfloat16, seed=None, device="cuda"):
    """Inputs of the sizes the TTT layer produces: L2-normalised q/k, eta = base_lr sigmoid(.) / (D m) (scaled
    x16 so that the inner updates move the state measurably over one test), N(0, 0.02) slow weights."""
    g = torch.Generator(device=device).manual_seed(seed if seed is not None else int(torch.seed() % 2**31))
    r = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    q = torch.nn.functional.normalize(r(B, H, L, D), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(r(B, H, L, D), dim=-1).to(dtype)
    v = r(B, H, L, D).to(dtype)
    base_lr = 0.1 if kind == "mlp" else 1.0
    eta = 16 * base_lr * torch.sigmoid(r(B, H, L)) / (D * m)
    norm_w, norm_b = 1 + 0.1 * r(H, D), 0.1 * r(H, D)
    E = 4 * D if kind == "mlp" else D
    params = [0.02 * r(H, D, E), 0.01 * r(H, E)]
    if kind == "mlp":
        params += [0.02 * r(H, E, D), 0.01 * r(H, D)]
    return [t.requires_grad_() for t in (q, k, v, eta, norm_w, norm_b, *params)]


def relative_errors(kind, B=1, H=48, L=18048, D=64, m=None, group=16, seed=None):
    """Output and gradient errors of the Triton path (bf16 in) against the fp32 reference on the same inputs."""
    from tttvideo.ttt import ops
    from tttvideo.ttt.reference import ttt_linear_reference, ttt_mlp_reference

    m = m or (64 if kind == "mlp" else 16)
    ins = make_inputs(kind, B, H, L, D, m, seed=seed)
    ref_fn, fast_fn = (ttt_mlp_reference, ops.ttt_mlp) if kind == "mlp" else (ttt_linear_reference, ops.ttt_linear)
    ref_ins = [t.detach().float().requires_grad_() for t in ins]
    ref = ref_fn(*ref_ins, m, group)
    dout = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * dout).sum(), ref_ins)
    old = os.environ.get("TTT_TRITON_POISON")
    os.environ["TTT_TRITON_POISON"] = "1"
    try:
        out = fast_fn(*ins, mini_batch_size=m, checkpoint_group_size=group, backend="triton")
        grads = torch.autograd.grad((out.float() * dout).sum(), ins)
    finally:
        os.environ.pop("TTT_TRITON_POISON") if old is None else os.environ.__setitem__("TTT_TRITON_POISON", old)
    errs = {}
    for name, a, b in zip(NAMES, (out, *grads), (ref, *ref_grads)):
        a, b = a.float(), b.float()
        errs[name] = float((a - b).norm() / b.norm()) if torch.isfinite(a).all() else float("nan")
    return errs


if pytest is not None:
    pytestmark = [pytest.mark.gpu,
                  pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

    @pytest.mark.parametrize("kind", ["mlp", "linear"])
    def test_full_size_matches_fp32_reference(kind):
        errs = relative_errors(kind)
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"TTT-{kind} relative errors over {TOL}: {bad} (all: {errs})"

    @pytest.mark.parametrize("kind", ["mlp", "linear"])
    def test_small_head_dim(kind):
        errs = relative_errors(kind, B=2, H=3, L=16 * 12, D=32, m=16, group=4)
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"TTT-{kind} D=32 relative errors over {TOL}: {bad}"


    @pytest.mark.parametrize("split", [1, 2, 4])
    def test_mlp_split_over_programs(split, monkeypatch):
        # one stream's hidden dim over 1, 2 or 4 cooperating programs (triton_exchange); 2 is the default at D=64
        monkeypatch.setenv("TTT_MLP_SPLIT", str(split))
        errs = relative_errors("mlp", B=2, H=3, L=64 * 21, D=64, m=64, group=4)
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"TTT-MLP split {split}: relative errors over {TOL}: {bad}"


if __name__ == "__main__":
    for kind in ("mlp", "linear"):
        print(kind, relative_errors(kind))
