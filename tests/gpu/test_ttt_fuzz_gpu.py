"""GPU fuzz of the Triton TTT kernels (issue 13): every (head dim, mini-batch, hidden) the dispatcher accepts, for
TTT-MLP and TTT-Linear, times four lengths, B in (1, 2, 3) and H in (1, 5, 48): 1,944 cases, each against the fp32
reference (output and every gradient, 2e-2 relative, NaN-poisoned outputs and scratch), in worker processes that are
restarted after a crash (tests/gpu/ttt_fuzz.py has the cases, the comparison and the runner; its command line
prints the same table). 7 minutes on an H100 with 12 workers (TTT_FUZZ_JOBS=12). TTT_FUZZ_FILTER="mlp-D32 M64" keeps
the cases whose id contains every word; TTT_FUZZ_JOBS sets the workers.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu import ttt_fuzz

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_every_accepted_shape_matches_the_reference():
    words = os.environ.get("TTT_FUZZ_FILTER", "").split()
    selected = [c for c in ttt_fuzz.cases() if all(w in c.id for w in words)]
    run = ttt_fuzz.fuzz(selected, jobs=int(os.environ.get("TTT_FUZZ_JOBS", "8")), verbose=False)
    print(ttt_fuzz.table(ttt_fuzz.tally(selected, run["results"])))
    bad = {k: v.get("error") or v.get("errors") for k, v in run["results"].items() if v["status"] != "pass"}
    assert len(run["results"]) == len(selected)
    assert not bad, f"{len(bad)} of {len(selected)} cases failed (seed {run['meta']['base_seed']}): " + "; ".join(
        f"{k}: {v}" for k, v in list(bad.items())[:10])
