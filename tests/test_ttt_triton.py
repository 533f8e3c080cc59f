"""Triton TTT kernels (TTT-MLP, TTT-Linear) against the reference, on CPU through the Triton interpreter.

The interpreter must be switched on before triton is imported, so the kernel checks run in one subprocess with
TRITON_INTERPRET=1 (and TTT_TRITON_POISON=1: every kernel output starts as NaN, so an unwritten element fails).
Sizes are tiny (head dim 16, mini-batch 16, a few mini-batches): the interpreter runs each program in numpy.
Inputs are fresh random draws each run (the seed is printed on failure). fp32 everywhere, so the kernels use
full-precision products and must match the reference to ~1e-6; the bound is 1e-4 relative (||a-b|| / ||b||).

Every load, store and atomic of every kernel launch in that subprocess is also checked against the tensors passed to
the launch (`_install_bounds_check`): an address outside all of them fails the run naming the kernel, so an index
that mixes up sizes (the mini-batch M and the head dim D, say) fails here even where it would read memory that
happens to exist.
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
# Issue 13 (kernel memory safety): TTT-MLP at mini-batch 64 with head dim 16 and 32 (M > D), several checkpoint
# groups and a partial last one; see test_mlp_minibatch_64_small_head_dim
M64_CASES = [
    ("mlp", 2, 1, 16, 64, 7, 2),  # four groups, the last of one mini-batch: every scratch set rotates
    ("mlp", 1, 2, 32, 64, 5, 2),  # three groups, the last partial; two heads
]
# the forward without gradients (sampling): kind, B, H, D, mini-batch, mini-batches; at mini-batch 16 the kernel
# takes its sampling form (no saves, the output write masked: triton_mlp._mlp_fwd_kernel's BRANCHED_OUT)
SAMPLING_CASES = [("mlp", 2, 1, 16, 16, 5), ("mlp", 1, 2, 16, 16, 1), ("mlp", 1, 1, 32, 16, 3),
                  ("mlp", 1, 1, 16, 64, 3)]
# the 32-bit limit lowered to one sample's elements (B = 2, H = 2, L = 64, D = 16) or to one head's, and the schedule
ONE_SAMPLE, ONE_HEAD = 2 * 64 * 16, 64 * 16
SPLIT_CASES = [("mlp", ONE_SAMPLE, "concurrent"), ("mlp", ONE_HEAD, "concurrent"), ("mlp", ONE_SAMPLE, "serial"),
               ("linear", ONE_SAMPLE, "concurrent"), ("mlp", ONE_SAMPLE, "one")]


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


def _install_bounds_check() -> None:
    """In the Triton interpreter, fail any load, store or atomic of a kernel whose address (masked-off lanes aside)
    lies outside every tensor argument of that launch (each tensor's own extent: its view, not its storage). Raises
    RuntimeError naming the kernel and the nearest argument; the interpreter wraps it in InterpreterError."""
    import inspect

    import numpy as np
    from triton.runtime import interpreter as interp

    ranges: list = []  # (first byte, end byte, argument name) of the launch being interpreted
    kernel = [""]
    init_args = interp.GridExecutor._init_args_hst

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        ranges.clear()
        names = inspect.getfullargspec(self.fn).args
        for name, a in [*zip(names, args_hst), *kwargs_hst.items()]:
            if isinstance(a, torch.Tensor) and a.numel():
                extent = sum((n - 1) * st for n, st in zip(a.shape, a.stride())) + 1
                ranges.append((a.data_ptr(), a.data_ptr() + extent * a.element_size(), name))
        kernel[0] = getattr(self.fn, "__name__", str(self.fn))
        return args_hst, kwargs_hst

    def check(ptrs, mask, nbytes, what):
        p = np.asarray(ptrs).astype(np.uint64)
        m = np.broadcast_to(np.asarray(mask).astype(bool), p.shape) if mask is not None else np.ones(p.shape, bool)
        p = p[m]
        inside = np.zeros(p.shape, bool)
        for lo, hi, _ in ranges:
            inside |= (p >= lo) & (p + nbytes <= hi)
        if not inside.all():
            bad = int(p[~inside][0])
            near = min(ranges, key=lambda r: min(abs(bad - r[0]), abs(bad - r[1])))
            raise RuntimeError(f"out-of-bounds {what} in {kernel[0]}: {int((~inside).sum())} elements, the first "
                               f"at byte {bad - near[0]} of {near[2]} ({near[1] - near[0]} bytes)")

    builder = interp.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def load_checked(self, ptrs, mask, other, *a):
        check(ptrs.data, mask.data, np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize, "load")
        return load(self, ptrs, mask, other, *a)

    def store_checked(self, ptrs, value, mask, *a):
        check(ptrs.data, mask.data, value.data.dtype.itemsize, "store")
        return store(self, ptrs, value, mask, *a)

    def rmw_checked(self, op, ptr, val, mask, *a):
        check(ptr.data, mask.data, val.data.dtype.itemsize, "atomic")
        return rmw(self, op, ptr, val, mask, *a)

    def cas_checked(self, ptr, cmp, val, *a):
        check(ptr.data, None, val.data.dtype.itemsize, "atomic")
        return cas(self, ptr, cmp, val, *a)

    interp.GridExecutor._init_args_hst = init_args_checked
    builder.create_masked_load, builder.create_masked_store = load_checked, store_checked
    builder.create_atomic_rmw, builder.create_atomic_cas = rmw_checked, cas_checked


def _launch_warps() -> dict:
    """Record the warps each TTT-MLP kernel is launched with (the interpreter ignores them; a GPU would not)."""
    from tttvideo.ttt import triton_mlp, triton_mlp_bwd

    seen: dict = {}

    def record(name, fn, index):
        def wrapped(*a, **kw):
            seen.setdefault(name, set()).add(int(a[index]))
            return fn(*a, **kw)
        return wrapped

    triton_mlp._launch_fwd = record("forward/recompute", triton_mlp._launch_fwd, 18)
    triton_mlp_bwd.output_path = record("output path", triton_mlp_bwd.output_path, 14)
    triton_mlp_bwd.reverse = record("reverse", triton_mlp_bwd.reverse, 20)
    triton_mlp_bwd.grad_k = record("d K", triton_mlp_bwd.grad_k, 9)
    return seen


def _interpreter_main() -> None:
    """Entry point of the subprocess: TRITON_INTERPRET=1 is already in its environment."""
    seed = int(sys.argv[1])
    _install_bounds_check()
    warps = _launch_warps()
    results = []
    for i, c in enumerate(CASES + M64_CASES):
        warps.clear()
        try:
            errors, fault = _errors(*c, seed + 10 * i), None
        except Exception as e:  # an out-of-bounds access (or any kernel failure) is this case's result
            errors, fault = {}, f"{type(e).__name__}: {e}"[:2000]
        results.append({"case": list(c), "errors": errors, "fault": fault,
                        "warps": {k: sorted(v) for k, v in warps.items()}})
    for i, (kind, B, H, D, m, n) in enumerate(SAMPLING_CASES):
        ins = [t.detach() for t in _inputs(kind, B, H, D, m, n, seed + 50 + i)]
        try:
            with torch.no_grad():
                ref = ttt_mlp_reference(*ins, m, 0)
                out = ops.ttt_mlp(*ins, mini_batch_size=m, checkpoint_group_size=0, backend="triton")
            errors, fault = {"out": float((out - ref).norm() / ref.norm())}, None
        except Exception as e:
            errors, fault = {}, f"{type(e).__name__}: {e}"[:2000]
        results.append({"case": [kind, B, H, D, m, n], "errors": errors, "fault": fault, "sampling": True})
    # a call past the kernels' 32-bit addressing runs as several calls (ops.by_head_groups): lower the limit so
    # that this two-sample, two-head case splits, by samples or by heads, or (TTT_KERNEL_GROUPS=serial) as before
    from tttvideo.ttt import triton_linear, triton_mlp

    calls = []
    for module, name in ((triton_mlp, "mlp_forward"), (triton_linear, "linear_forward")):
        def counted(*a, _fn=getattr(module, name), **kw):
            calls.append(list(a[0].shape[:2]))  # samples and heads of the call
            return _fn(*a, **kw)
        setattr(module, name, counted)
    for kind, limit, schedule in SPLIT_CASES:
        calls.clear()
        ops.MAX_KERNEL_ELEMENTS = limit
        os.environ["TTT_KERNEL_GROUPS"] = schedule
        c = (kind, 2, 2, 16, 16, 4, 2)
        try:
            errors, fault = _errors(*c, seed + 99), None
        except Exception as e:
            errors, fault = {}, f"{type(e).__name__}: {e}"[:2000]
        row = {"case": list(c), "errors": errors, "fault": fault, "warps": {}, "calls": list(calls)}
        # without gradients the parts write into one output (ops.by_head_groups' `into`): the same cut, and the
        # output bit for bit that of one call over everything
        ins = [t.detach() for t in _inputs(kind, 2, 2, 16, 16, 4, seed + 98)]
        scan = ops.ttt_mlp if kind == "mlp" else ops.ttt_linear
        calls.clear()
        with torch.no_grad():
            parted = scan(*ins, mini_batch_size=16, checkpoint_group_size=2, backend="triton")
            row["no_grad_calls"] = list(calls)
            ops.MAX_KERNEL_ELEMENTS = 2**31
            row["no_grad_equal"] = bool(torch.equal(parted, scan(*ins, mini_batch_size=16, checkpoint_group_size=2,
                                                                 backend="triton")))
        results.append(row)
    print("RESULTS " + json.dumps(results))


def guarded(fn, *args):
    """(fn(*args), None), or (None, the exception in one line): inside the interpreter an out-of-bounds access is one
    case's result, and the run goes on to the next."""
    try:
        return fn(*args), None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"[:2000]


def interpreter_main(case, cases, row, extras=()) -> None:
    """The body of an interpreter module's `_interpreter_main` (the seed in sys.argv[1]): the bounds check on, then
    `row(value, fault)` of `case(*c, seed + i)` for each c of `cases`, then {"errors", "fault"} of `fn(seed +
    offset)` for each (fn, offset) of `extras`, each run `guarded`; printed as one line "RESULTS <json>"."""
    seed = int(sys.argv[1])
    _install_bounds_check()
    results = [row(*guarded(case, *c, seed + i)) for i, c in enumerate(cases)]
    for fn, offset in extras:
        errors, fault = guarded(fn, seed + offset)
        results.append({"errors": errors or {}, "fault": fault})
    print("RESULTS " + json.dumps(results))


def run_in_interpreter(module: str, timeout: float = 600) -> tuple[int, list]:
    """(seed, results) of `module._interpreter_main()` run with a fresh seed in a subprocess with TRITON_INTERPRET=1
    and TTT_TRITON_POISON=1; it prints its results as one line "RESULTS <json>"."""
    pytest.importorskip("triton")
    seed = int(torch.randint(0, 2**30, ()).item())
    env = dict(os.environ, TRITON_INTERPRET="1", TTT_TRITON_POISON="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module} as t, sys; sys.argv = ['x', '{seed}']; t._interpreter_main()"],
        cwd=root, env=env, capture_output=True, text=True, timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"interpreter run failed (seed {seed}):\n{proc.stdout}\n{proc.stderr}"
    return seed, json.loads(lines[-1][len("RESULTS "):])


@pytest.fixture(scope="module")
def interpreter_results():
    return run_in_interpreter("tests.test_ttt_triton")


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c[0]}-B{c[1]}H{c[2]}D{c[3]}n{c[5]}g{c[6]}" for c in CASES])
def test_kernel_matches_reference(interpreter_results, index):
    seed, results = interpreter_results
    assert results[index]["fault"] is None, f"seed {seed}, case {CASES[index]}: {results[index]['fault']}"
    errors = results[index]["errors"]
    names = NAMES if CASES[index][0] == "mlp" else NAMES[:-2]
    assert set(errors) == set(names)
    bad = {k: v for k, v in errors.items() if not v <= TOL}  # NaN fails too: an unwritten (poisoned) element
    assert not bad, f"seed {seed}, case {CASES[index]}: relative errors over {TOL}: {bad}"


