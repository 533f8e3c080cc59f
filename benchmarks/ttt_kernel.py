"""TTT scan kernels on one GPU: time, achieved TFLOP/s, accuracy, and the SDPA yardstick, in one run.

    PYTHONPATH=src python3 benchmarks/ttt_kernel.py [--lengths 18048 51456 351168] [--out DIR] [--commit SHA]
    PYTHONPATH=src python3 benchmarks/ttt_kernel.py --compile-only      # no GPU needed: sm_80 / sm_89 / sm_90

(PYTHONPATH=src is not needed with the package installed.) Inputs and the accuracy check come from
tttvideo.ttt.testing; benchmarks/ttt_accuracy.py and benchmarks/ttt_layer_glue.py import this script's timer and
JSON writer (as `benchmarks.ttt_kernel` under `python -m`, or from their own folder when run as scripts).

B=1, H=48, head dim 64; TTT-MLP with mini-batch 64, TTT-Linear with 16; bf16 inputs, checkpoint group 16.
"fwd" is the training forward (checkpoints saved, as under autograd), "fwd+bwd" adds the backward of a random
output gradient. Medians of CUDA-event timings after warm-up. FLOP counts (per token, per head):
  MLP forward 229.4 k (seven 64x64x256 GEMMs per mini-batch of 64: 7 * 2 * 64*64*256 / 64); the "model" count of
  forward+backward is 3x that (the usual 1 + 2 convention); the kernels execute more (the backward recomputes).
  Linear forward 24.6 k (three 16x64x64 GEMMs per mini-batch of 16).
Writes ttt_kernel.json (device, versions, commit, every row) to --out and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

from tttvideo.memory.profile.profiler import git_commit
from tttvideo.results import save_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, for the commit

B, H, D = 1, 48, 64
MLP_FLOP = 7 * 2 * 64 * 64 * 256 / 64  # per token per head, forward
LIN_FLOP = 3 * 2 * 16 * 64 * 64 / 16


def bench(fn, min_runs=5, budget_s=2.0):
    """Median ms over CUDA-event timed runs (after two warm-up calls), at least `min_runs`."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times, t_end = [], time.time() + budget_s
    while len(times) < min_runs or (time.time() < t_end and len(times) < 50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), len(times)


def kernel_info(module, *keys):
    info = {}
    for key in keys:
        k = module.LAUNCHED.get(key)
        if k is not None:
            info[key] = dict(regs=k.n_regs, spills=k.n_spills, shared=k.metadata.shared, warps=k.metadata.num_warps)
    return info or None


def split_tune(tune):
    """A variant's launch overrides for the forward ("fwd_*") and the backward ("bwd_*"), prefixes removed."""
    return ({k[4:]: v for k, v in tune.items() if k.startswith("fwd_")},
            {k[4:]: v for k, v in tune.items() if k.startswith("bwd_")})


