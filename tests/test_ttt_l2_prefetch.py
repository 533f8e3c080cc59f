"""The TTT-MLP reverse kernel's L2 prefetch (`triton_common.prefetch_l2`): compiled for Ampere and Hopper (no GPU
needed) it issues one PTX prefetch per tile of the next step, and none when off; the switch reads TTT_L2_PREFETCH and
stays off in the interpreter; benchmarks/ttt_prefetch_ab.py runs in the interpreter. That the prefetch changes no
value on a GPU is checked there (benchmarks/ttt_prefetch_ab.py's bit-equal column, tests/gpu/test_ttt_triton_gpu.py)."""

from __future__ import annotations

import json

import pytest

from tests.interpreter_runs import run_in_interpreter

triton = pytest.importorskip("triton")

TILES = 12  # what `_prefetch_step` asks for: K, V, Q, the W2 rows, X2, gelu', S1, dZq1, Xq, Z2, G2, dZq2


def _reverse_ptx(sm: int, prefetch: int) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tttvideo.ttt.triton_common import DOT_BF16, LN_EPS
    from tttvideo.ttt.triton_mlp_bwd import _reverse_kernel

    fn = _reverse_kernel
    consts = dict(D=64, E=256, M=64, SPLIT=2, DOT=DOT_BF16, EPS=LN_EPS, PREFETCH=prefetch)
    bf16 = {"Q", "K", "V", "SW2", "XS", "GPS", "G2S", "DQ1", "XQ", "S1", "DQ2", "GK1", "DZ1", "DV"}
    ints = {"H", "L", "I0", "CNT", "NSLOT", "GSLOT"}
    sig = {n: "constexpr" if n in consts else "i32" if n in ints else "*i32" if n == "SYNC"
           else "*bf16" if n in bf16 else "*fp32" for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", sm, 32),
                       options=dict(num_warps=8, num_stages=1))
    return k.asm["ptx"]


@pytest.mark.parametrize("sm", [80, 90])
def test_the_reverse_prefetches_each_tile_of_the_next_step(sm):
    assert _reverse_ptx(sm, 1).count("prefetch.global.L2") == TILES


def test_off_it_prefetches_nothing():
    assert "prefetch" not in _reverse_ptx(90, 0)


def test_the_switch(monkeypatch):
    from tttvideo.ttt import triton_common

    monkeypatch.setattr(triton_common, "interpreting", lambda: False)
    monkeypatch.delenv("TTT_L2_PREFETCH", raising=False)
    assert triton_common.l2_prefetch_on()
    monkeypatch.setenv("TTT_L2_PREFETCH", "0")
    assert not triton_common.l2_prefetch_on()
    monkeypatch.setenv("TTT_L2_PREFETCH", "yes")
    with pytest.raises(ValueError, match="TTT_L2_PREFETCH='yes': use 1"):
        triton_common.l2_prefetch_on()
    monkeypatch.setenv("TTT_L2_PREFETCH", "1")
    monkeypatch.setattr(triton_common, "interpreting", lambda: True)
    assert not triton_common.l2_prefetch_on()  # the interpreter runs no PTX


def test_the_ab_benchmark_in_the_interpreter(tmp_path):
    out = tmp_path / "ab.json"
    proc = run_in_interpreter("ttt_prefetch_ab.py", "--length", "64", "--heads", "2", "--rounds", "1",
                              "--out", str(out))
    result = json.loads(out.read_text())
    assert result["benchmark"] == "ttt_prefetch_ab" and set(result["modes"]) == {"off", "on"}
    assert [r["runs"] for r in result["rows"]] == ["fwd+bwd", "train fwd"]
    assert all(r["equal"] and r["norm_grad_moved"] == 0.0 for r in result["rows"])
    assert "on/off" in proc.stdout