@pytest.mark.parametrize("index", range(len(M64_CASES)),
                         ids=[f"B{c[1]}H{c[2]}D{c[3]}M{c[4]}n{c[5]}g{c[6]}" for c in M64_CASES])
def test_mlp_minibatch_64_small_head_dim(interpreter_results, index):
    """Issue 13: TTT-MLP with mini-batch 64 and head dim 16 or 32 ended in "an illegal memory access" on an H100.

    The cause is not reproducible on CPU: it was Triton 3.6's sm_90 code for the d K kernel at 8 warps (its wgmma
    read shared memory past the kernel's allocation: compute-sanitizer memcheck, docs/kernels.md "Kernel memory
    safety"), and the interpreter runs the kernels' Python in numpy, with no warps, shared memory or wgmma. This test
    checks on CPU what can be checked:
    - every load, store and atomic of every kernel is inside the tensors of its launch (the bounds check of this
      module), so the kernels' own index arithmetic has no M-vs-D mix-up at these shapes;
    - the output and every gradient match the reference with outputs and scratch NaN-poisoned, over several
      checkpoint groups, a partial last group, and (four groups) the rotation of the backward's scratch sets;
    - the backward's cross-stream schedule names only launches already issued (`_Lanes` raises otherwise, in the
      interpreter too);
    - the launch configuration keeps 8-warp kernels off [64, D < 64] products (`warp_cap`): this part fails on the
      code before the fix, which launched the d K and output-path kernels with 8 warps here.
    The crash itself is covered on the GPU by tests/gpu/test_ttt_fuzz_gpu.py and compute-sanitizer
    (benchmarks/results/ttt_memcheck_h100.log)."""
    seed, results = interpreter_results
    res = results[len(CASES) + index]
    case = M64_CASES[index]
    assert res["fault"] is None, f"seed {seed}, case {case}: {res['fault']}"
    bad = {k: v for k, v in res["errors"].items() if not v <= TOL}
    assert set(res["errors"]) == set(NAMES) and not bad, f"seed {seed}, case {case}: relative errors over {TOL}: {bad}"
    assert set(res["warps"]) == {"forward/recompute", "output path", "reverse", "d K"}, res["warps"]
    too_many = {k: v for k, v in res["warps"].items() if max(v) > 4}
    assert not too_many, f"case {case}: kernels launched with more than 4 warps at M=64, D={case[3]}: {too_many}"


