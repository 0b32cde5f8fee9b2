"""What one output gradient contributes: its sum of squares and its dead-unit evidence.

Used by the layer's tensor hook (``taps.OutputTap``), eagerly and inside compiled code, so every
function here is traceable: tensor ops and facts fixed at attach (the layer's units and where
they are), nothing else. Compiled taps traced with ``detail="full"`` add every step's statistics to
their device cells with :meth:`GradStatistics.add_to_cells`; where the opaque op of ``host_branch.py``
records sampled steps, it runs the eager tap's :meth:`GradStatistics.record`; where that op is not
in use they take :meth:`GradStatistics.deltas` in the graph at every step and mask it.
"""

from __future__ import annotations

import math

import torch

from ..registry import outputs
from . import cpu_rows

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0

#: A layer's backward row (``cells.DeviceCells.backward``) starts with this many counts (its output
#: gradients' sum of squares, calls and samples); its dead-unit evidence follows them.
ROW_COUNTS = 3

#: A layer whose output-gradient norm stayed within these bounds over a window has its next window's
#: eager statistics reduced in float32 on the CPU (``GradStatistics.float32``; the switch is
#: ``registry.outputs.CPU_ROWS``, act_rms's too): the squares of a total
#: of at least 1e-22 lose nothing to underflow that float32 could show, and a norm up to 1e12 leaves
#: seven decades of growth within the window before its squares overflow.
FLOAT32_SAFE_NORM = (1e-11, 1e12)


