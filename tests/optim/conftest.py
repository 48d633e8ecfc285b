import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    # Small tensors: with two threads on shared cores the optimizer loops thrash instead of helping.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
