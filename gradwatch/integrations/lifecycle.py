"""The one lifecycle every integration shares: attach, record, exception, detach, checkpoint state.

The plain loop has it in ``GradMonitor`` itself (``with`` closes, an exception closes without a
collective). The Lightning callback and the Hugging Face callback hold a :class:`MonitorLifecycle`
and only translate their framework's events into its calls, so that attach, a failed attach, an
exception, detach, GradScaler discovery and checkpoint state behave the same everywhere.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any, Callable

from .. import _compat
from ..alerts import Alert, GradientHealthError
from ..config import HealthConfig
from ..monitor import GradMonitor

log = logging.getLogger("gradwatch")


class MonitorLifecycle:
    """The monitors of one training run (one per optimizer), from attach to detach, and what outlives them.

    Between runs it keeps the last run's alerts and state (``alerts``, :meth:`state`), and a state
    restored from a checkpoint for the next attach only (:meth:`load`).
    """

    def __init__(self) -> None:
        self.monitors: list[GradMonitor] = []
        self.alerts: list[Alert] = []  # the last run's, after it ended
        self._final_state: dict[str, Any] | None = None
        self._restore: dict[str, Any] | None = None  # from a checkpoint, for the next attach only

    def attach(self, factories: list[Callable[[], GradMonitor]]) -> list[GradMonitor]:
        """Detach what is left, then build one monitor per factory. If one raises, the monitors
        already built are closed without a collective (no hook, no writer thread left) and the
        error propagates. A state restored since the last run is loaded into the new monitors."""
        self.detach()
        self.alerts, self._final_state = [], None  # a new run starts fresh
        built: list[GradMonitor] = []
        try:
            for factory in factories:
                built.append(factory())
        except BaseException:
            for monitor in built:
                monitor.sync_dist = False
                monitor.close()
            raise
        self.monitors = built
        restore, self._restore = self._restore, None
        if restore:
            self._load_into(restore)
        return built

    def on_exception(self) -> None:
        """The run raised on this rank: the other ranks may never reach a collective, so every
        monitor closes with none (its last window is this rank's own)."""
        for monitor in self.monitors:
            monitor.sync_dist = False
        self.detach()

    def detach(self) -> None:
        """Close every monitor (a stop_on alert of the last flush is logged, not raised); keep their
        alerts and state for after the run."""
        monitors, self.monitors = self.monitors, []
        if not monitors:
            return
        try:
            for monitor in monitors:
                try:
                    monitor.close()
                except GradientHealthError:
                    pass
        finally:
            self.alerts = [alert for monitor in monitors for alert in monitor.alerts]
            self._final_state = _state_of(monitors)

    @staticmethod
    def record(monitor: GradMonitor, step: int, grads_scaled: bool = False) -> bool:
        """``monitor.step(step)``; True when a ``stop_on`` alert says training should stop."""
        try:
            monitor.step(step, grads_scaled=grads_scaled)
        except GradientHealthError as exc:
            log.error("gradwatch: stopping training: %s", exc)
            return True
        return False

    def current_alerts(self) -> list[Alert]:
        """Every alert of the current run (during it) or of the last one (after it)."""
        if self.monitors:
            return [alert for monitor in self.monitors for alert in monitor.alerts]
        return list(self.alerts)

    # ----------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        """The run's state for a checkpoint (during the run, after it, or as restored)."""
        if self.monitors:
            return _state_of(self.monitors)
        if self._final_state is not None:
            return dict(self._final_state)
        return dict(self._restore or {})

    def load(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state` output now (during a run) or at the next attach."""
        if not state:
            return
        if self.monitors:
            self._load_into(state)
        else:
            self._restore = dict(state)

    def _load_into(self, state: dict[str, Any]) -> None:
        for monitor, saved in zip(self.monitors, state.get("per_optimizer", [state])):
            monitor.load_state_dict(saved)


def _state_of(monitors: list[GradMonitor]) -> dict[str, Any]:
    if len(monitors) == 1:
        return monitors[0].state_dict()
    return {"per_optimizer": [monitor.state_dict() for monitor in monitors]}


def grads_still_scaled(scaler: Any, optimizer: Any) -> bool:
    """True when a GradScaler is active and has not unscaled ``optimizer``'s gradients yet (fused
    optimizers unscale inside their step: Lightning then does not call ``unscale_``). Read from the
    scaler's per-optimizer state; where this torch has none, gradwatch takes the gradients as
    unscaled and ``_compat`` warns once."""
    if scaler is None or not scaler.is_enabled():
        return False
    unscaled = _compat.scaler_unscaled(scaler, optimizer)
    return unscaled is False


def watchable_optimizer(optimizer: Any) -> Any:
    """The optimizer a framework steps, for update_ratio: unwrapped from accelerate's wrapper; None
    (with one WARNING) when it is not a ``torch.optim.Optimizer`` stepping the model's own
    parameters (DeepSpeed ZeRO's optimizer steps its fp32 partitions, then copies them back)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    if optimizer is None or hasattr(optimizer, "register_step_pre_hook"):
        return optimizer
    log.warning(
        "gradwatch: update_ratio is not measured: the training optimizer is a %s, not a torch.optim.Optimizer "
        "stepping the model's parameters (DeepSpeed ZeRO steps its own fp32 partitions); every other "
        "statistic is recorded", type(optimizer).__name__,
    )
    return None


def discover_scaler(*owners: Any) -> Any:
    """The first active ``GradScaler``-like object among ``owners``' ``scaler`` attributes (None)."""
    for owner in owners:
        scaler = getattr(owner, "scaler", None)
        if scaler is not None and hasattr(scaler, "is_enabled") and hasattr(scaler, "get_scale"):
            return scaler
    return None


def config_to_json(config: HealthConfig) -> dict[str, Any]:
    """A HealthConfig as JSON-friendly values (a Trainer checkpoint's callback arguments)."""
    values = asdict(config)
    values["stop_on"] = sorted(values["stop_on"])
    return values


def config_from(value: HealthConfig | dict[str, Any] | None) -> HealthConfig | None:
    """A HealthConfig from itself, from :func:`config_to_json` output, or None."""
    if isinstance(value, dict):
        values = dict(value)
        values["stop_on"] = frozenset(values.get("stop_on", ()))
        return HealthConfig(**values)
    return value
