"""GradWatchCallback: gradwatch for the Hugging Face ``transformers.Trainer``, a thin layer over GradMonitor.

    from gradwatch.hf import GradWatchCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[GradWatchCallback(flush_every=50)])

Statistics of the gradients *before clipping*. The Trainer clips (``max_grad_norm``,
1.0 by default) before it calls ``on_pre_optimizer_step``, so that hook only sees
clipped gradients. The callback therefore records right before the clip: at train
start it finds its Trainer (callbacks are not handed one: it is the caller that owns
the callback handler this callback is in) and wraps that Trainer's
``accelerator.clip_grad_norm_``, which is the call the Trainer makes once per
optimizer step to clip and to get the ``grad_norm`` it logs (also with
``max_grad_norm=0``, as a norm without clipping). The wrapper records, then calls
the original; it is removed when training ends. Where that call is not made
(DeepSpeed, gradients on mixed device meshes) the callback records in
``on_pre_optimizer_step`` instead and says once that the statistics are after clipping.

transformers is not a dependency of gradwatch: this module subclasses
``transformers.TrainerCallback`` when it is imported, and ``import gradwatch`` never
imports it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional, Union

from ..alerts import Alert, GradientHealthError
from ..config import HealthConfig
from ..monitor import GradMonitor, check_settings

log = logging.getLogger("gradwatch")

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - only without transformers
    raise ImportError(
        "gradwatch.hf needs the transformers package: pip install transformers accelerate; "
        "for a plain PyTorch loop use gradwatch.GradMonitor"
    ) from exc


class GradWatchCallback(TrainerCallback):
    """Monitor gradient health during ``Trainer.train()``; the same knobs as ``GradWatch``.

    Args:
        flush_every: optimizer steps per flush (TensorBoard write and health checks).
        config: thresholds of the health checks; ``config.stop_on`` kinds stop training
            (``control.should_training_stop``).
        include / exclude: fnmatch patterns on layer names of the model.
        logdir: TensorBoard folder; default: the Trainer's TensorBoard folder when
            ``report_to`` includes "tensorboard" (the same event files), else
            ``<output_dir>/gradwatch``.
        histograms: also write per-layer gradient histograms at each flush (costly).
        detail: ``"standard"`` (default) or ``"full"`` (every statistic at every step).
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
        self.config = check_settings(flush_every, config, detail)
        self.flush_every = flush_every
        self.include = include
        self.exclude = exclude
        self.logdir = logdir
        self.histograms = histograms
        self.detail = detail
        self.monitor: Optional[GradMonitor] = None
        self._alerts: list[Alert] = []
        self._state: Any = None  # the Trainer's TrainerState, for the step number
        self._scaler: Any = None  # accelerate's GradScaler under fp16 AMP
        self._recorded_at: Optional[int] = None  # the last step recorded before clipping
        self._stop = False
        self._warned_after_clip = False
        # (object, method name) of each method wrapped on an instance during train(): the
        # accelerator's clip_grad_norm_, the Trainer's training_step, its TensorBoardCallback's on_train_end
        self._wrapped: list[tuple[Any, str]] = []

    @property
    def alerts(self) -> list[Alert]:
        """Every alert raised during training (kept after training ends)."""
        return list(self.monitor.alerts) if self.monitor is not None else list(self._alerts)

    # ------------------------------------------------------------ lifecycle
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        self._detach()
        # Every train() starts fresh (a reused callback carries nothing over).
        self._alerts, self._stop, self._recorded_at, self._warned_after_clip = [], False, None, False
        trainer = _find_trainer(self)
        accelerator = getattr(trainer, "accelerator", None)
        scaler = getattr(accelerator, "scaler", None)
        writer, logdir = self._outputs(args, state, trainer)
        self._state = state
        self._scaler = scaler if scaler is not None and hasattr(scaler, "_scale") else None
        self.monitor = GradMonitor(
            model,
            writer=writer,
            logdir=logdir,
            flush_every=self.flush_every,
            config=self.config,
            include=self.include,
            exclude=self.exclude,
            scaler=self._scaler,
            histograms=self.histograms,
            optimizer=getattr(optimizer, "optimizer", optimizer),  # accelerate wraps the optimizer
            detail=self.detail,
        )
        if accelerator is not None and hasattr(accelerator, "clip_grad_norm_"):
            self._wrap_clip(accelerator)
        if trainer is not None:
            self._wrap_training_step(trainer)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._detach()

    # ---------------------------------------------------------------- record
    def _wrap_clip(self, accelerator: Any) -> None:
        original = accelerator.clip_grad_norm_
        callback = self

        def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2, **kwargs: Any) -> Any:
            # The gradients as the Trainer is about to clip them, once per optimizer step. The
            # Trainer logs this update's grad_norm at global_step + 1, after it increments it.
            callback._record(callback._state.global_step + 1, before_clip=True)
            return original(parameters, max_norm, norm_type=norm_type, **kwargs)

        self._install(accelerator, "clip_grad_norm_", clip_grad_norm_)

    def _wrap_training_step(self, trainer: Any) -> None:
        """The Trainer has no callback event for an exception: a step that raises (forward, loss,
        backward) detaches here, so that no hook or wrapper is left on the model."""
        original = trainer.training_step
        callback = self

        def training_step(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except BaseException:
                callback._detach()
                raise

        self._install(trainer, "training_step", training_step)

    def _install(self, owner: Any, name: str, wrapper: Any) -> None:
        """Put ``wrapper`` on the instance ``owner`` in place of its method ``name``, until _detach()."""
        wrapper.__gradwatch__ = True
        setattr(owner, name, wrapper)
        self._wrapped.append((owner, name))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step + 1
        if self._recorded_at == step or self.monitor is None:
            return
        if not self._warned_after_clip:  # the clip was not made through the accelerator
            self._warned_after_clip = True
            log.warning(
                "gradwatch: this Trainer did not clip through accelerator.clip_grad_norm_ (DeepSpeed, mixed "
                "device meshes, or the Trainer was not found); statistics are recorded in on_pre_optimizer_step, "
                "after any clipping"
            )
        self._record(step, before_clip=False)

    def _record(self, step: int, before_clip: bool) -> None:
        monitor = self.monitor
        if monitor is None or self._recorded_at == step:
            return
        self._recorded_at = step
        scaler = self._scaler
        try:
            # Before the clip, accelerate has not unscaled the gradients yet (fp16 AMP).
            monitor.step(step, grads_scaled=before_clip and scaler is not None and scaler.is_enabled())
        except GradientHealthError as exc:
            log.error("gradwatch: stopping training: %s", exc)
            self._stop = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._stop:
            control.should_training_stop = True
        return control

    # --------------------------------------------------------------- helpers
    def _outputs(self, args: Any, state: Any, trainer: Any) -> tuple[Any, Optional[str]]:
        """(the Trainer's TensorBoard writer, or a folder of our own); only the main process writes.

        With ``report_to`` including tensorboard, gradwatch writes through the Trainer's own
        ``TensorBoardCallback`` writer, whichever callback runs first: through a proxy that finds
        the callback's writer when gradwatch writes (the callback creates it in its own
        ``on_train_begin``), and gradwatch's last flush runs before that callback closes its writer
        (its ``on_train_end`` is wrapped), so that no second event file and no writer thread of
        gradwatch's is left behind.
        """
        if not getattr(state, "is_world_process_zero", True):
            return None, None
        if self.logdir is not None:
            return None, self.logdir
        for callback in getattr(getattr(trainer, "callback_handler", None), "callbacks", []):
            if type(callback).__name__ == "TensorBoardCallback" and hasattr(callback, "tb_writer"):
                self._wrap_tensorboard_end(callback)
                return _CallbackWriter(callback), None  # the Trainer's own event files: one run
        return None, os.path.join(args.output_dir, "gradwatch")

    def _wrap_tensorboard_end(self, tb_callback: Any) -> None:
        original = tb_callback.on_train_end
        callback = self

        def on_train_end(*args: Any, **kwargs: Any) -> Any:
            callback._detach()  # the last flush, while the Trainer's writer is open
            return original(*args, **kwargs)

        self._install(tb_callback, "on_train_end", on_train_end)

    def _detach(self) -> None:
        wrapped, self._wrapped = self._wrapped, []
        for owner, name in wrapped:
            if getattr(owner.__dict__.get(name), "__gradwatch__", False):
                delattr(owner, name)  # the class's method again
        if self.monitor is None:
            return
        monitor, self.monitor = self.monitor, None
        try:
            monitor.close()
        finally:
            self._alerts = monitor.alerts
            self._state = None


class _CallbackWriter:
    """The Trainer's TensorBoard writer, looked up when gradwatch writes: the TensorBoardCallback
    creates it in its own ``on_train_begin``, which may run after gradwatch's."""

    def __init__(self, callback: Any) -> None:
        self._callback = callback
        self.log_dir = getattr(callback, "logging_dir", None)

    def __getattr__(self, name: str) -> Any:
        writer = self._callback.tb_writer
        if writer is None:  # an AttributeError, so that getattr(writer, name, default) works
            raise AttributeError(f"the Trainer's TensorBoard writer is closed or not created yet (wanted {name!r})")
        return getattr(writer, name)


def _find_trainer(callback: object) -> Any:
    """The Trainer whose callback handler holds ``callback``: a caller up the stack (None if not found)."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        handler = getattr(candidate, "callback_handler", None)
        if handler is not None and any(c is callback for c in getattr(handler, "callbacks", [])):
            return candidate
        frame = frame.f_back
    return None
