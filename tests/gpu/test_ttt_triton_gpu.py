"""Device tests of the Triton TTT kernels at full size (skipped without CUDA).

B=1, H=48 heads of 64, L=18,048 tokens, bf16 inputs, checkpoint group 16: the output and every gradient against the
fp32 reference on the same (upcast) inputs, relative error ||a-b|| / ||b|| <= 2e-2. Fresh random inputs each run;
kernel outputs start as NaN (TTT_TRITON_POISON=1) so an unwritten element fails. Also a small uncovered-by-default
shape (head dim 32) to check that the kernels are right off the 64/64 path.

Inputs: `tttvideo.ttt.testing.make_inputs`. The full-size test draws from the layer's initialisation
("spec-init"); the small tests use "biased-eta16" on short chains, which stay well conditioned, to cover non-zero
initial biases and norms (on long chains that draw is ill-conditioned: see tttvideo.ttt.testing and
`benchmarks/ttt_accuracy.py`, which measures the kernels' error beside the reference's own sensitivity).

Run: `pytest tests/gpu/test_ttt_triton_gpu.py`, or `python tests/gpu/test_ttt_triton_gpu.py` (prints the errors).
"""

from __future__ import annotations

import torch

from tttvideo.ttt.testing import TOLERANCE, relative_errors

try:
    import pytest
except ImportError:  # the device image may lack pytest: the module also runs as a script
    pytest = None

