"""The few values judged at every step, on the host without a host/device sync.

``nonfinite`` and model-level ``exploding`` are judged at every step, not only at the flush:
after ``step()`` has written a step's row, the row's parameter-gradient sums of squares and
non-finite counts, the layers' forward sums and output-gradient sums of squares (and,
on sampled steps, the forward order) are

- on the CPU path: read through numpy views of the buffer, which is host memory: the step is
  judged at its own ``step()``;
- elsewhere (accelerators, and the device-agnostic path on CPU tensors): copied with
  ``non_blocking=True`` into pinned host memory, with a CUDA event recorded after the copy; a
  later ``step()`` reads the copy once ``event.query()`` says it has landed (the next one, almost
  always), so nothing waits for the device. The norms and forward sums are already on their way:
  the recorder copies its per-step stage into the window's host table at every step
  (``capture/per_step_rows.py``); else a ``cat`` of the buffer's two rows, copied here.
  The non-finite counts and output-gradient sums of squares, recorded on sampled steps only there,
  are one ``cat`` and copy more on those steps; the host reads zeros for them on the others.

Nothing here is traced: it runs in ``step()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import compress

import numpy as np
import torch

from ..capture.layout import Layout
from ..capture.per_step_rows import PerStepRows
from ..registry.statistics import layer_ran
from ..registry.states import FWD_ORDER, FWD_SUM, OUT_GRAD, PARAM_NONFINITE, PARAM_PRESENT, PARAM_SQ, STEP_FAILED

#: Staging slots allocated at attach for steps whose values are still being copied. A step that
#: finds them all in flight adds one (at most one per step of a window, as ``ready()`` runs at
#: every step and the flush clears the ring): every step is judged per step, and nothing waits.
_RING = 4


@dataclass
class StepValues:
    """One step's host values for the per-step checks."""

    slot: int
    sq: np.ndarray  # [P] per-tensor sums of squares
    nonfinite: np.ndarray  # [P] per-tensor non-finite counts (0 where not counted)
    present: np.ndarray  # [P] > 0: the tensor had a gradient (ranks that had it; a view of the host state)
    forward: np.ndarray  # [L] the step's forward sums
    out_sq: np.ndarray  # [L] output-gradient sums of squares (0 where not recorded)
    order: np.ndarray | None  # [L] forward clock at each layer's first call (sampled steps)
    failed: bool


