"""tttvideo.ttt.triton_carveout: the carveout each TTT kernel asks for, and that a mode is applied once per kernel
and again when it changes (a stand-in driver library records the calls; no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tttvideo.ttt import triton_carveout as tc

H100_SM = (233472, 65536, 2048)  # shared memory, registers and threads of one H100 SM


@pytest.mark.parametrize("shared, regs, warps, want", [
    (61440, 255, 8, 27),   # the TTT-MLP reverse: one program an SM -> the 64 KB configuration, 192 KB of L1
    (32768, 255, 4, 29),   # the sampling forward, 4 warps: two programs an SM
    (40960, 119, 8, 36),   # d K: 120 registers, two programs an SM
    (0, 32, 4, 8),         # no shared memory: 16 programs an SM, the driver's reserve for each
])
def test_percent_holds_the_resident_programs(shared, regs, warps, want):
    pct = tc.carveout_percent(shared, regs, warps * 32, *H100_SM)
    assert pct == want
    blocks = max(1, min(65536 // (-(-regs // 8) * 8 * warps * 32), 2048 // (warps * 32)))
    assert pct * H100_SM[0] / 100 >= blocks * (shared + 1024)  # every resident program's shared memory fits


class _Driver:
    def __init__(self):
        self.calls = []

    def cuFuncSetCacheConfig(self, fn, config):  # noqa: N802 - the CUDA driver's names
        self.calls.append(("cache", fn.value, config))

    def cuFuncSetAttribute(self, fn, attribute, value):  # noqa: N802
        self.calls.append(("attribute", fn.value, attribute, value))
        return self.status

    status = 0


def _kernel(handle, shared):
    return SimpleNamespace(function=handle, n_regs=255, metadata=SimpleNamespace(shared=shared, num_warps=8))


def test_modes_applied_once_per_kernel_and_again_on_change(monkeypatch):
    driver = _Driver()
    monkeypatch.setattr(tc, "_libcuda", lambda: driver)
    monkeypatch.setattr(tc, "_sm_limits", lambda device: H100_SM)
    monkeypatch.setattr(tc, "_applied", {})
    monkeypatch.setattr("torch.cuda.current_device", lambda: 0)
    kernel = _kernel(1234, 61440)
    monkeypatch.delenv("TTT_L1_CARVEOUT", raising=False)
    tc.fit_carveout(kernel)
    tc.fit_carveout(kernel)  # the same mode again: nothing to do
    assert driver.calls == [("cache", 1234, 0), ("attribute", 1234, 9, 27)]
    monkeypatch.setenv("TTT_L1_CARVEOUT", "triton")
    tc.fit_carveout(kernel)  # back to Triton's setting: prefer shared (over 48 KB), no carveout preference
    assert driver.calls[2:] == [("cache", 1234, 1), ("attribute", 1234, 9, -1)]
    tc.fit_carveout(_kernel(99, 40960))  # under 48 KB Triton sets no preference
    assert driver.calls[4:] == [("cache", 99, 0), ("attribute", 99, 9, -1)]


def test_a_refused_hint_is_logged_once(monkeypatch, caplog):
    driver = _Driver()
    driver.status = 1  # CUDA_ERROR_INVALID_VALUE
    monkeypatch.setattr(tc, "_libcuda", lambda: driver)
    monkeypatch.setattr(tc, "_sm_limits", lambda device: H100_SM)
    monkeypatch.setattr(tc, "_applied", {})
    monkeypatch.setattr("torch.cuda.current_device", lambda: 0)
    monkeypatch.delenv("TTT_L1_CARVEOUT", raising=False)
    with caplog.at_level("WARNING", logger="tttvideo.ttt.triton_carveout"):
        tc.fit_carveout(_kernel(7, 61440))
        tc.fit_carveout(_kernel(7, 61440))
    assert len([r for r in caplog.records if "refused" in r.message]) == 1


def test_no_cuda_function_is_left_alone(monkeypatch):
    monkeypatch.setattr(tc, "_libcuda", lambda: pytest.fail("the driver must not be called"))
    tc.fit_carveout(None)  # the interpreter's launches return no compiled kernel
    tc.fit_carveout(SimpleNamespace(function=0))


def test_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv("TTT_L1_CARVEOUT", "max")
    with pytest.raises(ValueError, match="TTT_L1_CARVEOUT='max'"):
        tc.carveout_mode()
