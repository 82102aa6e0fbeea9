"""Fixtures shared by the application tests."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops: one thread (two threads contending with other processes' cores are ~10x slower here)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