class StepReadback:
    """Per-step values of one window, handed over when they are on the host."""

    def __init__(self, layout: Layout, per_step_rows: PerStepRows | None = None) -> None:
        self.layout = layout
        buffer = layout.buffer
        self.host_path = layout.host_path
        self.cuda = buffer.device.type == "cuda"
        p, n = len(layout.param_layer), len(layout.names)
        self._p, self._n = p, n  # a staged row: [sums of squares | forward sums | non-finite counts | out_sq]
        self._rows = [
            (buffer.row(PARAM_SQ, t), buffer.row(FWD_SUM, t), buffer.row(PARAM_NONFINITE, t), buffer.row(OUT_GRAD, t)[0])
            for t in range(layout.flush_every)
        ]  # fmt: skip
        #: where every step's norms and forward sums land on the host: the recorder's per-step rows'
        #: table (it copies them itself), or None: the ring's first half (copied here)
        self._every_step = per_step_rows
        self._zeros = (np.zeros(p), np.zeros(n))  # what unsampled steps record of the sampled part
        self._order_rows = [buffer.row(FWD_ORDER, t) for t in range(layout.flush_every)]
        present = buffer.host[PARAM_PRESENT]
        self._present = [present[t] for t in range(layout.flush_every)]
        if self.host_path:
            # The same rows as numpy views, made once: indexing at every step costs a call each, at
            # the price such calls have right after backward.
            self._host_rows = [
                tuple(row.numpy() for row in (*rows, order)) for rows, order in zip(self._rows, self._order_rows)
            ]
        #: each row's forward sums as a view of the buffer's host memory on that path (an alias's
        #: column is filled in by :meth:`ready` or the flush), else None
        self.host_forward = [rows[1] for rows in self._host_rows] if self.host_path else None
        # In flight: (slot, staging index, event or None); the staging ring (pinned on CUDA) is
        # allocated at attach and grows by one slot when a step finds every slot in flight (a
        # device running many steps ahead of the host), up to one per step of a window.
        self._in_flight: list[tuple] = []
        self._ring: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._ring_host: list[tuple[np.ndarray, np.ndarray]] = []  # numpy views of the ring, made once
        self._free: list[int] = []
        if not self.host_path:
            for _ in range(min(_RING, layout.flush_every)):
                self._add_slot()

    def _add_slot(self) -> None:
        """One more staging slot (pinned host memory on CUDA), free."""
        buffer = self.layout.buffer
        p, n = self._p, self._n
        row = torch.empty(2 * (p + n), dtype=buffer.dtype, pin_memory=self.cuda)
        order = torch.empty(n, dtype=buffer.dtype, pin_memory=self.cuda)
        self._ring.append((row[: p + n], row[p + n :], order))  # views made once: slicing is an op per call
        self._ring_host.append((row.numpy(), order.numpy()))
        self._free.append(len(self._ring) - 1)

    @property
    def slots(self) -> int:
        """How many staging slots the ring has now (0 on the CPU path, which reads the buffer)."""
        return len(self._ring)

    @property
    def available(self) -> bool:
        """Whether per-step values can be had without a sync on this device."""
        return self.host_path or self.cuda or self.layout.buffer.device.type == "cpu"

    def capture(self, slot: int) -> None:
        """After ``step()`` wrote row ``slot``: start its copy to the host (nothing to do on the CPU path)."""
        if self.host_path:
            self._in_flight.append((slot,))
            return
        if not self._free:
            self._add_slot()  # every slot still in flight: grow rather than wait or lose the step
        k = self._free.pop()
        every_step, sampled_part, order = self._ring[k]
        rows = self._rows[slot]
        if self._every_step is None:
            every_step.copy_(torch.cat(rows[:2]), non_blocking=self.cuda)
        sampled = self.layout.is_sampled(slot)
        if sampled:
            sampled_part.copy_(torch.cat(rows[2:]), non_blocking=self.cuda)
            order.copy_(self._order_rows[slot], non_blocking=self.cuda)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        self._in_flight.append((slot, k, sampled, event))

    def ready(self, wait: bool = False) -> list[StepValues]:
        """The captured steps whose values are on the host, in order (``wait``: all of them; the
        flush, which synchronises anyway)."""
        out: list[StepValues] = []
        host = self.layout.buffer.host
        while self._in_flight:
            item = self._in_flight[0]
            slot = item[0]
            if self.host_path:
                sq, forward, nonfinite, out_sq, order = self._host_rows[slot]
                if not self.layout.is_sampled(slot):  # the sampling plan can change per window (full_window)
                    order = None
            else:
                _, k, sampled, event = item
                if event is not None and not wait and not event.query():
                    break  # not landed yet: judged at a later step
                if event is not None and wait:
                    event.synchronize()
                staged, order_host = self._ring_host[k]
                p, n = self._p, self._n
                if self._every_step is not None:  # the per-step table: norms (squared here) and float32 sums
                    sq = np.square(self._every_step.host_norms[slot], dtype=np.float64)
                    forward = self._every_step.forward_row(slot)
                    values = staged[p + n :].astype(np.float64) if sampled else None  # a copy: the slot is reused
                else:
                    values = staged[: 2 * (p + n) if sampled else p + n].astype(np.float64)
                    sq, forward, values = values[:p], values[p : p + n], values[p + n :]
                nonfinite, out_sq = (values[:p], values[p:]) if sampled else self._zeros
                order = order_host.astype(np.float64) if sampled else None
                self._free.append(k)
            self._in_flight.pop(0)
            if self.layout.forward_aliases:  # an alias's forward sum is its target's (it takes no sum of its own)
                self.layout.forward_aliases.fill(forward)
            # Views of the buffer's rows on the CPU path (they hold until the window ends), copies
            # of the staging slot otherwise.
            out.append(StepValues(slot, sq, nonfinite, self._present[slot], forward, out_sq, order,
                                  bool(host[STEP_FAILED][slot])))  # fmt: skip
        return out

    def clear(self) -> None:
        """Forget what is in flight (a window ends)."""
        for item in self._in_flight:
            if not self.host_path:
                if item[3] is not None:
                    item[3].synchronize()  # the copy must land before its slot is reused
                self._free.append(item[1])
        self._in_flight.clear()


