import os
import random
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

# Under pytest-xdist, before torch (and its OpenMP runtime, which reads this once, as it loads) is imported: OpenMP
# threads that wait for work sleep instead of spinning. The configs' train.cpu_threads (2 in configs/demo.toml) give
# a worker's in-process trainers, and the commands its tests start (the README snippet), two threads whatever
# OMP_NUM_THREADS says; spinning, each such thread took a core from the other worker's tests and waited on a peer
# thread that had none, at every parallel region (the README snippet took 112 s in the suite against 8 s alone). On a
# two-core machine the first pass took 160 s (291 s of CPU) against 328 s (632 s of CPU) spinning. Not in the serial
# pass: there sleeping threads made a two-thread run slower.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO_RUN = pytest.StashKey[tuple]()

# Under pytest-xdist the workers share the machine's cores: each worker and the processes a test starts (the README
# snippet, the demo job, the kernel runners under Triton's interpreter) take one intra-op thread each, as the launch
# tests' ranks do, instead of one per core each (oversubscribed OpenMP threads spin). On a two-core machine the first
# pass took 343-361 s against 385-463 s before.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # the worker itself: torch was imported before this

# The commands the tests start print as into a log file: tttv keeps each line whole where COLUMNS is unset and wraps
# at COLUMNS where one is set. A COLUMNS exported by the developer's shell, or the 80 (and LINES 24) pytest-xdist gives
# its workers, cut the paths the tests look for in two (two torchrun tests failed so under `-n 2`).
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)


@pytest.fixture(autouse=True)
def seeded(request):
    """Every test starts from its own fixed seed of torch, random and numpy (a function of its id), so a failure
    reproduces whether the test runs alone or in the suite, in any order. Returns the seed."""
    seed = zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return seed


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is several times faster than two on a shared 2-core CI machine.
    Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def start_demo_run() -> tuple[Path, subprocess.Popen]:
    """`tttv train configs/demo.toml` as `make demo` runs it, in its own process, its folders in a temporary
    directory, TensorBoard off and one thread (the demo's two would take the core the suite runs on: the same steps,
    rounded in another order); stdout goes to <dir>/printed.txt, stderr to <dir>/stderr.txt."""
    out = Path(tempfile.mkdtemp(prefix="tttv-demo-test-"))
    cmd = [sys.executable, "-m", "tttvideo", "train", "configs/demo.toml", "--set", f"train.output_dir={out / 'run'}",
           "--set", f"data.demo_dir={out / 'data'}", "--set", "train.tensorboard=false", "--set", "train.cpu_threads=1"]
    with open(out / "printed.txt", "w") as stdout, open(out / "stderr.txt", "w") as stderr:
        # niced: it takes the CPU the tests leave idle, not the time of the multi-process tests it runs beside
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, cwd=ROOT, env={**os.environ, "COLUMNS": "200"},
                                preexec_fn=lambda: os.nice(10))
    return out, proc


# Modules whose tests start several processes that work at once (torchrun launches, spawned ranks), or wait on the
# demo run below: the `launches` marker. `make test` runs the rest on every core with pytest-xdist (most of them
# work on one core: tiny tensors, and one intra-op thread where a module asks for it), then these one at a time.
LAUNCHES = {"test_dcp_device.py", "test_demo_learns.py", "test_faults_local.py", "test_faults_torchrun.py",
            "test_memory_matrix.py", "test_parallel.py", "test_parallel_sample.py", "test_parallel_train.py",
            "test_pipeline_profile.py", "test_sample_parallel_benchmark.py", "test_stage_chain_cpu.py",
            "test_train_ranks_peaks.py"}


def pytest_collection_modifyitems(session, config, items):
    """Mark the tests of LAUNCHES `launches`; tests/test_demo_learns.py waits for the demo run started below: run it
    last, so that the run overlaps the suite instead of being waited for (in file order it would come early and
    wait the run's whole length)."""
    for item in items:
        if item.path.name in LAUNCHES:
            item.add_marker(pytest.mark.launches)
    items.sort(key=lambda item: item.path.name == "test_demo_learns.py")  # stable: the rest keep their order


def pytest_collection_finish(session):
    """Start the demo run tests/test_demo_learns.py scores as soon as collection ends: it trains on one core for
    about 150 s, which then overlaps the rest of the suite on the other core instead of adding to it."""
    if not session.config.option.collectonly and any(item.path.name == "test_demo_learns.py"
                                                     for item in session.items):
        session.config.stash[DEMO_RUN] = start_demo_run()


def pytest_sessionfinish(session):
    run = session.config.stash.get(DEMO_RUN, None)
    if run is not None:
        out, proc = run
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(out, ignore_errors=True)
