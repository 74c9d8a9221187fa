"""Shared test settings: gloo on loopback, one thread per process, deterministic seeds."""
import os

import pytest
import torch

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
