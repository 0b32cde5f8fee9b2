"""The reductions that fill a group of parameter gradients' per-tensor statistics (``param_stats.py``
groups the tensors and picks one of these per group).

- ``ForeachStats`` (any device): one ``torch._foreach_norm`` per group for the
  sums of squares (accumulated in float64 on accelerators, where that costs
  nothing more than the memory read), one for max |g|, and a chunked foreach
  count of non-finite elements.
- ``CpuBlasStats`` (CPU, float32 tensors of at least 32K elements): one BLAS
  ``dot`` (sum of squares) and one ``aminmax`` (max |g|) per tensor, written into
  preallocated slots; on the CPU these beat the foreach kernels (the inf-norm
  kernel is ~8x slower than ``aminmax``, a float64 norm ~4x slower than ``dot``).
- ``TinyStats`` (CPU tensors whose float32 squares underflow, |g| < ~1e-15: a vanishing
  layer): float64 norms straight away, checked on the host like the slots.

CPU results are host memory: on the CPU the first two compute them in float32
into slots and then ``_CpuSlots.settle`` reads the sums of squares on the host (a
plain memory read, no device sync). A sum that is not finite means non-finite
elements (counted exactly, by a pass that runs only then) or a float32 overflow
of a finite gradient (|g| >~ 1e19: its sum of squares is recomputed in
float64), so a finite gradient always gets a finite, exact norm. A tiny sum (squares that
underflowed) is recomputed in float64 too, and ``param_stats`` moves such tensors to
``TinyStats`` from the next step on, so a vanishing run does not pay twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .devices import foreach_norm

_INF = float("inf")

# Temporaries of the non-finite count are bounded to this many elements at a time.
_COUNT_CHUNK = 1 << 24


@dataclass
class StepRows:
    """One step's rows of the per-tensor states (float64 views into the buffer), or a group's slice of them."""

    sq: torch.Tensor
    max: torch.Tensor | None  # None: max |g| not recorded this step
    nonfinite: torch.Tensor
    count: bool = True  # False: accelerators skip the non-finite count (finite-or-not stays in sq)
    #: CPU buffers: ``sq`` as a numpy view made once, for the host check of the results
    sq_host: np.ndarray | None = None
    #: ``sq`` is the per-step stage's norms (``capture/per_step_rows.py``), squared where read: the common
    #: case may leave the norms there (``ForeachStats.reduce``'s ``keep_norms``; a group's slice has
    #: it False, so that every strategy of the general path writes squares)
    norms_allowed: bool = False

    def __post_init__(self) -> None:
        self._slices: dict[tuple[int, int], "StepRows"] = {}

    def part(self, cols: slice) -> "StepRows":
        """The rows of columns ``cols``, as views made once (slicing is an op per call)."""
        key = (cols.start, cols.stop)
        part = self._slices.get(key)
        if part is None:
            part = StepRows(
                self.sq[cols], None if self.max is None else self.max[cols], self.nonfinite[cols], self.count,
                None if self.sq_host is None else self.sq_host[cols],
            )  # fmt: skip
            if len(self._slices) < 64:
                self._slices[key] = part
        return part


def nonfinite_counts(grads: list[torch.Tensor], chunk: int = _COUNT_CHUNK, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-tensor number of NaN/Inf elements, as one float32 tensor on the gradients' device (``out``:
    counted in its dtype and stacked into it, one op less than a copy).

    ``g - g`` is 0 for finite values and NaN for NaN/Inf, and the 0-"norm" counts the
    non-zeros. Gradients larger than ``chunk`` are cut into flat views of at most ``chunk``
    elements, and everything is processed at most ``chunk`` elements at a time, so the temporaries never exceed
    ``chunk`` elements however large the model.
    """
    pieces: list[torch.Tensor] = []
    owners: list[int] = []
    for i, g in enumerate(grads):
        # whole where it fits (the foreach kernels take any shape; a view and a split are two ops a tensor)
        for piece in (g,) if g.numel() <= chunk else g.reshape(-1).split(chunk):
            pieces.append(piece)
            owners.append(i)
    counts: list[torch.Tensor] = []
    start, size = 0, 0
    for end, piece in enumerate(pieces + [None]):  # type: ignore[operator]
        if piece is None or (size + piece.numel() > chunk and end > start):
            batch = pieces[start:end]
            diffs = torch._foreach_sub(batch, batch)
            counts.extend(torch._foreach_norm(diffs, 0) if out is None else foreach_norm(diffs, 0, out.dtype))
            start, size = end, 0
        if piece is not None:
            size += piece.numel()
    if len(pieces) > len(grads):  # add up the pieces of each split tensor
        per_tensor: list[list[torch.Tensor]] = [[] for _ in grads]
        for owner, count in zip(owners, counts):
            per_tensor[owner].append(count)
        counts = [c[0] if len(c) == 1 else torch.stack(c).sum() for c in per_tensor]
    return torch.stack(counts).to(torch.float32) if out is None else torch.stack(counts, out=out)


