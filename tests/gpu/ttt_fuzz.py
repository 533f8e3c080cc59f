"""GPU fuzz of the Triton TTT kernels over every shape the dispatcher accepts (issue 13, "kernel memory safety").

Cases: TTT-MLP and TTT-Linear, head dim D in ops.KERNEL_HEAD_DIMS (16, 32, 64) x mini-batch M in
ops.KERNEL_MINI_BATCHES (16, 32, 64); the MLP at every hidden size E that ops.uncovered_reason accepts (powers of two
in [16, ops.KERNEL_MAX_HIDDEN]: 16 ... 256, so E = 4 D, the layer's, and the other widths a layer built with another
`mlp_expansion` would hand the kernels; Linear is square, E = D); times the length L: one mini-batch, one checkpoint
group, four groups (the backward's scratch sets rotate) and a partial last group (2.5 groups less one mini-batch),
at checkpoint group 16 (training's); times B in (1, 2, 3) and H in (1, 5, 48). 45 x 36 MLP + 9 x 36 Linear = 1,944.

Each case: bf16 inputs drawn as the layer produces them (tttvideo.ttt.testing.make_inputs, "spec-init": L2-normalised
q/k, eta = base_lr sigmoid(.) / (D M), W ~ N(0, 0.02), zero biases, ttt_norm (1, 0)), forward and the backward of a
random output gradient through ops (backend "triton", TTT_TRITON_POISON=1: every output and scratch buffer starts as
NaN), against the fp32 reference on the same (upcast) inputs: the output and every gradient (q, k, v, eta, norm w/b, W1,
b1, and W2, b2 for the MLP) within TOL = 2e-2 relative (||a - b|| / ||b||, the device tests' bound for bf16); NaN or inf
fails. A finite tensor over TOL is judged once more against what bf16 products alone cost on that draw: it passes if its
error is at most BF16_SLACK = 4 x that of the reference run with bf16 operands (`operand_dtype=torch.bfloat16`, the
precision of the kernels' products, without their bugs). Small tensors need it: a 16-element b1 gradient (one head, one
mini-batch of 32, hidden 16) came to 1.9e-2 on the H100, the worst of the 1,944 cases, and a sum over few tokens with
cancellation can cross 2e-2 on a fresh draw. On the gradients that come near TOL (W1, b1, W2, b2, k, q; Linear's v and
eta) the kernels err 1.0-2.1x the bf16 reference at L = 18,048 (benchmarks/results/ttt_accuracy_h100.json); where the
rounding of the bf16 output adds more (MLP out, v, eta and norm w/b 4-6x, its norm_b up to 17x; Linear norm w/b 5-6x)
the errors stayed at most 1.1e-2 over the 1,944 cases. A wrong index, an unwritten element or a stray read errs by O(1).
The result records the bf16 reference's errors and which tensors passed that way ("within_bf16_cost"; the JSON lists
those cases).

Processes: an illegal address poisons the CUDA context, so cases run in worker processes (one per (kind, D, M, E)
batch, several at once: --jobs). A worker that dies or hangs (--case-timeout) charges the case it was running and
the rest of its batch is rerun in a fresh process. --memcheck runs each case in its own process under
`compute-sanitizer --tool memcheck` and keeps its summary lines.

    PYTHONPATH=src:. python3 -m tests.gpu.ttt_fuzz [--jobs 8] [--out DIR] [--filter SUBSTR ...] [--memcheck]

Writes ttt_fuzz.json (device, torch, triton, commit, counts, every case) or, with --memcheck, ttt_memcheck.log, and
prints a table (cases run / passed / failed) last. tests/gpu/test_ttt_fuzz_gpu.py runs the same under pytest.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict

from tttvideo.ttt.testing import TOLERANCE as TOL

BF16_SLACK = 4.0
GROUP = 16
BATCHES = (1, 2, 3)
HEADS = (1, 5, 48)
# mini-batches per case, by name
LENGTHS = {"1mb": 1, "1group": GROUP, "4groups": 4 * GROUP, "partial": 2 * GROUP + GROUP // 2 - 1}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str
    D: int
    M: int
    E: int
    length: str
    B: int
    H: int

    @property
    def n(self) -> int:
        """Mini-batches: a name of LENGTHS, or "n<count>" (for hand-picked cases, e.g. --ids)."""
        return int(self.length[1:]) if self.length not in LENGTHS and self.length[:1] == "n" else LENGTHS[self.length]

    @property
    def L(self) -> int:
        return self.n * self.M

    @property
    def config(self) -> str:
        return f"{self.kind}-D{self.D}-M{self.M}-E{self.E}"

    @property
    def id(self) -> str:
        return f"{self.config}-{self.length}-B{self.B}-H{self.H}"

    @classmethod
    def parse(cls, text: str) -> "Case":
        kind, d, m, e, length, b, h = text.split("-")
        return cls(kind, int(d[1:]), int(m[1:]), int(e[1:]), length, int(b[1:]), int(h[1:]))


def accepted_hidden(kind: str, D: int) -> list[int]:
    from tttvideo.ttt import ops

    if kind == "linear":
        return [D]
    return [e for e in range(16, ops.KERNEL_MAX_HIDDEN + 1) if e & (e - 1) == 0]


def cases(kinds=("mlp", "linear")) -> list[Case]:
    """Every case (module docstring), each checked to be one the dispatcher hands to the kernels."""
    import torch

    from tttvideo.ttt import ops

    out = []
    for kind in kinds:
        for D, M in itertools.product(ops.KERNEL_HEAD_DIMS, ops.KERNEL_MINI_BATCHES):
            for E in accepted_hidden(kind, D):
                for length, B, H in itertools.product(LENGTHS, BATCHES, HEADS):
                    c = Case(kind, D, M, E, length, B, H)
                    reason = ops.uncovered_reason(kind, torch.empty(B, H, c.L, D, device="meta"), E, M)
                    assert reason is None, f"{c.id}: the dispatcher refuses it ({reason})"
                    out.append(c)
    return out


def run_case(case: Case, seed: int) -> dict:
    """Output and every gradient of the Triton path against the fp32 reference; {status, errors, worst, ...}."""
    import torch

    from tttvideo.ttt.testing import NAMES, errors_between, make_inputs, scan_with_grads

    os.environ["TTT_TRITON_POISON"] = "1"
    if os.environ.get("TTT_FUZZ_ABORT_AT") == case.id:  # the harness's own test: a worker that dies mid-case
        os._exit(9)
    t0 = time.time()
    # CPU only inside the Triton interpreter (the harness's own test), in fp32
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    ins = make_inputs(case.kind, case.B, case.H, case.L, case.D, case.M, dtype, seed, device, hidden=case.E)
    ref_ins = [t.detach().float() for t in ins]
    g = torch.Generator(device=device).manual_seed(seed + 1)
    dout = torch.randn(ref_ins[0].shape, device=device, generator=g)
    ref = scan_with_grads(case.kind, ref_ins, dout, case.M, GROUP)
    fast = scan_with_grads(case.kind, ins, dout, case.M, GROUP, backend="triton")
    if device == "cuda":
        torch.cuda.synchronize()
    names = NAMES if case.kind == "mlp" else NAMES[:-2]
    errors = errors_between(fast, ref)
    assert set(errors) == set(names), (sorted(errors), names)
    over = [k for k, v in errors.items() if not v <= TOL]
    res = {}
    if over and all(errors[k] == errors[k] for k in over):  # NaN / inf fails outright
        # what bf16 products alone cost on this draw (module docstring: BF16_SLACK)
        emulated = scan_with_grads(case.kind, ref_ins, dout, case.M, GROUP, operand_dtype=torch.bfloat16)
        res["bf16_reference"] = {k: errors_between(emulated, ref)[k] for k in over}
        res["within_bf16_cost"] = [k for k in over if errors[k] <= BF16_SLACK * res["bf16_reference"][k]]
    bad = [k for k in over if k not in res.get("within_bf16_cost", ())]
    worst = max(errors, key=lambda k: float("inf") if errors[k] != errors[k] else errors[k])
    return dict(status="fail" if bad else "pass", errors=errors, worst=worst, worst_error=errors[worst], **res,
                seconds=round(time.time() - t0, 2))


def worker(ids: list[str], seeds: dict, log_path: str) -> None:
    """Run cases in order, appending START / DONE lines to log_path. Any exception ends the process (after its
    DONE line): after an illegal address the CUDA context is unusable, and the driver reruns the rest."""
    with open(log_path, "a", buffering=1) as log:
        for cid in ids:
            log.write("START " + cid + "\n")
            try:
                res = run_case(Case.parse(cid), seeds[cid])
            except BaseException as e:  # noqa: BLE001 - reported as this case's result, then the process ends
                res = dict(status="error", error=f"{type(e).__name__}: {e}"[:500])
                log.write("DONE " + json.dumps(dict(id=cid, seed=seeds[cid], **res)) + "\n")
                log.flush()
                os._exit(3)
            log.write("DONE " + json.dumps(dict(id=cid, seed=seeds[cid], **res)) + "\n")


def _read_log(path: str) -> tuple[dict, str | None, float]:
    """(finished results by id, the id started but not finished, when that start was seen in the file)."""
    done, started = {}, None
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.startswith("START "):
                    started = line[6:].strip()
                elif line.startswith("DONE ") and line.endswith("\n"):
                    r = json.loads(line[5:])
                    done[r["id"]] = r
    return done, (started if started not in done else None), os.path.getmtime(path) if os.path.exists(path) else 0


def _worker_cmd(memcheck: bool) -> list[str]:
    cmd = [sys.executable, "-m", "tests.gpu.ttt_fuzz", "--worker"]
    if memcheck:
        cmd = ["compute-sanitizer", "--tool", "memcheck", "--print-limit", "8"] + cmd
    return cmd


def _run_batch(ids: list[str], seeds: dict, tmp: str, tag: str, case_timeout: float, memcheck: bool,
               progress, deadline: float) -> dict:
    """Run a batch of cases in worker processes until each has a result; returns {id: result}. Past `deadline`
    (time.time()) no process starts: the cases left are "not run"."""
    results, todo, attempt = {}, list(ids), 0
    if time.time() > deadline:
        return {c: dict(id=c, seed=seeds[c], status="not run") for c in ids}
    env = dict(os.environ, TTT_TRITON_POISON="1", PYTHONPATH=os.pathsep.join(
        p for p in (os.path.join(ROOT, "src"), ROOT, os.environ.get("PYTHONPATH", "")) if p))
    while todo:
        attempt += 1
        log_path = os.path.join(tmp, f"{tag}.{attempt}.log")
        spec_path = os.path.join(tmp, f"{tag}.{attempt}.json")
        with open(spec_path, "w") as f:
            json.dump(dict(ids=todo, seeds={c: seeds[c] for c in todo}, log=log_path), f)
        out_path = os.path.join(tmp, f"{tag}.{attempt}.out")
        with open(out_path, "w") as out:
            proc = subprocess.Popen(_worker_cmd(memcheck) + [spec_path], cwd=ROOT, env=env, stdout=out,
                                    stderr=subprocess.STDOUT)
            last, last_change, timed_out = None, time.time(), False
            while proc.poll() is None:
                time.sleep(0.5)
                _, started, _ = _read_log(log_path)
                if started != last:
                    last, last_change = started, time.time()
                # the first case of a process also compiles its kernels
                if started is not None and time.time() - last_change > case_timeout:
                    proc.kill()
                    proc.wait()
                    timed_out = True
        done, started, _ = _read_log(log_path)
        with open(out_path, errors="replace") as f:
            tail = f.read()[-20000:]
        if started is not None:
            why = "timeout" if timed_out else f"process died (exit {proc.returncode})"
            last_lines = " | ".join([ln for ln in tail.splitlines() if ln.strip()][-6:])[-800:]
            done[started] = dict(id=started, seed=seeds[started], status="error", error=f"{why}: {last_lines}")
        elif not done and todo:  # died before starting anything: charge the first case, do not loop forever
            done[todo[0]] = dict(id=todo[0], seed=seeds[todo[0]], status="error",
                                 error=f"worker exit {proc.returncode} before its first case: {tail[-800:]}")
        if memcheck:  # one case per process: the sanitizer's report is that case's
            (cid,) = done
            lines = [ln for ln in tail.splitlines() if ln.startswith("=========") and "Host Frame" not in ln]
            done[cid]["memcheck"] = _memcheck_summary(lines)
            if done[cid]["memcheck"]["errors"] != 0 and done[cid]["status"] == "pass":
                done[cid]["status"] = "fail"
        for cid, r in done.items():
            if cid not in results:
                results[cid] = r
                progress(r)
        todo = [c for c in todo if c not in results]
    return results


def _memcheck_summary(lines: list[str]) -> dict:
    summary = next((ln for ln in lines if "ERROR SUMMARY" in ln), None)
    errors = int(summary.split("ERROR SUMMARY:")[1].split()[0]) if summary else None
    detail = [ln for ln in lines if "ERROR SUMMARY" not in ln and "COMPUTE-SANITIZER" not in ln][:12]
    return dict(errors=errors, summary=summary, detail=detail)


def fuzz(selected: list[Case], jobs: int = 8, case_timeout: float = 240.0, memcheck: bool = False, seed=None,
         verbose: bool = True, budget_s: float = float("inf")) -> dict:
    """Run `selected` cases; returns {"results": {id: result}, "meta": ...}. No worker starts after budget_s."""
    from concurrent.futures import ThreadPoolExecutor

    base = seed if seed is not None else random.randrange(2**30)
    seeds = {c.id: base + 7919 * i for i, c in enumerate(selected)}
    if memcheck:  # one case per process, so every sanitizer report belongs to its case
        batches = [[c.id] for c in selected]
    else:
        by_config = defaultdict(list)
        for c in selected:
            by_config[c.config].append(c.id)
        batches = list(by_config.values())
    counts, t0 = Counter(), time.time()

    def progress(r):
        counts[r["status"]] += 1
        if verbose and (r["status"] != "pass" or sum(counts.values()) % 100 == 0):
            extra = r.get("error") or f"{r.get('worst')} {r.get('worst_error', 0):.3g}"
            print(f"[{sum(counts.values())}/{len(selected)} {time.time() - t0:.0f}s] {r['id']} {r['status']} {extra}",
                  flush=True)

    results = {}
    with tempfile.TemporaryDirectory(prefix="ttt_fuzz_") as tmp, ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(_run_batch, b, seeds, tmp, f"b{i}", case_timeout, memcheck, progress, t0 + budget_s)
                   for i, b in enumerate(batches)]
        for f in futures:
            results.update(f.result())
    ordered = {c.id: results[c.id] for c in selected}
    return dict(meta=dict(base_seed=base, seconds=round(time.time() - t0, 1), jobs=jobs, tol=TOL, group=GROUP,
                          memcheck=memcheck), results=ordered)


def tally(selected: list[Case], results: dict) -> dict:
    """Counts by kind and by (kind, D, M): cases / run / pass / fail / error / not run."""
    by_kind, by_cfg = defaultdict(Counter), defaultdict(Counter)
    for c in selected:
        st = results[c.id]["status"]
        for table, key in ((by_kind, c.kind), (by_cfg, f"{c.kind}-D{c.D}-M{c.M}")):
            table[key]["cases"] += 1
            table[key]["run"] += st != "not run"
            table[key][st] += 1
    return dict(by_kind={k: dict(v) for k, v in by_kind.items()}, by_shape={k: dict(v) for k, v in by_cfg.items()})


def table(counts: dict) -> str:
    cols = ("cases", "run", "pass", "fail", "error")
    rows = [("", "cases", "run", "passed", "failed", "error")]
    total = Counter()
    for c in counts["by_kind"].values():
        total.update(c)
    for key, c in [*counts["by_shape"].items(), ("-" * 16, None), *counts["by_kind"].items(), ("total", total)]:
        rows.append((key, *(("",) * 5 if c is None else (c.get(k, 0) for k in cols))))
    return "\n".join(f"{r[0]:<16} {r[1]:>6} {r[2]:>6} {r[3]:>7} {r[4]:>7} {r[5]:>6}" for r in rows)


def _finite(x):
    """NaN / inf as strings, so the JSON is strict."""
    if isinstance(x, float) and not (x == x and abs(x) < float("inf")):
        return repr(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def environment() -> dict:
    import torch
    import triton

    from tttvideo.memory.profile.profiler import git_commit

    commit = os.environ.get("TTT_COMMIT") or git_commit()  # git_commit: $GIT_COMMIT, else this checkout's HEAD
    return dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                torch=torch.__version__, triton=triton.__version__, git_commit=commit or None,
                date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    ap.add_argument("--jobs", type=int, default=8, help="worker processes at once")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON / memcheck log")
    ap.add_argument("--filter", nargs="*", default=[], help="keep cases whose id contains every one of these")
    ap.add_argument("--ids", nargs="*", default=[], help="exactly these case ids (Case.id; length 'n<count>' too)")
    ap.add_argument("--kinds", nargs="*", default=["mlp", "linear"])
    ap.add_argument("--memcheck", action="store_true", help="each case under compute-sanitizer memcheck")
    ap.add_argument("--case-timeout", type=float, default=240.0)
    ap.add_argument("--budget", type=float, default=float("inf"), help="seconds after which no worker starts")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--name", default="", help="output file name (default ttt_fuzz.json / ttt_memcheck.log)")
    args = ap.parse_args(argv)
    if args.worker:
        with open(args.spec) as f:
            spec = json.load(f)
        worker(spec["ids"], spec["seeds"], spec["log"])
        return 0
    if args.ids:
        selected = [Case.parse(i) for i in args.ids]
    else:
        selected = [c for c in cases(tuple(args.kinds)) if all(s in c.id for s in args.filter)]
    env = environment()
    print(f"{len(selected)} cases on {env['device']} (torch {env['torch']}, triton {env['triton']}, "
          f"commit {env['git_commit']})", flush=True)
    run = fuzz(selected, args.jobs, args.case_timeout, args.memcheck, args.seed, budget_s=args.budget)
    counts = tally(selected, run["results"])
    bad = {k: v for k, v in run["results"].items() if v["status"] != "pass"}
    os.makedirs(args.out, exist_ok=True)
    if args.memcheck:
        path = os.path.join(args.out, args.name or "ttt_memcheck.log")
        with open(path, "w") as f:
            f.write(f"# compute-sanitizer --tool memcheck, one process per case; {env}\n")
            f.write(f"# tolerance {TOL} relative on the output and every gradient; checkpoint group {GROUP}\n")
            for cid, r in run["results"].items():
                mc = r.get("memcheck") or {}
                f.write(f"{cid}: {r['status']}; {mc.get('summary') or 'no sanitizer summary'}"
                        f"{'; ' + r['error'] if r.get('error') else ''}\n")
                for ln in mc.get("detail", []) if mc.get("errors") else []:
                    f.write(f"    {ln}\n")
            f.write(table(counts) + "\n")
    else:
        path = os.path.join(args.out, args.name or "ttt_fuzz.json")
        worst = defaultdict(float)
        for c in selected:
            for k, v in run["results"][c.id].get("errors", {}).items():
                worst[f"{c.kind}:{k}"] = max(worst[f"{c.kind}:{k}"], v if v == v else float("inf"))
        keep = ("status", "seed", "worst", "worst_error", "seconds", "error", "within_bf16_cost", "bf16_reference")
        compact = {cid: {k: r[k] for k in keep if k in r}
                   for cid, r in run["results"].items()}
        worst = {k: (v if v < float("inf") else "nan or inf") for k, v in worst.items()}
        with open(path, "w") as f:
            json.dump(_finite(dict(env, **run["meta"], cases=len(selected), counts=counts,
                           passed=sum(r["status"] == "pass" for r in run["results"].values()),
                           passed_within_bf16_cost=sorted(k for k, r in run["results"].items()
                                                          if r["status"] == "pass" and r.get("within_bf16_cost")),
                           failed={k: v for k, v in bad.items()}, worst_error_by_tensor=dict(worst),
                           axes=dict(head_dims="ops.KERNEL_HEAD_DIMS", mini_batches="ops.KERNEL_MINI_BATCHES",
                                     mlp_hidden="powers of two in [16, ops.KERNEL_MAX_HIDDEN]", lengths=LENGTHS,
                                     batches=BATCHES, heads=HEADS, group=GROUP),
                           results=compact)), f, indent=1)
    for cid, r in list(bad.items())[:20]:
        print("NOT PASSED", cid, r.get("error") or {k: round(v, 4) for k, v in r.get("errors", {}).items()})
    print(f"wrote {path}")
    print(table(counts))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
