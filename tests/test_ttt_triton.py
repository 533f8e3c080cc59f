"""Triton TTT kernels (TTT-MLP, TTT-Linear) against the reference, on CPU through the Triton interpreter.

The interpreter must be switched on before triton is imported, so the kernel checks run in one subprocess with
TRITON_INTERPRET=1 (and TTT_TRITON_POISON=1: every kernel output starts as NaN, so an unwritten element fails).
Sizes are tiny (head dim 16, mini-batch 16, a few mini-batches): the interpreter runs each program in numpy.
Inputs are fresh random draws each run (the seed is printed on failure). fp32 everywhere, so the kernels use
full-precision products and must match the reference to ~1e-6; the bound is 1e-4 relative (||a-b|| / ||b||).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from tttvideo.ttt import ops
from tttvideo.ttt.reference import ttt_linear_reference, ttt_mlp_reference

TOL = 1e-4
NAMES = ["out", "q", "k", "v", "eta", "norm_w", "norm_b", "W1", "b1", "W2", "b2"]
# kind, B, H, D, mini-batch, mini-batches, checkpoint group
CASES = [
    ("mlp", 1, 2, 16, 16, 4, 2),  # two full groups
    ("mlp", 2, 1, 16, 16, 5, 2),  # batch 2 (slow-weight gradients sum over it), a partial last group
    ("mlp", 1, 1, 16, 16, 3, 0),  # no checkpointing: one group
    ("mlp", 1, 1, 16, 16, 1, 2),  # one mini-batch: the forward's output path has no step before it
    ("mlp", 1, 1, 16, 16, 9, 2),  # five groups: the backward's scratch sets rotate (three and two of them)
    ("linear", 2, 2, 16, 16, 5, 2),
    ("linear", 1, 1, 32, 16, 3, 0),
]


def _inputs(kind, B, H, D, m, n, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    L = m * n
    q = torch.nn.functional.normalize(r(B, H, L, D), dim=-1)
    k = torch.nn.functional.normalize(r(B, H, L, D), dim=-1)
    v = r(B, H, L, D)
    eta = torch.rand(B, H, L, generator=g) * 0.5
    eta[..., -m // 2:] = 0  # padded tokens carry eta = 0
    norm_w, norm_b = 1 + 0.2 * r(H, D), 0.2 * r(H, D)
    E = 4 * D if kind == "mlp" else D
    params = [0.2 * r(H, D, E), 0.1 * r(H, E)]
    if kind == "mlp":
        params += [0.2 * r(H, E, D), 0.1 * r(H, D)]
    return [t.requires_grad_() for t in (q, k, v, eta, norm_w, norm_b, *params)]


def _errors(kind, B, H, D, m, n, group, seed):
    """Relative error of the Triton output and every gradient against the reference (dispatch through ops)."""
    ins = _inputs(kind, B, H, D, m, n, seed)
    ref_fn, fast_fn = (ttt_mlp_reference, ops.ttt_mlp) if kind == "mlp" else (ttt_linear_reference, ops.ttt_linear)
    ref = ref_fn(*ins, m, group)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1))
    ref_grads = torch.autograd.grad((ref * dout).sum(), ins)
    out = fast_fn(*ins, mini_batch_size=m, checkpoint_group_size=group, backend="triton")
    grads = torch.autograd.grad((out * dout).sum(), ins)
    errs = {}
    for name, a, b in zip(NAMES, (out, *grads), (ref, *ref_grads)):
        errs[name] = float((a - b).norm() / b.norm()) if torch.isfinite(a).all() else float("nan")
    return errs


def _interpreter_main() -> None:
    """Entry point of the subprocess: TRITON_INTERPRET=1 is already in its environment."""
    seed = int(sys.argv[1])
    results = [{"case": list(c), "errors": _errors(*c, seed + 10 * i)} for i, c in enumerate(CASES)]
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results():
    pytest.importorskip("triton")
    seed = int(torch.randint(0, 2**30, ()).item())
    env = dict(os.environ, TRITON_INTERPRET="1", TTT_TRITON_POISON="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", f"import tests.test_ttt_triton as t, sys; sys.argv = ['x', '{seed}']; "
                               "t._interpreter_main()"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"interpreter run failed (seed {seed}):\n{proc.stdout}\n{proc.stderr}"
    return seed, json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c[0]}-B{c[1]}H{c[2]}D{c[3]}n{c[5]}g{c[6]}" for c in CASES])
def test_kernel_matches_reference(interpreter_results, index):
    seed, results = interpreter_results
    errors = results[index]["errors"]
    names = NAMES if CASES[index][0] == "mlp" else NAMES[:-2]
    assert set(errors) == set(names)
    bad = {k: v for k, v in errors.items() if not v <= TOL}  # NaN fails too: an unwritten (poisoned) element
    assert not bad, f"seed {seed}, case {CASES[index]}: relative errors over {TOL}: {bad}"


def test_auto_on_cpu_is_the_reference(caplog):
    ins = _inputs("mlp", 1, 2, 16, 16, 2, seed=3)
    with caplog.at_level(logging.INFO, logger="tttvideo.ttt.ops"):
        out = ops.ttt_mlp(*ins, mini_batch_size=16, checkpoint_group_size=1, backend="auto")
    assert torch.equal(out, ttt_mlp_reference(*ins, 16, 1))
    assert not caplog.records  # CPU is the reference's home: nothing to report


def test_reference_backend_is_the_reference():
    ins = _inputs("linear", 1, 2, 16, 16, 2, seed=4)
    out = ops.ttt_linear(*ins, mini_batch_size=16, checkpoint_group_size=0, backend="reference")
    assert torch.equal(out, ttt_linear_reference(*ins, 16, 0))


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ins = _inputs("mlp", 1, 1, 16, 16, 1, seed=5)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        ops.ttt_mlp(*ins, mini_batch_size=16, backend="triton")


def test_unknown_backend_raises():
    ins = _inputs("linear", 1, 1, 16, 16, 1, seed=6)
    with pytest.raises(ValueError, match="unknown TTT backend"):
        ops.ttt_linear(*ins, mini_batch_size=16, backend="cuda")


@pytest.mark.parametrize(
    "kind, D, hidden, m, L, expect",
    [
        ("mlp", 64, 256, 64, 128, None),
        ("linear", 64, 64, 16, 64, None),
        ("mlp", 48, 192, 64, 128, "head dim 48"),
        ("mlp", 64, 256, 8, 64, "mini-batch 8"),
        ("mlp", 64, 256, 64, 100, "not a multiple"),
        ("mlp", 64, 384, 64, 128, "hidden size 384"),
        ("linear", 64, 32, 16, 64, "not square"),
    ],
)
def test_uncovered_reason(kind, D, hidden, m, L, expect):
    reason = ops.uncovered_reason(kind, torch.empty(1, 2, L, D), hidden, m)
    assert reason is None if expect is None else expect in reason


def test_uncovered_shape_falls_back_with_one_log_line(monkeypatch, caplog):
    # the interpreter counts as a Triton device for dispatch; head dim 48 is not covered
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ops, "_logged", set())
    q = torch.empty(1, 2, 64, 48)
    with caplog.at_level(logging.WARNING, logger="tttvideo.ttt.ops"):
        assert not ops._use_triton("mlp", "auto", q, 192, 64)
        assert not ops._use_triton("mlp", "auto", q, 192, 64)
    assert len(caplog.records) == 1 and "head dim 48" in caplog.records[0].getMessage()
    with pytest.raises(ValueError, match="do not cover"):
        ops._use_triton("mlp", "triton", q, 192, 64)
