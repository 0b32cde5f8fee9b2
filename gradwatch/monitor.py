"""GradMonitor: the gradient-health monitor for plain PyTorch training loops."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from .alerts import Alert, AlertTracker, GradientHealthError
from .config import HealthConfig
from .detectors import HealthChecks
from .hooks import HookSet
from .layers import discover_layers
from .recorder import Recorder
from .sinks.tensorboard import TensorBoardSink
from .window import Window, build_window

log = logging.getLogger("gradwatch")

_STATE_VERSION = 1


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
    ) -> None:
        if not isinstance(flush_every, int) or isinstance(flush_every, bool) or flush_every < 1:
            raise ValueError(f"flush_every must be an int >= 1 (steps per flush), got {flush_every!r}")
        if config is None:
            config = HealthConfig()
        elif not isinstance(config, HealthConfig):
            raise TypeError(f"config must be a gradwatch.HealthConfig, got {type(config).__name__}")
        if logdir is not None and writer is not None:
            raise ValueError("pass either logdir (gradwatch owns a writer) or writer (yours), not both")
        if scaler is not None and not (hasattr(scaler, "is_enabled") and hasattr(scaler, "_scale")):
            raise TypeError(
                f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}"
            )
        self.config = config
        self.flush_every = flush_every
        self.histograms = bool(histograms)
        self._scaler = scaler
        self._layer_specs = discover_layers(model, include, exclude)
        self._names = [layer.name for layer in self._layer_specs]
        device = self._layer_specs[0].params[0].device
        _check_window_size(flush_every, len(self._layer_specs))

        self.sync_dist = _dist_world_size() > 1
        is_writer = _dist_rank() == 0  # only rank 0 writes

        # A weak reference: the hooks hold the recorder, and the recorder must not keep
        # the monitor alive (so that dropping the monitor removes its hooks).
        self_ref = weakref.ref(self)

        def scale_source() -> torch.Tensor | None:
            monitor = self_ref()
            return None if monitor is None else monitor._current_scale()

        self._recorder = Recorder(
            self._layer_specs, flush_every, device, scale_source, project_units=config.dead_eps == 0
        )
        self._param_numel = np.array(
            [sum(p.numel() for p in layer.params) for layer in self._layer_specs], dtype=np.int64
        )
        self._checks = HealthChecks(config, self._names)
        self._tracker = AlertTracker(config.remind_every)
        self._sink: TensorBoardSink | None = None
        if is_writer and writer is not None:
            self._sink = TensorBoardSink(writer, owns_writer=False)
        elif is_writer and logdir is not None:
            from torch.utils.tensorboard import SummaryWriter

            # A deep queue so that a flush's events never wait for the writer thread;
            # flush_secs bounds how stale the files on disk can be.
            writer = SummaryWriter(log_dir=str(logdir), max_queue=1000, flush_secs=30)
            self._sink = TensorBoardSink(writer, owns_writer=True)
        self._window_steps: list[int] = []
        self._next_step = 0
        # Set by adapters when an optimizer leaves its gradients scaled at step().
        self._params_scaled = False
        self._closed = False
        self.last_window: Window | None = None  # the most recent flushed window
        self._hooks = HookSet(self._layer_specs, self._recorder)

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
        """Bytes of statistics gradwatch holds on the training device."""
        return self._recorder.buffer.nbytes

    def add_alert_callback(self, callback: Callable[[Alert], None]) -> None:
        """Call ``callback(alert)`` for every new alert (after it is logged)."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        self._tracker.callbacks.append(callback)

    # ------------------------------------------------------------------ step
    def step(self, global_step: int | None = None) -> list[Alert]:
        """Record one optimizer step; flushes (and returns new alerts) every ``flush_every`` steps.

        Between flushes this enqueues device work only: no host/device sync.
        """
        if self._closed:
            raise RuntimeError("this GradMonitor is closed; create a new one to keep monitoring")
        if global_step is not None and (not isinstance(global_step, int) or isinstance(global_step, bool)):
            global_step = int(global_step)
        step = self._next_step if global_step is None else global_step
        try:
            self._recorder.record_step(params_scaled=self._params_scaled)
        except Exception as exc:  # never break a healthy run
            self._recorder.hook_failed("step()", exc)
            return []
        self._window_steps.append(step)
        self._next_step = step + 1
        if self._recorder.slot >= self.flush_every:
            return self.flush()
        return []

    def flush(self) -> list[Alert]:
        """Move buffered statistics to the host, write them, run the health checks."""
        return self._flush(final=False)

    def _flush(self, final: bool) -> list[Alert]:
        recorder = self._recorder
        if recorder.slot == 0:
            return []
        steps = self._window_steps
        self._window_steps = []
        try:
            if self.sync_dist:
                recorder.buffer.all_reduce()
            host = recorder.buffer.to_host()
            window = build_window(
                host,
                steps,
                self._names,
                self._param_numel,
                recorder.out_calls,
                recorder.param_present,
                recorder.unit_offset,
                recorder.unit_count,
                self.config.dead_eps,
                recorder.step_orders,
                scaler_in_use=self._scaler is not None and self._scaler.is_enabled(),
            )
        except Exception as exc:
            log.warning("gradwatch: flush failed (%s: %s); this window is dropped", type(exc).__name__, exc)
            return []
        finally:
            recorder.reset_window()
        findings = self._checks.check(window)
        new = self._tracker.update(findings, steps[-1])
        if self._sink is not None:
            try:
                self._sink.write(window, new, len(self._tracker.alerts), final=final)
                if self.histograms and not final:
                    named = [(layer.name, [p.grad for p in layer.params if p.grad is not None])
                             for layer in self._layer_specs]
                    self._sink.write_histograms([(n, g) for n, g in named if g], steps[-1])
            except Exception as exc:
                log.warning("gradwatch: writing to TensorBoard failed: %s: %s", type(exc).__name__, exc)
        self.last_window = window
        stopping = [a for a in new if a.kind in self.config.stop_on]
        if stopping:
            raise GradientHealthError(stopping)
        return new

    # --------------------------------------------------------------- closing
    def close(self) -> None:
        """Flush what is left, remove every hook, close the writer gradwatch owns. Idempotent."""
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
            self._recorder.active = False
            self._recorder.discard_pending()
            if self._sink is not None:
                self._sink.close()
                self._sink = None
            # Drop every reference to the model so that it can be collected.
            self._layer_specs = []
            self._recorder.layers = []
            self._recorder.param_stats.params = []

    def __enter__(self) -> "GradMonitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self._hooks.remove()
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
            "layout_written": bool(self._sink and self._sink.layout_written),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (layers matched by name)."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError("not a gradwatch GradMonitor state_dict (or from an incompatible version)")
        self._next_step = int(state["next_step"])
        self._checks.load_state_dict(state["checks"])
        self._tracker.load_state_dict(state["tracker"])
        if self._sink is not None and state.get("layout_written"):
            self._sink.layout_written = True

    # --------------------------------------------------------------- helpers
    def _current_scale(self) -> torch.Tensor | None:
        scaler = self._scaler
        if scaler is None or not scaler.is_enabled():
            return None
        return scaler._scale  # a device tensor; get_scale() would synchronise


def _dist_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# Per step and layer: five float32 device statistics and two int64 host counters.
_BYTES_PER_STEP_AND_LAYER = 5 * 4 + 2 * 8
_MAX_WINDOW_BYTES = 1 << 30


def _check_window_size(flush_every: int, layers: int) -> None:
    """A window is kept per step until it is flushed: refuse one that cannot fit."""
    size = flush_every * layers * _BYTES_PER_STEP_AND_LAYER
    if size > _MAX_WINDOW_BYTES:
        raise ValueError(
            f"flush_every={flush_every} with {layers} monitored layers would keep {size / (1 << 30):.1f} GiB "
            f"of per-step statistics between flushes (limit 1 GiB); use a smaller flush_every "
            f"(statistics are buffered per step and written at each flush)"
        )

