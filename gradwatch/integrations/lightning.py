"""GradWatch: the Lightning callback, a thin adapter over GradMonitor.

It subclasses the ``Callback`` of every Lightning package installed
(``pytorch_lightning`` and/or ``lightning.pytorch``), so one class serves
``pytorch_lightning.Trainer`` and ``lightning.pytorch.Trainer`` alike.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Union

from ..alerts import Alert
from ..config import HealthConfig
from ..monitor import GradMonitor
from ..settings import check_settings
from .lifecycle import MonitorLifecycle, grads_still_scaled

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
        self.config = check_settings(flush_every, config, detail)
        self.detail = detail
        self.flush_every = flush_every
        self.include = include
        self.exclude = exclude
        self.logdir = logdir
        self.histograms = histograms
        self._lifecycle = MonitorLifecycle()  # the monitors (one per optimizer) during fit, and their state
        self._optimizers: list[Any] = []
        self._own_writer: Any = None  # with several optimizers and no logger: their shared writer

    @property
    def monitors(self) -> list[GradMonitor]:
        """The monitors of this fit, one per optimizer (empty outside fit)."""
        return self._lifecycle.monitors

    @property
    def monitor(self) -> Optional[GradMonitor]:
        """The monitor of the (first) optimizer during fit; None outside fit."""
        return self.monitors[0] if self.monitors else None

    # ------------------------------------------------------------ lifecycle
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._detach()
        writer, logdir, metric_loggers = self._outputs(trainer)
        optimizers = list(trainer.optimizers or [None])
        layer_sets = self._layers_per_optimizer(pl_module, optimizers)
        if logdir is not None and len(optimizers) > 1:  # one writer of our own for every monitor
            from ..sinks.event_writer import summary_writer

            writer = self._own_writer = summary_writer(logdir)
            logdir = None
        kept = [(opt, include) for opt, include in zip(optimizers, layer_sets) if include or len(optimizers) == 1]

        def factory(optimizer: Any, include: Any) -> Any:
            def build() -> GradMonitor:
                monitor = GradMonitor(
                    pl_module, writer=writer, logdir=logdir, flush_every=self.flush_every, config=self.config,
                    include=include, exclude=self.exclude if include is self.include else None,
                    scaler=getattr(trainer.precision_plugin, "scaler", None), histograms=self.histograms,
                    sync_dist=trainer.world_size > 1, optimizer=optimizer, detail=self.detail,
                )  # fmt: skip
                for logger in metric_loggers:
                    monitor.add_metrics_callback(logger.log_metrics)
                return monitor

            return build

        try:
            monitors = self._lifecycle.attach([factory(opt, include) for opt, include in kept])
        except BaseException:
            self._close_own_writer()
            raise
        self._optimizers = [opt for opt, _ in kept]
        if len(monitors) > 1:
            everyone = [name for monitor in monitors for name in monitor.layers]
            order = {name: i for i, name in enumerate(_module_order(pl_module))}
            everyone.sort(key=lambda name: order.get(name, len(order)))
            for k, monitor in enumerate(monitors):
                monitor._share_dashboard(everyone, writes_layout=k == 0)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._detach()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Other ranks may not reach a collective now: close this rank's monitors without one.
        self._lifecycle.on_exception()
        self._detach()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._detach()

    # Validation inside fit (and the sanity check) runs under no_grad, which the
    # hooks already ignore; switching the recorder off also covers user code
    # that enables grad in validation_step.
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        for monitor in self.monitors:
            monitor.pause()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        for monitor in self.monitors:
            monitor.resume()

    # ---------------------------------------------------------------- record
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        monitor = self._monitor_of(optimizer)
        if monitor is None:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if self._lifecycle.record(monitor, trainer.global_step, grads_still_scaled(scaler, optimizer)):
            trainer.should_stop = True

    def _monitor_of(self, optimizer: Any) -> Optional[GradMonitor]:
        """The monitor of the layers ``optimizer`` updates (each is recorded at its own optimizer's steps)."""
        for opt, monitor in zip(self._optimizers, self.monitors):
            if opt is optimizer or opt is None:
                return monitor
            # Lightning hands callbacks its LightningOptimizer wrapper, or the optimizer itself
            if getattr(optimizer, "optimizer", None) is opt:
                return monitor
        return None

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return self._lifecycle.state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._lifecycle.load(state_dict)

    @property
    def alerts(self) -> list[Alert]:
        """Every alert raised during the current (or, after it, the last) fit (the most recent ones)."""
        return self._lifecycle.current_alerts()

    # --------------------------------------------------------------- helpers
    def _detach(self) -> None:
        self._optimizers = []
        try:
            self._lifecycle.detach()
        finally:
            self._close_own_writer()

    def _close_own_writer(self) -> None:
        writer, self._own_writer = self._own_writer, None
        if writer is not None:
            writer.close()

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

    def _layers_per_optimizer(self, pl_module: Any, optimizers: list[Any]) -> list[Any]:
        """The ``include`` of each optimizer's monitor: with one optimizer, the callback's own;
        with several, the names of the layers whose parameters each one updates."""
        if len(optimizers) <= 1:
            return [self.include]
        import glob as _glob

        from ..capture.layers import discover_layers

        layers = discover_layers(pl_module, self.include, self.exclude)
        sets, claimed = [], set()
        for optimizer in optimizers:
            mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
            names = [layer.name for layer in layers if layer.name not in claimed and any(id(p) in mine for p in layer.params)]
            claimed.update(names)
            sets.append([_glob.escape(name) for name in names])
        unclaimed = [layer.name for layer in layers if layer.name not in claimed]
        if unclaimed:
            log.warning(
                "gradwatch: no optimizer of this Trainer updates layers %s; they are not monitored",
                ", ".join(unclaimed),
            )
        return sets


def _module_order(module: Any) -> list[str]:
    from .._compat import user_name

    return [user_name(name) or "<root>" for name, _ in module.named_modules()]


def default_logdir(root_dir: str) -> str:
    """Where GradWatch writes with no logger: ``<root>/lightning_logs/gradwatch``.

    Never ``<root>/gradwatch``: run from a source checkout, that is the package folder.
    """
    return os.path.join(root_dir, "lightning_logs", "gradwatch")


def _is_tensorboard_logger(logger: Any) -> bool:
    return any(cls.__name__ == "TensorBoardLogger" for cls in type(logger).__mro__)
