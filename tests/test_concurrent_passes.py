"""sample.concurrent.PassPair: the hand-over of a pass to a worker thread (CPU, no streams); the CUDA streams are
checked in tests/gpu/test_concurrent_passes_gpu.py."""

import threading

import pytest
import torch

from tttvideo.sample.concurrent import PassPair


def test_first_call_serial_then_threads():
    pair = PassPair("cpu", threads=True)
    seen = []

    def make(v):
        def fn():
            seen.append(threading.get_ident())
            return torch.full((3,), float(v))
        return fn

    a, b = pair.run(make(1), make(2))
    assert seen == [threading.get_ident()] * 2  # the warm-up call: both on the caller
    seen.clear()
    a, b = pair.run(make(1), make(2))
    assert a.tolist() == [1.0] * 3 and b.tolist() == [2.0] * 3
    assert seen[0] != seen[1] and threading.get_ident() in seen
    pair.close()


def test_worker_keeps_the_callers_grad_and_inference_mode():
    pair = PassPair("cpu", threads=True)
    w = torch.ones(2, requires_grad=True)
    pair.run(lambda: w * 2, lambda: w * 3)
    with torch.no_grad():
        a, b = pair.run(lambda: w * 2, lambda: w * 3)
    assert not a.requires_grad and not b.requires_grad
    a, b = pair.run(lambda: w * 2, lambda: w * 3)
    assert a.requires_grad and b.requires_grad
    with torch.inference_mode():
        a, b = pair.run(lambda: w * 2, lambda: w * 3)
    assert a.is_inference() and b.is_inference()
    pair.close()


def test_worker_error_reaches_the_caller():
    pair = PassPair("cpu", threads=True)
    pair.run(lambda: torch.zeros(1), lambda: torch.zeros(1))

    def fail():
        raise torch.OutOfMemoryError("second pass")

    with pytest.raises(torch.OutOfMemoryError, match="second pass"):
        pair.run(lambda: torch.zeros(1), fail)
    pair.close()


def test_off_cuda_without_threads_is_sequential():
    pair = PassPair("cpu")
    order = []
    pair.run(lambda: order.append(1) or torch.zeros(1), lambda: order.append(2) or torch.zeros(1))
    pair.run(lambda: order.append(1) or torch.zeros(1), lambda: order.append(2) or torch.zeros(1))
    assert order == [1, 2, 1, 2] and pair._pool is None