class GradStatistics:
    """The statistics of one layer's output gradients.

    Args:
        units: the layer's declared units (0: unknown; then no dead-unit evidence).
        channel_first: the units are dimension 1 of a (N, C, *spatial) output (convolutions).
        weights: fixed positive projection weights in [1, 2), shared by the layers of a device.
        dtype: the cells' dtype (float64 where the device has it).
    """

    def __init__(self, units: int, channel_first: bool, weights: torch.Tensor, dtype: torch.dtype) -> None:
        self.units = int(units)
        self.channel_first = bool(channel_first)
        self.weights = weights
        self.dtype = dtype
        #: per-unit sums of squares (``dead_eps > 0``) instead of the random projection
        self.unit_sums = False
        #: the layer's output-gradient norms were within :data:`FLOAT32_SAFE_NORM` over the last
        #: window: eager taps on the CPU take norms of rows in float32 (combined in float64) and
        #: a convolution's dead-unit evidence by projection (``float32_rows``)
        self.float32 = False
        #: (rows, dtype) -> the first ``rows`` projection weights as a (1, rows) matrix (eager: slicing
        #: and converting are an op each per call; batch shapes repeat)
        self._weight_rows: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def unit_dim(self, ndim: int) -> int:
        return 1 if self.channel_first and ndim >= 2 else ndim - 1

    def judged(self, g: torch.Tensor) -> bool:
        """Whether ``g`` has the layer's declared units where they belong (then it is dead-unit evidence)."""
        ndim = g.ndim
        return ndim > 0 and self.units > 0 and g.shape[self.unit_dim(ndim)] == self.units

    def samples(self, g: torch.Tensor) -> int:
        """The samples behind ``g``'s dead-unit evidence: the N of (N, C, *spatial), else every row of (*, U)."""
        ndim = g.ndim
        if ndim >= 3 and self.unit_dim(ndim) == 1:
            return g.shape[0]
        return g.numel() // g.shape[-1] if ndim >= 2 else 1

    def deltas(self, g: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a sampled step adds to (sum of squares [1], per-unit evidence [units or 0]), in the
        cells' dtype; ``weights``: the projection weights (as in :meth:`of`)."""
        sq, evidence, _ = self.of(g, weights)
        units = evidence.square().to(self.dtype) if evidence is not None else g.new_zeros(0, dtype=self.dtype)
        return sq.to(self.dtype).reshape(1), units

    def add_to_cells(self, g: torch.Tensor, weights: torch.Tensor, row: torch.Tensor) -> None:
        """Add one output gradient of a recorded step to a layer's backward row on the device: its
        counts (sum of squares, calls, samples) and its dead-unit evidence, squared, after them
        (:data:`ROW_COUNTS`); ``weights`` as in :meth:`of`. What compiled code records where every
        step is (``detail="full"``, traced)."""
        sq, evidence, samples = self.of(g, weights)
        row[1:2].add_(1.0)
        row[0:1].add_(sq)
        if evidence is not None:
            row[ROW_COUNTS:].addcmul_(evidence, evidence)
            row[2:3].add_(samples)

    def of(self, g: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """(sum of squares, per-unit evidence or None, the samples behind it) of one output gradient:
        the form compiled code takes (:meth:`add_to_cells`, :meth:`deltas`; eager taps write the same
        into their cells, :meth:`record`).
        ``weights``: the device's projection weights, handed in by compiled code (which reaches them
        through the tap's shared state, not through this object: ``capture/cells.py``); the same
        tensor as ``self.weights``, which eager code reads.

        The sum of squares is exact at any magnitude: norms of rows accumulated in float64 (on the
        CPU a float64 reduction over rows costs a third of one over the whole tensor; a large
        convolution gradient's rows, outside traced code, in float32 with a float64 redo of the rows
        float32 cannot hold: :meth:`_channel_rows`), then their squares summed; the rows are also
        what the dead-unit evidence is made of."""
        ndim = g.ndim
        judged = self.judged(g)
        if ndim >= 3 and self.unit_dim(ndim) == 1:
            # (N, C, *spatial): one norm per (sample, channel) over positions, in any layout.
            rows = self._channel_rows(g)
            if not judged:
                return rows.square().sum(), None, 0.0
            # Per channel over samples and positions. The samples are the N examples, not
            # N x positions: neighbouring positions of one image are not independent evidence.
            return rows.square().sum(), torch.linalg.vector_norm(rows, 2, dim=0), float(g.shape[0])
        rows = _as_rows(g)
        # (traced code: no method call, one guard less)
        row_norms = torch.linalg.vector_norm(rows, 2, dim=1, dtype=self.dtype)
        sq = torch.dot(row_norms, row_norms)
        if not judged:
            return sq, None, 0.0  # units unknown, or an output without the declared units
        if rows.dtype not in (torch.float32, torch.float64):
            rows = rows.float()  # half-precision squares overflow
        n = rows.shape[0]
        if self.unit_sums:  # dead_eps > 0: per-unit norms, compared with dead_eps (float64: exact at any size)
            return sq, torch.linalg.vector_norm(rows, 2, dim=0, dtype=self.dtype), float(n)
        # Projection on fixed positive weights (one matrix-vector product): zero for a unit
        # whose gradient is zero for every row, and (but for an exact cancellation against
        # random weights) not otherwise. Squared when added, so that calls never cancel.
        weights = weights[:n] if n <= weights.shape[0] else generated_weights(n, rows.device)
        if weights.dtype != rows.dtype:
            weights = weights.to(rows.dtype)
        return sq, torch.mv(rows.t(), weights), float(n)

    def _channel_rows(self, g: torch.Tensor) -> torch.Tensor:
        """(N, C, *spatial) -> each (sample, channel)'s norm over positions, (N, C) in the cells' dtype:
        one float64 reduction where traced, float32 rows with a float64 redo where ``capture.cpu_rows``
        applies (eager taps outside float32 windows, and a compiled conv net's sampled steps, which
        run :meth:`of` eagerly: ``host_branch``)."""
        if outputs.CPU_ROWS and self.dtype == torch.float64 and cpu_rows.applies(g):
            return cpu_rows.channel_row_squares(g, self.dtype).sqrt()
        return torch.linalg.vector_norm(g, 2, dim=tuple(range(2, g.ndim)), dtype=self.dtype)

    def record(self, g: torch.Tensor, sq: torch.Tensor, units: torch.Tensor, first: bool) -> float:
        """Eager: fold one output gradient's statistics (those of :meth:`of`) into the layer's cells.

        Args:
            g: the output gradient (this rank's piece).
            sq: the 0-d sum-of-squares cell.
            units: the (1, units) dead-unit evidence cell (squares of the projection, or of per-unit
                norms with ``unit_sums``), added in its own dtype (float64: the square of a float32
                projection of 1e-25 gradients would underflow to a dead unit's zero).
            first: the layer's first output gradient of the step: the sum of squares is written into
                its cell (``out=``, one op), not added (the cell holds an older step's value).

        Returns:
            the samples behind the dead-unit evidence (0.0: ``g`` is none).
        """
        ndim = g.ndim
        fast = self.float32_rows(g)
        if ndim >= 3 and self.unit_dim(ndim) == 1:
            # (N, C, *spatial): as in :meth:`of`, per (sample, channel) over positions, then per channel.
            rows = self._row_norms(g, tuple(range(2, ndim)), True) if fast else self._channel_rows(g)
            _write(_sum_all, (rows.square(),), sq, first)
            if not self.judged(g):
                return 0.0
            evidence = self._channel_projection(g) if fast else torch.linalg.vector_norm(rows, 2, dim=0, keepdim=True)
            units.addcmul_(evidence, evidence)
            return float(g.shape[0])
        rows = _as_rows(g)
        if fast and cpu_rows.dot_applies(g):  # one float32 dot (cpu_rows.DOT_MAX), into the float64 cell
            square_sum = cpu_rows.dot_square_sum(g)
            if first:
                sq.copy_(square_sum)
            else:
                sq.add_(square_sum)
        else:
            row_norms = self._row_norms(rows, 1, fast)
            _write(torch.dot, (row_norms, row_norms), sq, first)
        if not self.judged(g):
            return 0.0
        if rows.dtype not in (torch.float32, torch.float64):
            rows = rows.float()  # half-precision squares overflow
        n = rows.shape[0]
        if self.unit_sums:  # as in :meth:`of`
            evidence = torch.linalg.vector_norm(rows, 2, dim=0, keepdim=True, dtype=self.dtype)
        else:  # the projection of :meth:`of`, as a (1, n) x (n, units) product: no transpose
            evidence = torch.mm(self._weight_row(n, rows.dtype, rows.device), rows)
        units.addcmul_(evidence, evidence)
        return float(n)

    def float32_rows(self, g: torch.Tensor) -> bool:
        """Whether eager code norms ``g``'s rows in float32 (combined in float64): :meth:`record`, which
        the ops that record compiled sampled steps run too (``host_branch``).

        On the CPU a float64 reduction of float32 values is 3-80x slower than a float32 one (the
        cast is not vectorised: 0.2-0.6 ms per convolution output of the standard CNN, 16 ms for a
        (64, 64, 32, 32) one, against 0.05-0.15 ms). In a window where the layer's norms allow it
        (:attr:`float32`), each row (a sample's channel, a token) is normed in float32 (relative
        error ~4e-8: few elements each), or a (*, U) gradient of at most ``cpu_rows.DOT_MAX``
        elements is summed by one float32 dot (within ~5e-7, at about half the rows' time): squares
        below ~1e-38 are lost to underflow, nothing next to a total of at least 1e-22
        (:data:`FLOAT32_SAFE_NORM`). Not with per-unit
        sums (``dead_eps > 0``), nor for a channels-last gradient (:meth:`_channel_projection`
        would copy it)."""
        return (self.float32 and outputs.CPU_ROWS and g.dtype == torch.float32 and not self.unit_sums
                and g.device.type == "cpu" and g.is_contiguous())  # fmt: skip

    def _row_norms(self, x: torch.Tensor, dim: int | tuple[int, ...], fast: bool) -> torch.Tensor:
        """Norms of ``x`` over ``dim`` in the cells' dtype: accumulated in it, or (``fast``) in float32 and cast."""
        if fast:
            return torch.linalg.vector_norm(x, 2, dim=dim).to(self.dtype)
        return torch.linalg.vector_norm(x, 2, dim=dim, dtype=self.dtype)

    def _channel_projection(self, g: torch.Tensor) -> torch.Tensor:
        """A contiguous (N, C, *spatial) gradient's dead-unit evidence in float32 windows, (1, C).

        Float32 row norms of 1e-30 gradients read zero, and a unit's zero test must not depend on
        underflow: channel ``c`` gets ``sum over n, p of w_n w_p g[n, c, p]`` with fixed positive
        weights, like a linear layer's projection: zero for a channel whose gradient is zero and
        (but for an exact cancellation against irrational-like weights) not otherwise, at any
        magnitude."""
        n, c = g.shape[0], g.shape[1]
        per_position = torch.mm(self._weight_row(n, g.dtype, g.device), g.reshape(n, -1))  # (1, C x P)
        positions = per_position.shape[1] // c
        weights = self._weight_row(positions, g.dtype, g.device).view(positions, 1)
        return torch.mm(per_position.view(c, positions), weights).view(1, c)

    def _weight_row(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The first ``n`` projection weights as (1, n), kept per shape for the drawn ones (views, or
        one conversion of at most 64 KiB); generated afresh for longer gradients, as in :meth:`of`."""
        key = (n, dtype)
        row = self._weight_rows.get(key)
        if row is not None:
            return row
        if n > self.weights.shape[0]:
            return generated_weights(n, device).to(dtype).view(1, n)
        row = self.weights[:n].to(dtype).view(1, n)
        if len(self._weight_rows) >= 8:  # bounded: shapes that keep changing are converted per call
            self._weight_rows.clear()
        self._weight_rows[key] = row
        return row


def _as_rows(g: torch.Tensor) -> torch.Tensor:
    """A (*, U) output gradient as (rows, U): every leading index is a row (a sample, or a token of one)."""
    return g if g.ndim == 2 else g.reshape(-1, g.shape[-1]) if g.ndim > 2 else g.reshape(1, -1)


def _sum_all(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return torch.sum(x) if out is None else torch.sum(x, dim=None, out=out)


def _write(fn, args: tuple, cell: torch.Tensor, first: bool) -> None:  # type: ignore[no-untyped-def]
    """``cell = fn(*args)`` in one op (``out=``, in the arguments' dtype) at a step's first call, else
    ``cell += fn(*args)``."""
    if first:
        fn(*args, out=cell)
    else:
        cell.add_(fn(*args))


def generated_weights(n: int, device: torch.device) -> torch.Tensor:
    """Deterministic weights in [1, 2) for more rows than the drawn ones cover (the golden-ratio sequence)."""
    return torch.arange(n, dtype=torch.float32, device=device).mul_(_GOLDEN).frac_().add_(1.0)
