import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """The oracle is many small elementwise ops; on a shared CPU extra OpenMP threads only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
