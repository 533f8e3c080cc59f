import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is several times faster than two on a shared 2-core CI machine.
    Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