@pytest.mark.parametrize("index", range(len(SAMPLING_CASES)),
                         ids=[f"B{c[1]}H{c[2]}D{c[3]}M{c[4]}n{c[5]}" for c in SAMPLING_CASES])
def test_sampling_forward_matches_reference(interpreter_results, index):
    # the forward without gradients: its own form of the step at mini-batch 16 (no saves, the output write masked),
    # the training form at 64; output NaN-poisoned, every access bounds-checked
    seed, results = interpreter_results
    res = next(r for r in results if r.get("sampling") and r["case"] == list(SAMPLING_CASES[index]))
    assert res["fault"] is None, f"seed {seed}, case {res['case']}: {res['fault']}"
    assert res["errors"]["out"] <= TOL, f"seed {seed}, case {res['case']}: relative error {res['errors']['out']}"


@pytest.mark.parametrize("index", range(len(SPLIT_CASES)), ids=[f"{c[0]}-{c[2]}-{c[1]}" for c in SPLIT_CASES])
def test_call_past_32_bit_addressing_runs_in_parts(interpreter_results, index):
    """A scan whose q/k/v pass the kernels' 2^31-element limit (B = 2 at 63 s) runs as one kernel call per part
    (limit lowered here; B = 2, H = 2, 64 tokens of 16): one call per sample where a sample fits, one per sample and
    head where it does not, with TTT_KERNEL_GROUPS=serial the earlier cut (both samples, one head per call), and
    with TTT_KERNEL_GROUPS=one (for measurements) one call over everything.
    The output and every gradient are the reference's (relative error <= TOL)."""
    seed, results = interpreter_results
    kind, limit, schedule = SPLIT_CASES[index]
    res = results[len(CASES) + len(M64_CASES) + len(SAMPLING_CASES) + index]
    assert res["fault"] is None, f"seed {seed}: {res['fault']}"
    bad = {k: v for k, v in res["errors"].items() if not v <= TOL}
    names = NAMES if kind == "mlp" else NAMES[:-2]
    assert set(res["errors"]) == set(names) and not bad, f"seed {seed}, {kind}: relative errors over {TOL}: {bad}"
    expected = {(ONE_SAMPLE, "concurrent"): [[1, 2]] * 2, (ONE_HEAD, "concurrent"): [[1, 1]] * 4,
                (ONE_SAMPLE, "serial"): [[2, 1]] * 2, (ONE_SAMPLE, "one"): [[2, 2]]}[limit, schedule]
    assert res["calls"] == expected, res["calls"]
    # without gradients: the same calls, writing into one output, equal to one call's bit for bit
    assert res["no_grad_calls"] == expected and res["no_grad_equal"], res


