"""The dead-unit evidence of a window's first sampled steps, on the host before the window ends.

A layer whose units look dead on the sampled steps must be confirmed on every step (a unit
silent on two sampled steps may fire on a few rows in between). Read here, after the last
sampled step of the window's first run of them, that confirmation can run in the same window:
``StepPipeline`` switches the rest of the window to every statistic at every step, and the
flush judges on that. Read without a sync: on CPU buffers through numpy views (host memory);
elsewhere with one ``non_blocking`` copy and an event a later ``step()`` checks.

With data-parallel ranks each rank decides from its own rows, without a collective: a layer
dead for every batch looks dead on every rank's sampled steps, so they all switch at the same
step. Where they do not agree, the window records which ranks sampled each step
(``STEP_UNSAMPLED``): a step is sampled in the reduced window only where every rank sampled it,
so a rank that switched alone adds evidence (a unit it saw fire is alive) but confirms nothing,
and the flush asks the next window for the confirmation, as every rank agrees on it there. Not
where ranks hold different layers (pipeline or tensor parallel with a union of layers): this
rank's layers are not the rules' layers there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..capture.layout import Layout
from ..registry.states import OUT_GRAD, STEP_FAILED, UNIT_ACC
from ..registry.statistics import dead_unit_fractions, rows_seen_of


class UnitProbe:
    """Reads the unit evidence of a window's first sampled steps once per window.

    Args:
        layout: the rank's buffer layout.
        dead_eps: the output-gradient magnitude that counts as zero.
        enabled: False where ranks hold different layers (then this reads nothing).
    """

    def __init__(self, layout: Layout, dead_eps: float, enabled: bool) -> None:
        self.layout, self.dead_eps, self.enabled = layout, dead_eps, enabled
        planned = layout.planned_slots
        gaps = np.flatnonzero(~planned)
        #: the slot after which the window's first run of sampled steps ends (None: every slot is sampled)
        self.trigger = int(gaps[0]) - 1 if len(gaps) and gaps[0] > 0 else None
        self._units = layout.buffer.host_view(UNIT_ACC)
        self._out = layout.buffer.host_view(OUT_GRAD)
        self._pending: tuple[torch.Tensor, Any] | None = None  # (staged evidence, event) in flight

    def after_step(self, slot: int) -> tuple[np.ndarray, np.ndarray] | None:
        """After ``step()`` wrote row ``slot``: the (dead fraction, rows seen) per layer of the
        window's sampled steps so far, once they are on the host; None until then or when not read."""
        if not self.has_news(slot):
            return None
        if slot == self.trigger:
            if self._units is not None:  # CPU buffer: host memory, read now
                return self._evidence(self._units, self._rows_seen(self._out[: slot + 1, 2]))
            self._start_copy(slot)
            return None
        if self._pending is not None:
            staged, event = self._pending
            if event is not None and not event.query():
                return None
            self._pending = None
            values = staged.double().numpy()
            count = int(self.layout.unit_count.sum())
            return self._evidence(values[:count], rows_seen_of(values[None, count:]))
        return None

    def has_news(self, slot: int) -> bool:
        """Whether :meth:`after_step` may have evidence after row ``slot`` (the trigger step, or a
        copy in flight); False at nearly every step, which then costs the caller no more."""
        return (slot == self.trigger or self._pending is not None) and self.enabled and not self.layout.full_window

    def reset(self) -> None:
        """A new window: forget a copy still in flight."""
        self._pending = None

    def _rows_seen(self, samples: np.ndarray) -> np.ndarray:
        ok = self.layout.buffer.host[STEP_FAILED][: len(samples)] == 0
        return rows_seen_of(np.where(ok[:, None], samples, 0.0))

    def _start_copy(self, slot: int) -> None:
        buffer = self.layout.buffer
        cuda = buffer.device.type == "cuda"
        evidence = torch.cat([buffer[UNIT_ACC], buffer[OUT_GRAD][: slot + 1, 2].sum(0)])
        staged = torch.empty(evidence.shape, dtype=evidence.dtype, pin_memory=cuda)
        staged.copy_(evidence, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending = (staged, event)

    def _evidence(self, units: np.ndarray, rows_seen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        fractions, _ = dead_unit_fractions(np.asarray(units, dtype=np.float64), self.layout, rows_seen, self.dead_eps)
        return fractions, rows_seen
