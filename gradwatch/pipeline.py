"""One step, and every ``flush_every`` steps one flush, through gradwatch's stages in order.

capture (the step's row: ``capture/recorder.py``) -> the per-step checks (``detect/per_step.py``)
-> at a flush: the window read, reduced across ranks and decoded (``flush/reader.py``) -> the
health checks (``detect/checks.py``) -> alert tracking (``detect/tracker.py``) -> the sinks
(``sinks/outputs.py``). ``GradMonitor`` (``monitor.py``) checks its arguments, attaches and
detaches, and hands every ``step()`` and ``flush()`` to this.
"""

from __future__ import annotations

from typing import Any

from .alerts import Alert, GradientHealthError
from .capture.column_groups import ModelMoved
from .detect.checks import Assessment
from .flush.window import Window


class StepPipeline:
    """Records each step and runs each flush of one monitor.

    Args:
        recorder: the capture stage (``capture.recorder.Recorder``).
        watch: the model and run changing under the monitor (``capture.watch.ModelWatch``).
        reader: reads a window off the buffer (``flush.reader.WindowReader``).
        detection: the checks, tracker and per-step judge (``detect.assemble``).
        outputs: the sinks of the writing rank, or None on the others.
        config: the ``HealthConfig`` (``stop_on``, ``dead_eps``).
        failures: where a failure inside gradwatch is reported (never raised into training).
        flush_every: steps per window.
        scaler: the GradScaler in use, or None.
        histograms: write each layer's gradient histogram at every flush.

    Its ``layers`` (the monitored ``LayerSpec`` list) and ``optimizer`` (the optimizer gradwatch
    holds; its update measurements are the recorder's) are set by the monitor, which replaces them
    (``set_optimizer``) and empties them (``close``): nothing here refers back to the monitor, so a
    monitor dropped unclosed is freed at once.
    """

    def __init__(self, recorder: Any, watch: Any, reader: Any, detection: Any, outputs: Any, config: Any,
                 failures: Any, flush_every: int, scaler: Any, histograms: bool) -> None:  # fmt: skip
        self.recorder, self.watch, self.reader, self.outputs = recorder, watch, reader, outputs
        self.checks, self.tracker, self.judge = detection.checks, detection.tracker, detection.judge
        self.per_step = detection.per_step
        self.units_probe = detection.units_probe
        self.config, self.failures, self.flush_every, self.scaler = config, failures, flush_every, scaler
        self.histograms = histograms
        self.layers: list = []
        self.optimizer: Any = None
        self.window_steps: list[int] = []
        self._alerts_since_flush: list[Alert] = []  # raised by step() since the last flush, for its text
        self.last_window: Window | None = None  # the most recent flushed window
        self._fresh_evidence = False  # this window's dead-unit evidence was restarted (a layer fell silent)

    def step(self, step: int, grads_scaled: bool) -> list[Alert]:
        """Record step ``step`` and judge it; flush when the window is full. Returns the new alerts.

        Raises:
            GradientHealthError: an alert of a kind in ``config.stop_on``.
        """
        watch, recorder = self.watch, self.recorder
        if not grads_scaled and self.scaler is not None:
            grads_scaled = watch.still_scaled(self.scaler, self.optimizer)
        try:
            recorder.record_step(params_scaled=grads_scaled)
        except ModelMoved as exc:  # the row is marked failed, nothing more is recorded
            watch.stop_recording(str(exc))
        except Exception as exc:  # never break a healthy run; the row is marked failed
            recorder.hook_failed("step()", exc)
        watch.backward.remember()
        self.window_steps.append(step)
        # the per-step judgement (``detect/per_step.py``): from the recorder's own host check where it
        # found the gradients calm and no GradScaler is in use
        if not self.per_step:
            new = []
        elif recorder.calm_total is not None and self.scaler is None:
            new = self.judge.judge_calm(recorder.slot - 1, self.window_steps, recorder.calm_total)
        else:
            new = self.judge.judge(recorder.slot - 1, self.window_steps)
        self._alerts_since_flush += new
        if recorder.slot < self.flush_every:
            self._confirm_dead_units_now()
        if recorder.slot >= self.flush_every:
            try:
                new = new + self.flush(final=False, after_step=True)
            except GradientHealthError as exc:
                exc.alerts[:0] = [a for a in new if a.kind in self.config.stop_on]
                raise
        if new:  # (a calm step makes no call more)
            self._stop_on(new)
        return new

    def flush(self, final: bool, after_step: bool = False) -> list[Alert]:
        """Read, check, track and write the window so far; returns the new alerts. ``after_step``:
        called by :meth:`step` right after recording (the taps' cells need no reset: ``Recorder.reset_window``).

        Raises:
            GradientHealthError: an alert of a kind in ``config.stop_on``.
        """
        recorder = self.recorder
        if recorder.slot == 0 and not recorder.update_steps:
            return []
        early = self._before_reading()
        steps, self.window_steps = self.window_steps, []
        try:
            window = self.reader.read(steps, self.config.dead_eps, self.scaler is not None and self.scaler.is_enabled())
        finally:
            recorder.reset_window(after_step=after_step)
            self.units_probe.reset()
            self.judge.fell_silent = None  # the new window's sampled steps see it anyway
            self._fresh_evidence = False
        if window is None:
            return early
        self.failures.guarded("choosing the output statistics' precision",
                              lambda: recorder.follow_output_magnitudes(window))  # fmt: skip
        checks = self.checks
        assessment = self.failures.guarded("the health checks", lambda: checks.check(window), Assessment())
        recorder.layout.full_window = checks.wants_every_step  # dead units to confirm on every step
        last_step = max(steps + window.update_steps)
        new = early + self.failures.guarded("alert tracking", lambda: self.tracker.update(assessment, last_step), [])
        of_window, self._alerts_since_flush = self._alerts_since_flush + new, []  # the text shows them all
        if self.outputs is not None:
            self.outputs.write(window, of_window, self.tracker.raised, final,
                               self._histogram_grads if self.histograms else None)  # fmt: skip
        if window.steps:  # not a window of update measurements alone
            self.last_window = window
            self.watch.check_hooks_ran(window)
            self.watch.check_gradients_arrived(window)
            self.watch.check_recompile_limit()
            self.watch.check_grads_left_out()
        self._stop_on(new)
        return new

    def _confirm_dead_units_now(self) -> None:
        """Dead units confirmed inside their own window: when a layer fell silent at a step (every
        unit at once), the rest of the window is recorded in full on fresh evidence; when the
        window's first sampled steps found a layer dead, the rest of it is recorded in full."""
        recorder, probe = self.recorder, self.units_probe
        # (taken first whenever a layer fell silent: it is noted whether or not its evidence is wiped;
        # the None test only spares the call at the steps where none did)
        if self.judge.fell_silent is not None and self._take_fell_silent() and probe.enabled \
                and not self._fresh_evidence:  # wiped once a window
            self._fresh_evidence = True
            recorder.sample_rest_of_window(fresh=True)
            return
        if not probe.has_news(recorder.slot - 1):
            return
        evidence = self.failures.guarded("the dead-unit check", lambda: probe.after_step(recorder.slot - 1))
        if evidence is None:
            return
        worth = self.checks.dead.worth_confirming(*evidence, recorder.layout.unit_count)
        if worth.any():
            recorder.suspect_dead_units(worth)
            recorder.sample_rest_of_window()

    def _before_reading(self) -> list[Alert]:
        """The model and optimizer still the ones attached; the window's last steps judged per step."""
        watch = self.watch
        watch.check_parameters(self.layers)
        skipping = self.checks.scaler_skips.streak > 0  # a GradScaler skipping: the optimizer does not step
        watch.check_optimizer_steps(self.recorder.updates, self.window_steps, self.flush_every, skipping)
        watch.check_unfrozen()
        if not self.per_step:
            return []
        alerts = self.judge.finish_window(self.window_steps)
        self._take_fell_silent()  # judged only now: too late to record more, not to be noted
        return alerts

    def _take_fell_silent(self) -> bool:
        """Whether a layer fell silent at a step judged since the last call; such layers are noted in
        the window as asked to be confirmed (``Recorder.suspect_dead_units``)."""
        silent, self.judge.fell_silent = self.judge.fell_silent, None
        if silent is None or not silent.any():
            return False
        self.recorder.suspect_dead_units(silent)
        return True

    def _histogram_grads(self) -> list[tuple[str, list]]:
        # this rank's gradients, also where they are not p.grad (DeepSpeed ZeRO, FSDP1's flat ones)
        named = [(layer.name, layer.rank_gradients()) for layer in self.layers]
        return [(name, grads) for name, grads in named if grads]

    def _stop_on(self, new: list[Alert]) -> None:
        stopping = [a for a in new if a.kind in self.config.stop_on]
        if stopping:
            raise GradientHealthError(stopping)
