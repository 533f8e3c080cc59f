"""benchmarks/backbone_kernels.py on the CPU: its fp8 GEMM (e4m3 codes with one scale per row, as fp8 weight storage
quantises them, `tttvideo.models.fp8_storage.quantize_rows`, through torch._scaled_mm) against the product of the
dequantised codes in fp32 (1e-2: the bf16 output's rounding) and against the unquantised product (e4m3 keeps 3
mantissa bits: about 4e-2 relative); without CUDA the script stops with one sentence and exit code 2."""

from __future__ import annotations

import pytest
import torch

from tests.benchmark_scripts import load_benchmark


def test_fp8_gemm_matches_its_dequantised_reference():
    bk = load_benchmark("backbone_kernels")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(96, 256, generator=g), torch.randn(64, 256, generator=g) / 16
    bias = 0.02 * torch.randn(64, generator=g)
    (x8, xs), (w8, ws) = bk.quantize_rows(x), bk.quantize_rows(w)
    assert x8.dtype == torch.float8_e4m3fn and xs.shape == (96,) and ws.shape == (64,)
    try:
        got = bk.scaled_linear_fp8(x8, xs, w8, ws, bias.to(torch.bfloat16), torch.bfloat16)
    except RuntimeError as err:  # an older CPU build without fp8 GEMMs
        pytest.skip(f"torch._scaled_mm on this CPU: {err}")
    dequantised = torch.nn.functional.linear(x8.float() * xs[:, None], w8.float() * ws[:, None], bias)
    assert bk.rel_error(got, dequantised) < 1e-2
    assert 5e-3 < bk.rel_error(got, torch.nn.functional.linear(x, w, bias)) < 6e-2


def test_without_cuda_one_sentence_and_exit_code_2(capsys, monkeypatch):
    bk = load_benchmark("backbone_kernels")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bk.main([]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
