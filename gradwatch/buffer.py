"""The on-device statistics buffer.

Every state is a reducible partial (a sum of squares, a maximum, a count) and
declares how ranks combine it, in the manner of torchmetrics'
``add_state(..., dist_reduce_fx=...)``. All states live in one flat float32
tensor on the training device, grouped by reduction, so that a flush is a
single device-to-host copy and a distributed reduction is one collective per
reduction kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

Reduce = Literal["sum", "max", "none"]
_ORDER: tuple[Reduce, ...] = ("sum", "max", "none")


@dataclass
class _State:
    name: str
    shape: tuple[int, ...]
    reduce: Reduce
    offset: int = 0

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


class StatBuffer:
    """Preallocated float32 states on one device, copied to the host in one transfer."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._states: dict[str, _State] = {}
        self._storage = torch.zeros(0, dtype=torch.float32, device=device)
        self._views: dict[str, torch.Tensor] = {}
        self._rows: dict[str, list[torch.Tensor]] = {}

    def add_state(self, name: str, shape: tuple[int, ...], reduce: Reduce) -> None:
        """Declare or resize a state; every value already held is kept.

        A resized state keeps the values of its overlapping leading elements (flat
        order), so growing the per-unit state mid-window, when a layer runs for the
        first time, does not forget what the other layers accumulated.
        """
        if reduce not in _ORDER:
            raise ValueError(f"reduce must be one of {_ORDER}, got {reduce!r}")
        old = {n: self._views[n].reshape(-1).clone() for n in self._states}
        self._states[name] = _State(name, tuple(shape), reduce)
        self._layout()
        for n, value in old.items():
            target = self._views[n].view(-1)
            keep = min(value.numel(), target.numel())
            target[:keep].copy_(value[:keep])

    def _layout(self) -> None:
        offset = 0
        for kind in _ORDER:
            for state in self._states.values():
                if state.reduce == kind:
                    state.offset = offset
                    offset += state.numel
        self._storage = torch.zeros(offset, dtype=torch.float32, device=self.device)
        self._views = {
            s.name: self._storage[s.offset : s.offset + s.numel].view(s.shape)
            for s in self._states.values()
        }
        self._rows = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._views[name]

    def row(self, name: str, index: int) -> torch.Tensor:
        """Row ``index`` of a state, as a view made once per layout (indexing is an op per call)."""
        rows = self._rows.get(name)
        if rows is None:
            rows = self._rows[name] = list(self._views[name].unbind(0))
        return rows[index]

    @property
    def nbytes(self) -> int:
        """Bytes held on the device."""
        return self._storage.numel() * self._storage.element_size()

    def all_reduce(self, group: object = None) -> None:
        """Combine the states across ranks: one collective per reduction kind present."""
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        for kind, op in ops.items():
            members = [s for s in self._states.values() if s.reduce == kind]
            if not members:
                continue
            start = min(s.offset for s in members)
            stop = max(s.offset + s.numel for s in members)
            dist.all_reduce(self._storage[start:stop], op=op, group=group)

    def to_host(self) -> dict[str, np.ndarray]:
        """Copy every state to host numpy arrays in one transfer (this synchronises)."""
        host = self._storage.to("cpu", copy=True).numpy()
        return {
            s.name: host[s.offset : s.offset + s.numel].reshape(s.shape)
            for s in self._states.values()
        }

    def zero_(self) -> None:
        """Reset every state for the next window."""
        self._storage.zero_()