def test_kernel_parts_cut_63s_guided_scan_by_sample():
    """The 63-s guided sampling scan (B = 2, 48 heads, 351,168 tokens of 64) runs as one call per sample, where the
    earlier cut ran 47 heads then 1; every part is under the limit and together they cover each (sample, head) once."""
    B, H, L, D = 2, 48, 351168, 64
    parts = ops.kernel_parts(B, H, L, D, ops.MAX_KERNEL_ELEMENTS)
    assert parts == [(slice(0, 1), slice(None)), (slice(1, 2), slice(None))]
    assert [h.stop - h.start for _, h in ops.serial_head_groups(B, H, L, D, ops.MAX_KERNEL_ELEMENTS)] == [47, 1]
    for B, H, limit in ((5, 7, 3 * 7 * 10), (3, 7, 3 * 10), (1, 48, 48 * 10 - 1), (4, 6, 6 * 10)):
        parts = ops.kernel_parts(B, H, 10, 1, limit)
        covered = torch.zeros(B, H, dtype=torch.int64)
        for s, h in parts:
            covered[s, h] += 1
            assert covered[s, h].numel() * 10 <= limit, (B, H, limit, parts)
        assert (covered == 1).all(), (B, H, limit, parts)
        for axis in (0, 1):  # near-equal parts: their sample (head) counts differ by at most one
            counts = {covered[s, h].shape[axis] for s, h in parts}
            assert max(counts) - min(counts) <= 1, (B, H, limit, parts)
    with pytest.raises(ValueError, match="one head"):
        ops.kernel_parts(1, 2, 10, 4, 39)


