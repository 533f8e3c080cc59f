"""The Triton kernel of `model.fp8_matmul`'s per-token e4m3 quantisation (`tttvideo.models.triton_fp8_quantize`)
against its reference `fp8_storage.quantize_tokens`, on CPU in the Triton interpreter: a subprocess with
TRITON_INTERPRET=1 (it must be set before triton is imported), NaN-poisoned outputs (TTT_TRITON_POISON=1: an element
the kernel fails to write fails the comparison) and every load and store bounds-checked (tests/test_ttt_triton.py).
Fresh random inputs each run (the seed is in the failure message).

Cases: 1, 7 and 33 rows; rows of 48, 200 and 1000 elements (none a multiple of the kernel's block); bf16, fp16 and
fp32; the two-pass path for long rows forced by lowering its bound (`max_one_pass`) to 64 and 100; rows of zeros,
of a huge value (1e30: the rest round to 0), of an outlier (the rest in e4m3's subnormal range), of tiny values
(1e-30), with a NaN and with an inf. Each case both ways the kernel can round to e4m3: by the cast (Hopper and
later) and in fp32 before it (Ada, `triton_fp8_quantize.rounds_in_fp32`), whose rounding is also checked alone, bit
for bit against torch's conversion. And `fp8_linear` with the kernel against `fp8_linear` with the reference.

Tolerances (tests/fp8_quantize_check.py): scales to 1e-6 relative (fp32 rounding; in practice equal); codes equal,
or one e4m3 step apart only where the reference's fp32 quotient one ulp away rounds to the kernel's code (a division
rounding differently in its last bit); in practice equal, since the kernel divides with IEEE rounding as torch does.

The interpreter's own fp32 -> fp8 conversion rounds wrongly (see `triton_fp8_quantize._patch_interpreter_fp8_cast`),
so under the interpreter the kernel's cast goes through torch's round-to-nearest-even with the GPU's saturation;
everything else in the kernel, the fp8 store included, runs as written. On the GPU the cast is Triton's own (on
Hopper one cvt.rn.satfinite instruction), checked against the reference in tests/gpu/test_fp8_quantize_gpu.py.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.fp8_quantize_check import FP8, compare_with_reference
from tttvideo.models.fp8_storage import quantize_tokens, quantize_tokens_fast, use_quantize_kernel

try:
    import triton
    import triton.language as tl

    from tttvideo.models.triton_fp8_quantize import _round_to_e4m3
except ImportError:  # Triton is optional: the interpreter tests skip themselves
    triton = None

pytestmark = pytest.mark.usefixtures("one_thread")

SCALE_TOL = 1e-6
# the kernel's two ways of rounding to e4m3: the cast itself (Hopper and later), and rounding in fp32 first (Ada)
ROUNDINGS = {"cast": False, "rounded in fp32": True}
# rows, row length, dtype, max_one_pass (None: the default, one pass), special rows
CASES = [
    (1, 48, "bfloat16", None, False),
    (7, 200, "bfloat16", None, True),
    (33, 1000, "bfloat16", None, True),
    (7, 1000, "float32", None, True),
    (33, 48, "float32", None, False),
    (1, 200, "float32", None, False),
    (7, 200, "float16", None, True),
    (7, 200, "bfloat16", 64, True),  # two passes: four chunks of 64, the last partial
    (33, 1000, "float32", 100, True),  # a bound not a power of two: chunks of 64
    (1, 48, "bfloat16", 16, False),
]


def case_id(c) -> str:
    rows, K, dtype, bound, special = c
    return f"{rows}x{K}-{dtype}" + (f"-twopass{bound}" if bound else "") + ("-special" if special else "")


def case_input(rows: int, K: int, dtype: str, special: bool, g: torch.Generator) -> torch.Tensor:
    """Random rows of different ranges; with `special`, the first six rows replaced as the module docstring lists."""
    dt = getattr(torch, dtype)
    x = torch.randn(rows, K, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    if special:
        big = 6e4 if dt == torch.float16 else 1e30  # fp16 tops out at 65504
        x[0] = 0
        x[1, K // 3] = big
        x[2, K // 2] = 1e3 * x[2].abs().max()
        x[3] *= 1e-30
        x[4, 1] = float("nan")
        x[5, K - 1] = float("inf")
    return x.to(dt)


def _interpreter_main() -> None:
    """Entry point of the subprocess: TRITON_INTERPRET=1 is already in its environment."""
    from tests.test_ttt_triton import _install_bounds_check
    from tttvideo.models import fp8_storage
    from tttvideo.models.triton_fp8_quantize import MAX_ONE_PASS, quantize_tokens_triton

    seed = int(sys.argv[1])
    _install_bounds_check()
    g = torch.Generator().manual_seed(seed)
    results = []
    for rows, K, dtype, bound, special in CASES:
        x = case_input(rows, K, dtype, special, g)
        result = {}
        for path, round_in_fp32 in ROUNDINGS.items():
            try:
                codes, scales = quantize_tokens_triton(x, max_one_pass=bound or MAX_ONE_PASS,
                                                       round_in_fp32=round_in_fp32)
                result[path] = {**compare_with_reference(x, codes, scales), "fault": None}
            except Exception as e:  # an out-of-bounds access is this case's result
                result[path] = {"fault": f"{type(e).__name__}: {e}"[:2000]}
        results.append(result)
    results.append(_rounding_in_fp32(g))
    # fp8_linear end to end: the dispatcher picks the kernel in the interpreter; the reference gives the same codes
    # and scales, so torch._scaled_mm gives the same output bit for bit
    layer = fp8_storage.Fp8Linear(torch.nn.Linear(64, 48).requires_grad_(False))
    x = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)
    args = (layer.weight_fp8, layer.weight_scale, layer.bias, torch.bfloat16)
    with_kernel = fp8_storage.fp8_linear(x, *args)
    fp8_storage.use_quantize_kernel = lambda rows: False
    with_reference = fp8_storage.fp8_linear(x, *args)
    results.append({"kernel_dispatched": use_quantize_kernel(x.reshape(-1, 64)),
                    "linear_equal": bool(torch.equal(with_kernel, with_reference))})
    print("RESULTS " + json.dumps(results))


if triton is not None:
    @triton.jit
    def _rounding_kernel(Q, OUT, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(OUT + i, _round_to_e4m3(tl.load(Q + i, mask=i < n)), mask=i < n)


def _rounding_in_fp32(g: torch.Generator) -> dict:
    """`_round_to_e4m3` (the rounding Ada needs before its cast) stored as fp32, against torch's conversion to
    e4m3 and back, bit for bit (-0 included): every e4m3 value, the ties between neighbours and one fp32 ulp
    either side of each, random values over the whole range, ±0, NaN. Compared before any cast, so a value that
    misses the e4m3 grid shows even where a later conversion would round it back."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()  # -448 ... 448
    ties = (grid[1:] + grid[:-1]) / 2
    q = torch.cat([grid, ties, *(torch.nextafter(ties, ties + d) for d in (-1.0, 1.0)),
                   (torch.rand(4000, generator=g) * 2 - 1) * 448 * torch.logspace(-12, 0, 4000),
                   torch.tensor([0.0, -0.0, float("nan")])])
    out = torch.empty_like(q)
    _rounding_kernel[(triton.cdiv(q.numel(), 1024),)](q, out, q.numel(), BLOCK=1024)
    want = q.to(FP8).float()
    same = (out.view(torch.int32) == want.view(torch.int32)) | (out.isnan() & want.isnan())  # NaN payloads aside
    return {"values": q.numel(), "differ": int((~same).sum())}


