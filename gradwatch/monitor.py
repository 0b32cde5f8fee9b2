"""GradMonitor: the facade of the pipeline hook -> buffer -> flush -> detectors -> sinks (docs/design.md)."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Sequence

import torch
from torch import nn

from . import _compat
from .alerts import Alert, GradientHealthError
from .capture.attach import build_recorder, replacement_updates
from .capture.layers import discover_layers
from .config import HealthConfig
from .distributed.collectives import Collectives
from .distributed.tensor_parallel import output_shares
from .failures import FailureLog
from .flush.window import Window
from .settings import (DETAILS, check_callback, check_device, check_outputs, check_settings, check_step_number, check_window_size,
                       warn_about_wrappers)  # fmt: skip
from .stages import connect
from .state import restore_state, saved_state

log = logging.getLogger("gradwatch")

class GradMonitor:
    """Per-layer gradient statistics kept on the training device, flushed every ``flush_every`` steps.

    Call :meth:`step` once per optimizer step, after ``backward()`` (after ``scaler.unscale_``
    with AMP) and before ``zero_grad()``; call :meth:`close` at the end (or use ``with``).

    Args:
        model: the ``nn.Module`` to watch (a ``torch.compile`` wrapper is unwrapped: layers keep
            the user's names). Raises ``TypeError`` for anything else, ``ValueError`` when its
            parameters are on the meta device.
        logdir: a folder for a TensorBoard writer the monitor owns (default None: none).
        writer: your ``SummaryWriter``, used and never closed (default None). Not with ``logdir``.
        flush_every: optimizer steps per flush (default 50): statistics stay on the device until then.
        config: a :class:`HealthConfig` with every threshold and ``stop_on`` (default: its defaults).
        include: fnmatch pattern(s) of layer names to monitor (default None: every layer with
            parameters of its own); patterns selecting nothing raise ``ValueError``.
        exclude: fnmatch pattern(s) of layer names to leave out (default None).
        scaler: the ``torch.amp.GradScaler`` in use (default None): statistics are of unscaled gradients.
        histograms: also write per-layer gradient histograms at each flush (default False; costly).
        sync_dist: combine statistics across processes at each flush (default None: on when more
            than one process runs). False: no collective at all.
        optimizer: the optimizer stepping the model (default None); enables ``update_ratio``.
        detail: ``"standard"`` (default: grad_norm and the non-finite checks at every step, every
            statistic on sampled steps) or ``"full"`` (every statistic at every step).
        metrics_callback: ``callback(metrics, step)`` called with every flushed step's scalars
            (default None); more with :meth:`add_metrics_callback`.

    Raises:
        TypeError, ValueError: a wrong argument, or a sharding gradwatch cannot read (``UnsupportedSharding``:
            DeepSpeed ZeRO 3 before ``deepspeed.initialize``, FSDP1 internals missing), naming the fix.
    """

    def __init__(self, model: nn.Module, *, logdir: str | None = None, writer: Any = None, flush_every: int = 50,
                 config: HealthConfig | None = None, include: str | Sequence[str] | None = None,
                 exclude: str | Sequence[str] | None = None, scaler: Any = None, histograms: bool = False,
                 sync_dist: bool | None = None, optimizer: Any = None, detail: str = "standard",
                 metrics_callback: Callable[[dict[str, float], int], None] | None = None) -> None:  # fmt: skip
        self.config = config = check_settings(flush_every, config, detail)
        check_outputs(logdir, writer, scaler, sync_dist)
        check_callback(metrics_callback)
        self.flush_every, self.detail, self.histograms = flush_every, detail, bool(histograms)
        self._scaler = scaler
        self._closed = True  # until attached: close() and __del__ have nothing to undo
        self._next_step = 0
        model = _compat.unwrap(model)  # torch.compile(model): hooks and names on the model the user wrote
        self._layer_specs = discover_layers(model, include, exclude)  # a TypeError for a non-module
        self._include, self._exclude = include, exclude
        warn_about_wrappers(model)
        device = self._layer_specs[0].params[0].device
        check_device(device)
        check_window_size(flush_every, len(self._layer_specs), sum(len(s.params) for s in self._layer_specs))
        self._failures = FailureLog()
        self._collectives = collectives = Collectives(sync_dist)
        self._output_shares = None  # tensor parallelism: read first, it sets split layers' units
        if collectives.enabled:  # torch's private TP layouts: a failure costs the TP weights, not the run
            self._output_shares = self._failures.guarded(
                "reading the tensor-parallel layout", lambda: output_shares(model, self._layer_specs)
            )
        self._recorder = build_recorder(
            self, self._layer_specs, flush_every, device, scale_source=functools.partial(_scale_of, scaler) if scaler else None,
            project_units=config.dead_eps == 0, world_size=collectives.world_size, optimizer=optimizer,
            sample_every=DETAILS[detail], reduce_partials=collectives.reduce_partials,
        )  # fmt: skip
        try:  # from here on, a failure must leave no hook and no writer thread behind
            self._stages = connect(model, self._layer_specs, self._recorder, collectives, self._output_shares,
                                   self._failures, config, optimizer=optimizer, scaler=scaler, flush_every=flush_every,
                                   histograms=self.histograms, include=include, exclude=exclude, logdir=logdir,
                                   writer=writer)  # fmt: skip
        except BaseException:
            self._recorder.drop_references()
            raise
        self._names, self._tracker = self._stages.names, self._stages.detection.tracker
        if metrics_callback is not None:
            self.add_metrics_callback(metrics_callback)
        self._closed = False

    # ------------------------------------------------------------ properties
    @property
    def last_window(self) -> Window | None:
        """The most recent flushed window (numpy arrays; None before the first flush)."""
        stages = getattr(self, "_stages", None)
        return stages.pipeline.last_window if stages is not None else None

    @property
    def layers(self) -> list[str]:
        """Monitored layer names, in module order (every rank's, when ranks hold different layers)."""
        return list(self._names)

    @property
    def alerts(self) -> list[Alert]:
        """The most recent alerts (at most ``detect.tracker.KEEP_ALERTS``; all stay in the event files)."""
        return list(self._tracker.alerts)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of statistics gradwatch holds on the training device (buffer, step cells, weights)."""
        return self._recorder.nbytes

    @property
    def sync_dist(self) -> bool:
        """Whether gradwatch makes collectives (one per reduction kind per flush). Setting it False
        means no collective at all; every rank must then call :meth:`step` on its own schedule."""
        return self._collectives.enabled

    @sync_dist.setter
    def sync_dist(self, value: bool) -> None:
        self._collectives.enable(value)

    @property
    def recording(self) -> bool:
        """False between :meth:`pause` and :meth:`resume`."""
        return self._recorder.active

    def pause(self) -> None:
        """Stop recording forward/backward calls (a validation loop with grad enabled); no collective."""
        self._recorder.active = False
        self._collectives.paused = True

    def resume(self) -> None:
        """Record forward/backward calls again after :meth:`pause`."""
        self._collectives.paused = False
        if not self._closed and not self._stages.watch.stopped:
            self._recorder.active = True

    def set_optimizer(self, optimizer: Any) -> None:
        """Hand over the optimizer that steps the model from now on (one replaced mid-run), so that
        ``update_ratio`` follows it.

        Raises:
            ValueError: the monitor was created without ``optimizer=`` (its buffer has no update
                states: create the monitor with ``optimizer=``), the optimizer holds none of the
                monitored parameters, or it steps FSDP1's flat parameters (``use_orig_params=False``).
                TypeError: not an optimizer.
        """
        new = replacement_updates(self, self._recorder, optimizer, self.flush_every)  # raises before anything changes
        self._recorder.replace_updates(new)
        self._stages.pipeline.optimizer = optimizer
        self._stages.watch.optimizer_steps_seen = 0

    def add_alert_callback(self, callback: Callable[[Alert], None]) -> None:
        """Call ``callback(alert)`` for every new alert, on the writing rank (rank 0) only. Every rank
        computes the same alerts, so ``stop_on`` stops every rank together. Raises TypeError."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        self._tracker.callbacks.append(callback)

    def add_metrics_callback(self, callback: Callable[[dict[str, float], int], None]) -> None:
        """Send every flushed step's scalars to ``callback(metrics, step)`` (any tracker), in step order,
        on the writing rank; ``metrics`` maps TensorBoard's tags to floats. Raises TypeError."""
        check_callback(callback)
        if self._stages.is_writer and self._stages.outputs is not None:
            self._stages.outputs.add_callback(callback)

    # ------------------------------------------------------------------ step
    def step(self, global_step: int | None = None, *, grads_scaled: bool = False) -> list[Alert]:
        """Record one optimizer step; returns the alerts it raised (and, every ``flush_every`` steps, the flush's).

        A call with no backward since the last recorded step (its gradients unchanged) records
        nothing and returns ``[]``, with one warning.

        Args:
            global_step: the step number (default: one more than the last).
            grads_scaled: the gradients still carry the GradScaler's scale (an optimizer that
                unscales inside its own step); gradwatch divides by the scale.

        Raises:
            GradientHealthError: an alert of a kind in ``config.stop_on``.
            RuntimeError: the monitor is closed. TypeError: ``global_step`` is not an int.
        """
        if self._closed:
            raise RuntimeError("this GradMonitor is closed; create a new one to keep monitoring")
        if global_step is not None:  # (None: counted here, nothing to check; a call costs microseconds after backward)
            global_step = check_step_number(global_step)
        stages = self._stages
        watch = stages.watch
        if watch.backward.repeats_last_step():
            watch.say_repeated_step()
            return []
        if global_step is None:
            step = self._next_step
        else:
            step = global_step
            watch.check_step_number(step, self._next_step)
        self._next_step = step + 1
        return stages.pipeline.step(step, grads_scaled)

    def flush(self) -> list[Alert]:
        """Move buffered statistics to the host, write them, run the health checks; returns new alerts.

        Raises:
            GradientHealthError: an alert of a kind in ``config.stop_on``.
        """
        return self._stages.pipeline.flush(final=False)

    def _share_dashboard(self, layers: list[str], writes_layout: bool) -> None:
        """One of several monitors of one model on one writer (one per optimizer): the dashboard
        layout names ``layers``, and only one of them writes it."""
        board = self._board()
        if board is not None:
            board.share_layout(layers, writes_layout)

    # --------------------------------------------------------------- closing
    def close(self) -> None:
        """Flush what is left, remove every hook, close the writer gradwatch owns. Idempotent.

        Afterwards the monitor holds no reference to the model; its layers, alerts and last
        window stay readable. A ``stop_on`` alert of the last flush is logged, not raised.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._stages.pipeline.flush(final=True)
        except GradientHealthError as exc:
            log.error("gradwatch: %s", exc)
        finally:
            self._stages.detach(self._recorder)
            self._layer_specs = []

    def __enter__(self) -> "GradMonitor":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is not None:  # the other ranks may never reach a collective now
            self._collectives.disable()
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                if self._stages.hooks is not None:
                    self._stages.hooks.remove()
                if self._recorder.updates is not None:
                    self._recorder.updates.remove()
        except Exception:
            pass

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs: step count, detector baselines, alert state (bounded in size)."""
        return saved_state(self._next_step, self._names, self._stages.detection.checks, self._tracker, self._board())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (layers matched by name). Raises ValueError for anything else."""
        checks = self._stages.detection.checks
        self._next_step = restore_state(state, checks, self._tracker, self._board())
        self._recorder.layout.full_window = checks.wants_every_step  # a confirmation carried over

    def _board(self) -> Any:
        """The TensorBoard sink (None: this rank does not write, or the monitor is closed)."""
        outputs = self._stages.outputs
        return outputs.tensorboard if outputs is not None else None


def _scale_of(scaler: Any) -> torch.Tensor | None:
    """The GradScaler's current scale as a device tensor (None while it is disabled)."""
    return _compat.scaler_scale(scaler) if scaler.is_enabled() else None