def test_parts_reassemble_in_sample_and_head_order():
    """_assemble puts each part's output back at its samples and heads (parts cut by samples, then by heads)."""
    x = torch.randn(3, 5, 4, 2)
    for parts in (ops.kernel_parts(3, 5, 4, 2, 5 * 8), ops.kernel_parts(3, 5, 4, 2, 2 * 8),
                  ops.serial_head_groups(3, 5, 4, 2, 3 * 8 * 2)):
        assert torch.equal(ops._assemble(parts, [x[s, h] for s, h in parts]), x), parts


def test_sampling_forward_at_mini_batch_16_takes_two_roles_at_four_warps(monkeypatch):
    # the launch shape alone (the kernel at that shape runs in tests/gpu): only a CUDA forward that saves nothing at
    # mini-batch 16 and the measured head shape changes; training forwards keep the launch they were measured at
    from tttvideo.ttt import triton_mlp

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TTT_MLP_SPLIT", raising=False)
    cuda = torch.device("cuda")
    assert triton_mlp.forward_shape(256, 16, 64, cuda, save=False) == (2, 4)
    assert triton_mlp.forward_shape(256, 16, 64, cuda, save=True) == (1, 8)
    assert triton_mlp.forward_shape(256, 64, 64, cuda, save=False) == (2, 8)
    assert triton_mlp.forward_shape(128, 16, 32, cuda, save=False) == (1, 8)
    assert triton_mlp.forward_shape(256, 16, 64, torch.device("cpu"), save=False)[0] == 1
    monkeypatch.setenv("TTT_MLP_SPLIT", "1")  # a measurement's override wins
    assert triton_mlp.forward_shape(256, 16, 64, cuda, save=False) == (1, 8)


def test_backward_schedule_refuses_a_dependency_not_issued():
    from tttvideo.ttt.triton_mlp import _Lanes

    lanes = _Lanes(torch.device("cpu"))
    ran = []
    lanes.run("serial", ("rc", 1), lambda: ran.append("rc1"))
    lanes.run("parallel", ("op", 1), lambda: ran.append("op1"), after=[("rc", 1)])
    with pytest.raises(RuntimeError, match="not issued"):
        lanes.run("serial", ("rev", 1), lambda: ran.append("rev1"), after=[("op", 1), ("dk", 3)])
    with pytest.raises(RuntimeError, match="issued twice"):
        lanes.run("serial", ("rc", 1), lambda: ran.append("again"))
    assert ran == ["rc1", "op1"]


def test_gpu_fuzz_runner_attributes_a_crash_and_reruns_the_rest(monkeypatch):
    """The runner of tests/gpu/ttt_fuzz.py (the GPU fuzz), on CPU through the interpreter: a worker that dies in a
    case charges that case alone, and the rest of its batch runs in a fresh process."""
    pytest.importorskip("triton")
    from tests.gpu import ttt_fuzz

    selected = [ttt_fuzz.Case("linear", 16, 16, 16, "1mb", 1, 1), ttt_fuzz.Case("mlp", 16, 16, 64, "1mb", 1, 1),
                ttt_fuzz.Case("mlp", 16, 16, 64, "1mb", 2, 1), ttt_fuzz.Case("mlp", 16, 16, 32, "1mb", 1, 2)]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TTT_FUZZ_ABORT_AT", selected[1].id)
    res = ttt_fuzz.fuzz(selected, jobs=2, case_timeout=120, verbose=False)["results"]
    assert [r["status"] for r in res.values()] == ["pass", "error", "pass", "pass"], res
    assert "process died" in res[selected[1].id]["error"]
    counts = ttt_fuzz.tally(selected, res)["by_kind"]
    assert counts == {"linear": {"cases": 1, "run": 1, "pass": 1}, "mlp": {"cases": 3, "run": 3, "pass": 2, "error": 1}}


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
