"""Host-to-device helpers that never synchronise the host with an accelerator."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def index_tensor(values: Sequence[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 index tensor on ``device``, built without a host/device sync."""
    return host_to_device(np.asarray(values, dtype=np.int64), device)


def host_to_device(values: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of host values on ``device``, copied without a host/device sync.

    A copy from pageable host memory to a CUDA device may synchronise the stream;
    a copy from pinned memory with ``non_blocking=True`` does not.
    """
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
