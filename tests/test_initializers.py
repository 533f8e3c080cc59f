"""The meta-skipping initialiser: a model built on the meta device does not pay torch's Python decompositions (whose
first use imports torch._dynamo, 1.8 s of every process that builds one), and a real tensor gets N(0, std^2)."""

from __future__ import annotations

import subprocess
import sys

import torch

from tttvideo import initializers


def test_normal_fills_a_real_tensor_and_leaves_a_meta_one():
    torch.manual_seed(0)
    x = initializers.normal_(torch.zeros(256, 256), std=0.02)
    assert abs(x.std().item() - 0.02) < 0.002 and abs(x.mean().item()) < 0.002
    torch.manual_seed(0)  # the same draw as nn.init.normal_: a seeded model initialises as before
    assert torch.equal(x, torch.nn.init.normal_(torch.zeros(256, 256), std=0.02))
    meta = torch.empty(4, 4, device="meta")
    assert initializers.normal_(meta, std=0.02) is meta


def test_building_each_backbone_on_meta_leaves_torch_dynamo_unimported():
    code = (
        "import sys\n"
        "from tttvideo.config.schema import TTTConfig\n"
        "from tttvideo.models import get_preset, init_model\n"
        "for name in ('tiny', 'wan-tiny'):\n"
        "    for layer in ('ttt', 'full-attention', 'gated-deltanet'):\n"
        "        init_model(get_preset(name), TTTConfig(), True, device='meta', sequence_layer=layer)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "False"
