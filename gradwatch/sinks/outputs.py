"""Where a flushed window goes: every sink behind one small protocol.

A sink takes each flushed window with the alerts of its steps, and is closed once. The
TensorBoard sink (a writer gradwatch owns, opened again at each flush until it works, or the
user's), metrics callbacks (any tracker: Lightning loggers, W&B, MLflow, ...) and histograms are
the sinks of a monitor; a failing sink costs that sink's output with one logged warning
(``FailureLog``), never the run. Only the writing rank (rank 0) has sinks.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from ..alerts import Alert
from ..failures import FailureLog
from ..flush.window import Window
from .metrics import MetricsCallback, describe, window_metrics
from .tensorboard import TensorBoardSink


class Sink(Protocol):
    """What every sink does: take a flushed window, and close."""

    def write(self, window: Window, alerts: list[Alert], total_alerts: int, final: bool = False) -> None: ...

    def close(self) -> None: ...


class Outputs:
    """The monitor's sinks (the writing rank's), each failing on its own.

    Args:
        failures: where a sink's failure is reported (once, then rare reminders).
        logdir: a folder for a TensorBoard writer gradwatch owns (None: none).
        writer: the user's ``SummaryWriter`` (used, never closed), or None.
        thresholds: the health checks' thresholds, written beside the layer list for ``gradwatch report``.
        layer_types: each layer's module type (name -> class name), written with the layer list.
    """

    def __init__(self, failures: FailureLog, logdir: str | None, writer: Any,
                 thresholds: dict[str, Any] | None = None, layer_types: dict[str, str] | None = None) -> None:  # fmt: skip
        self._failures = failures
        self._logdir = logdir
        self._thresholds = thresholds
        self._layer_types = dict(layer_types or {})
        self.tensorboard: TensorBoardSink | None = self._sink(writer, owns_writer=False) if writer is not None else None
        #: (log name, callback) of each metrics callback: every flushed step's scalars, in step order
        self.callbacks: list[tuple[str, MetricsCallback]] = []
        self._open_own_writer()

    def _sink(self, writer: Any, owns_writer: bool) -> TensorBoardSink:
        sink = TensorBoardSink(writer, owns_writer=owns_writer)
        sink.thresholds = self._thresholds
        sink.layer_types = self._layer_types
        return sink

    def add_callback(self, callback: MetricsCallback) -> None:
        self.callbacks.append((f"sending metrics to {describe(callback)}", callback))

    def _open_own_writer(self) -> None:
        """Open the writer gradwatch owns (at attach, then at each flush until it works: a full disk)."""
        if self.tensorboard is not None or self._logdir is None:
            return

        def open_writer() -> TensorBoardSink:
            from .event_writer import summary_writer

            return self._sink(summary_writer(self._logdir), owns_writer=True)

        self.tensorboard = self._failures.guarded("opening the TensorBoard writer", open_writer)

    def write(self, window: Window, alerts: list[Alert], total_alerts: int, final: bool,
              histograms: Callable[[], list[tuple[str, Any]]] | None = None) -> None:  # fmt: skip
        """One flushed window to every sink; ``histograms``: the gradients to histogram now, if asked."""
        self._open_own_writer()
        board = self.tensorboard
        if board is not None:
            self._failures.guarded("writing to TensorBoard", lambda: board.write(window, alerts, total_alerts, final=final))
            if histograms is not None and not final and window.steps:
                self._failures.guarded("writing histograms", lambda: board.write_histograms(histograms(), window.steps[-1]))
        if not self.callbacks:
            return
        metrics = self._failures.guarded("collecting metrics", lambda: window_metrics(window, total_alerts), [])
        for name, callback in self.callbacks:  # the same scalars for every callback, made once
            self._failures.guarded(name, lambda: _send(callback, metrics))

    def close(self) -> None:
        board, self.tensorboard = self.tensorboard, None
        if board is not None:
            self._failures.guarded("closing the TensorBoard writer", board.close)


def _send(callback: MetricsCallback, metrics: list[tuple[int, dict[str, float]]]) -> None:
    for step, values in metrics:
        callback(values, step)
