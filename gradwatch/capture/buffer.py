"""The on-device statistics buffer: every state declared once, when the monitor attaches.

Every state is a reducible partial (a sum of squares, a maximum, a count) that
declares its shape and how ranks combine it, in the manner of torchmetrics'
``add_state(..., dist_reduce_fx=...)``. The declarations are made from the
model's structure alone (layers, parameters, declared units), so the layout is
identical on every rank by construction, and :meth:`StatBuffer.freeze` makes it
final: nothing is resized mid-run.

All states live in one flat tensor on the training device, grouped by
reduction, so that a flush is a single device-to-host copy and a distributed
reduction is one collective per reduction kind. The tensor is float64 where the
device has it (a gradient's sum of squares overflows float32 from |g| ~ 1e19),
float32 elsewhere (Apple MPS).

Counts the host already knows (calls seen, parameters present, samples seen)
are *host states*: numpy arrays updated without touching the device, copied
into their slots of the flat tensor at flush time, and reduced with the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

Reduce = Literal["sum", "max", "none"]
_ORDER: tuple[Reduce, ...] = ("sum", "max", "none")


def stat_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device supports it, else float32 (MPS has no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


@dataclass
class _State:
    name: str
    shape: tuple[int, ...]
    reduce: Reduce
    host: bool
    offset: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # (1 for a scalar's empty shape)


class StatBuffer:
    """Declared states on one device, copied to the host in one transfer."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.dtype = stat_dtype(device)
        self._states: dict[str, _State] = {}
        self._frozen = False
        self._storage = torch.zeros(0, dtype=self.dtype, device=device)
        self._views: dict[str, torch.Tensor] = {}
        self._rows: dict[str, list[torch.Tensor]] = {}
        self.host: dict[str, np.ndarray] = {}  # host states, by name (views of one array, laid out at freeze)
        self._host_block = np.zeros(0, dtype=np.int64)
        self._host_runs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add_state(self, name: str, shape: tuple[int, ...], reduce: Reduce, host: bool = False) -> None:
        """Declare a state: its shape and its cross-process reduction ("sum", "max" or "none").

        ``host=True``: a count kept in a numpy array (``buffer.host[name]``) and
        copied into the flat tensor at flush. Only before :meth:`freeze`.
        """
        if self._frozen:
            raise RuntimeError(f"state {name!r} declared after the layout was frozen")
        if reduce not in _ORDER:
            raise ValueError(f"reduce must be one of {_ORDER}, got {reduce!r}")
        if name in self._states:
            raise ValueError(f"state {name!r} is declared twice")
        self._states[name] = _State(name, tuple(int(s) for s in shape), reduce, host)

    def freeze(self) -> None:
        """Lay the declared states out in one flat tensor; the layout never changes afterwards.

        By reduction kind; within a kind, the host states last, so that each kind's are one
        contiguous run: the host keeps them in one array laid out the same (``host`` holds views
        of it), and a flush copies each run in one op (:meth:`load_host_states`)."""
        offset = 0
        runs: list[tuple[int, int]] = []  # (offset, numel) of each kind's host states
        for kind in _ORDER:
            members = [s for s in self._states.values() if s.reduce == kind]
            for state in sorted(members, key=lambda s: s.host):  # stable: declaration order otherwise
                state.offset = offset
                offset += state.numel
            host_numel = sum(s.numel for s in members if s.host)
            if host_numel:
                runs.append((offset - host_numel, host_numel))
        self._storage = torch.zeros(offset, dtype=self.dtype, device=self.device)
        self._views = {
            s.name: self._storage[s.offset : s.offset + s.numel].view(s.shape) for s in self._states.values()
        }
        # The host array holds the runs end to end, each state where storage order puts it.
        block = self._host_block = np.zeros(sum(n for _, n in runs), dtype=np.int64)
        self.host, at = {}, 0
        for state in sorted((s for s in self._states.values() if s.host), key=lambda s: s.offset):
            self.host[state.name] = block[at : at + state.numel].reshape(state.shape)
            at += state.numel
        # views made once: each run's slots of the flat tensor and the part of the host array it copies
        starts = np.cumsum([0] + [n for _, n in runs])
        self._host_runs = [(self._storage[offset : offset + n], torch.from_numpy(block[start : start + n]))
                           for (offset, n), start in zip(runs, starts)]  # fmt: skip
        self._frozen = True

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._views[name]

    def row(self, name: str, index: int) -> torch.Tensor:
        """Row ``index`` of a state, as a view made once (indexing is an op per call)."""
        rows = self._rows.get(name)
        if rows is None:
            rows = self._rows[name] = list(self._views[name].unbind(0))
        return rows[index]

    def host_view(self, name: str) -> np.ndarray | None:
        """A state as a numpy array sharing its memory (CPU buffers only; None elsewhere).

        Made once: reading it later is a plain memory read, not a device sync.
        """
        if self.device.type != "cpu":
            return None
        return self._views[name].numpy()

    def layout(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, reduce) of every state, in storage order: the same on every rank."""
        states = sorted(self._states.values(), key=lambda s: s.offset)
        return [(s.name, s.shape, s.reduce) for s in states]

    @property
    def nbytes(self) -> int:
        """Bytes held on the device."""
        return self._storage.numel() * self._storage.element_size()

    def load_host_states(self) -> None:
        """Copy the host states into their slots of the flat tensor (at flush time): one copy per
        reduction kind that has some (one in all: they are counts, summed)."""
        for slots, values in self._host_runs:
            slots.copy_(values, non_blocking=False)

    def reduction_spans(self) -> list[tuple[str, torch.Tensor]]:
        """(reduction kind, flat view) of each kind that ranks combine ("sum", "max"): what
        ``distributed.collectives.Collectives.reduce_states`` reduces, one collective each."""
        spans = []
        for kind in ("sum", "max"):
            members = [s for s in self._states.values() if s.reduce == kind]
            if members:
                start = min(s.offset for s in members)
                stop = max(s.offset + s.numel for s in members)
                spans.append((kind, self._storage[start:stop]))
        return spans

    def to_host(self) -> dict[str, np.ndarray]:
        """Every state as a float64 numpy array, in one device-to-host transfer (this synchronises)."""
        host = self._storage.to("cpu", copy=True).numpy().astype(np.float64, copy=False)
        return {s.name: host[s.offset : s.offset + s.numel].reshape(s.shape) for s in self._states.values()}

    def zero_(self) -> None:
        """Reset every state for the next window."""
        self._storage.zero_()
        self._host_block[...] = 0
