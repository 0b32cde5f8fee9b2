"""Every compiled test starts and ends with dynamo's caches and counters empty."""

import pytest
import torch
import torch._dynamo


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
