"""The values judged at every step, staged in one device row beside the taps' forward sums (the
accelerators' path).

``nonfinite`` and the model's ``exploding`` are judged at every step from each tensor's gradient
sum of squares and each layer's forward sum (``flush/readback.py``). Those live in two states of
the buffer, ``param_sq`` and ``fwd_sum``, which are laid out apart (by reduction kind: the forward
sums are summed over ranks, the replicated gradients' sums are not). Read from there, every step
paid a ``cat`` of the rows and a copy of the forward sums into theirs before the read-back's
copy to the host.

Here one small device tensor, the *stage*, holds both, side by side in one storage: the gradient
*norms* in its first ``P`` values (float64, the stack of ``_foreach_norm``, not squared:
``ForeachStats.reduce``'s ``keep_norms``) and, right after them, the taps' forward sums
themselves (float32: ``cells.DeviceCells.sums`` is this part of the stage, so nothing copies them
in). At the end of every step the stage goes to the host whole, one op, into the step's row of a
host table of the window (pinned on CUDA; ``non_blocking``). A step that takes the general path
(max |g| on sampled steps, a gradient missing, a cast) writes sums of squares there as it writes
a buffer row, and takes their roots.

The forward sums need zeroing for the next step only where some layer may not *write* its cell
then. An eager check writes at its layer's first call of a step (``sum(..., out=)``) and adds
after it; compiled code always adds, and a layer not called leaves its cell alone. So the stage
zeroes them after a step only where some layer's eager check did not write at that step (a host
count, ``RecordingFlags.forward_writes``). After a step where every one did, the sums stay; a
layer that does not write at the next step (not called: an idle expert, a branch not taken; or
run by compiled code for the first time) then carried the last step's sum in its cell, and the
host takes it out of its row before anyone reads it (:meth:`PerStepRows.forward_row`, and the
flush): zero exactly for a layer not called.

The host table is the window's record of these values: the read-back reads each step's row there
(once its copy has landed), and the flush copies the window's rows back into ``param_sq``
(squared) and ``fwd_sum`` before anything reduces or reads the buffer, so that everything after
the recorder sees the buffer it always saw. An unsampled step of an eager model thus costs three
ops beyond the forward check's one per layer: the norms, their stack, the stage's copy to the
host; four where the sums are zeroed (compiled code). It was five: also a copy of the forward sums
into a device row per step, kept for the flush, and their zeroing at every step; seven before
that: also the squares, and the read-back's ``cat`` of two rows.

Norms and sums share a storage of bytes (two dtype views), because a ``cat`` of mixed dtypes
copies each input with a kernel of its own on CUDA (``parallel_cat`` takes inputs of the output's
dtype only; measured on the CPU: 367 against 110 us for 387 inputs), and float64 forward sums would
make every layer's forward check reduce in float64.

Used where the per-step values are not read from host memory (the CPU's own path reads the
buffer's numpy views), the parameter columns are not weighted pieces of sharded tensors, and
every layer's cells are on the buffer's device: plain tensors.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..registry.states import FWD_SUM, PARAM_SQ
from .buffer import StatBuffer


class PerStepRows:
    """The stage on the buffer's device, and the window's rows of it on the host.

    Args:
        buffer: the rank's statistics buffer (its device and dtype; filled at :meth:`into_buffer`).
        flush_every: steps per window (host rows).
        params: parameter columns (``P``).
        layers: layers (``L``).
    """

    def __init__(self, buffer: StatBuffer, flush_every: int, params: int, layers: int) -> None:
        self.params, self.layers = params, layers
        device, dtype = buffer.device, buffer.dtype
        norm_bytes = params * dtype.itemsize
        width = -(-(norm_bytes + 4 * layers) // dtype.itemsize) * dtype.itemsize  # whole values of either dtype
        self.stage = torch.zeros(width, dtype=torch.uint8, device=device)
        #: [P] this step's gradient norms (or, on the general path, sums of squares turned into norms)
        self.norms = self.stage[:norm_bytes].view(dtype)
        #: [L] float32: the taps' forward sums of this step (``cells.DeviceCells.sums``)
        self.forward = self.stage[norm_bytes : norm_bytes + 4 * layers].view(torch.float32)
        self.pinned = device.type == "cuda"
        self.host = torch.zeros(flush_every, width, dtype=torch.uint8, pin_memory=self.pinned)
        # Views made once (slicing is an op per call): each step's row; for the read-back, the
        # table as [flush_every x P] norms and [flush_every x L] forward sums (numpy).
        self._host_rows = list(self.host.unbind(0))
        self._host_norms = self.host[:, :norm_bytes].view(dtype)
        self._host_forward = self.host[:, norm_bytes : norm_bytes + 4 * layers].view(torch.float32)
        self.host_norms, self.host_forward = self._host_norms.numpy(), self._host_forward.numpy()
        #: where the flush copies the table to (``into_buffer``)
        self._buffer_sq, self._buffer_forward = buffer[PARAM_SQ], buffer[FWD_SUM]
        #: the forward sums were not zeroed after the last step (every layer wrote its own there)
        self._kept = False
        #: slot -> the layers whose cells carried the last step's sum into it (``_settle``)
        self._carried: dict[int, np.ndarray] = {}
        #: the last window's last forward sums (float32), kept at its flush: what a first step may have carried
        self._last_window_forward = np.zeros(layers, dtype=np.float32)

    def record(self, param_stats, rows, present: np.ndarray) -> None:  # type: ignore[no-untyped-def]
        """This step's parameter statistics (``param_stats.record`` into ``rows``, whose ``sq`` is
        :attr:`norms`): norms in the common case; the general path's sums of squares become norms."""
        if not param_stats.record(rows, present):
            rows.sq.sqrt_()

    def finish(self, slot: int, every_layer_wrote: bool, missing: Callable[[], np.ndarray]) -> None:
        """The stage into host row ``slot`` (in stream order, not waited for), then the forward sums
        zeroed for the next step, unless every layer's eager check wrote its sum at this step.

        Args:
            slot: the step's row.
            every_layer_wrote: every layer's cell was written (not added to) by an eager check at
                this step (``RecordingFlags.forward_writes``): then the sums are kept, and a layer
                that writes again at the next step overwrites its own.
            missing: [L] bool, the layers no eager check wrote at this step (called only where the
                last step's sums were kept: those layers' cells still held them).
        """
        if self._kept:
            carried = np.flatnonzero(missing())
            if len(carried):
                self._carried[slot] = carried
        self._host_rows[slot].copy_(self.stage, non_blocking=self.pinned)
        self._kept = every_layer_wrote
        if not every_layer_wrote:
            self.forward.zero_()

    def forget(self) -> None:
        """The cells were zeroed (calls no step() claims, a new window): nothing carries into the next step."""
        self._kept = False

    def start_window(self, keep_sums: bool = False) -> None:
        """A new window (its rows were settled at the flush, :meth:`into_buffer`). ``keep_sums``: the
        cells were not zeroed since the last step's :meth:`finish`, so what it kept carries into the
        new window's first step, taken out against the last window's last row (kept at the flush)."""
        self._kept = self._kept and keep_sums
        self._carried.clear()

    def forward_row(self, slot: int) -> np.ndarray:
        """Step ``slot``'s forward sums as float64 (a copy), once its copy and the last step's have
        landed on the host. Where the last step's sums were kept and a layer did not write its own
        at this step (a layer not called, or called by compiled code, which adds), its cell held the
        last step's sum, which is taken out here (:meth:`_settle`)."""
        self._settle(slot)
        return self.host_forward[slot].astype(np.float64)

    def _settle(self, slot: int) -> None:
        """Subtract what row ``slot`` carried from row ``slot - 1`` (in place, once): exactly zero for
        a layer not called, its compiled calls' sum for one called there (float32 rounding aside). A
        carried sum that was not finite leaves nothing to subtract from: the layer reads zero, as a
        layer not called (compiled code at the step right after a non-finite forward, alone, could
        hide a non-finite sum of its own at that one step)."""
        layers = self._carried.pop(slot, None)
        if layers is None:
            return
        before = self.host_forward[slot - 1] if slot > 0 else self._last_window_forward
        carried = before[layers].astype(np.float64)
        row = self.host_forward[slot]
        row[layers] = np.where(np.isfinite(carried), row[layers] - carried, 0.0)

    def into_buffer(self, recorded: int) -> None:
        """Copy the first ``recorded`` steps' rows into the buffer's ``param_sq`` (squared) and ``fwd_sum`` (at a
        flush; the rows after them stay as the buffer has them: zero). On CUDA the host waits for
        the device first: the last steps' copies to the host may still be in flight, and a flush
        synchronises anyway."""
        if recorded <= 0:
            return
        if self.pinned:
            torch.cuda.synchronize(self.stage.device)
        for slot in sorted(self._carried):
            self._settle(slot)
        # what the window's last step may carry into the next window's first: its row is rewritten
        # before the next flush (and, without per-step judging, before anything settles that step)
        self._last_window_forward = self.host_forward[recorded - 1].copy()
        views = (self._host_norms, self._host_forward, self._buffer_sq, self._buffer_forward)
        if recorded < len(self._host_rows):  # a window cut short (the views are whole: slicing is an op per call)
            views = tuple(v[:recorded] for v in views)
        norms, forward, sq, fwd = views
        sq.copy_(norms).square_()
        fwd.copy_(forward)

    @property
    def nbytes(self) -> int:
        """Bytes held on the device besides the forward sums (which the cells count): the norms."""
        return self.stage.numel() - 4 * self.layers