TOL = TOLERANCE


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
        # short chains stay well conditioned even in the biased draw, which covers non-zero initial biases
        errs = relative_errors(kind, B=2, H=3, L=16 * 12, D=32, m=16, group=4, regime="biased-eta16")
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"TTT-{kind} D=32 relative errors over {TOL}: {bad}"


    @pytest.mark.parametrize("split", [1, 2, 4])
    @pytest.mark.parametrize("m", [64, 16])
    def test_mlp_split_over_programs(split, m, monkeypatch):
        # one stream's hidden dim over 1, 2 or 4 cooperating programs (triton_exchange), at the training mini-batch
        # and the sampling one (16)
        monkeypatch.setenv("TTT_MLP_SPLIT", str(split))
        errs = relative_errors("mlp", B=2, H=3, L=64 * 21, D=64, m=m, group=4, regime="biased-eta16")
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"TTT-MLP split {split}: relative errors over {TOL}: {bad}"

    @pytest.mark.parametrize("B", [2, 1])
    def test_mlp_sampling_launch_matches_fp32_reference(B):
        # without gradients at mini-batch 16 the forward takes triton_mlp.forward_shape's launch (2 roles at 4 warps,
        # two programs an SM): a guided step's 2 x 48 heads at 3 s, and one sample's 48, against the fp32 reference
        from tttvideo.ttt import ops, triton_mlp
        from tttvideo.ttt.reference import ttt_mlp_reference
        from tttvideo.ttt.testing import make_inputs, poisoned_outputs

        assert triton_mlp.forward_shape(256, 16, 64, torch.device("cuda"), save=False) == (2, 4)
        L = 16 * 1128
        ins = [t.detach() for t in make_inputs("mlp", B, 48, L, 64, 16)]
        with torch.no_grad():
            want = ttt_mlp_reference(*(t.float() for t in ins), mini_batch_size=16, checkpoint_group_size=16)
            with poisoned_outputs():
                got = ops.ttt_mlp(*ins, mini_batch_size=16, checkpoint_group_size=16, backend="triton").float()
        err = float((got - want).norm() / want.norm())
        assert err <= TOL, f"TTT-MLP sampling launch, B={B}: relative error {err} over {TOL}"
        assert triton_mlp.LAUNCHED["fwd"].metadata.num_warps == 4

    def test_mlp_past_32_bit_addressing_equals_per_sample_calls(monkeypatch):
        # B = 2 at 63 s: q/k/v hold more than 2^31 elements, so ops runs the call per sample; each sample run alone
        # (under the limit) must give the same output, bit for bit, and so must the whole batch as one launch
        # (TTT_KERNEL_GROUPS=one: the stream offsets are 64-bit)
        from tttvideo.ttt import ops
        from tttvideo.ttt.testing import make_inputs

        L = 64 * 5488  # 63 s, padded to the mini-batch
        ins = [t.detach() for t in make_inputs("mlp", 2, 48, L, 64, 64, seed=0)]
        assert ins[0].numel() > 2**31
        with torch.no_grad():
            both = ops.ttt_mlp(*ins, mini_batch_size=64, checkpoint_group_size=16, backend="triton")
            for b in range(2):
                one = ops.ttt_mlp(*(t[b:b + 1] for t in ins[:4]), *ins[4:], mini_batch_size=64,
                                  checkpoint_group_size=16, backend="triton")
                assert torch.equal(both[b:b + 1], one), f"sample {b}"
            monkeypatch.setenv("TTT_KERNEL_GROUPS", "one")
            whole = ops.ttt_mlp(*ins, mini_batch_size=64, checkpoint_group_size=16, backend="triton")
            assert torch.equal(whole, both), "one launch"

    @pytest.mark.parametrize("kind", ["mlp", "linear"])
    @pytest.mark.parametrize("limit_heads", [3, 1])
    def test_parts_side_by_side_equal_one_call(kind, limit_heads, monkeypatch):
        # the kernel calls of a scan past the limit run on CUDA streams of their own without gradients: with the
        # limit lowered to 3 heads' (one sample: per-sample parts) or 1 head's elements (per sample and head), the
        # output is the single call's, bit for bit, and so is that of the parts in sequence (TTT_KERNEL_GROUPS)
        from tttvideo.ttt import ops
        from tttvideo.ttt.testing import make_inputs

        B, H, L, D, m = 2, 3, 64 * 12, 64, 16
        ins = [t.detach() for t in make_inputs(kind, B, H, L, D, m, seed=1)]
        scan = ops.ttt_mlp if kind == "mlp" else ops.ttt_linear
        with torch.no_grad():
            whole = scan(*ins, mini_batch_size=m, checkpoint_group_size=4, backend="triton")
            monkeypatch.setattr(ops, "MAX_KERNEL_ELEMENTS", limit_heads * L * D)
            # the serial schedule keeps every sample in each call: under a one-head limit it has no cut to make
            for schedule in ("concurrent", "serial") if limit_heads >= B else ("concurrent",):
                monkeypatch.setenv("TTT_KERNEL_GROUPS", schedule)
                parts = scan(*ins, mini_batch_size=m, checkpoint_group_size=4, backend="triton")
                torch.cuda.synchronize()
                assert torch.equal(parts, whole), schedule

    def test_recompute_lane_keeps_the_gradients():
        # the backward's recompute on a stream of its own (one group ahead of the reverse, recompute_lane): every
        # gradient equals that of the recompute in sequence with the reverse on one stream, at full size, bit for
        # bit but the LayerNorm weight's and bias's, which the kernels sum with fp32 atomics in whatever order their
        # programs arrive (under either schedule)
        from tttvideo.ttt import triton_mlp
        from tttvideo.ttt.testing import make_inputs

        m, group = 64, 16
        ins = [t.detach() for t in make_inputs("mlp", 1, 48, 18048, 64, m, seed=3)]
        dout = torch.randn_like(ins[0])
        _, ck = triton_mlp.mlp_forward(*ins, m, group, True)
        grads = {lane: triton_mlp.mlp_backward(dout, *ins[:6], ck, m, group, recompute_lane=lane)
                 for lane in ("recompute", "serial")}
        torch.cuda.synchronize()
        names = ["q", "k", "v", "eta", "norm_w", "norm_b", "W1", "b1", "W2", "b2"]
        for name, a, b in zip(names, grads["recompute"], grads["serial"]):
            if name in ("norm_w", "norm_b"):
                err = float((a - b).norm() / b.norm())
                assert err <= 1e-5, f"d {name}: relative difference {err} between the recompute lanes"
            else:
                assert torch.equal(a, b), f"d {name} differs between the recompute lanes"


if __name__ == "__main__":
    for kind in ("mlp", "linear"):
        print(kind, relative_errors(kind))
