"""Reading one window: prepare the buffer, combine it across ranks, copy it to the host, decode it."""

from __future__ import annotations

from typing import Any

from ..registry.states import STEP_FAILED
from ..distributed.collectives import Collectives
from ..failures import FailureLog
from .window import Window


class WindowReader:
    """Turns a recorder's buffer into a host :class:`Window` at each flush.

    Args:
        recorder: the rank's recorder (buffer, layout, decoding).
        collectives: the owner of the flush's reduction (one collective per reduction kind).
        failures: where a failed stage is reported (the window is dropped, the run goes on).
        mesh: the union layout when ranks hold different layers, else None.
    """

    def __init__(self, recorder: Any, collectives: Collectives, failures: FailureLog, mesh: Any = None) -> None:
        self.recorder = recorder
        self.collectives = collectives
        self.failures = failures
        self.mesh = mesh

    def read(self, steps: list[int], dead_eps: float, scaler_in_use: bool) -> Window | None:
        """The window of ``steps``, or None if reading it failed. Every rank reaches the collective
        whatever failed before it on this rank (a failure is marked in the buffer instead), so no
        rank is left waiting; a failed collective is not retried (``Collectives``)."""
        recorder, mesh = self.recorder, self.mesh
        try:
            recorder.prepare_flush()
        except Exception as exc:
            self.failures.failed("preparing a flush", exc, "this window's statistics are dropped")
            recorder.mark_window_failed()
            try:
                recorder.buffer.load_host_states()
            except Exception:
                pass
        if mesh is not None:  # this rank's layers into the union of every rank's
            try:
                mesh.gather(combined=self.collectives.enabled)
            except Exception as exc:  # still reach the collective: the window is marked failed
                self.failures.failed("preparing a flush", exc, "this window's statistics are dropped")
                mesh.buffer.zero_()
                mesh.buffer[STEP_FAILED].fill_(1)
        buffer = mesh.buffer if mesh is not None else recorder.buffer
        if self.collectives.enabled and not self.collectives.reduce_states(buffer.reduction_spans()):
            return None  # part of the buffer may be reduced, part not: drop the window rather than guess
        try:
            window = recorder.snapshot(steps, dead_eps, scaler_in_use=scaler_in_use, layout=mesh)
        except Exception as exc:
            self.failures.failed("reading the statistics", exc, "this window is dropped")
            return None
        self.failures.succeeded("preparing a flush")
        return window
