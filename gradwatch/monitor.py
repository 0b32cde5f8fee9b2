"""GradMonitor: the gradient-health monitor for plain PyTorch training loops."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from .alerts import Alert, GradientHealthError
from .detect.tracker import AlertTracker
from .config import HealthConfig
from .detect.checks import Assessment, HealthChecks, normalises_step
from ._compat import unwrap
from .capture.hooks import HookSet
from .capture.layers import discover_layers
from .capture.layout import STEP_FAILED, SYNC_VOTE
from .distributed.mesh import MeshLayout, conflicts, describe_rank
from .flush.readback import StepReadback, forward_order, summarize
from .capture.param_stats import ModelMoved
from .capture.recorder import Recorder
from .sinks.metrics import describe, window_metrics
from .sinks.tensorboard import TensorBoardSink
from .failures import FailureLog
from .distributed.tensor_parallel import output_shares
from .capture.updates import UpdateRatio
from .flush.window import Window

log = logging.getLogger("gradwatch")

_STATE_VERSION = 1

#: detail -> every how many steps (from each window's first) every statistic is recorded.
#: "standard" records grad_norm and the non-finite checks at every step and the rest
#: (grad_max, out_grad_norm, dead-unit evidence) at steps 0, 25, ... of each window.
DETAILS = {"standard": 25, "full": 1}


class GradMonitor:
    """Per-layer gradient statistics, kept on the device, flushed every ``flush_every`` steps.

    Call :meth:`step` once per optimizer step, after ``backward()`` (and after
    ``scaler.unscale_`` with AMP) and before ``zero_grad()``. See the README.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        logdir: str | None = None,
        writer: Any = None,
        flush_every: int = 50,
        config: HealthConfig | None = None,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        scaler: Any = None,
        histograms: bool = False,
        sync_dist: bool | None = None,
        optimizer: Any = None,
        detail: str = "standard",
        metrics_callback: Callable[[dict[str, float], int], None] | None = None,
    ) -> None:
        config = check_settings(flush_every, config, detail)
        if logdir is not None and writer is not None:
            raise ValueError("pass either logdir (gradwatch owns a writer) or writer (yours), not both")
        if scaler is not None and not (hasattr(scaler, "is_enabled") and hasattr(scaler, "_scale")):
            raise TypeError(
                f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}"
            )
        if sync_dist is not None and not isinstance(sync_dist, bool):
            raise TypeError(f"sync_dist must be True, False or None (automatic), got {sync_dist!r}")
        self.config = config
        self.flush_every = flush_every
        self.detail = detail
        self.histograms = bool(histograms)
        self._scaler = scaler
        model = unwrap(model)  # torch.compile(model): hooks and names on the model the user wrote
        self._layer_specs = discover_layers(model, include, exclude)  # a TypeError for a non-module
        _warn_about_wrappers(model)
        self._names = [layer.name for layer in self._layer_specs]
        device = self._layer_specs[0].params[0].device
        if device.type == "meta":
            raise ValueError(
                "the model's parameters are on the meta device (not materialised yet): create the monitor "
                "after materialising the model (model.to_empty(device=...) and initialisation, or your "
                "framework's deferred initialisation)"
            )
        _check_window_size(flush_every, len(self._layer_specs), sum(len(s.params) for s in self._layer_specs))

        world = _dist_world_size()
        self._rank = _dist_rank()
        self._sync_dist = world > 1 if sync_dist is None else (sync_dist and world > 1)
        # Tensor parallelism: a split layer's taps judge this rank's slice of its units.
        self._failures = FailureLog()
        self._output_shares = None
        if self._sync_dist:  # torch's private layouts are read here: a failure costs the TP weights, not the run
            self._output_shares = self._guarded(
                "reading the tensor-parallel layout", lambda: output_shares(model, self._layer_specs), None
            )
        #: the union of every rank's layers, when the ranks hold different ones or share outputs
        self._mesh: MeshLayout | None = None
        is_writer = self._rank == 0  # only rank 0 writes

        # A weak reference: the hooks hold the recorder, and the recorder must not keep
        # the monitor alive (so that dropping the monitor removes its hooks).
        self_ref = weakref.ref(self)

        def scale_source() -> torch.Tensor | None:
            monitor = self_ref()
            return None if monitor is None else monitor._current_scale()

        self._recorder = Recorder(
            self._layer_specs,
            flush_every,
            device,
            scale_source if scaler is not None else None,  # no GradScaler: nothing to unscale, no call per step
            project_units=config.dead_eps == 0,
            world_size=world,
            track_updates=optimizer is not None,
            sample_every=DETAILS[detail],
        )
        self._updates: UpdateRatio | None = None
        if optimizer is not None:
            recorder = self._recorder

            def write_update(columns: Any, index: torch.Tensor, update_sq: torch.Tensor, weight_sq: torch.Tensor) -> None:
                monitor = self_ref()
                if monitor is not None and not monitor._closed:
                    recorder.write_update(monitor._next_step - 1, columns, index, update_sq, weight_sq)

            def write_estimate(update_norms: torch.Tensor, weight_norms: torch.Tensor) -> None:
                monitor = self_ref()
                if monitor is not None and not monitor._closed:
                    recorder.write_estimate(update_norms, weight_norms)

            self._updates = UpdateRatio(
                optimizer,
                recorder.param_stats.params,
                recorder.param_stats.param_layer,
                flush_every,
                write_update,
                recorder.hook_failed,
                recorder.buffer.dtype,
                write_estimate=write_estimate,
                sample_columns=recorder.layout.sample_columns,
            )
        if self._sync_dist:
            self._agree_on_layout()
        normalised = config.normalised_optimizer
        if normalised is None:
            normalised = optimizer is not None and normalises_step(optimizer)
        self._checks = HealthChecks(config, self._names, normalised_steps=normalised)
        # nonfinite and the model-level exploding check at every step, from a read-back that never
        # waits for the device. Not for sharded parameters: each rank's values are partial until
        # the flush's reduction, and a per-step decision (stop_on) must be the same on every rank.
        self._readback = StepReadback(self._recorder.layout, host_path=self._recorder.param_stats.counts_every_step)
        # Nor when the ranks hold different layers (pipeline stages, tensor parallelism).
        self._per_step = self._readback.available and not self._recorder.param_stats.sharded and self._mesh is None
        self._checks.model_per_step = self._per_step
        self._previous_forward: np.ndarray | None = None  # the last judged step's running forward sums
        self._alerts_since_flush: list[Alert] = []  # raised by step() since the last flush, for its text
        self._window_order: list[int] = []  # the window's latest forward order
        self._tracker = AlertTracker(
            config.remind_every, log_alerts=is_writer, recovery_flushes=config.recovery_flushes, layers=self._names
        )
        self._sink: TensorBoardSink | None = None
        self._logdir = str(logdir) if is_writer and logdir is not None else None
        if is_writer and writer is not None:
            self._sink = TensorBoardSink(writer, owns_writer=False)
        self._open_own_writer()
        self._metrics_callbacks: list[Callable[[dict[str, float], int], None]] = []
        self._is_writer = is_writer
        if metrics_callback is not None:
            self.add_metrics_callback(metrics_callback)
        self._window_steps: list[int] = []
        self._warned_hooks = False
        self._moved = False  # the model moved to another device after attaching (ModelMoved)
        self._next_step = 0
        self._closed = False
        self.last_window: Window | None = None  # the most recent flushed window
        self._hooks = HookSet(model, self._layer_specs, self._recorder.cells.taps)

    # ------------------------------------------------------------ properties
    @property
    def layers(self) -> list[str]:
        """Monitored layer names, in module order."""
        return list(self._names)

    @property
    def alerts(self) -> list[Alert]:
        """Every alert raised so far."""
        return list(self._tracker.alerts)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of statistics gradwatch holds on the training device (buffer, step cells, weights)."""
        return self._recorder.nbytes

    @property
    def sync_dist(self) -> bool:
        """Whether flushes combine statistics across processes (one collective per reduction kind).

        On by default when ``torch.distributed`` runs more than one process. Every rank
        must then call :meth:`step` the same number of times. Set it to False where the
        other ranks cannot reach a collective any more (an exception on one rank).
        """
        return self._sync_dist

    @sync_dist.setter
    def sync_dist(self, value: bool) -> None:
        self._sync_dist = bool(value) and _dist_world_size() > 1

    @property
    def recording(self) -> bool:
        """False between :meth:`pause` and :meth:`resume`."""
        return self._recorder.active

    def pause(self) -> None:
        """Stop recording forward/backward calls (e.g. a validation loop with grad enabled)."""
        self._recorder.active = False

    def resume(self) -> None:
        """Record forward/backward calls again after :meth:`pause`."""
        if not self._closed and not self._moved:
            self._recorder.active = True

    def add_alert_callback(self, callback: Callable[[Alert], None]) -> None:
        """Call ``callback(alert)`` for every new alert (after it is logged), on the writing rank
        only (rank 0, like metrics callbacks: one page, not one per process). Every rank still
        computes the same alerts, so ``stop_on`` stops every rank together."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        self._tracker.callbacks.append(callback)

    def add_metrics_callback(self, callback: Callable[[dict[str, float], int], None]) -> None:
        """Send every flushed step's scalars to ``callback(metrics, step)`` (any tracker).

        Called at flush time, once per step the window describes, in step order, on the
        writing rank only; ``metrics`` maps TensorBoard's tags (``gradwatch/grad_norm/<layer>``,
        ``gradwatch/global/grad_norm``, ...) to floats. Steps are those of the past window:
        see the README for trackers whose own step must only grow (W&B).
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable as callback(metrics: dict, step: int), got {callback!r}")
        self._metrics_callbacks.append(callback)

    # ------------------------------------------------------------------ step
    def step(self, global_step: int | None = None, *, grads_scaled: bool = False) -> list[Alert]:
        """Record one optimizer step; flushes (and returns new alerts) every ``flush_every`` steps.

        ``grads_scaled``: the parameter gradients still carry the GradScaler's scale at
        this point (an optimizer that unscales inside its own step, e.g. fused Adam
        under AMP); gradwatch divides by the scale. Between flushes this enqueues
        device work only: no host/device sync.
        """
        if self._closed:
            raise RuntimeError("this GradMonitor is closed; create a new one to keep monitoring")
        if global_step is not None and (not isinstance(global_step, int) or isinstance(global_step, bool)):
            global_step = int(global_step)
        step = self._next_step if global_step is None else global_step
        try:
            self._recorder.record_step(params_scaled=grads_scaled)
        except ModelMoved as exc:  # the row is marked failed, nothing more is recorded
            self._stop_recording(str(exc))
        except Exception as exc:  # never break a healthy run; the row is marked failed
            self._recorder.hook_failed("step()", exc)
        self._window_steps.append(step)
        self._next_step = step + 1
        new = self._judge_steps(self._recorder.slot - 1) if self._per_step else []
        self._alerts_since_flush += new
        if self._recorder.slot >= self.flush_every:
            try:
                new = new + self.flush()
            except GradientHealthError as exc:
                exc.alerts[:0] = [a for a in new if a.kind in self.config.stop_on]
                raise
        stopping = [a for a in new if a.kind in self.config.stop_on]
        if stopping:
            raise GradientHealthError(stopping)
        return new

    def _judge_steps(self, slot: int | None, wait: bool = False) -> list[Alert]:
        """Judge the steps whose values are on the host (``slot``: the step just recorded, whose
        copy starts now): nonfinite and the model's exploding, as soon as each step is readable.
        Returns the new alerts; stopping on them is the caller's (after any flush)."""
        try:
            if slot is not None:
                self._readback.capture(slot)
            findings = []
            scaler = self._scaler is not None and self._scaler.is_enabled()
            for values in self._readback.ready(wait=wait):
                if values.order is not None:
                    self._window_order = forward_order(values.order)
                summary = summarize(values, self._recorder.layout, self._previous_forward)
                self._previous_forward = values.forward
                if values.failed or values.slot >= len(self._window_steps):
                    continue
                step = self._window_steps[values.slot]
                findings += self._checks.judge_step(step, summary, self._window_order, scaler)
            return self._tracker.raise_onsets(findings) if findings else []
        except Exception as exc:  # never break a run
            self._failures.failed("the per-step checks", exc)
            return []

    def flush(self) -> list[Alert]:
        """Move buffered statistics to the host, write them, run the health checks."""
        return self._flush(final=False)

    def _flush(self, final: bool) -> list[Alert]:
        recorder = self._recorder
        if recorder.slot == 0 and not recorder.update_steps:
            return []
        self._check_parameters_current()
        early: list[Alert] = []
        if self._per_step:  # the window's last steps (the flush waits for the device anyway)
            try:
                early = self._judge_steps(None, wait=True)
            finally:
                self._readback.clear()
                self._previous_forward = None
        steps = self._window_steps
        self._window_steps = []
        window = None
        try:
            window = self._read_window(steps)
        finally:
            recorder.reset_window()
        if window is None:
            return []
        self._open_own_writer()
        assessment = self._guarded("the health checks", lambda: self._checks.check(window), Assessment())
        # Dead units seen on sampled steps only are confirmed on every step of the next window.
        self._recorder.layout.full_window = self._checks.wants_every_step
        last_step = max(steps + window.update_steps)
        new = early + self._guarded("alert tracking", lambda: self._tracker.update(assessment, last_step), [])
        # The window's text and heatmap show every alert of its steps, those step() raised too.
        of_window, self._alerts_since_flush = self._alerts_since_flush + new, []
        if self._sink is not None:
            self._guarded(
                "writing to TensorBoard",
                lambda: self._sink.write(window, of_window, len(self._tracker.alerts), final=final),  # type: ignore[union-attr]
                None,
            )
            if self.histograms and not final:
                self._guarded("writing histograms", lambda: self._write_histograms(steps[-1]), None)
        if self._metrics_callbacks and self._is_writer:
            metrics = self._guarded("collecting metrics", lambda: window_metrics(window, len(self._tracker.alerts)), [])
            for callback in self._metrics_callbacks:
                self._guarded(f"sending metrics to {describe(callback)}", lambda: _send(callback, metrics), None)
        if window.steps:  # not a window of update measurements alone
            self.last_window = window
            self._check_hooks_ran(window)
        stopping = [a for a in new if a.kind in self.config.stop_on]
        if stopping:
            raise GradientHealthError(stopping)
        return new

    def _read_window(self, steps: list[int]) -> Window | None:
        """Prepare, reduce across ranks, copy to the host and decode; None if that failed.

        Every rank reaches the collective whatever failed before it on this rank (a
        failure is marked in the buffer instead), so no rank is left waiting.
        """
        recorder = self._recorder
        try:
            recorder.prepare_flush()
        except Exception as exc:
            self._failures.failed("preparing a flush", exc, "this window's statistics are dropped")
            recorder.mark_window_failed()
            try:
                recorder.buffer.load_host_states()
            except Exception:
                pass
        synced = False
        mesh = self._mesh
        if mesh is not None:  # this rank's layers into the union of every rank's
            try:
                mesh.gather(combined=self._sync_dist)
            except Exception as exc:  # still reach the collective: the window is marked failed
                self._failures.failed("preparing a flush", exc, "this window's statistics are dropped")
                mesh.buffer.zero_()
                mesh.buffer[STEP_FAILED].fill_(1)
        if self._sync_dist:
            try:
                (mesh.buffer if mesh is not None else recorder.buffer).all_reduce(vote=SYNC_VOTE)
                synced = True
            except Exception as exc:  # failed twice on this rank: nothing better than going local
                self._sync_dist = False
                self._failures.failed(
                    "the cross-process reduction", exc, "each rank now reports its own statistics"
                )
        try:
            window = recorder.snapshot(
                steps, self.config.dead_eps, scaler_in_use=self._scaler is not None and self._scaler.is_enabled(),
                layout=mesh,
            )
        except Exception as exc:
            self._failures.failed("reading the statistics", exc, "this window is dropped")
            return None
        if synced and recorder.last_vote:
            # Some rank's collective failed (and was retried): every rank saw the same vote in the
            # reduced buffer, so every rank turns reduction off after this same flush.
            self._sync_dist = False
            log.warning(
                "gradwatch: a cross-process reduction failed on some rank; from now on every rank reports "
                "its own statistics (only rank 0 writes)"
            )
        self._failures.succeeded("preparing a flush")
        return window

    def _share_dashboard(self, layers: list[str], writes_layout: bool) -> None:
        """One of several monitors of the same model on the same writer (one per optimizer): the
        dashboard layout names ``layers``, and only one of them writes it."""
        if self._sink is not None:
            self._sink.share_layout(layers, writes_layout)

    def _check_parameters_current(self) -> None:
        """Once per flush: the layers still own the parameters gradwatch reads. A model whose
        parameters were replaced after attaching (``load_state_dict(..., assign=True)``, a wrapper
        that swaps them) would otherwise look like a model without gradients."""
        if self._moved:
            return
        for layer in self._layer_specs:
            current = {id(p) for p in layer.module.parameters(recurse=False)}
            if any(id(p) not in current for p in layer.params):
                self._stop_recording(
                    f"the parameters of layer {layer.name} were replaced after gradwatch attached "
                    "(load_state_dict(..., assign=True), a wrapper that swaps parameters, ...), so gradwatch no "
                    "longer sees the model's gradients: create the monitor after the model is materialised and "
                    "wrapped (or close() this monitor and create a new one). gradwatch stops recording"
                )
                return

    def _stop_recording(self, reason: str) -> None:
        """The model changed under gradwatch (moved, or its parameters replaced): stop recording for
        good (resume() does not undo it), and say why once, as an ERROR."""
        if not self._moved:
            self._moved = True
            log.error("gradwatch: %s", reason)
        self._recorder.active = False

    def _check_hooks_ran(self, window: Window) -> None:
        """Warn once when the layers had gradients but gradwatch's forward hooks never ran: code
        compiled before the monitor attached that gradwatch could not find (a compiled function
        around the model), which runs without its hooks."""
        if self._warned_hooks or not self._recorder.active:
            return
        ran = any(order for order, _ in window.step_orders)
        if window.has_grad.any() and not ran:
            self._warned_hooks = True
            log.warning(
                "gradwatch: the model's layers had gradients but gradwatch's forward hooks did not run in the "
                "steps %d-%d, so out_grad_norm, dead units and the forward non-finite check are missing. Code "
                "compiled before the monitor attached runs without its hooks: create the monitor before "
                "compiling (or before the first compiled call), or call torch.compiler.reset() after creating it",
                window.steps[0], window.steps[-1],
            )  # fmt: skip

    def _guarded(self, stage: str, action: Callable[[], Any], default: Any) -> Any:
        try:
            result = action()
        except Exception as exc:
            self._failures.failed(stage, exc)
            return default
        self._failures.succeeded(stage)
        return result

    def _open_own_writer(self) -> None:
        """Open the writer gradwatch owns (at attach, then at each flush until it works: a full disk)."""
        if self._sink is not None or self._logdir is None:
            return

        def open_writer() -> TensorBoardSink:
            from torch.utils.tensorboard import SummaryWriter

            # A deep queue so that a flush's events never wait for the writer thread;
            # flush_secs bounds how stale the files on disk can be.
            writer = SummaryWriter(log_dir=self._logdir, max_queue=1000, flush_secs=30)
            return TensorBoardSink(writer, owns_writer=True)

        self._sink = self._guarded("opening the TensorBoard writer", open_writer, None)

    def _write_histograms(self, step: int) -> None:
        named = [(layer.name, [p.grad for p in layer.params if p.grad is not None]) for layer in self._layer_specs]
        self._sink.write_histograms([(n, g) for n, g in named if g], step)  # type: ignore[union-attr]

    # --------------------------------------------------------------- closing
    def close(self) -> None:
        """Flush what is left, remove every hook, close the writer gradwatch owns. Idempotent.

        Afterwards the monitor holds no reference to the model; its layers, alerts
        and last window stay readable.
        """
        if self._closed:
            return
        self._closed = True
        try:
            try:
                self._flush(final=True)
            except GradientHealthError as exc:
                log.error("gradwatch: %s", exc)
        finally:
            self._hooks.remove()
            if self._updates is not None:
                self._updates.remove()
            self._recorder.drop_references()
            if self._sink is not None:
                self._guarded("closing the TensorBoard writer", self._sink.close, None)
                self._sink = None
            self._layer_specs = []

    def __enter__(self) -> "GradMonitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self._hooks.remove()
                if self._updates is not None:
                    self._updates.remove()
        except Exception:
            pass

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs: step count, detector baselines, alert state."""
        return {
            "version": _STATE_VERSION,
            "next_step": self._next_step,
            "layers": list(self._names),
            "checks": self._checks.state_dict(),
            "tracker": self._tracker.state_dict(),
            # The dashboard layout belongs to a log folder, not to the run.
            "layout_dir": self._sink.layout_dir if self._sink is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (layers matched by name)."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError("not a gradwatch GradMonitor state_dict (or from an incompatible version)")
        self._next_step = int(state["next_step"])
        self._checks.load_state_dict(state["checks"])
        self._recorder.layout.full_window = self._checks.wants_every_step  # a confirmation carried over
        self._tracker.load_state_dict(state["tracker"])
        if self._sink is not None:
            self._sink.restore_layout_dir(state.get("layout_dir"))

    # --------------------------------------------------------------- helpers
    def _current_scale(self) -> torch.Tensor | None:
        scaler = self._scaler
        if scaler is None or not scaler.is_enabled():
            return None
        return scaler._scale  # a device tensor; get_scale() would synchronise

    def _agree_on_layout(self) -> None:
        """One collective at attach: every rank describes the layers it holds, and all agree on one layout.

        Ranks holding the same layers (data parallelism, FSDP2) keep their own layout: identical by
        construction. Ranks holding different layers (pipeline stages) or sharing layer outputs
        (tensor parallelism) reduce into the union of every rank's layers (``mesh.py``). A layer
        name held with different units or parameter shapes on two ranks cannot be combined: each
        rank then reports its own statistics.
        """
        import torch.distributed as dist

        recorder = self._recorder
        mine = describe_rank(self._layer_specs, recorder.param_stats, recorder.layout, self._output_shares)
        try:
            ranks: list[Any] = [None] * _dist_world_size()
            dist.all_gather_object(ranks, mine)
        except Exception as exc:
            self._sync_dist = False
            self._failures.failed("agreeing on a layout across ranks", exc, "each rank reports its own statistics")
            return
        mismatched = conflicts(ranks)
        if mismatched:
            self._sync_dist = False
            log.warning(
                "gradwatch: the same layer name has different units or parameters on different ranks (%s%s), so "
                "statistics cannot be combined across ranks: each rank reports its own and only rank 0 writes. "
                "Give every rank the same model structure and names: for pipeline stages, build the full model "
                "and delete the layers outside each stage (names stay those of the full model); ranks may "
                "monitor different layers, but a name must mean the same layer everywhere.",
                "; ".join(mismatched[:3]), " ..." if len(mismatched) > 3 else "",
            )  # fmt: skip
            return
        if all(r.signature() == mine.signature() for r in ranks) and self._output_shares is None:
            return  # the same layers everywhere: the rank's own layout is the shared one
        try:
            self._mesh = MeshLayout(ranks, self._rank, recorder.layout)
        except Exception as exc:  # the same on every rank (same descriptions): every rank goes local
            self._sync_dist = False
            self._failures.failed("agreeing on a layout across ranks", exc, "each rank reports its own statistics")
            return
        self._names = list(self._mesh.names)


def check_settings(flush_every: Any, config: Any, detail: Any) -> HealthConfig:
    """Check the knobs GradMonitor and the callbacks share; returns the HealthConfig to use.

    The callbacks call it when they are built, so a wrong value fails at once, with the same
    message, not when training starts.
    """
    if not isinstance(flush_every, int) or isinstance(flush_every, bool) or flush_every < 1:
        raise ValueError(f"flush_every must be an int >= 1 (optimizer steps per flush), got {flush_every!r}")
    if config is not None and not isinstance(config, HealthConfig):
        raise TypeError(f"config must be a gradwatch.HealthConfig, got {type(config).__name__}")
    if detail not in DETAILS:
        raise ValueError(
            f"detail must be one of {list(DETAILS)}: 'standard' (the default, meant to stay on: every step "
            f"has grad_norm and the non-finite checks, some steps every statistic) or 'full' (every "
            f"statistic at every step), got {detail!r}"
        )
    return config if config is not None else HealthConfig()


def _warn_about_wrappers(model: nn.Module) -> None:
    """One WARNING at attach for the wrappers whose statistics gradwatch cannot make whole."""
    names = {type(m).__name__ for m in model.modules()}
    if any(isinstance(m, nn.DataParallel) for m in model.modules()):
        log.warning(
            "gradwatch: nn.DataParallel runs copies of the model on each GPU; parameter-gradient statistics "
            "(grad_norm, grad_max, nonfinite, update_ratio) are of the summed gradients and exact, but "
            "out_grad_norm, dead units and the forward non-finite check cover the copy on the first GPU only "
            "(its share of the batch). Use DistributedDataParallel for all of them."
        )
    if "FullyShardedDataParallel" in names:
        log.warning(
            "gradwatch: FSDP1 (FullyShardedDataParallel) flattens each wrapped unit's parameters into one sharded "
            "FlatParameter: the 'layers' gradwatch finds are those flat shards, and their statistics are of "
            "each rank's shard, not of the model's layers. Use FSDP2 (torch.distributed.fsdp.fully_shard), whose "
            "DTensor parameters gradwatch reduces to the full layers."
        )


def _send(callback: Callable[[dict[str, float], int], None], metrics: list[tuple[int, dict[str, float]]]) -> None:
    for step, values in metrics:
        callback(values, step)


def _dist_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# Per step: three float64 device statistics per parameter tensor (param_sq, param_max,
# param_nonfinite) and one host count (param_present, copied into the buffer at flush); five per
# layer (out_grad's sum of squares, calls and samples, fwd_sum, fwd_order).
_BYTES_PER_STEP_AND_TENSOR = 3 * 8 + 8
_BYTES_PER_STEP_AND_LAYER = 5 * 8
_MAX_WINDOW_BYTES = 1 << 30


def _check_window_size(flush_every: int, layers: int, tensors: int) -> None:
    """A window is kept per step until it is flushed: refuse one that cannot fit."""
    size = flush_every * (layers * _BYTES_PER_STEP_AND_LAYER + tensors * _BYTES_PER_STEP_AND_TENSOR)
    if size > _MAX_WINDOW_BYTES:
        raise ValueError(
            f"flush_every={flush_every} with {layers} monitored layers would keep {size / (1 << 30):.1f} GiB "
            f"of per-step statistics between flushes (limit 1 GiB); use a smaller flush_every "
            f"(statistics are buffered per step and written at each flush)"
        )

