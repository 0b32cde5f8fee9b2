"""Host-to-device helpers that never synchronise the host with an accelerator."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch


def index_tensor(values: Sequence[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 index tensor on ``device``, built without a host/device sync.

    A copy from pageable host memory to a CUDA device may synchronise the stream;
    a copy from pinned memory with ``non_blocking=True`` does not.
    """
    host = torch.as_tensor(np.asarray(values, dtype=np.int64))
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class IndexCache:
    """Index tensors on one device, built once per key so that steady-state steps copy nothing.

    Call patterns (which layers ran, which parameters have gradients) repeat from step to
    step; a bounded number of them is kept.
    """

    def __init__(self, device: torch.device, limit: int = 64) -> None:
        self.device = device
        self.limit = limit
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def get(
        self, key: tuple[int, ...], values: Callable[[], Sequence[int] | np.ndarray] | None = None
    ) -> torch.Tensor:
        """The tensor of ``values()`` (default: the key itself) for ``key``."""
        index = self._cache.get(key)
        if index is None:
            index = index_tensor(key if values is None else values(), self.device)
            if len(self._cache) < self.limit:
                self._cache[key] = index
        return index