def load_baseline(path):
    """A kernel module from a file (an earlier version of triton_mlp.py, for a same-run comparison)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ttt_baseline_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # the module finds its own backward kernels through sys.modules
    spec.loader.exec_module(mod)
    return mod


def time_scan(kind, L, group=16, module=None, **tune):
    from tttvideo.ttt import triton_linear, triton_mlp
    from tttvideo.ttt.testing import default_mini_batch, make_inputs

    m = default_mini_batch(kind)
    ins = make_inputs(kind, B, H, L, D, m, seed=L)
    mod = module or (triton_mlp if kind == "mlp" else triton_linear)
    fwd_fn = mod.mlp_forward if kind == "mlp" else mod.linear_forward
    bwd_fn = mod.mlp_backward if kind == "mlp" else mod.linear_backward
    x = [t.detach() for t in ins]
    dout = torch.randn_like(x[0])
    fwd_tune, bwd_tune = split_tune(tune)
    out_only = tune.get("output", True)

    def fwd():
        return fwd_fn(*x, m, group, True, output=out_only, **fwd_tune) if kind == "mlp" else \
            fwd_fn(*x, m, group, True, **fwd_tune)

    def fwd_bwd():
        _, ck = fwd()
        return bwd_fn(dout, *x[:6], ck, m, group, **bwd_tune)

    def infer():
        return fwd_fn(*x, m, group, False, **fwd_tune)

    ms_f, n_f = bench(fwd)
    row = dict(kind=kind, L=L, mini_batch=m, group=group, fwd_ms=ms_f, fwd_runs=n_f, fwd_kernel=kernel_info(mod, "fwd"))
    if module is not None:
        row["baseline"] = os.path.basename(getattr(module, "__file__", ""))
    if out_only:
        ms_fb, n_fb = bench(fwd_bwd)
        ms_i, _ = bench(infer)
        bwd = kernel_info(mod, "bwd", "bwd_recompute", "bwd_output", "bwd_reverse", "bwd_dk")
        row.update(fwdbwd_ms=ms_fb, fwdbwd_runs=n_fb, infer_ms=ms_i, bwd_kernel=bwd)
    flop = (MLP_FLOP if kind == "mlp" else LIN_FLOP) * B * H * L
    row["fwd_tflops"] = flop / ms_f / 1e9
    if "fwdbwd_ms" in row:
        row["fwdbwd_model_tflops"] = 3 * flop / row["fwdbwd_ms"] / 1e9
    row.update({k: str(v) for k, v in tune.items()})
    del ins
    x.clear()  # the closures above hold the list; emptying it frees the inputs
    torch.cuda.empty_cache()
    return row


def profile_scan(L, group=16, **tune):
    """GPU time per kernel name over one MLP forward+backward (torch.profiler), to see where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    from tttvideo.ttt import triton_mlp
    from tttvideo.ttt.testing import make_inputs

    m = 64
    x = [t.detach() for t in make_inputs("mlp", B, H, L, D, m, seed=L)]
    dout = torch.randn_like(x[0])
    fwd_tune, bwd_tune = split_tune(tune)

    def run():
        _, ck = triton_mlp.mlp_forward(*x, m, group, True, **fwd_tune)
        triton_mlp.mlp_backward(dout, *x[:6], ck, m, group, **bwd_tune)

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    totals = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0):
            totals[e.key] = (getattr(e, "self_device_time_total", 0) / 1e3, e.count)
    row = dict(kind="profile", L=L, kernels={k: dict(ms=v[0], calls=v[1]) for k, v in
                                            sorted(totals.items(), key=lambda kv: -kv[1][0])[:12]})
    row.update({k: str(v) for k, v in tune.items()})
    return row


def time_sdpa(L=18048):
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    g = torch.randn_like(f())
    ms_f, _ = bench(f)
    ms_fb, _ = bench(lambda: torch.autograd.grad(f(), (q, k, v), g))
    return dict(kind="sdpa", L=L, fwd_ms=ms_f, fwdbwd_ms=ms_fb)


# one machine instruction in cuobjdump -sass output: "/*0a40*/  FFMA R3, R4, R5, R6 ;"
SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", re.MULTILINE)

# the backward's scratch buffers held in the operand dtype (triton_mlp_bwd's docstring)
OPERAND_BUFFERS = ("GK1", "DZ1", "XS", "GPS", "GPPS", "G2S", "DQ1", "XQ", "S1", "DQ2")


