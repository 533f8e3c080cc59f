"""The Triton kernel of the sampling TTT output's post-norm (`tttvideo.ttt.triton_post_norm`) against the PyTorch
reference (`tttvideo.ttt.layer.post_norm_rows`), on CPU in the Triton interpreter (switched on before triton is
imported, so the comparison runs in a subprocess with TRITON_INTERPRET=1, TTT_TRITON_POISON=1 and every memory
access bounds-checked: tests/test_ttt_triton.py). The kernel serves forwards without gradients only.

Also the TTT layer without gradients, whole and chunked (`chunked_pass_`), with backend "triton" (these kernels and
the scan's) against backend "reference". Fresh random inputs each run (the seed is in the failure message). fp32:
the kernel computes in fp32 like the reference, in another order, so they agree to ~1e-7; bound 1e-5 relative
(||a-b|| / ||b||). bf16 inputs and output: 1e-2 (one bf16 rounding is 4e-3).
"""

from __future__ import annotations

import os

import pytest
import torch

# B, H, L, pad, D, dtype, affine
CASES = [
    (2, 3, 37, 11, 16, "float32", True),  # heads not a power of two, a partial last program, padding
    (1, 48, 9, 0, 64, "float32", True),  # the model's heads and head dim
    (2, 4, 5, 3, 32, "float32", False),  # no affine weight and bias, fewer tokens than a program
    (2, 5, 21, 7, 64, "bfloat16", True),  # the model's dtype
]


def _case(B, H, L, pad, D, dtype, affine, seed):
    """Relative error of the kernel's output against the reference computed in fp32, and whether an index that
    repeats and skips positions is followed (the output rows are the indexed ones)."""
    from tttvideo.ttt.layer import post_norm_rows
    from tttvideo.ttt.triton_post_norm import post_norm_rows_forward

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    scanned = (3 * torch.randn(B, H, L + pad, D, generator=g) + 1).to(dt)
    index = torch.randperm(L, generator=g)
    w = 1 + 0.3 * torch.randn(H * D, generator=g) if affine else None
    b = 0.3 * torch.randn(H * D, generator=g) if affine else None
    got = post_norm_rows_forward(scanned, index, w, b, 1e-6)
    want = post_norm_rows(scanned.float(), index, w, b, 1e-6)
    repeated = torch.tensor([L - 1, 0, L - 1, 2])
    follows = torch.equal(post_norm_rows_forward(scanned, repeated, w, b, 1e-6), got[:, [index.tolist().index(i)
                                                                                      for i in repeated.tolist()]])
    return float((got.float() - want).norm() / want.norm()), got.dtype == dt, follows


def _layer_case(seed):
    """The bidirectional TTT layer (TTT-MLP, batch 2, fp32) without gradients, whole and chunked, with backend
    "triton" against backend "reference"."""
    from tttvideo.config.schema import TTTConfig
    from tttvideo.layout import VideoLayout
    from tttvideo.sequence.chunks import ChunkPlan
    from tttvideo.ttt.layer import BidirectionalTTT

    lay = VideoLayout.create("3s", height=32, width=48, text_tokens=5, mini_batch_size=16)
    x = torch.randn(2, lay.total_tokens, 32, generator=torch.Generator().manual_seed(seed))
    results = []
    for backend in ("triton", "reference"):
        torch.manual_seed(seed)
        layer = BidirectionalTTT(32, 2, TTTConfig(kind="mlp", scan_checkpoint_group_size=0, backend=backend))
        with torch.no_grad():
            layer.ttt.post_norm.weight.add_(0.3 * torch.randn_like(layer.ttt.post_norm.weight))
            layer.ttt.post_norm.bias.add_(0.3 * torch.randn_like(layer.ttt.post_norm.bias))
            for g in (layer.forward_gate_text, layer.forward_gate_video, layer.reverse_gate_text,
                      layer.reverse_gate_video):
                g.normal_(std=0.7)
            whole = layer(x, lay)
            chunked = x.clone()
            layer.chunked_forward_(chunked, lay, ChunkPlan(tokens=16, ttt_head_groups=2))
        results.append((whole, chunked))
    (whole, chunked), (ref, ref_chunked) = results
    return {"whole": float((whole - ref).norm() / ref.norm()),
            "chunked": float((chunked - ref_chunked).norm() / ref_chunked.norm()),
            "moved": float((ref - x).norm() / x.norm())}


def _interpreter_main() -> None:
    """Entry point of the subprocess: TRITON_INTERPRET=1 is already in its environment."""
    from tests.test_ttt_triton import interpreter_main

    def row(value, fault):
        error, same_dtype, follows = value or (None, False, False)
        return {"error": error, "same_dtype": same_dtype, "follows": follows, "fault": fault}

    interpreter_main(_case, CASES, row, [(_layer_case, 50)])


@pytest.fixture(scope="module")
def interpreter_results():
    from tests.test_ttt_triton import run_in_interpreter

    return run_in_interpreter("tests.test_ttt_post_norm_triton", timeout=300)


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[f"B{c[0]}H{c[1]}L{c[2]}p{c[3]}D{c[4]}-{c[5]}{'' if c[6] else '-plain'}" for c in CASES])
def test_kernel_matches_reference(interpreter_results, index):
    seed, results = interpreter_results
    r = results[index]
    assert r["fault"] is None, f"seed {seed}, case {CASES[index]}: {r['fault']}"
    bound = 1e-5 if CASES[index][5] == "float32" else 1e-2
    assert r["error"] <= bound, f"seed {seed}, case {CASES[index]}: relative error {r['error']} over {bound}"
    assert r["same_dtype"] and r["follows"], f"seed {seed}, case {CASES[index]}: {r}"


def test_sampling_layer_with_the_kernel_matches_the_reference(interpreter_results):
    """The TTT layer without gradients, whole and chunked, kernels against the reference (fp32, bound 1e-4 relative,
    tests/test_ttt_triton.py's bound for the scan); the layer changes its input (the comparison is not of zeros)."""
    seed, results = interpreter_results
    r = results[len(CASES)]
    assert r["fault"] is None, f"seed {seed}: {r['fault']}"
    e = r["errors"]
    assert e["whole"] <= 1e-4 and e["chunked"] <= 1e-4 and e["moved"] > 1e-2, f"seed {seed}: {e}"


def test_dispatch(monkeypatch):
    """The kernel runs where the glue kernels run (CUDA, or the interpreter with backend "triton") and not under
    autocast; else the reference."""
    from tttvideo.ttt import layer as layer_module

    calls = []
    monkeypatch.setattr(layer_module, "post_norm_rows", lambda *a: calls.append("reference") or a[0])
    norm = torch.nn.LayerNorm(8)
    scanned, index = torch.zeros(1, 2, 3, 4), torch.arange(3)
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    layer_module.sampling_post_norm(scanned, index, norm, "auto", False)
    layer_module.sampling_post_norm(scanned, index, norm, "reference", False)
    assert calls == ["reference", "reference"]
    if not interpreting:
        layer_module.sampling_post_norm(scanned, index, norm, "triton", False)
        assert len(calls) == 3
