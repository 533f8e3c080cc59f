"""Measure the planner's per-token costs on a GPU, fit them, and check the predictions against held-out runs.

    # on the GPU: profile every setup (one process each), keep the measurements
    PYTHONPATH=src python3 benchmarks/plan_calibration.py run --gpu-kind h100 \\
        --out benchmarks/results/plan_calibration_h100.json --also benchmarks/results/fit_24gb_h100.json
    # anywhere: fit the costs from the calibration setups, write src/tttvideo/memory/plan/costs.json, and print
    # predicted against measured for every setup (the held-out ones are the test)
    PYTHONPATH=src python3 benchmarks/plan_calibration.py fit benchmarks/results/plan_calibration_h100.json \\
        --also benchmarks/results/fit_24gb_h100.json
    # on the GPU: run the planner's choice for 24, 48 and 80 GiB cards at 3 and 9 s under each card's cap
    PYTHONPATH=src python3 benchmarks/plan_calibration.py check --out benchmarks/results/plan_check_h100.json

A setup is a config, a phase, a duration and `--set` overrides; `run` profiles it with `tttv profile --steps 2`
(random init, no cap, the expandable allocator segments `tttv` sets by default) and records the peak allocated
memory and the second step's time. `fit` subtracts the counted part (`tttvideo.memory.plan.count`) from each
measured peak and keeps the activation per regime as a curve (and what the allocator reserved above the peak, as
another) through the calibration durations of `SETUPS` (each memory technique's `calibration`,
`tttvideo.memory.techniques`; `tttvideo.memory.plan.costs.Curve`), and step time
likewise, each step less its optimizer step (`--optimizer-step`: benchmarks/optimizer_step.py's JSON, fitted per
optimizer by `tttvideo.memory.plan.optimizer_time`; a profile step holds one), then it predicts every setup (at one
micro-batch a step, as profiled) and prints the errors. `--also` takes the profiler runs of benchmarks/fit_24gb.py's
JSON as the setups with the same switches (so they are not measured twice).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
from pathlib import Path

from tttvideo.memory.techniques import calibration_setups
from tttvideo.results import save_json

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
NO_WEIGHTS = ["model.pretrained_path=", "train.init_from=", "memory.max_gpu_gib=0"]
# Every registered memory technique's calibration setups (`MemoryTechnique.calibration`), in run order. A setup's
# measurement may also come from `--also` (benchmarks/fit_24gb.py's JSON): a run there with the same resolved
# switches counts as this setup's.
SETUPS = calibration_setups()


def measure(name: str, config: str, phase: str, duration: str, overrides: list[str], work: Path,
            timeout: float) -> dict:
    """One `tttv profile --steps 2` in its own process (`tttvideo.memory.studies.matrix.run_variant`) -> the row `fit`
    reads."""
    from tttvideo.memory.studies.matrix import Matrix, Variant, run_variant

    r = run_variant(Matrix(Path(__file__), ROOT / config, [], timeout_s=timeout),
                    Variant(f"{name} @ {duration}", NO_WEIGHTS + [f"layout.duration={duration}"] + overrides, phase,
                            2), work)
    row = {"config": config, "phase": phase, "duration": duration, "overrides": overrides,
           "exit_code": r.exit_code, "status": r.status}
    s = r.summary
    if s is None:
        row["error"] = r.note
    else:
        row.update(peak_allocated=s["totals"]["peak_allocated"], peak_reserved=s["totals"]["peak_reserved"],
                   step_seconds=s.get("step_seconds", []), oom=(s.get("oom") or {}).get("location"))
    return row


def cmd_run(args) -> int:
    import torch

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    out = Path(args.out)
    # a rerun (another machine, after a time limit) keeps what an earlier one measured and runs the rest
    rows = [r for r in json.loads(out.read_text())["setups"] if r.get("status") in ("ok", "oom")] \
        if out.is_file() else []
    done = {(r["name"], r["duration"]) for r in rows + also_rows(args.also, rows)}
    for setup in SETUPS:
        name, config, phase, overrides, cal = (setup.name, setup.config, setup.phase, list(setup.overrides),
                                               setup.calibrate)
        if args.only and args.only not in name:
            continue
        for duration in cal + setup.held_out:
            if (name, duration) in done or (args.durations and duration not in args.durations.split(",")):
                continue
            print(f"{name} @ {duration}", flush=True)
            row = measure(name, config, phase, duration, overrides + args.overrides, work, args.timeout)
            row.update(name=name, calibrate=duration in cal)
            rows.append(row)
            print(f"  {row['status']} peak {row.get('peak_allocated', 0) / GIB:.2f} GiB, steps "
                  f"{row.get('step_seconds')}", flush=True)
            save_json(out, _result(rows, args, torch))
    return 0


def _result(rows, args, torch) -> dict:
    from tttvideo.memory.profile.profiler import git_commit

    commit = git_commit()
    return {"benchmark": "plan_calibration", "gpu_kind": args.gpu_kind,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "git_commit": commit, "setups": rows}


def _config(row: dict):
    from tttvideo.config.loader import load_config

    duration = [f"layout.duration={row['duration']}"] if row.get("duration") else []  # None: the config's own
    cfg = load_config(ROOT / row["config"], NO_WEIGHTS + setup_overrides(row) + duration + row["overrides"])
    row["duration"] = cfg.layout.duration
    return cfg


def setup_overrides(row: dict) -> list[str]:
    """The overrides of the setup a measured row is named after, before the row's own: a setup that pins what its
    config file has changed since (the QKVO setups' fp32 weights) costs what ran, not what the file says now."""
    return next((list(s.overrides) for s in SETUPS if f"{row['name']}".split(" @ ")[0] == s.name), [])


def signature(cfg, phase: str) -> str:
    """What a setup's peak and step time depend on: every switch except the duration and the memory cap (a cap
    changes when the allocator frees its cache, not what the tensors take)."""
    from dataclasses import asdict

    d = {k: asdict(getattr(cfg, k)) for k in ("model", "ttt", "layout", "checkpointing", "memory")}
    d["model"].pop("pretrained_path")
    d["layout"].pop("duration")
    d["memory"].pop("max_gpu_gib")
    d["train"] = {"optimizer": cfg.train.optimizer, "batch_size": cfg.train.batch_size}
    d["sample"] = {k: getattr(cfg.sample, k) for k in ("cfg_batched", "offload_blocks", "prefetch_blocks")}
    return json.dumps([phase, d], sort_keys=True, default=str)


def also_rows(paths: list[str], measured: list[dict]) -> list[dict]:
    """The `--also` runs, each named after the setup with the same switches (calibration or held out as that setup
    lists its duration), left out where the run JSON measured that setup and duration itself, and held out under
    their own name where no setup matches."""
    from tttvideo.config.loader import load_config

    known = {signature(load_config(ROOT / s.config, NO_WEIGHTS + list(s.overrides)), s.phase): (s.name, s.calibrate)
             for s in SETUPS}
    have = {(r["name"], r["duration"]) for r in measured}
    out = []
    for path in paths:
        for r in rows_from_fit_24gb(Path(path)):
            name, cal = known.get(signature(_config(r), r["phase"]), (r["name"], []))
            if (name, r["duration"]) not in have:
                have.add((name, r["duration"]))
                out.append({**r, "name": name, "calibrate": r["duration"] in cal})
    return out


def rows_from_fit_24gb(path: Path) -> list[dict]:
    """The `tttv profile` runs of benchmarks/fit_24gb.py's JSON, as rows of this benchmark."""
    from tttvideo.config.loader import load_config

    data = json.loads(path.read_text())
    runs = data.get("sample", {}).get("variants", []) + data.get("train_profile", {}).get("runs", [])
    out = []
    for r in runs:
        if r.get("status") != "ok":
            continue
        argv = shlex.split(r["command"])
        # the config as a repository path, wherever the repository was when the run wrote its command
        given = Path(argv[argv.index("profile") + 1])
        config = str(Path(*given.parts[given.parts.index("configs"):])) if "configs" in given.parts else str(given)
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        duration = next((s.split("=", 1)[1] for s in sets if s.startswith("layout.duration=")), None)
        sets = [s for s in sets if not s.startswith("layout.duration=")
                and s.split("=", 1)[0] not in ("model.pretrained_path", "train.init_from")]
        # a run under a cap (its --set, else its config's) reserved what the cap let it keep: no reserve point
        capped = load_config(ROOT / config, NO_WEIGHTS[:2] + sets).memory.max_gpu_gib > 0
        out.append({"name": r.get("variant") or r.get("config"), "config": config,
                    "phase": argv[argv.index("--phase") + 1], "duration": duration, "overrides": sets,
                    "status": "ok", "peak_allocated": r["totals"]["peak_allocated"],
                    **({} if capped else {"peak_reserved": r["totals"]["peak_reserved"]}),
                    "step_seconds": r.get("step_s", []), "calibrate": False, "source": str(path)})
    return out


def _shared_floors(floors: dict[str, float]) -> dict[str, float]:
    """The chunked regimes' floors, each the least over every chunked regime of the same preset and dtype: the phase
    outside the scan does not depend on the head groups, so each regime's runs bound the same fixed part."""
    family = lambda key: re.sub(r"\|chunked-g\d+", "|chunked", key)  # noqa: E731 - the key less its head groups
    least: dict[str, float] = {}
    for key, value in floors.items():
        least[family(key)] = min(least.get(family(key), float("inf")), value)
    return {key: max(0.0, least[family(key)]) for key in floors}


def calibrates(row: dict) -> bool:
    """Whether a measured setup calibrates the curves: the design's durations (SETUPS), not what they were when the
    run wrote its JSON (a row of a setup no longer designed keeps its own flag)."""
    design = {s.name: s.calibrate for s in SETUPS}
    return row["duration"] in design[row["name"]] if row["name"] in design else bool(row.get("calibrate", False))


def optimizer_costs(path: str | None, gpu: str) -> dict:
    """Per optimizer, one step's fitted cost from benchmarks/optimizer_step.py's JSON at `path` (or this GPU kind's
    committed one); {} where there is none."""
    from tttvideo.memory.plan.optimizer_time import fit_optimizer_costs

    file = Path(path) if path else ROOT / "benchmarks" / "results" / f"optimizer_step_{gpu}.json"
    if not file.is_file():
        if path:
            raise SystemExit(f"--optimizer-step: {path} does not exist")
        print(f"no {file.relative_to(ROOT)}: the time curves keep the profiles' optimizer steps")
        return {}
    costs = fit_optimizer_costs(json.loads(file.read_text())["rows"])
    for name, cost in costs.items():
        print(f"{name} step: {1e3 * cost.per_tensor_s:.3f} ms a trainable tensor + "
              f"{1e12 * cost.per_gradient_byte_s:.2f} s a TB of gradients ({file.name})")
    return costs


def cmd_fit(args) -> int:
    from tttvideo.layout import VideoLayout
    from tttvideo.memory.plan.costs import CostTable, Curve, activation_key, chunked_floor_streams, save_costs, time_key
    from tttvideo.memory.plan.count import count
    from tttvideo.memory.plan.optimizer_time import optimizer_step_s

    data = json.loads(Path(args.measured).read_text()) if args.measured else {"gpu_kind": None, "setups": []}
    rows = [{**r, "calibrate": calibrates(r)} for r in data["setups"] if r.get("status") == "ok"]
    rows += also_rows(args.also, rows)
    if not data.get("device") and args.also:
        data["device"] = json.loads(Path(args.also[0]).read_text()).get("device", "")
    if not rows:
        raise SystemExit("no measured setup to fit")
    gpu = args.gpu_kind or data["gpu_kind"] or "h100"
    optimizer = optimizer_costs(args.optimizer_step, gpu)
    points: dict[str, dict[str, list]] = {"activation": {}, "time": {}}
    reserve: dict[str, list] = {}  # per regime: (tokens, reserved - allocated at the peak) of its calibration runs
    floors: dict[str, float] = {}  # per chunked regime: the least (activation - FLOOR_STREAMS streams), costs.py
    prepared = []
    for r in rows:
        cfg = _config(r)
        phase = r["phase"]
        tokens = VideoLayout.from_config(cfg.layout, cfg.ttt).total_tokens * (cfg.train.batch_size if phase == "train"
                                                                               else 1)
        counted = count(cfg, phase).total
        # a profile step is one micro-batch and one optimizer step: the curves hold the rest
        opt_s = (optimizer_step_s(optimizer, cfg) or 0.0) if phase == "train" else 0.0
        prepared.append((r, cfg, phase, tokens, counted, opt_s))
        if r.get("calibrate"):
            points["activation"].setdefault(activation_key(cfg, phase), []).append(
                (tokens, r["peak_allocated"] - counted))
            if r.get("peak_reserved"):
                reserve.setdefault(activation_key(cfg, phase), []).append(
                    (tokens, r["peak_reserved"] - r["peak_allocated"]))
            if r.get("step_seconds"):
                points["time"].setdefault(time_key(cfg, phase), []).append((tokens, r["step_seconds"][-1] - opt_s))
            streams = chunked_floor_streams(cfg) if phase == "sample" else None
            if streams is not None:
                key = activation_key(cfg, phase)
                floors[key] = min(floors.get(key, float("inf")), r["peak_allocated"] - counted - streams)
    sources = ", ".join(str(x) for x in ([args.measured] if args.measured else []) + args.also)
    table = CostTable(gpu, data.get("device", ""), sources,
                      {k: Curve.fit(v) for k, v in points["activation"].items()},
                      {k: Curve.fit(v) for k, v in points["time"].items()},
                      {int(k): v for k, v in (args.sp_efficiency or {}).items()},
                      {k: Curve.fit(v) for k, v in reserve.items()}, None,
                      _shared_floors(floors), optimizer)
    save_costs(table, *([Path(args.costs_out)] if args.costs_out else []))
    print(f"wrote {len(table.activation)} activation and {len(table.time)} time regimes for {table.gpu}")
    print("\n| setup | duration | calibration? | measured peak GiB | predicted GiB | error | measured s | "
          "predicted s | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    mem_err, time_err = [], []
    for r, cfg, phase, tokens, counted, opt_s in prepared:
        act = table.activation.get(activation_key(cfg, phase))
        tim = table.time.get(time_key(cfg, phase))
        pred = None if act is None else counted + max(act(tokens), table.floor(cfg, phase) or 0)
        pred_s = None if tim is None else tim(tokens) + opt_s
        meas_s = r["step_seconds"][-1] if r.get("step_seconds") else None
        e_m = None if pred is None else (pred - r["peak_allocated"]) / r["peak_allocated"]
        e_t = None if pred_s is None or not meas_s else (pred_s - meas_s) / meas_s
        if not r.get("calibrate"):
            if e_m is not None:
                mem_err.append(abs(e_m))
            if e_t is not None:
                time_err.append(abs(e_t))
        print(f"| {r['name']} | {r['duration']} | {'yes' if r.get('calibrate') else 'held out'} | "
              f"{r['peak_allocated'] / GIB:.2f} | {'' if pred is None else f'{pred / GIB:.2f}'} | "
              f"{'' if e_m is None else f'{100 * e_m:+.1f}%'} | {'' if meas_s is None else f'{meas_s:.2f}'} | "
              f"{'' if pred_s is None else f'{pred_s:.2f}'} | {'' if e_t is None else f'{100 * e_t:+.1f}%'} |")
    if mem_err:
        print(f"\nheld out: {len(mem_err)} peaks, median |error| {100 * statistics.median(mem_err):.1f}%, max "
              f"{100 * max(mem_err):.1f}%; {len(time_err)} step times, median |error| "
              f"{100 * statistics.median(time_err) if time_err else float('nan'):.1f}%, max "
              f"{100 * max(time_err) if time_err else float('nan'):.1f}%")
    return 0


def cmd_check(args) -> int:
    """For each card size and duration: write the planner's choice as a plan file (what `tttv plan --out` writes),
    profile it under that card's cap (a card at least the GPU's size: uncapped), and also `--faster` candidates
    faster than a choice and predicted not to fit (which should run out of memory)."""
    import torch

    from tttvideo.config.loader import load_config
    from tttvideo.memory.plan.costs import load_costs
    from tttvideo.memory.plan.planner import CUDA_CONTEXT, best, overheads, plan, plan_toml
    from tttvideo.memory.studies.matrix import Matrix, Variant, run_variant

    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    costs = load_costs(args.gpu_kind)
    held = json.loads(out.read_text()) if out.is_file() else {}
    rows = [r for r in held.get("setups", []) if r.get("status") in ("ok", "oom")]
    superseded = held.get("superseded", [])
    total = torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else None
    cases = [(float(m), d) for m in args.gpu_mem.split(",") for d in args.durations.split(",")]
    spot_checks = 0  # "faster, predicted not to fit" runs so far, fastest first, over the cases that have them
    for mem, duration in cases:
        cfg = load_config(ROOT / args.config, NO_WEIGHTS + [f"layout.duration={duration}"])
        preds = plan(cfg, args.phase, int(mem * GIB), costs)
        chosen = best(preds)
        # a choice the planner no longer makes (costs or margins changed since) is kept aside, not checked again
        current = chosen.candidate.label if chosen is not None else None
        for r in [r for r in rows if (r["gpu_mem_gib"], r["duration"], r["role"]) == (mem, duration, "chosen")
                  and r.get("setup") != current]:
            rows.remove(r)
            superseded.append({**r, "superseded_by": current})
        done = {(r["gpu_mem_gib"], r["duration"], r["role"]) for r in rows}
        if chosen is None:
            rows.append({"gpu_mem_gib": mem, "duration": duration, "role": "chosen", "status": "nothing fits"})
            continue
        tries = [("chosen", chosen)]
        faster = [p for p in preds if p.fits is False and p.step_s is not None and p.step_s < chosen.step_s]
        faster.sort(key=lambda p: (p.step_s, overheads(p.config), p.peak))
        for n, pred in enumerate(faster[:max(0, args.faster - spot_checks)]):
            spot_checks += 1
            tries.append((("faster" if n == 0 else f"faster #{n + 1}") + ", predicted not to fit", pred))
        cap = round((mem * GIB - CUDA_CONTEXT) / GIB, 2)  # the card less its CUDA context, as the planner counts
        if total is not None and cap >= total:  # a card this size is the whole of this one: run uncapped
            cap = 0.0
        for role, pred in tries:
            if (mem, duration, role) in done:
                continue
            name = f"{mem:g} GiB {duration} {role}"
            plan_file = work / f"plan-{mem:g}gib-{duration}-{role.split(',')[0].replace(' #', '')}.toml"
            plan_file.write_text(plan_toml(pred, ROOT / args.config, plan_file, f"plan_calibration.py check {name}"))
            print(f"{name}: {pred.candidate.label} (predicted {pred.peak / GIB:.2f} GiB, {pred.step_s:.2f} s)",
                  flush=True)
            r = run_variant(Matrix(Path(__file__), plan_file, [], timeout_s=args.timeout),
                            Variant(name, NO_WEIGHTS + [f"layout.duration={duration}", f"memory.max_gpu_gib={cap}"],
                                    args.phase, 2), work)
            s = r.summary or {}
            rows.append({"gpu_mem_gib": mem, "duration": duration, "role": role, "setup": pred.candidate.label,
                         "overrides": pred.candidate.settings(pred.config), "cap_gib": cap,
                         "predicted_peak": pred.peak, "predicted_step_s": pred.step_s, "status": r.status,
                         "note": r.note, "peak_allocated": s.get("totals", {}).get("peak_allocated"),
                         "peak_reserved": s.get("totals", {}).get("peak_reserved"),
                         "step_seconds": s.get("step_seconds", [])})
            print(f"  {r.status} {r.note}", flush=True)
            save_json(out, {**_result(rows, args, torch), "benchmark": "plan_check",
                            "config": args.config, "phase": args.phase, "superseded": superseded})
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="profile every setup on this GPU")
    r.add_argument("--gpu-kind", default="h100")
    r.add_argument("--out", default="benchmarks/results/plan_calibration.json",
                   help="the results JSON; setups it already holds (ok or out of memory) are not run again")
    r.add_argument("--work", default="runs/plan_calibration")
    r.add_argument("--timeout", type=float, default=900)
    r.add_argument("--also", action="append", default=[],
                   help="benchmarks/fit_24gb.py JSON: the setups it measured are not run again")
    r.add_argument("--only", default=None, help="run only the setups whose name contains this text")
    r.add_argument("--durations", default=None, help="run only these durations, comma separated (e.g. 3s,9s,18s)")
    r.add_argument("--set", dest="overrides", action="append", default=[],
                   help="config override for every run (e.g. model.preset=tiny to rehearse on a CPU)")
    f = sub.add_parser("fit", help="fit the costs and check the predictions")
    f.add_argument("measured", nargs="?", default=None, help="the JSON `run` wrote")
    f.add_argument("--also", action="append", default=[],
                   help="benchmarks/fit_24gb.py JSON: its runs count as the setups with the same switches")
    f.add_argument("--gpu-kind", default=None)
    f.add_argument("--costs-out", default=None,
                   help="write the table here (default: tttvideo's memory/plan/costs.json)")
    f.add_argument("--optimizer-step", default=None,
                   help="benchmarks/optimizer_step.py JSON of this GPU kind (default: benchmarks/results/"
                        "optimizer_step_<gpu kind>.json where it exists; none: the time curves keep the profiles' "
                        "optimizer steps and the planner adds none)")
    f.add_argument("--sp-efficiency", type=json.loads, default=None,
                   help='measured sequence-parallel efficiency per degree, e.g. \'{"2": 0.75}\'')
    c = sub.add_parser("check", help="run the planner's choice for each card size under its cap")
    c.add_argument("--config", default="configs/cogvideox-5b/24gb-9s.toml")
    c.add_argument("--phase", default="train", choices=["train", "sample"])
    c.add_argument("--gpu-mem", default="24,48,80", help="card sizes in GiB, comma separated")
    c.add_argument("--durations", default="3s,9s")
    c.add_argument("--faster", type=int, default=2,
                   help="also run this many candidates faster than the choice and predicted not to fit, fastest "
                        "first, taken from the first cases that have them")
    c.add_argument("--gpu-kind", default="h100")
    c.add_argument("--out", default="benchmarks/results/plan_check.json",
                   help="the results JSON; cases it already holds are not run again")
    c.add_argument("--work", default="runs/plan_check")
    c.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    return {"run": cmd_run, "fit": cmd_fit, "check": cmd_check}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
