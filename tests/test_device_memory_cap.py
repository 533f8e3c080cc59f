"""cap_process_memory (tttvideo.device): the fraction of a card's memory a GiB cap is, checked with a fake card."""

from __future__ import annotations

import types

import pytest
import torch

from tttvideo.device import cap_process_memory
from tttvideo.errors import UserError


def test_cap_is_gib_over_total(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    assert cap_process_memory(24, "cuda:1") == 0.3
    assert calls == [(0.3, torch.device("cuda:1"))]
    for bad in (0, 81):
        with pytest.raises(UserError, match="80.0 GiB"):
            cap_process_memory(bad, "cuda")
    assert len(calls) == 1


def test_cap_on_cpu_is_a_no_op():
    assert cap_process_memory(24, "cpu") is None
