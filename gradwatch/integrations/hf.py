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

from ..alerts import Alert
from ..config import HealthConfig
from ..monitor import GradMonitor
from ..settings import check_settings
from .lifecycle import MonitorLifecycle, config_from, config_to_json, discover_scaler, watchable_optimizer

log = logging.getLogger("gradwatch")

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - only without transformers
    raise ImportError(
        "gradwatch.hf needs the transformers package: pip install transformers accelerate; "
        "for a plain PyTorch loop use gradwatch.GradMonitor"
    ) from exc


try:  # transformers >= 4.42 saves the state of ExportableState callbacks in its checkpoints
    from transformers.trainer_callback import ExportableState as _ExportableState
except ImportError:  # pragma: no cover - older transformers: no callback state in checkpoints

    class _ExportableState:  # type: ignore[no-redef]
        pass


class GradWatchCallback(TrainerCallback, _ExportableState):
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

    Its state (detector baselines, alert state) is saved in the Trainer's checkpoints
    (``TrainerState.stateful_callbacks``) and restored by ``resume_from_checkpoint``: an alert
    raised before the checkpoint is not a new onset after it.
    """

    def __init__(
        self,
        flush_every: int = 50,
        config: Union[HealthConfig, dict, None] = None,
        include: Union[str, list[str], None] = None,
        exclude: Union[str, list[str], None] = None,
        logdir: Optional[str] = None,
        histograms: bool = False,
        detail: str = "standard",
    ) -> None:
        self.config = check_settings(flush_every, config_from(config), detail)
        self.flush_every = flush_every
        self.include = include
        self.exclude = exclude
        self.logdir = logdir
        self.histograms = histograms
        self.detail = detail
        self._lifecycle = MonitorLifecycle()
        self._state: Any = None  # the Trainer's TrainerState, for the step number
        self._scaler: Any = None  # accelerate's GradScaler under fp16 AMP
        self._recorded_at: Optional[int] = None  # the last step recorded before clipping
        self._stop = False
        self._warned_after_clip = False
        # (object, method name) of each method wrapped on an instance during train(): the
        # accelerator's clip_grad_norm_, the Trainer's training_step, its TensorBoardCallback's on_train_end
        self._wrapped: list[tuple[Any, str]] = []

    @property
    def monitor(self) -> Optional[GradMonitor]:
        """The monitor during ``train()``; None outside it."""
        return self._lifecycle.monitors[0] if self._lifecycle.monitors else None

    @property
    def alerts(self) -> list[Alert]:
        """Every alert raised during training (kept after training ends; the most recent ones)."""
        return self._lifecycle.current_alerts()

    # ----------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        """What a Trainer checkpoint keeps (``ExportableState``): the arguments, and the monitor's state."""
        return {
            "args": {
                "flush_every": self.flush_every, "config": config_to_json(self.config), "include": self.include,
                "exclude": self.exclude, "logdir": self.logdir, "histograms": self.histograms, "detail": self.detail,
            },
            "attributes": {"restored_state": self._lifecycle.state()},
        }  # fmt: skip

    @property
    def restored_state(self) -> dict[str, Any]:
        """The monitor's state (as :meth:`state` saves it)."""
        return self._lifecycle.state()

    @restored_state.setter
    def restored_state(self, value: dict[str, Any]) -> None:
        """Set by the Trainer when it resumes from a checkpoint: loaded into the next train()'s monitor."""
        self._lifecycle.load(value)

    # ------------------------------------------------------------ lifecycle
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        self._detach()
        # Every train() starts fresh (a reused callback carries nothing over but a restored checkpoint).
        self._stop, self._recorded_at, self._warned_after_clip = False, None, False
        trainer = _find_trainer(self)
        accelerator = getattr(trainer, "accelerator", None)
        writer, logdir = self._outputs(args, state, trainer)
        self._state = state
        self._scaler = discover_scaler(accelerator)
        if getattr(state, "global_step", 0) > 0:  # resumed from a checkpoint: its saved state, whatever
            self._lifecycle.load(_saved_state(state))  # restore_callback_states_from_checkpoint says

        def build() -> GradMonitor:
            return GradMonitor(
                model, writer=writer, logdir=logdir, flush_every=self.flush_every, config=self.config,
                include=self.include, exclude=self.exclude, scaler=self._scaler, histograms=self.histograms,
                optimizer=watchable_optimizer(optimizer),
                detail=self.detail,
            )  # fmt: skip

        self._lifecycle.attach([build])
        if accelerator is not None and hasattr(accelerator, "clip_grad_norm_"):
            self._record_before(accelerator, "clip_grad_norm_")
        engine = getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "engine", None)
        if engine is not None and hasattr(engine, "step"):
            self._record_before(engine, "step")
        if trainer is not None:
            self._wrap_training_step(trainer)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._detach()

    # ---------------------------------------------------------------- record
    def _record_before(self, owner: Any, name: str) -> None:
        """Record the gradients just before ``owner.name()`` runs, once per optimizer step: the
        accelerator's ``clip_grad_norm_`` (the gradients as the Trainer is about to clip them), or
        DeepSpeed's ``engine.step()``, which accelerate calls inside ``accelerator.backward()`` at
        each accumulation boundary (ZeRO's reduced gradients exist only until then; DeepSpeed
        clips inside it). The Trainer logs this update's grad_norm at global_step + 1, after it
        increments it."""
        original = getattr(owner, name)
        callback = self

        def record_then_call(*args: Any, **kwargs: Any) -> Any:
            state = callback._state
            if state is not None:
                callback._record(state.global_step + 1, before_clip=True)
            return original(*args, **kwargs)

        self._install(owner, name, record_then_call)

    def _wrap_training_step(self, trainer: Any) -> None:
        """The Trainer has no callback event for an exception: a step that raises (forward, loss,
        backward) detaches here, so that no hook or wrapper is left on the model."""
        original = trainer.training_step
        callback = self

        def training_step(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except BaseException:
                callback._detach(exception=True)  # no collective: the other ranks may never reach one
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
        # Before the clip, accelerate has not unscaled the gradients yet (fp16 AMP).
        if self._lifecycle.record(monitor, step, before_clip and scaler is not None and scaler.is_enabled()):
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

    def _detach(self, exception: bool = False) -> None:
        wrapped, self._wrapped = self._wrapped, []
        for owner, name in wrapped:
            if getattr(owner.__dict__.get(name), "__gradwatch__", False):
                delattr(owner, name)  # the class's method again
        try:
            if exception:
                self._lifecycle.on_exception()
            else:
                self._lifecycle.detach()
        finally:
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


def _saved_state(state: Any) -> Optional[dict[str, Any]]:
    """The monitor state a resumed Trainer's checkpoint holds for this callback (None: none)."""
    saved = (getattr(state, "stateful_callbacks", None) or {}).get(GradWatchCallback.__name__)
    if isinstance(saved, list):
        saved = saved[0] if saved else None
    return ((saved or {}).get("attributes") or {}).get("restored_state") or None


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
