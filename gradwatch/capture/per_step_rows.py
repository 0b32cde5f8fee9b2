"""The values judged at every step, one contiguous device row per step (the accelerators' path).

``nonfinite`` and the model's ``exploding`` are judged at every step from each tensor's gradient
sum of squares and each layer's forward sum (``flush/readback.py``). Those live in two states of
the buffer, ``param_sq`` and ``fwd_sum``, which are laid out apart (by reduction kind: the forward
sums are summed over ranks, the replicated gradients' sums are not). Read from there, every step
paid a ``cat`` of the rows and a copy of the forward sums into theirs before the read-back's
copy to the host.

Here each step writes both into one row of a device tensor of its own, ``[flush_every, P + L]``:
the gradient *norms* in its first ``P`` columns (the stack of ``_foreach_norm``, not squared:
``ForeachStats.reduce``'s ``keep_norms``) and the taps' forward sums after them (copied, then the
taps' cells zeroed). A step that takes the general path (max |g| on sampled steps, a gradient
missing, a cast) writes sums of squares there as it writes a buffer row and takes their roots.
The norms are squared where they are read: on the host by the read-back, which copies the row in
one op, and at the flush, before anything reduces or reads the buffer, where the window's rows go
into ``param_sq`` (squared) and ``fwd_sum``, so that everything after the recorder sees the
buffer it always saw. An unsampled step thus costs five ops beyond the forward check's one per
layer: the norms, their stack, the forward sums' copy, the zeroing of the taps' cells, the copy
to the host (it was seven: also the squares, and the read-back's ``cat`` of the two rows).

The forward sums are not stacked with the norms (one op less): the taps sum in float32 and the
row is float64, and a ``cat`` of mixed dtypes copies each input with a kernel of its own on CUDA
(``parallel_cat`` takes inputs of the output's dtype only; measured on the CPU: 367 against 110
us for 387 inputs).

Used where the per-step values are not read from host memory (the CPU's own path reads the
buffer's numpy views) and the parameter columns are not weighted pieces of sharded tensors: every
layer's cells on the buffer's device, plain tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..registry.states import FWD_SUM, PARAM_SQ
from .buffer import StatBuffer


class PerStepRows:
    """One window's per-step ``[sums of squares | forward sums]`` rows on the buffer's device.

    Args:
        buffer: the rank's statistics buffer (its device and dtype; filled at :meth:`into_buffer`).
        flush_every: steps per window (rows).
        params: parameter columns (``P``).
        layers: layers (``L``).
    """

    def __init__(self, buffer: StatBuffer, flush_every: int, params: int, layers: int) -> None:
        self.params, self.layers = params, layers
        self.values = torch.zeros(flush_every, params + layers, dtype=buffer.dtype, device=buffer.device)
        # Views made once (slicing is an op per call).
        self.rows = list(self.values.unbind(0))
        self.sq_rows = [row[:params] for row in self.rows]
        self.forward_rows = [row[params:] for row in self.rows]

    def record(self, param_stats: Any, slot: int, rows: Any, present: np.ndarray, moves: Any) -> None:
        """Step ``slot``'s parameter statistics (``param_stats.record`` into ``rows``, whose ``sq`` is
        this row's start: norms in the common case; the general path's sums of squares become
        norms) and its forward sums (``moves``: the recorder's ``_CellMoves``, which copies them in
        and zeroes the taps' cells, whatever happened before)."""
        try:
            if not param_stats.record(rows, present):
                rows.sq.sqrt_()
        finally:
            moves.forward_into_row(slot)

    def into_buffer(self, buffer: StatBuffer, recorded: int) -> None:
        """Copy the first ``recorded`` steps' rows into ``param_sq`` and ``fwd_sum`` (at a flush;
        the rows after them stay as the buffer has them: zero)."""
        if recorded <= 0:
            return
        values = self.values[:recorded]
        buffer[PARAM_SQ][:recorded].copy_(values[:, : self.params]).square_()
        buffer[FWD_SUM][:recorded].copy_(values[:, self.params :])

    def zero_(self) -> None:
        """A new window: every row zero, as the buffer's (a column a step does not write, a gradient
        that was missing, reads zero as before)."""
        self.values.zero_()

    @property
    def nbytes(self) -> int:
        """Bytes held on the device."""
        return self.values.numel() * self.values.element_size()
