"""What eager taps count on the host at a sampled step, and how it joins the step's row.

An eager tap knows some of its statistics without reading a tensor: how many output gradients
reached it, the samples behind their dead-unit evidence, how many output elements it saw, and
where in the step's forward it ran. Counting them in device cells cost an op each per layer and
call (an ``add_`` of a Python number; ~20 ops per sampled step of a 9-layer MLP). Here they are
numpy counts, written at no device cost and added into the step's row by ``step()`` with a few
ops whatever the number of layers (none on the CPU path, whose buffer is host memory).
Compiled calls count here too where their sampled statistics go through the opaque ops
(``host_branch.py``): the ops' kernels run on the host at every sampled call and record by the
eager tap's code. Traced recording (``detail="full"``, the masked path) keeps device cells; the two
add up in the row.

The forward order is the one value eager and compiled taps must agree on: it is the device
clock (``taps.DeviceCells.clock``), which each *compiled* call whose Python does not run at
run time (traced recording: ``detail="full"``, the masked path) counts down by ``tick``, read
by an eager tap at its first call of the step (one op, no decrement; none where the opaque op
orders compiled calls on the host: the clock is then at its start, and the host adds that value
itself), plus a host part that
orders the eager layers between two compiled calls (:meth:`HostCells.next_order`): ``tick - 1``
for the first of them, one less for each after it. A larger value is an earlier call, so an
eager layer run before a compiled call sorts before it, one run after it sorts after it, and
eager layers sort among themselves as they ran.
"""

from __future__ import annotations

import numpy as np
import torch

from .devices import host_to_device
from .layout import Layout
from ..registry.outputs import accumulator_count
from ..registry.states import FWD_ORDER, OUT_GRAD, OUT_STATS


class ClockScale:
    """The forward clock's range on one device's cells: where it starts and how far each compiled
    call counts it down. Float64 cells (every device but MPS) leave ``tick - 1`` values between two
    compiled calls for eager layers (the host part of their order); float32 cells have no room for
    it (integers are exact to 2**24 only), so there eager taps count the clock down themselves."""

    def __init__(self, dtype: torch.dtype) -> None:
        wide = dtype == torch.float64
        #: the clock's value at a step's start: up to start / tick compiled calls a step
        self.start = float(1 << 40) if wide else float(1 << 24)
        #: how much one compiled call counts it down (1: eager taps count it down too)
        self.tick = float(1 << 20) if wide else 1.0

    @property
    def host_order(self) -> bool:
        """Whether eager taps order themselves on the host (else they count the device clock down)."""
        return self.tick > 1.0


#: The clock's span on float64 cells, for code that lays several clocks end to end (``mesh.py``).
CLOCK_SPAN = ClockScale(torch.float64).start


class HostCells:
    """Per layer (global index), what eager taps counted at the current sampled step.

    ``order``: the host part of each layer's forward order (see the module docstring; 0: none);
    ``calls``: output gradients seen; ``samples``: the samples behind their dead-unit evidence;
    ``elements``: output elements seen by the output statistics. Written by the taps through
    :meth:`add` and :meth:`next_order` (numpy item assignments, no device op), moved into the row
    and cleared at ``step()``.
    """

    def __init__(self, n_layers: int, tick: float) -> None:
        self.values = np.zeros((4, n_layers), dtype=np.float64)
        self.order, self.calls, self.samples, self.elements = self.values  # views, one per count
        self.tick = tick
        self._sequence = 0  # eager first calls so far in this step
        #: some tap wrote here since the last clear (a model of compiled taps only never does)
        self.touched = False

    def add(self, counts: np.ndarray, index: int, value: float) -> None:
        """Add ``value`` to layer ``index`` of ``counts`` (one of this object's rows)."""
        counts[index] += value
        self.touched = True

    def next_order(self) -> float:
        """The host part of the order of the step's next eager first call: ``tick - 1``, then one
        less for each (layers past ``tick - 2`` of them in one step share the last value)."""
        sequence = self._sequence
        self._sequence = sequence + 1
        self.touched = True
        return self.tick - 1.0 - min(sequence, self.tick - 2.0)

    def clear(self) -> None:
        """Forget the step's counts (after step() moved them, or calls no step() will claim)."""
        if self.touched:
            self.values[...] = 0.0
            self._sequence = 0
            self.touched = False


class HostCellMoves:
    """Adds the host counts of a sampled step into its row of the buffer.

    Args:
        layout: the rank's layout (its buffer holds the rows).
        cells: the counts.
        numpy_rows: the buffer is host memory read through numpy (the CPU path): add there, no op.
            Otherwise one copy to the buffer's device (``devices.host_to_device``: pinned and
            asynchronous on CUDA, the host never waits) and three adds.
    """

    def __init__(self, layout: Layout, cells: HostCells, numpy_rows: bool) -> None:
        buffer = layout.buffer
        self.cells = cells
        self.device, self.dtype = buffer.device, buffer.dtype
        self.numpy_rows = numpy_rows and buffer.device.type == "cpu"
        self.has_stats = accumulator_count() > 0
        n, steps = len(layout.names), layout.flush_every
        if self.numpy_rows:
            self._order = buffer.host_view(FWD_ORDER)
            self._out = buffer.host_view(OUT_GRAD)
            self._stats = buffer.host_view(OUT_STATS) if self.has_stats else None
            return
        # Row views made once, shaped like the staged blocks they receive (indexing is an op per call).
        self._order_rows = [buffer.row(FWD_ORDER, t).view(1, n) for t in range(steps)]
        self._count_rows = [buffer.row(OUT_GRAD, t)[1:3] for t in range(steps)]
        self._element_rows = [buffer.row(OUT_STATS, t)[:, :1].t() for t in range(steps)] if self.has_stats else []

    def into_row(self, slot: int) -> None:
        """Add the step's counts into row ``slot`` (nothing when no eager tap counted)."""
        cells = self.cells
        if not cells.touched:
            return
        values = cells.values
        if self.numpy_rows:
            self._order[slot] += values[0]
            self._out[slot, 1:3] += values[1:3]
            if self._stats is not None:
                self._stats[slot, :, 0] += values[3]
            return
        # On CUDA a fresh pinned copy (the copy to the device may still read it after step() returns
        # and the counts are cleared); on the CPU the counts themselves, added before they are.
        order, counts, elements = host_to_device(values, self.device, self.dtype).split([1, 2, 1])
        self._order_rows[slot].add_(order)
        self._count_rows[slot].add_(counts)
        if self.has_stats:
            self._element_rows[slot].add_(elements)
