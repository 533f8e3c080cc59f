"""Run the setups whose reserved peak the planner under-predicts under that prediction: does the prediction hold?

    PYTHONPATH=src python3 benchmarks/plan_cap_check.py --list          # which rows it would run, and their caps
    PYTHONPATH=src python3 benchmarks/plan_cap_check.py --jobs 4        # on one GPU: run them, four processes at once

A free run's reserved peak is what the caching allocator kept, which on a card larger than the setup needs can be
more than the setup needs (freed blocks stay cached). So a held-out row of benchmarks/plan_accuracy.py whose measured
reserved peak is above the prediction by more than `--worse-than` (default 10 %) is run again here under
`memory.max_gpu_gib` = its predicted reserved peak plus `--margin` (default 5 %, `tttv plan`'s default margin), the
same config and overrides, `tttv profile --steps 2` in its own process (the study runner of
`tttvideo.memory.studies.matrix`): it either fits that cap (the prediction was enough; the allocator's reserve under
it is recorded) or runs out of memory (a plan that said "fits" wrongly). One GPU's rows only; rows of several GPUs
run under `benchmarks/stage_chain.py --cap-at-plan`. A row is left out when a capped run of its setup already
answers today's cap: it ran under a cap no larger than today's, or ran out of memory under a cap no smaller than
today's (a setup whose prediction grew past the cap it ran out of memory under runs again).

Rows run concurrently with --jobs (each its own process under its own cap: the caps are per process, so memory
figures are unaffected; times are contended and not recorded as step times). The JSON (default
benchmarks/results/plan_cap_check_<gpu>.json) is rewritten after every row; a rerun keeps finished rows and runs the
rest. benchmarks/plan_accuracy.py reads it: each row a held-out row run under the plan's cap.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:  # one module object for plan_accuracy, whether this runs as a script or is imported from the package
    from benchmarks import plan_accuracy, plan_accuracy_rows
except ImportError:  # run as a script: this folder is on sys.path
    import plan_accuracy
    import plan_accuracy_rows

GIB, ROOT, STEP_SETUP = plan_accuracy_rows.GIB, plan_accuracy_rows.ROOT, plan_accuracy_rows.STEP_SETUP


def candidates(worse_than: float, only: str | None = None, margin: float = 0.05) -> list[plan_accuracy_rows.Row]:
    """plan_accuracy's held-out one-GPU rows measured above their predicted reserved peak by more than `worse_than`
    (a share), each with its prediction, but for those whose setup has a run under a cap that already answers the
    plan's cap now (prediction + `margin`, `plan_accuracy_rows.cap_answers`). A setup whose prediction has grown past
    the cap it ran out of memory under runs again."""
    from tttvideo.memory.plan.costs import load_costs

    rows = plan_accuracy_rows.all_rows()
    costs = load_costs("h100")
    capped = plan_accuracy_rows.capped_runs(rows)
    out = []
    for row in rows:
        if row.role != "held out" or row.gpus != 1 or row.reserved is None or row.plan_cap is not None:
            continue
        if only and only not in row.name:
            continue
        row.predicted = plan_accuracy.predict_row(row, costs)
        cap = cap_of(row, margin)
        if plan_accuracy_rows.cap_answers(capped.get(plan_accuracy_rows.setup_key(row), []), cap):
            continue
        err = plan_accuracy.rel(row.predicted["reserved_gib"], row.reserved)
        if err is not None and err < -worse_than:
            out.append(row)
    return out


def cap_of(row: plan_accuracy_rows.Row, margin: float) -> float:
    """The allocator cap of a row: its predicted reserved peak plus `margin` of it, GiB (two decimals)."""
    return round(row.predicted["reserved_gib"] * (1 + margin), 2)


def run_row(row: plan_accuracy_rows.Row, cap: float, work: Path, timeout: float) -> dict:
    """`tttv profile --steps 2` of `row`'s setup under `cap` GiB, in its own process -> the result row."""
    from tttvideo.layout import parse_duration
    from tttvideo.memory.studies.matrix import Matrix, Variant, run_variant

    config = ROOT / row.config if row.config else None
    overrides = (STEP_SETUP if row.config is None else []) + row.overrides + [f"memory.max_gpu_gib={cap}"]
    r = run_variant(Matrix(Path(__file__), config, [], timeout_s=timeout),
                    Variant(f"{row.name} under {cap}", overrides, row.phase, 2), work)
    s = r.summary or {}
    totals = s.get("totals", {})

    def gib(x):
        return None if x is None else round(x / GIB, 3)

    return {"setup": row.name, "source": row.source, "config": row.config, "overrides": row.overrides,
            "phase": row.phase, "duration_s": parse_duration(plan_accuracy_rows.config_of(row).layout.duration),
            "free_reserved_gib": row.reserved, "free_allocated_gib": row.allocated,
            "predicted_reserved_gib": row.predicted["reserved_gib"], "cap_gib": cap, "status": r.status,
            "note": r.note, "process_s": round(r.seconds, 1), "peak_allocated_gib": gib(totals.get("peak_allocated")),
            "peak_reserved_gib": gib(totals.get("peak_reserved")), "step_s": s.get("step_seconds", [])}