class ForeachStats:
    """Device-agnostic: one foreach kernel per statistic and group."""

    name = "foreach"

    def __init__(self, acc_dtype: torch.dtype) -> None:
        self.acc_dtype = acc_dtype  # float64 where the device has it (not MPS)

    def reduce(self, grads: list[torch.Tensor], rows: StepRows, cpu: "_CpuSlots | None", count: bool = False,
               keep_norms: bool = False, dots_from: int | None = None) -> bool:  # fmt: skip
        """Fill ``rows`` (this group's columns) for ``grads``; ``cpu``: result slots of the CPU path
        (float32 and narrower gradients); ``count``: count non-finite elements even on a step that
        does not (float64 gradients on the CPU path, whose counts are promised at every step);
        ``keep_norms``: leave the norms in ``rows.sq`` where ``rows.norms_allowed`` (the per-step
        stage's, squared where read: one op less); ``dots_from`` (CPU path): ``grads[dots_from:]``
        are float32 tensors large enough that a BLAS dot reads them faster than the foreach norm
        (``column_groups.DOT_MIN``: :func:`square_sum_into`); None: none.
        Returns whether ``rows.sq`` holds norms."""
        if cpu is not None:  # CPU: float32 norms, squared into the float64 row, checked on the host
            k = len(grads)
            normed = k if dots_from is None else dots_from
            if normed:  # stack into float32 (a float64 out= costs ~6x as much), squared into the row
                torch.stack(foreach_norm(grads if normed == k else grads[:normed], 2, torch.float32),
                            out=cpu.head(normed)[0])  # fmt: skip
            if normed < k:  # (no loop over nothing: the common case without dot-read tensors)
                for g, (sq, _, _) in zip(grads[normed:], cpu.slots[normed:k]):
                    square_sum_into(g, sq)
            cpu.settle(k, grads, rows, norms=normed)
            if rows.max is not None:
                rows.max.copy_(_cpu_abs_max(grads))
            return False
        norms = keep_norms and rows.norms_allowed
        torch.stack(foreach_norm(grads, 2, self.acc_dtype), out=rows.sq)
        if not norms:
            rows.sq.square_()
        if rows.count or count:
            nonfinite_counts(grads, out=rows.nonfinite)
        if rows.max is not None:
            torch.stack(foreach_norm(grads, _INF, self.acc_dtype), out=rows.max)
        return norms


def square_sum_into(g: torch.Tensor, out: torch.Tensor) -> None:
    """A CPU float32 tensor's sum of squares in float32 into the 0-d ``out``: one BLAS dot of its
    flat view (faster than a norm, and more accurate: ``column_groups.DOT_MIN``); a tensor that is
    not contiguous (channels-last, transposed) by its norm, squared (a flat copy would cost more)."""
    if g.is_contiguous():
        flat = g.view(-1)
        torch.dot(flat, flat, out=out)
    else:
        torch.linalg.vector_norm(g, out=out)
        out.square_()


