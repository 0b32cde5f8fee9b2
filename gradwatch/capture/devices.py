"""Host-to-device helpers that never synchronise the host with an accelerator, and the one op
whose signature depends on the torch release."""

from __future__ import annotations

from typing import Callable, Sequence

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


def _foreach_norm_takes_dtype() -> bool:
    try:
        schemas = torch._C._jit_get_schemas_for_operator("aten::_foreach_norm")
    except Exception:  # pragma: no cover - a build without the JIT registry
        return False
    return any("dtype" in str(schema) for schema in schemas)


#: Whether ``torch._foreach_norm`` takes ``dtype=`` (torch 2.4 added it; the operator's schema is
#: checked, not the version). Without it each tensor's norm is taken with
#: ``torch.linalg.vector_norm(..., dtype=)`` instead: the same values, one op per tensor.
FOREACH_NORM_DTYPE = _foreach_norm_takes_dtype()


def _norms_one_by_one(tensors: list[torch.Tensor], ord: float, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors]


#: ``foreach_norm(tensors, ord, dtype)``: per-tensor norms accumulated and returned in ``dtype``, on
#: any torch gradwatch supports. Where ``torch._foreach_norm`` takes the dtype (positionally too),
#: it is that function itself: no Python call of ours around it at every step.
foreach_norm: Callable[[list[torch.Tensor], float, torch.dtype], Sequence[torch.Tensor]] = (
    torch._foreach_norm if FOREACH_NORM_DTYPE else _norms_one_by_one  # type: ignore[assignment]
)
