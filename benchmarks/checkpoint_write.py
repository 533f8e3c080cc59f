"""Writing a checkpoint's tensors: safetensors' `save_file` then reading the file back to hash it (what a checkpoint
save did before) against `tttvideo.tensorfile.write_safetensors` (staged in chunks, hashed on the way out), each
followed by an fsync, each in a process of its own so that its host memory peak is its own.

    PYTHONPATH=src python3 benchmarks/checkpoint_write.py --gib 8 --device cuda --out FILE

(PYTHONPATH=src is not needed with the package installed.) The tensors are random bf16 matrices of a 5B block's
linear-layer sizes (3072 x 3072 and 3072 x 12288) on `--device`, `--gib` in all. Per writer: seconds (median of
`--reps`, a fresh file each), GB/s, the process's host memory high-water mark above what it held before writing
(`tttvideo.train.monitor.host_gib`), and whether the two writers' files read back equal. Prints a table last;
writes JSON with device, torch and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
WRITERS = ("save_file+rehash", "write_safetensors")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="tensor bytes to write, GiB")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="", help="where the files go (default: a temporary folder)")
    ap.add_argument("--out", default="")
    ap.add_argument("--one", choices=WRITERS, help=argparse.SUPPRESS)  # a child process: one writer
    return ap.parse_args(argv)


def make_tensors(gib: float, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    shapes, tensors, total, i = [(3072, 3072), (3072, 12288)], {}, 0, 0
    while total < gib * 2**30:
        shape = shapes[i % 2]
        tensors[f"blocks.{i // 2}.w{i % 2}"] = torch.randn(*shape, generator=g, device=device).bfloat16()
        total += shape[0] * shape[1] * 2
        i += 1
    return tensors


def write_one(writer: str, tensors: dict[str, torch.Tensor], path: Path) -> str:
    from tttvideo.runs import file_digest
    from tttvideo.tensorfile import write_safetensors

    if writer == "write_safetensors":
        digest = write_safetensors(tensors, path, {"format": "bench"})
    else:
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata={"format": "bench"})
        digest = file_digest(path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return digest


def child(args) -> int:
    """One writer, --reps times: prints one JSON line."""
    from tttvideo.train.monitor import host_gib

    tensors = make_tensors(args.gib, args.device)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    before = host_gib()
    times, digest = [], ""
    folder = Path(args.dir)
    for rep in range(args.reps):
        path = folder / f"{args.one}-{rep}.safetensors"
        start = time.perf_counter()
        digest = write_one(args.one, tensors, path)
        times.append(time.perf_counter() - start)
        if rep < args.reps - 1:
            path.unlink()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(json.dumps({"writer": args.one, "seconds": statistics.median(times), "times": times,
                      "gb_per_s": nbytes / 1e9 / statistics.median(times), "host_peak_over_gib": host_gib() - before,
                      "bytes": nbytes, "sha256": digest, "file": str(path)}))
    return 0


def same_tensors(a: str, b: str) -> bool:
    from safetensors import safe_open

    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        return set(fa.keys()) == set(fb.keys()) and all(torch.equal(fa.get_tensor(k), fb.get_tensor(k))
                                                        for k in fa.keys())


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one:
        return child(args)
    folder = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-write-"))
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    rows = []
    for writer in WRITERS:
        out = subprocess.run([sys.executable, __file__, "--one", writer, "--gib", str(args.gib), "--device",
                              args.device, "--reps", str(args.reps), "--dir", str(folder)],
                             capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise SystemExit(f"{writer} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    equal = same_tensors(rows[0]["file"], rows[1]["file"])
    for r in rows:
        Path(r.pop("file")).unlink(missing_ok=True)
    from tttvideo.memory.profile.profiler import git_commit
    from tttvideo.results import save_json

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    result = {"benchmark": "checkpoint_write", "device": device, "torch": torch.__version__, "git_commit": git_commit(),
              "gib": args.gib, "reps": args.reps, "folder": str(folder), "files_equal": equal,
              "command": " ".join(["python3", "benchmarks/checkpoint_write.py", *(argv or sys.argv[1:])]), "rows": rows}
    if args.out:
        save_json(args.out, result)
    print(f"\n{device}, {args.device} tensors, {rows[0]['bytes'] / 2**30:.2f} GiB, median of {args.reps}, "
          f"files read back equal: {equal}")
    print(f"{'writer':<20} {'s':>7} {'GB/s':>6} {'host peak over GiB':>19}")
    for r in rows:
        print(f"{r['writer']:<20} {r['seconds']:>7.2f} {r['gb_per_s']:>6.2f} {r['host_peak_over_gib']:>19.2f}")
    print(f"speed-up {rows[0]['seconds'] / rows[1]['seconds']:.2f}x" + (f"; wrote {args.out}" if args.out else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