def compile_only():
    """Compile every kernel for sm_80, sm_89 and sm_90 (no GPU needed) and report ptxas's resource use and the
    number of machine (SASS) instructions: the scan's step is a serial chain, so its instruction count matters."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tttvideo.ttt import triton_linear, triton_mlp, triton_mlp_bwd
    from tttvideo.ttt.triton_common import DOT_BF16, LN_EPS

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    act = {n: "*bf16" for n in ("Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV")}
    ints = ("H", "L", "NMB", "GROUP", "HW", "S_W1", "S_B1", "S_W2", "S_B2", "W1_SD", "W1_SE", "NSLOT", "I0", "CNT",
            "GSLOT")
    split = triton_mlp.split_for(256, 64, 64)  # TTT_MLP_SPLIT overrides it, as at run time
    warps = triton_mlp.warps_for(256, split)
    mlp = dict(D=64, E=256, M=64, DOT=DOT_BF16, EPS=LN_EPS)
    # the sampling forward at mini-batch 16, in its GPU launch shape (a torch.device needs no GPU to exist)
    sample_split, sample_warps = triton_mlp.forward_shape(256, 16, 64, torch.device("cuda"), False)
    kernels = [
        ("mlp_fwd", triton_mlp._mlp_fwd_kernel, warps,
         dict(mlp, SPLIT=split, SAVE=True, OUTPUT=True, SAVE_ACT=False, PREFETCH=1)),
        ("mlp_fwd_sample", triton_mlp._mlp_fwd_kernel, sample_warps,
         dict(mlp, M=16, SPLIT=sample_split, SAVE=False, OUTPUT=True, SAVE_ACT=False, PREFETCH=1)),
        ("mlp_bwd_recompute", triton_mlp._mlp_fwd_kernel, warps,
         dict(mlp, SPLIT=split, SAVE=True, OUTPUT=False, SAVE_ACT=True, PREFETCH=1)),
        ("mlp_bwd_output", triton_mlp_bwd._output_path_kernel, 8, dict(mlp, NC=triton_mlp_bwd.chunks_for(256, 8))),
        ("mlp_bwd_reverse", triton_mlp_bwd._reverse_kernel, warps, dict(mlp, SPLIT=split)),
        ("mlp_bwd_dk", triton_mlp_bwd._dk_kernel, 8,
         dict(D=64, E=256, M=64, DOT=DOT_BF16, NC=triton_mlp_bwd.chunks_for(256, 8))),
        ("linear_fwd", triton_linear._linear_fwd_kernel, triton_linear.FWD_WARPS,
         dict(D=64, M=16, DOT=triton_linear.DOT, EPS=LN_EPS, SAVE=True)),
        ("linear_bwd", triton_linear._linear_bwd_kernel, triton_linear.BWD_WARPS,
         dict(D=64, M=16, DOT=triton_linear.DOT, EPS=LN_EPS)),
    ]
    rows = []
    only = os.environ.get("TTT_COMPILE_KERNELS", "")
    for cc in [int(x) for x in os.environ.get("TTT_COMPILE_SM", "90,80,89").split(",")]:
        for name, fn, warps, consts in kernels:
            if only and name not in only.split(","):
                continue
            sig = {n: "constexpr" if n in consts else "i32" if n in ints else act.get(n, "*fp32") for n in fn.arg_names}
            if "SYNC" in sig:
                sig["SYNC"] = "*i32"
            for n in OPERAND_BUFFERS:  # the backward's scratch kept in the operand dtype
                if n in sig:
                    sig[n] = "*bf16"
            if name in ("mlp_bwd_output", "mlp_bwd_reverse", "mlp_bwd_dk", "mlp_bwd_recompute"):
                for n in ("SW1", "SW2"):  # the recomputed group states (the forward's checkpoints stay fp32)
                    if n in sig:
                        sig[n] = "*bf16"
            t0 = time.time()
            # the launcher's specialisation: 16-byte aligned pointers, sizes divisible by 16 (H=48, L, group 16)
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                     if sig[n].startswith("*") or n in ("H", "L", "GROUP")}
            k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", cc, 32),
                               options=dict(num_warps=warps, num_stages=1))
            path = f"/tmp/ttt_{name}_{cc}.cubin"
            with open(path, "wb") as f:
                f.write(k.asm["cubin"])
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True).stdout
            sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True).stdout
            line = next((ln.strip() for ln in usage.splitlines() if "REG:" in ln), "")
            fields = dict(p.split(":") for p in line.split() if ":" in p)
            mma = "wgmma" if "wgmma" in k.asm["ptx"] else "mma.sync" if "mma.sync" in k.asm["ptx"] else "none"
            row = dict(sm=cc, kernel=name, warps=warps, regs=int(fields.get("REG", -1)),
                       stack_bytes=int(fields.get("STACK", -1)), shared_bytes=k.metadata.shared, mma=mma,
                       sass_instructions=len(SASS_LINE.findall(sass)), compile_s=round(time.time() - t0, 1))
            print(row, flush=True)
            rows.append(row)
    return rows


def main():
    global H
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="*", default=[18048, 51456, 351168])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--commit", default=os.environ.get("TTT_COMMIT", ""))
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--no-check", action="store_true", help="skip the accuracy check")
    ap.add_argument("--baseline", default="", help="an earlier triton_mlp.py to time at the first length too")
    ap.add_argument("--kinds", nargs="*", default=["mlp", "linear"])
    ap.add_argument("--heads", type=int, default=48,
                    help="heads (streams at B = 1): 24 / 12 are what each rank scans under sp = 2 / 4 (the scan is "
                         "serial in tokens, parallel in streams, so fewer streams leave SMs idle; with TTT_MLP_SPLIT "
                         "this times more programs per stream)")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time of the MLP at the first length")
    ap.add_argument("--variants", action="store_true", help="also time kernel variants at the first length")
    ap.add_argument("--variant", action="append", default=[], type=json.loads,
                    help='a variant to time instead of the default ones, as JSON: {"fwd_SCR": true, "output": false}')
    args = ap.parse_args()
    H = args.heads
    import triton

    meta = dict(torch=torch.__version__, triton=triton.__version__, git_commit=args.commit or git_commit(), heads=H,
                split_override=os.environ.get("TTT_MLP_SPLIT"))
    if args.compile_only:
        res = dict(meta, mode="compile-only", rows=compile_only())
        write_json(args.out, "ttt_kernel_compile.json", res)
        return

    from tttvideo.ttt.testing import relative_errors

    meta["device"] = torch.cuda.get_device_name()
    rows = []
    if not args.no_check:
        for kind in args.kinds:
            t0 = time.time()
            errs = relative_errors(kind)
            rows.append(dict(kind=kind, check="bf16 vs fp32 reference, L=18048", errors=errs,
                             max_error=max(errs.values()), seconds=time.time() - t0))
            print(rows[-1], flush=True)
    rows.append(time_sdpa())
    print(rows[-1], flush=True)
    if args.baseline:
        rows.append(time_scan("mlp", args.lengths[0], module=load_baseline(args.baseline)))
        print(rows[-1], flush=True)
    for L in args.lengths:
        for kind in args.kinds:
            rows.append(time_scan(kind, L))
            print(rows[-1], flush=True)
    if args.variants or args.variant:
        L = args.lengths[0]
        for tune in args.variant or (dict(output=False), dict(fwd_num_warps=8, bwd_num_warps=8)):
            rows.append(time_scan("mlp", L, **tune))
            print(rows[-1], flush=True)
    if args.profile:
        for tune in [{}] + args.variant:
            rows.append(profile_scan(args.lengths[0], **tune))
            print(rows[-1], flush=True)
    res = dict(meta, rows=rows)
    write_json(args.out, "ttt_kernel.json", res)
    _table(res)




def write_json(out: str, name: str, res: dict) -> None:
    save_json(os.path.join(out, name), res)


def _table(res):
    sdpa = next(r for r in res["rows"] if r["kind"] == "sdpa")
    print(f"\n{res['device']}  torch {res['torch']}  triton {res['triton']}  commit {res['git_commit'][:10]}")
    print(f"SDPA flash attention, 18,048 tokens, 48 x 64: fwd {sdpa['fwd_ms']:.2f} ms, "
          f"fwd+bwd {sdpa['fwdbwd_ms']:.2f} ms")
    print(f"{'kind':7} {'L':>8} {'fwd ms':>9} {'TFLOP/s':>8} {'infer ms':>9} {'fwd+bwd ms':>11} {'model TF/s':>10} "
          f"{'fwd/SDPA':>9} {'f+b/SDPA':>9}")
    for r in res["rows"]:
        if r["kind"] in ("mlp", "linear") and "fwd_ms" in r:
            keys = [k for k in r if k in ("output", "baseline")
                    or k.startswith(("fwd_", "bwd_")) and not k.endswith(("_ms", "_kernel"))
                    and k != "fwd_runs" and k != "fwd_tflops"]
            tag = "" if not keys else " (" + ",".join(f"{k}={r[k]}" for k in keys) + ")"
            fb, nan = r.get("fwdbwd_ms", float("nan")), float("nan")
            print(f"{r['kind']:7} {r['L']:>8} {r['fwd_ms']:>9.2f} {r['fwd_tflops']:>8.1f} "
                  f"{r.get('infer_ms', nan):>9.2f} {fb:>11.2f} {r.get('fwdbwd_model_tflops', nan):>10.1f} "
                  f"{r['fwd_ms'] / sdpa['fwd_ms']:>9.2f} {fb / sdpa['fwdbwd_ms']:>9.2f}{tag}")
    for r in res["rows"]:
        if r["kind"] == "profile":
            tag = ",".join(f"{k}={v}" for k, v in r.items() if k.startswith(("fwd_", "bwd_")))
            print(f"profile L={r['L']} {tag}: " + "; ".join(f"{k[:40]} {v['ms']:.2f} ms/{v['calls']}"
                                                         for k, v in r["kernels"].items()))
    for r in res["rows"]:
        if "check" in r:
            print(f"accuracy {r['kind']}: max relative error {r['max_error']:.2e} ({r['check']})")
    for r in res["rows"]:
        if r.get("fwd_kernel"):
            print(f"{r['kind']} {r['L']} kernels: fwd {r['fwd_kernel']}  bwd {r.get('bwd_kernel')}")


if __name__ == "__main__":
    main()
