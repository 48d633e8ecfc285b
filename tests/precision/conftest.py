import pytest
import torch


@pytest.fixture
def one_thread():
    # FP16/BF16 matmuls are emulated on this CPU; with two threads on shared cores they thrash instead of helping.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