@dataclass
class StepSummary:
    """What the per-step checks judge, per layer and for the model, from one step's values."""

    has_grad: bool
    global_norm: float  # over the tensors that had a gradient (NaN: none had one)
    fwd_bad: np.ndarray  # [L] an output turned non-finite at this step (first time in the window)
    grad_bad: np.ndarray  # [L] a parameter gradient or output gradient was non-finite
    count: float  # non-finite parameter-gradient elements counted (0: not counted this step)
    any_bad: bool | None = None  # fwd_bad or grad_bad anywhere (None: worked out from them)
    zero_grad: bool = False  # some tensor that had a gradient had an exactly zero one (a layer may have fallen silent)

    def __post_init__(self) -> None:
        if self.any_bad is None:
            self.any_bad = bool(self.fwd_bad.any() or self.grad_bad.any())


def summarize(values: StepValues, layout: Layout) -> StepSummary:
    """Per layer and for the model: what one step's host values say.

    This runs at every step, right after backward has swept the caches, where each distinct
    call costs tens of microseconds (benchmarks/RESULTS.md, "Compiled training"). So the common
    case, everything finite, is decided on Python floats in a few C-level calls, without numpy
    ufuncs or error-state changes: a NaN or Inf anywhere makes the probe non-finite (Python float
    arithmetic propagates them and never warns). Anything else takes the exact path, which works
    out the per-layer masks.
    """
    present = values.present.tolist()
    had = list(compress(values.sq.tolist(), present))  # the sums of squares of the tensors that had a gradient
    total = sum(had)
    probe = total + sum(values.forward.tolist()) + sum(values.out_sq.tolist())
    if math.isfinite(probe) and not any(values.nonfinite.tolist()):
        has_grad = any(present)
        none = _no_layer(len(layout.names))
        return StepSummary(has_grad, math.sqrt(total) if has_grad else math.nan, none, none, 0.0, any_bad=False,
                           zero_grad=0.0 in had)  # fmt: skip
    return _summarize_exactly(values, layout)


def _summarize_exactly(values: StepValues, layout: Layout) -> StepSummary:
    """:func:`summarize` when something may not be finite: per-layer masks from every value."""
    n = len(layout.names)
    present = values.present > 0
    with np.errstate(invalid="ignore", over="ignore"):
        total = float(np.dot(present, np.where(present, values.sq, 0.0)))
        has_grad = bool(present.any())
        norm = float(np.sqrt(total)) if has_grad else float("nan")
        bad_tensor = present & (~np.isfinite(values.sq) | (values.nonfinite > 0))
        grad_bad = np.bincount(layout.param_layer[bad_tensor], minlength=n) > 0
        grad_bad |= ~np.isfinite(values.out_sq)
        fwd_bad = ~np.isfinite(values.forward)
    count = float(np.rint(np.sum(np.where(present, values.nonfinite, 0.0))))
    return StepSummary(has_grad, norm, fwd_bad, grad_bad, count, zero_grad=bool(np.any(present & (values.sq == 0))))


@lru_cache(maxsize=8)
def _no_layer(n: int) -> np.ndarray:
    """A read-only all-False mask over ``n`` layers, made once per size."""
    none = np.zeros(n, dtype=bool)
    none.setflags(write=False)
    return none


def forward_order(first_calls: np.ndarray) -> list[int]:
    """Layers in the order of their first forward call (the clock counts down)."""
    ran = np.flatnonzero(first_calls > 0)
    return [int(i) for i in ran[np.argsort(-first_calls[ran], kind="stable")]]


def silent_layers(values: StepValues, layout: Layout) -> np.ndarray:
    """[L] layers that ran at this step (``registry.statistics.layer_ran``: the decoder's rule) and
    whose every parameter gradient was exactly zero: every unit silent on every sample, or a path cut."""
    n = len(layout.names)
    present = values.present > 0
    nonzero = np.bincount(layout.param_layer, weights=present & (values.sq != 0), minlength=n) > 0
    held = np.bincount(layout.param_layer, weights=present, minlength=n) > 0
    ran = layer_ran(values.forward, values.order if values.order is not None else 0.0)
    return held & ~nonzero & ran