@pytest.fixture(scope="module")
def interpreter_results():
    from tests.test_ttt_triton import run_in_interpreter

    return run_in_interpreter("tests.test_fp8_quantize", timeout=300)


@pytest.mark.parametrize("path", ROUNDINGS)
@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_kernel_matches_reference(interpreter_results, index, path):
    seed, results = interpreter_results
    r = results[index][path]
    where = f"seed {seed}, case {case_id(CASES[index])}, {path}"
    assert r["fault"] is None, f"{where}: {r['fault']}"
    assert r["shape_ok"], f"{where}: codes or scales of the wrong shape or dtype"
    assert r["scale_rel"] <= SCALE_TOL, f"{where}: scales differ by {r['scale_rel']} relative"
    assert r["unexplained"] == 0, f"{where}: {r['unexplained']} of {r['code_diffs']} differing codes unexplained"


def test_rounding_in_fp32_is_the_e4m3_conversion(interpreter_results):
    seed, results = interpreter_results
    r = results[len(CASES)]
    assert r["values"] > 4000 and r["differ"] == 0, f"seed {seed}: {r}"


def test_fp8_linear_with_the_kernel_equals_it_with_the_reference(interpreter_results):
    seed, results = interpreter_results
    r = results[len(CASES) + 1]
    assert r["kernel_dispatched"], f"seed {seed}: the interpreter run did not dispatch to the kernel"
    assert r["linear_equal"], f"seed {seed}: fp8_linear differs between the kernel and the reference"