def _cpu_abs_max(grads: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor max |g| of small CPU tensors (the CPU inf-norm kernel is slow)."""
    if hasattr(torch, "_foreach_max"):
        return torch.stack(torch._foreach_max(torch._foreach_abs(grads)))
    return torch.stack([g.abs().max() for g in grads])


class CpuBlasStats:
    """CPU float32 tensors of at least ``column_groups.CPU_LARGE`` elements: one BLAS dot
    (:func:`square_sum_into`) and one aminmax each.

    ``aminmax`` goes first: it splits the tensor across the intra-op threads and
    leaves it in cache for the dot.
    """

    name = "cpu-blas"

    def reduce(self, grads: list[torch.Tensor], rows: StepRows, cpu: "_CpuSlots") -> None:
        """Fill ``rows`` (this group's columns) for ``grads``."""
        with_max = rows.max is not None
        for (sq, lo, hi), g in zip(cpu.slots, grads):
            if with_max:
                torch.aminmax(g, out=(lo, hi))
            square_sum_into(g, sq)
        _, lo, hi = cpu.head(len(grads))
        cpu.settle(len(grads), grads, rows, norms=0)
        if with_max:
            rows.max.copy_(torch.maximum(hi, lo.neg()))


#: A float32 sum of squares below this may have lost squares to underflow (those of |g| < 1.1e-19
#: are subnormal, of |g| < 2.6e-23 zero: a vanishing layer's 1e-25 gradient would read as zero),
#: so such tensors are summed again in float64. Above it, what underflow loses (at most 1.4e-45
#: per element) is below float32's own precision for any tensor under 1e9 elements.
TINY_SQ = 1e-30
#: ... and a tensor taken by TinyStats goes back to float32 once its sum of squares is this large
#: (a thousandfold norm above the line: no back and forth around it).
GROWN_SQ = TINY_SQ * 1e6


class _CpuSlots:
    """Preallocated float32 result slots for CPU groups, and the host-side check of their sums."""

    def __init__(self, size: int) -> None:
        self.sq = torch.zeros(size, dtype=torch.float32)
        self.lo = torch.zeros(size, dtype=torch.float32)
        self.hi = torch.zeros(size, dtype=torch.float32)
        self.sq_host = self.sq.numpy()  # shares memory: reading it is a plain memory read
        self.slots = list(zip(self.sq.unbind(), self.lo.unbind(), self.hi.unbind()))
        self._heads: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        #: positions (in the rows of the latest ``settle``) whose sums were tiny
        self.found_tiny: list[int] = []
        #: the latest ``settle``'s sum of the row, where every value was finite and not tiny (the
        #: common case, decided on the host anyway: ``param_stats.ParamStats.checked_total``); else None
        self.checked_total: float | None = None

    def head(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        heads = self._heads.get(k)
        if heads is None:  # slicing is an op per call; the group sizes repeat
            heads = self._heads[k] = (self.sq[:k], self.lo[:k], self.hi[:k])
        return heads

    def settle(self, k: int, grads: list[torch.Tensor], rows: StepRows, norms: int) -> None:
        """The first ``k`` slots into ``rows.sq``, checked: the first ``norms`` of them hold norms and
        are squared, the rest hold sums of squares. Where a float32 result is not finite or is tiny,
        :meth:`_repair` makes it exact.

        Where the row is host memory, in one pass of Python floats: the slots read once
        (``tolist``), squared in float64 (exact squares of float32 values), written into the row and
        checked from the same list. Right after backward each numpy or dispatcher call pays tens of
        microseconds of cold caches: ``np.square`` into the row took 35 us there, a numpy
        reduction ~50 us more than the check on Python floats (benchmarks/RESULTS.md)."""
        if rows.sq_host is None:
            head = self.head(k)[0]
            if norms == k:
                torch.square(head, out=rows.sq)
            else:
                rows.sq.copy_(head)
                if norms:
                    rows.sq[:norms].square_()
            listed = rows.sq.numpy().tolist()
        else:
            listed = self.sq_host[:k].tolist()
            if norms == k:
                listed = [v * v for v in listed]
            elif norms:
                listed[:norms] = [v * v for v in listed[:norms]]
            rows.sq_host[:] = listed
        self.found_tiny = []
        total = sum(listed)  # (NaN or Inf when any value is)
        if math.isfinite(total) and min(listed) >= TINY_SQ:
            self.checked_total = total
            return
        self.checked_total = None
        self._repair(grads, rows)

    def _repair(self, grads: list[torch.Tensor], rows: StepRows) -> None:
        """Where a float32 result is not finite: count the non-finite elements exactly, and for a
        finite gradient whose squares overflowed float32, write its float64 sum of squares. Where
        it is tiny (squares that underflowed float32): its float64 sum of squares."""
        values = rows.sq_host if rows.sq_host is not None else rows.sq.numpy()
        tiny = np.flatnonzero(values < TINY_SQ)
        if len(tiny):
            # One foreach reduction for them all; float64 squares of float32 values never underflow.
            norms = torch.stack(foreach_norm([grads[t] for t in tiny], 2, torch.float64))
            rows.sq.index_copy_(0, torch.from_numpy(tiny), norms.square_().to(rows.sq.dtype))
            self.found_tiny = tiny.tolist()  # TinyStats takes them from the next step on
        bad = np.flatnonzero(~np.isfinite(values))
        if not len(bad):
            return
        for b, count in zip(bad.tolist(), _write_nonfinite_counts(grads, rows, bad)):
            if count == 0:
                norm = torch.linalg.vector_norm(grads[b].reshape(-1), dtype=torch.float64)
                rows.sq[b] = norm.to(rows.sq.dtype).square()


def _write_nonfinite_counts(grads: list[torch.Tensor], rows: StepRows, bad: np.ndarray) -> list[float]:
    """Count the non-finite elements of the tensors at positions ``bad`` exactly, into ``rows``."""
    counts = nonfinite_counts([grads[b] for b in bad]).tolist()
    for b, count in zip(bad.tolist(), counts):
        rows.nonfinite[b] = count
    return counts


class TinyStats:
    """CPU tensors whose float32 squares underflow (a vanishing layer, |g| < ~1e-15): float64 norms
    straight away, since a float32 pass would only be redone (see ``_CpuSlots.settle``); checked on
    the host like the slots. ``grown``: the positions of the latest call that are tiny no more."""

    name = "tiny"

    def __init__(self) -> None:
        self.grown: list[int] = []

    def reduce(self, grads: list[torch.Tensor], rows: StepRows) -> None:
        """Fill ``rows`` (this group's columns, float64 host memory) for ``grads``."""
        torch.stack(foreach_norm(grads, 2, torch.float64), out=rows.sq)
        rows.sq.square_()
        if rows.max is not None:
            rows.max.copy_(_cpu_abs_max(grads))
        values = rows.sq_host if rows.sq_host is not None else rows.sq.numpy()
        listed = values.tolist()
        if not math.isfinite(sum(listed)):
            _write_nonfinite_counts(grads, rows, np.flatnonzero(~np.isfinite(values)))
        self.grown = [k for k, v in enumerate(listed) if v >= GROWN_SQ]  # NaN is never grown


def complex_stats(grads: list[torch.Tensor], rows: StepRows, acc: torch.dtype) -> None:
    """Complex gradients by their modulus (|g| = sqrt(re^2 + im^2)): the sum of squares of the real
    view is the sum of |g|^2; max |g| and the non-finite count are taken per complex element."""
    real = [torch.view_as_real(g) for g in grads]
    rows.sq.copy_(torch.stack([torch.linalg.vector_norm(r, dtype=acc) for r in real]).square())
    rows.nonfinite.copy_(torch.stack([(~torch.isfinite(g)).sum() for g in grads]).to(rows.nonfinite.dtype))
    if rows.max is not None:
        rows.max.copy_(torch.stack([g.abs().max().to(rows.max.dtype) for g in grads]))
