"""The TTT-MLP forward kernel's LL exchange (tttvideo.ttt.triton_exchange: partial sums in sequence-numbered 64-bit
words, polled directly) against the flag exchange, in Triton's interpreter (one role: the interpreter runs programs
one after another), bit for bit: the output and checkpoints of the forward with and without saves, and the backward,
whose recompute launches the same kernel. The cross-role exchange is checked on a GPU
(tests/gpu/test_ttt_triton_gpu.py::test_mlp_ll_exchange_equals_flag_exchange)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def _main() -> None:
    from tttvideo.ttt import triton_mlp
    from tttvideo.ttt.testing import make_inputs

    for M, L, save in ((16, 64, False), (64, 256, True), (16, 96, True)):
        ins = [t.detach() for t in make_inputs("mlp", 2, 3, L, 16, M, seed=3, device="cpu", dtype=torch.float32)]
        runs = {}
        for protocol in ("flag", "ll"):
            os.environ["TTT_MLP_EXCHANGE"] = protocol
            out, ck = triton_mlp.mlp_forward(*ins, M, 2, save, output=True, exchange=protocol)
            runs[protocol] = [out, *(ck or ())]
            if save:
                dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
                runs[protocol] += [g for g in triton_mlp.mlp_backward(dout, *ins[:6], ck, M, 2) if g is not None]
        for i, (a, b) in enumerate(zip(runs["flag"], runs["ll"], strict=True)):
            assert torch.equal(a, b), f"M={M} L={L} save={save}: tensor {i} differs"
    print("ok")


def test_ll_exchange_equals_flag_exchange_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", TTT_TRITON_POISON="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c",
                           "import tests.test_ttt_exchange_ll as t; t._main()"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_unknown_exchange_is_refused(monkeypatch):
    from tttvideo.ttt import triton_mlp

    monkeypatch.setenv("TTT_MLP_EXCHANGE", "fast")
    with pytest.raises(ValueError, match="TTT_MLP_EXCHANGE"):
        triton_mlp.exchange_protocol()