def default_out() -> Path:
    import torch

    from tttvideo.memory.plan.costs import gpu_kind

    kind = gpu_kind(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"
    return ROOT / "benchmarks" / "results" / f"plan_cap_check_{kind}.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worse-than", type=float, default=0.10,
                    help="run rows measured above their predicted reserved peak by more than this share (0.10)")
    ap.add_argument("--margin", type=float, default=0.05, help="the cap: predicted reserved peak x (1 + this)")
    ap.add_argument("--only", default=None, help="only the rows whose name contains this text")
    ap.add_argument("--jobs", type=int, default=1, help="rows run at once (one process each)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per row")
    ap.add_argument("--work", default="runs/plan_cap_check", help="folder for the profiler's output")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/plan_cap_check_<gpu>.json)")
    ap.add_argument("--list", action="store_true", help="print the rows and their caps; run nothing")
    args = ap.parse_args(argv)
    if args.worse_than < 0 or args.margin < 0 or args.jobs < 1:
        ap.error("--worse-than and --margin are shares, 0 or more; --jobs is 1 or more")
    rows = candidates(args.worse_than, args.only, args.margin)
    for row in rows:
        print(f"{row.name[:70]:<70} free {row.reserved:6.2f} GiB, predicted {row.predicted['reserved_gib']:6.2f}, "
              f"cap {cap_of(row, args.margin):6.2f}", flush=True)
    if args.list or not rows:
        print("nothing to run" if not rows else "", flush=True)
        return 0

    import torch

    from tttvideo.memory.profile.profiler import git_commit
    from tttvideo.results import save_json

    out = Path(args.out) if args.out else default_out()
    old = json.loads(out.read_text()) if out.is_file() else {}
    done = [r for r in old.get("rows", []) if r.get("status") in ("ok", "oom")]
    todo = [r for r in rows if (r.name, cap_of(r, args.margin)) not in {(d["setup"], d["cap_gib"]) for d in done}]
    result = {"benchmark": "plan_cap_check", "device": torch.cuda.get_device_name() if torch.cuda.is_available()
              else "cpu", "torch": torch.__version__, "git_commit": git_commit(), "gpus": 1, "margin": args.margin,
              "command": "python3 benchmarks/plan_cap_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rows": done}
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    lock = threading.Lock()

    def one(row):
        r = run_row(row, cap_of(row, args.margin), work, args.timeout)
        with lock:
            result["rows"].append(r)
            save_json(out, result)
            print(f"{r['status']:<6} {r['setup'][:60]:<60} cap {r['cap_gib']:.2f}: reserved "
                  f"{r['peak_reserved_gib']} allocated {r['peak_allocated_gib']} {r['note']}", flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, todo))
    print(f"\n{'setup':<62} {'free':>6} {'pred':>6} {'cap':>6} {'resv':>6} {'alloc':>6} status")
    for r in result["rows"]:
        print(f"{r['setup'][:62]:<62} {r['free_reserved_gib']:6.2f} {r['predicted_reserved_gib']:6.2f} "
              f"{r['cap_gib']:6.2f} {r['peak_reserved_gib'] or 0:6.2f} {r['peak_allocated_gib'] or 0:6.2f} "
              f"{r['status']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