def test_launch_config():
    """One pass up to MAX_ONE_PASS elements per row, at least TILE elements per program, at most 16 warps; longer
    rows in chunks no wider than CHUNK or the bound."""
    pytest.importorskip("triton")
    from tttvideo.models.triton_fp8_quantize import CHUNK, MAX_ONE_PASS, TILE, launch_config

    for K in (1, 48, 200, 1000, 3072, 12288, MAX_ONE_PASS):
        cfg = launch_config(K)
        assert cfg["ONE_PASS"] and cfg["BLOCK_K"] >= K and cfg["ROWS"] * cfg["BLOCK_K"] >= TILE, (K, cfg)
        assert 1 <= cfg["num_warps"] <= 16, (K, cfg)
    for K, bound in ((MAX_ONE_PASS + 16, MAX_ONE_PASS), (200, 64), (1000, 100)):
        cfg = launch_config(K, bound)
        assert not cfg["ONE_PASS"] and cfg["ROWS"] == 1 and cfg["BLOCK_K"] <= min(bound, CHUNK), (K, cfg)
        assert cfg["BLOCK_K"] & (cfg["BLOCK_K"] - 1) == 0, (K, cfg)


def test_dispatch_off_cuda_is_the_reference():
    """Outside the interpreter a CPU tensor takes the reference itself, and so does a tensor of no elements
    anywhere."""
    x = torch.randn(3, 32)
    assert use_quantize_kernel(x) == (os.environ.get("TRITON_INTERPRET", "0") == "1")
    assert not use_quantize_kernel(torch.zeros(0, 32))
    codes, scales = quantize_tokens_fast(torch.zeros(0, 32))
    assert codes.shape == (0, 32) and scales.shape == (0, 1)
    if not use_quantize_kernel(x):
        for got, want in zip(quantize_tokens_fast(x), quantize_tokens(x)):
            assert torch.equal(got.float(), want.float())


def test_the_comparison_explains_only_a_last_bit_division_difference():
    """tests/fp8_quantize_check.py's tolerance: in a row of amax 448 the scale is 1, so 168 sits exactly between
    the e4m3 values 160 and 176 and rounds to even (160); 176 is what a quotient one ulp higher gives (explained),
    192 is not, and neither is a wrong scale."""
    x = torch.tensor([[448.0, 168.0, 1.0]])
    codes, scales = quantize_tokens(x)
    assert codes[0, 1].float() == 160
    assert compare_with_reference(x, codes, scales) == {"scale_rel": 0.0, "code_diffs": 0, "unexplained": 0,
                                                        "shape_ok": True}
    for value, unexplained in ((176.0, 0), (192.0, 1)):
        moved = codes.clone()
        moved[0, 1] = value
        assert compare_with_reference(x, moved, scales) == {"scale_rel": 0.0, "code_diffs": 1,
                                                             "unexplained": unexplained, "shape_ok": True}
    assert compare_with_reference(x, codes, scales * (1 + 1e-5))["scale_rel"] > SCALE_TOL
    assert not compare_with_reference(x, codes.float(), scales)["shape_ok"]
