import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads add only synchronisation, which costs seconds on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
