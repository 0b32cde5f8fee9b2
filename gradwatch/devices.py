"""Host-to-device helpers that never synchronise the host with an accelerator."""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

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


class BoundedCache:
    """Values built once per key, for keys that repeat from step to step (call patterns,
    which parameters have gradients); at most ``limit`` of them are kept."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._cache: dict[Hashable, Any] = {}

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value for ``key``, made by ``make()`` the first time."""
        value = self._cache.get(key)
        if value is None:
            value = make()
            if len(self._cache) < self.limit:
                self._cache[key] = value
        return value


class IndexCache(BoundedCache):
    """Index tensors on one device, built once per key so that steady-state steps copy nothing."""

    def __init__(self, device: torch.device, limit: int = 64) -> None:
        super().__init__(limit)
        self.device = device

    def get(  # type: ignore[override]
        self, key: tuple[int, ...], values: Callable[[], Sequence[int] | np.ndarray] | None = None
    ) -> torch.Tensor:
        """The tensor of ``values()`` (default: the key itself) for ``key``."""
        return super().get(key, lambda: index_tensor(key if values is None else values(), self.device))
