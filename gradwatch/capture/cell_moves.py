"""One device's cells into a step's row of the buffer (``Recorder.record_step``): a few copies
whatever the number of layers, and on sampled steps the output gradients' counts unscaled where a
GradScaler scaled them."""

from __future__ import annotations

import numpy as np
import torch

from ..registry import accumulator_count
from ..registry.states import FWD_ORDER, FWD_SUM, OUT_GRAD, OUT_STATS
from .cells import DeviceCells
from .devices import index_tensor
from .layout import Layout
from .per_step_rows import PerStepRows


class CellMoves:
    """Moves one device's cells into a step's row: a few copies whatever the number of layers.

    The forward sums are the step's own (non-finite at a step whose outputs were, see decode.py):
    copied into the row, then zeroed, one op each per device whatever the number of layers.
    """

    def __init__(self, cells: DeviceCells, layout: Layout, cpu_fast: bool = True,
                 per_step_rows: PerStepRows | None = None) -> None:  # fmt: skip
        buffer, flush_every = layout.buffer, layout.flush_every
        k = cells.n
        self.whole = k == len(layout.names)  # the usual case: every layer on the buffer's device
        self.sums = cells.sums
        self.first_calls = cells.first_calls
        self.cells = cells  # its backward rows are gathered on sampled steps (``DeviceCells.grad_counts``)
        # CPU: the forward sums move on the host, through numpy views of the same memory made once:
        # right after backward each dispatcher call pays 40-90 us of cold caches (this move: 43 us
        # in context with copy_ and zero_, 22 with numpy; benchmarks/RESULTS.md, twenty-second
        # session). The forward sums are never saved for a backward, so that zeroing them leaves
        # their version counter alone is safe. ``cpu_fast`` False (``param_stats.CPU_FAST_PATH``): CPU
        # tensors take the accelerators' path, copy_ and zero_ included, which is how CI runs it.
        on_host = cpu_fast and self.whole and buffer.device.type == "cpu" and cells.sums.device.type == "cpu"
        self.fwd_host = buffer.host_view(FWD_SUM) if on_host else None
        self.sums_host = cells.sums.numpy() if on_host else None
        #: with per-step rows the forward sums stay where they are: they are the stage's (``per_step_rows.py``)
        self.staged = per_step_rows is not None
        self.fwd_rows = [] if on_host or self.staged else [buffer.row(FWD_SUM, t) for t in range(flush_every)]
        self.order_rows = [buffer.row(FWD_ORDER, t) for t in range(flush_every)]
        stats = accumulator_count()
        self.stats = cells.outputs if stats else None
        self.stats_rows = [buffer.row(OUT_STATS, t) for t in range(flush_every)] if stats else []
        self.out_rows = [buffer.row(OUT_GRAD, t) for t in range(flush_every)]
        self.out_flat = [row.view(-1) for row in self.out_rows] if self.whole else []  # index_select's out=
        self.to_buffer = buffer.device
        if not self.whole:  # a model spread over several devices: this device's layers and units
            self.layer_index = index_tensor(cells.layers, buffer.device)
            offsets, counts = layout.unit_offset[cells.layers], layout.unit_count[cells.layers]
            units = [np.arange(o, o + c) for o, c in zip(offsets, counts)]
            self.unit_index = index_tensor(np.concatenate(units) if units else np.zeros(0), buffer.device)

    def into_row(self, slot: int, sampled: bool, scale: torch.Tensor | None, units_window: torch.Tensor,
                 scale_units: bool) -> None:  # fmt: skip
        """Copy the step's cells into row ``slot`` (and the unit evidence into the window's)."""
        cells = self.cells
        if self.whole:
            if self.sums_host is not None:
                self.fwd_host[slot] = self.sums_host
                self.sums_host.fill(0.0)
            elif not self.staged:  # (staged: copied to the host with the norms, and zeroed, by the per-step rows)
                self.fwd_rows[slot].copy_(self.sums)
                self.sums.zero_()
            if sampled:
                self.order_rows[slot].copy_(self.first_calls)
                torch.index_select(cells.backward, 0, cells.grad_index, out=self.out_flat[slot])
                units = cells.units()
                unscale(self.out_rows[slot], units, scale, scale_units)
                units_window.add_(units)
                if self.stats is not None:
                    self.stats_rows[slot].copy_(self.stats)
            return
        to = self.to_buffer
        self.fwd_rows[slot].index_copy_(0, self.layer_index, self.sums.to(to, non_blocking=True))
        self.sums.zero_()  # after the copy in stream order (a copy across devices syncs both streams)
        if sampled:
            self.order_rows[slot].index_copy_(0, self.layer_index, self.first_calls.to(to, non_blocking=True))
            counts, units = cells.grad_counts(), cells.units()
            unscale(counts, units, scale, scale_units)
            self.out_rows[slot].index_copy_(1, self.layer_index, counts.to(to, non_blocking=True))
            units_window.index_add_(0, self.unit_index, units.to(to, non_blocking=True))
            if self.stats is not None:
                self.stats_rows[slot].index_copy_(0, self.layer_index, self.stats.to(to, non_blocking=True))


def unscale(counts: torch.Tensor, units: torch.Tensor, scale: torch.Tensor | None, scale_units: bool) -> None:
    """The taps saw scaled output gradients (GradScaler, ``scale``): unscale their sums of squares
    (``counts[0]``, of [3 x layers]) and, where ``scale_units`` (sums of squares compared with
    dead_eps; a projection's zeros need nothing), the units' evidence. Nothing without a scale."""
    if scale is None:
        return
    inverse = scale.square().reciprocal()
    counts[0].mul_(inverse)
    if scale_units:
        units.mul_(inverse)
