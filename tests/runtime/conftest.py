import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny matmuls run faster on one thread, and far faster when the 2 cores are shared."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
