"""GradWatch: the Lightning callback, a thin adapter over GradMonitor.

It subclasses the ``Callback`` of every Lightning package installed
(``pytorch_lightning`` and/or ``lightning.pytorch``), so one class serves
``pytorch_lightning.Trainer`` and ``lightning.pytorch.Trainer`` alike.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Union

from .alerts import Alert, GradientHealthError
from .config import HealthConfig
from .monitor import GradMonitor

log = logging.getLogger("gradwatch")


def _callback_bases() -> tuple[type, ...]:
    bases: list[type] = []
    try:
        from pytorch_lightning import Callback as PLCallback

        bases.append(PLCallback)
    except ImportError:
        pass
    try:
        from lightning.pytorch import Callback as LCallback

        if LCallback not in bases:
            bases.append(LCallback)
    except ImportError:
        pass
    if not bases:
        raise ImportError(
            "gradwatch.GradWatch needs Lightning: pip install pytorch-lightning (or lightning); "
            "for a plain PyTorch loop use gradwatch.GradMonitor"
        )
    return tuple(bases)


class GradWatch(*_callback_bases()):  # type: ignore[misc]
    """Monitor gradient health during ``Trainer.fit``; see GradMonitor for the statistics.

    Args:
        flush_every: optimizer steps per flush to TensorBoard and health check.
        config: thresholds of the health checks; ``config.stop_on`` kinds set
            ``trainer.should_stop``.
        include: fnmatch patterns on layer names (relative to the LightningModule).
        exclude: fnmatch patterns of layers to leave out.
        logdir: where to write when the trainer has no TensorBoardLogger
            (default: ``<trainer.default_root_dir>/gradwatch``).
        histograms: also write per-layer gradient histograms at each flush
            (copies every gradient to the host; off by default).
        detail: ``"standard"`` (default: every step grad_norm and the non-finite checks,
            every statistic on sampled steps) or ``"full"`` (every statistic at every step).
    """

    def __init__(
        self,
        flush_every: int = 50,
        config: Optional[HealthConfig] = None,
        include: Union[str, list[str], None] = None,
        exclude: Union[str, list[str], None] = None,
        logdir: Optional[str] = None,
        histograms: bool = False,
        detail: str = "standard",
    ) -> None:
        super().__init__()
        from .monitor import DETAILS

        if detail not in DETAILS:
            raise ValueError(f"detail must be one of {list(DETAILS)}, got {detail!r}")
        self.detail = detail
        if not isinstance(flush_every, int) or isinstance(flush_every, bool) or flush_every < 1:
            raise ValueError(f"flush_every must be an int >= 1 (optimizer steps per flush), got {flush_every!r}")
        if config is not None and not isinstance(config, HealthConfig):
            raise TypeError(f"config must be a gradwatch.HealthConfig, got {type(config).__name__}")
        self.flush_every = flush_every
        self.config = config or HealthConfig()
        self.include = include
        self.exclude = exclude
        self.logdir = logdir
        self.histograms = histograms
        self.monitor: Optional[GradMonitor] = None
        self._pending_state: Optional[dict[str, Any]] = None
        self._alerts: list[Alert] = []

    # ------------------------------------------------------------ lifecycle
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._detach()
        writer, logdir = self._find_writer(trainer)
        monitor = GradMonitor(
            pl_module,
            writer=writer,
            logdir=logdir,
            flush_every=self.flush_every,
            config=self.config,
            include=self.include,
            exclude=self.exclude,
            scaler=getattr(trainer.precision_plugin, "scaler", None),
            histograms=self.histograms,
            sync_dist=trainer.world_size > 1,
            optimizer=trainer.optimizers[0] if trainer.optimizers else None,
            detail=self.detail,
        )
        if self._pending_state is not None:
            monitor.load_state_dict(self._pending_state)
            self._pending_state = None
        self.monitor = monitor

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._detach()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Other ranks may not reach a collective now: flush this rank's data without one.
        if self.monitor is not None:
            self.monitor.sync_dist = False
        self._detach()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._detach()

    # Validation inside fit (and the sanity check) runs under no_grad, which the
    # hooks already ignore; switching the recorder off also covers user code
    # that enables grad in validation_step.
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.pause()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.resume()

    # ---------------------------------------------------------------- record
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        monitor = self.monitor
        if monitor is None or (trainer.optimizers and optimizer is not trainer.optimizers[0]):
            return
        try:
            monitor.step(trainer.global_step, grads_scaled=_grads_still_scaled(trainer, optimizer))
        except GradientHealthError as exc:
            log.error("gradwatch: stopping training: %s", exc)
            trainer.should_stop = True

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        if self.monitor is not None:
            return self.monitor.state_dict()
        return dict(self._pending_state or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.monitor is not None:
            self.monitor.load_state_dict(state_dict)
        else:
            self._pending_state = dict(state_dict)

    @property
    def alerts(self) -> list[Alert]:
        """Every alert raised during fit (kept after detaching)."""
        return list(self.monitor.alerts) if self.monitor is not None else list(self._alerts)

    # --------------------------------------------------------------- helpers
    def _detach(self) -> None:
        if self.monitor is None:
            return
        monitor, self.monitor = self.monitor, None
        try:
            monitor.close()
        finally:
            self._alerts = monitor.alerts
            self._pending_state = monitor.state_dict()

    def _find_writer(self, trainer: Any) -> tuple[Any, Optional[str]]:
        """The trainer's TensorBoardLogger writer on rank 0, else a logdir of our own."""
        if trainer.global_rank != 0:
            return None, None
        for logger in getattr(trainer, "loggers", []) or []:
            if type(logger).__name__ == "TensorBoardLogger":
                return logger.experiment, None
        root = self.logdir or os.path.join(trainer.default_root_dir, "gradwatch")
        return None, root


def _grads_still_scaled(trainer: Any, optimizer: Any) -> bool:
    """True when a GradScaler is active but did not unscale this optimizer (fused optimizers)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return False
    state = scaler._per_optimizer_states.get(id(optimizer), {})
    stage = state.get("stage")
    return getattr(stage, "name", "") != "UNSCALED"
