"""Same-run A/B of the TTT-MLP reverse kernel's L2 prefetch (`triton_common.prefetch_l2`, `TTT_L2_PREFETCH`): each
step of the backward's reverse asks L2 for the next step's tiles ("on", the default) against no prefetch ("off"),
in alternating rounds.

    PYTHONPATH=src python3 benchmarks/ttt_prefetch_ab.py --out benchmarks/results/ttt_prefetch_ab_h100.json

Cases (heads of 64, bf16 inputs as the layer makes them, `tttvideo.ttt.testing.make_inputs`, 18,048 tokens): TTT-MLP
forward + backward at mini-batch 64, checkpoint group 16 (the training scan, where the reverse runs), and its
training forward alone, which the switch does not touch (a control: its two modes should time alike). The prefetch
loads nothing into registers, so both modes compute the same values: outputs and gradients must be equal bit for bit
but for the norm gradients, which two CUDA streams add with atomics (see ttt_carveout_ab.py, whose runner this
shares). On a CPU (TRITON_INTERPRET=1, a smoke run: `--length 64 --heads 2`) the interpreter runs no PTX, so both
modes are the same kernel and the times mean nothing.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ttt_carveout_ab import Switch, switch_main  # noqa: E402 - this script's folder

PREFETCH = Switch(
    "ttt_prefetch_ab", "TTT_L2_PREFETCH", ("off", "on"),
    {"off": "no prefetch (TTT_L2_PREFETCH=0)",
     "on": "each reverse step prefetches the next step's tiles into L2 (TTT_L2_PREFETCH=1, the default)"},
    [("MLP forward + backward", "mlp", 1, 64, "fwd+bwd"),
     ("MLP training forward", "mlp", 1, 64, "train fwd")],
    values={"off": "0", "on": "1"})


if __name__ == "__main__":
    sys.exit(switch_main(PREFETCH, __doc__))
