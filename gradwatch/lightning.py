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
        logdir: where to write TensorBoard files when the trainer has no logger at all
            (default: ``<trainer.default_root_dir>/lightning_logs/gradwatch``).
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
        from .monitor import check_settings

        self.config = check_settings(flush_every, config, detail)
        self.detail = detail
        self.flush_every = flush_every
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
        writer, logdir, metric_loggers = self._outputs(trainer)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        monitor = GradMonitor(
            pl_module,
            writer=writer,
            logdir=logdir,
            flush_every=self.flush_every,
            config=self.config,
            include=self._include_for(trainer, pl_module),
            exclude=self.exclude,
            scaler=getattr(trainer.precision_plugin, "scaler", None),
            histograms=self.histograms,
            sync_dist=trainer.world_size > 1,
            optimizer=optimizer,
            detail=self.detail,
        )
        for logger in metric_loggers:
            monitor.add_metrics_callback(logger.log_metrics)
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

    def _outputs(self, trainer: Any) -> tuple[Any, Optional[str], list[Any]]:
        """(TensorBoard writer, own log folder, loggers fed through log_metrics), on rank 0.

        A TensorBoardLogger gets everything through its writer: the scalars (one event per
        step, what its log_metrics would write, faster) and the TensorBoard-only output
        (layout, heatmap images, alert text). Every other logger (CSV, MLflow, W&B, ...) gets
        the scalars through ``log_metrics(metrics, step)`` at the step each value describes.
        With no logger at all, gradwatch writes TensorBoard files of its own.
        """
        if trainer.global_rank != 0:
            return None, None, []
        loggers = list(getattr(trainer, "loggers", []) or [])
        tensorboard = [lg for lg in loggers if _is_tensorboard_logger(lg)]
        others = [lg for lg in loggers if not _is_tensorboard_logger(lg)]
        if tensorboard:
            return tensorboard[0].experiment, None, others + tensorboard[1:]
        if others:
            return None, None, others
        return None, self.logdir or default_logdir(trainer.default_root_dir), []

    def _include_for(self, trainer: Any, pl_module: Any) -> Any:
        """With several optimizers, the layers of the first one (recorded at its steps); said at fit start."""
        optimizers = list(trainer.optimizers or [])
        if len(optimizers) <= 1:
            return self.include
        from .layers import discover_layers

        first = {id(p) for group in optimizers[0].param_groups for p in group["params"]}
        layers = discover_layers(pl_module, self.include, self.exclude)
        mine = [layer.name for layer in layers if any(id(p) in first for p in layer.params)]
        others = [layer.name for layer in layers if layer.name not in mine]
        log.warning(
            "gradwatch: this Trainer has %d optimizers; GradWatch records the layers the first one updates "
            "(%s), at that optimizer's steps. Not monitored: %s. To watch another optimizer's layers, add a "
            "GradWatch with include= those layers' names and its own logdir.",
            len(optimizers), ", ".join(mine) or "none", ", ".join(others) or "none",
        )  # fmt: skip
        import glob as _glob

        return [_glob.escape(name) for name in mine] or self.include


def default_logdir(root_dir: str) -> str:
    """Where GradWatch writes with no logger: ``<root>/lightning_logs/gradwatch``.

    Never ``<root>/gradwatch``: run from a source checkout, that is the package folder.
    """
    return os.path.join(root_dir, "lightning_logs", "gradwatch")


def _is_tensorboard_logger(logger: Any) -> bool:
    return any(cls.__name__ == "TensorBoardLogger" for cls in type(logger).__mro__)


def _grads_still_scaled(trainer: Any, optimizer: Any) -> bool:
    """True when a GradScaler is active but did not unscale this optimizer (fused optimizers)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return False
    state = scaler._per_optimizer_states.get(id(optimizer), {})
    stage = state.get("stage")
    return getattr(stage, "name", "") != "UNSCALED"
