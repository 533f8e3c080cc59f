"""The suite's own fixtures: every test starts from a fixed seed of its own (tests/conftest.py `seeded`)."""

from __future__ import annotations

import random
import zlib

import numpy as np
import torch


def test_each_test_starts_from_the_seed_of_its_id(seeded, request):
    assert seeded == zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF
    drawn = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(seeded)
    random.seed(seeded)
    np.random.seed(seeded)
    assert torch.equal(torch.rand(3), drawn[0]) and random.random() == drawn[1] and np.random.rand() == drawn[2]
