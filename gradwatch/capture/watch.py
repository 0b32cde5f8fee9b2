"""The model and the run changing under the monitor: parameters replaced, moved or unfrozen, hooks that
never ran, an optimizer that stopped stepping, step numbers that do not grow, gradients still scaled."""

from __future__ import annotations

import logging
from typing import Any

from .. import _compat
from .freshness import BackwardWitness
from .layers import LayerSpec

log = logging.getLogger("gradwatch")


class ModelWatch:
    """Stops recording, once and loudly, when the model is no longer the one gradwatch attached to.

    Args:
        recorder: the recorder to switch off for good.
        frozen: (name, module) of the selected layers that were frozen at attach.
        layers: the monitored layers, whose witnesses tell a repeated ``step()`` (``freshness.py``).
    """

    def __init__(self, recorder: Any, frozen: list[tuple[str, Any]] | None = None,
                 layers: list[LayerSpec] | None = None) -> None:  # fmt: skip
        self.recorder = recorder
        self.backward = BackwardWitness(layers or [])
        #: (name, module) of the selected layers frozen at attach (see check_unfrozen)
        self.frozen = list(frozen or [])
        self.stopped = False  # the model moved or its parameters were replaced: resume() does not undo it
        self._warned: set[str] = set()  # the one-time messages already said
        self.optimizer_steps_seen = 0
        #: the code objects dynamo may compile for the model (``_compat.model_code``), set when the hooks go on
        self.model_code: list = []

    def stop_recording(self, reason: str) -> None:
        """Stop recording for good, and say why once, as an ERROR."""
        if not self.stopped:
            self.stopped = True
            log.error("gradwatch: %s", reason)
        self.recorder.active = False

    def check_parameters(self, layers: list[LayerSpec]) -> None:
        """Once per flush: the layers still own the parameters gradwatch reads. A model whose
        parameters were replaced after attaching (``load_state_dict(..., assign=True)``, a wrapper
        that swaps them) would otherwise look like a model without gradients."""
        if self.stopped:
            return
        for layer in layers:
            current = {id(p) for p in layer.module.parameters(recurse=False)}
            # FSDP1's use_orig_params=False: gradwatch's placeholders, never the module's own
            if any(id(p) not in current and not _compat.fsdp1.is_placeholder(p) for p in layer.params):
                self.stop_recording(
                    f"the parameters of layer {layer.name} were replaced after gradwatch attached "
                    "(load_state_dict(..., assign=True), a wrapper that swaps parameters, ...), so gradwatch no "
                    "longer sees the model's gradients: create the monitor after the model is materialised and "
                    "wrapped (or close() this monitor and create a new one). gradwatch stops recording"
                )
                return

    def check_unfrozen(self) -> None:
        """Once per flush: a layer frozen at attach that requires gradients now (gradual unfreezing,
        LoRA-style toggling) is not monitored; say so once, with the call that takes it in."""
        unfrozen = [name for name, module in self.frozen if any(p.requires_grad for p in module.parameters(recurse=False))]
        if not unfrozen:
            return
        self.frozen = [(name, module) for name, module in self.frozen if name not in unfrozen]
        log.warning(
            "gradwatch: layer(s) %s require gradients now but were frozen when gradwatch attached, so they are "
            "not monitored; to monitor them, close() this monitor and create a new one after unfreezing (the "
            "Lightning and Hugging Face callbacks attach anew at the next fit or train())",
            ", ".join(unfrozen[:8]) + (f", ... ({len(unfrozen) - 8} more)" if len(unfrozen) > 8 else ""),
        )

    def drop_references(self) -> None:
        self.frozen = []
        self.model_code = []
        self.backward.drop_references()

    def say_repeated_step(self) -> None:
        """A ``step()`` with no backward since the last recorded one (``backward.repeats_last_step()``,
        which ``step()`` asks directly: a call less at every step): not a new record, said once."""
        if self._once("repeat"):
            log.warning(
                "gradwatch: step() was called with no backward since the last step(), so there are no new "
                "gradients to record; this call records nothing (call monitor.step() once per optimizer step, "
                "after backward; not in evaluation loops)"
            )

    def check_hooks_ran(self, window: Any) -> None:
        """Warn once when the layers had gradients but gradwatch's forward hooks never ran: code
        compiled before the monitor attached that gradwatch could not find (a compiled function
        around the model), which runs without its hooks."""
        if "hooks" in self._warned or not self.recorder.active:
            return
        ran = any(order for order, _ in window.step_orders)
        if window.has_grad.any() and not ran and self._once("hooks"):
            log.warning(
                "gradwatch: the model's layers had gradients but gradwatch's forward hooks did not run in the "
                "steps %d-%d, so out_grad_norm, dead units and the forward non-finite check are missing. Code "
                "compiled before the monitor attached runs without its hooks: create the monitor before "
                "compiling (or before the first compiled call), or call torch.compiler.reset() after creating it",
                window.steps[0], window.steps[-1],
            )  # fmt: skip

    def check_recompile_limit(self) -> None:
        """Once per flush until said: a function of the model that dynamo stopped compiling (its
        recompile limit reached) runs eagerly for every call that matches none of its compiled
        variants; said once, as a WARNING, with the function and what usually causes it."""
        if "recompile_limit" in self._warned or not self.model_code:
            return
        full = _compat.at_recompile_limit(self.model_code)
        if full and self._once("recompile_limit"):
            name, count, limit = full[0]
            log.warning(
                "gradwatch: torch.compile reached its recompile limit for %s (%d compiled variants, "
                "torch._dynamo.config.recompile_limit = %d): calls that match none of them now run eagerly, "
                "slower than compiled (gradwatch still records them, with the same values). gradwatch adds no "
                "variant of its own (whether a step is sampled is data the compiled graph reads); see what "
                "does with TORCH_LOGS=recompiles. Batch or sequence sizes that change: torch.compile(..., "
                "dynamic=True) or torch._dynamo.mark_dynamic(tensor, dim)",
                name, count, limit,
            )  # fmt: skip

    def check_grads_left_out(self) -> None:
        """Warn once when compiled code with the model's KV cache on met a layer output that the
        gradient tap cannot be handed through (``capture/grad_passthrough.py``: only a tensor, or a
        plain tuple that starts with one): that layer's output-gradient statistics are not recorded."""
        if "cache" in self._warned:
            return
        names = [tap.name for tap in self.recorder.cells.taps if tap.grad_left_out]
        if names and self._once("cache"):
            log.warning(
                "gradwatch: compiled with the model's KV cache on (config.use_cache=True), %d layer(s) return an "
                "output that is neither a tensor nor a tuple starting with one (%s): their out_grad_norm and dead "
                "units are not recorded in compiled steps (a tensor hook there trips a dynamo bug that drops the "
                "whole-model graph). A training step does not use the cache: model.config.use_cache = False "
                "records them.", len(names), ", ".join(names[:5]) + (", ..." if len(names) > 5 else ""),
            )  # fmt: skip

    def check_gradients_arrived(self, window: Any) -> None:
        """Warn once when backward reached the layers (their output gradients were seen) but no
        parameter had a ``.grad`` at any ``step()`` of the window: something takes the gradients
        before ``step()`` (DeepSpeed ZeRO keeps them in its own buffers; an optimizer-in-backward
        hook clears them), so every parameter-gradient statistic would be silently missing."""
        if "gradients" in self._warned or not self.recorder.active:
            return
        if window.out_seen.any() and not window.has_grad.any() and self._once("gradients"):
            log.warning(
                "gradwatch: backward reached the model's layers in steps %d-%d (their output gradients were seen) "
                "but no parameter had a .grad at step(), so grad_norm, grad_max, nonfinite, vanishing and exploding "
                "have nothing to judge. Something takes the gradients before step(): a hook that steps the "
                "optimizer inside backward and clears p.grad, zero_grad() called before step(), or DeepSpeed ZeRO "
                "stepping its engine before step() (ZeRO 1/2 gradients exist between engine.backward() and "
                "engine.step()). Call step() where this step's gradients are still held (after backward, before "
                "zero_grad or engine.step).",
                window.steps[0], window.steps[-1],
            )  # fmt: skip

    def _once(self, key: str) -> bool:
        if key in self._warned:
            return False
        self._warned.add(key)
        return True

    def check_step_number(self, step: int, next_step: int) -> None:
        """A repeated or decreasing step number merges records: said once."""
        if step < next_step and self._once("order"):
            log.warning(
                "gradwatch: step(%d) after step(%d): step numbers must grow (records at one step merge in "
                "TensorBoard and trackers); pass the optimizer step, e.g. trainer.global_step", step, next_step - 1,
            )  # fmt: skip

    def still_scaled(self, scaler: Any, optimizer: Any) -> bool:
        """step() before ``scaler.unscale_``: the gradients still carry the loss scale. Read from the
        scaler's state (no sync); they are then recorded unscaled, and that is said once."""
        from .. import _compat

        if not scaler.is_enabled() or _compat.scaler_unscaled(scaler, optimizer) is not False:
            return False
        if self._once("scaled"):
            log.info(
                "gradwatch: step() was called before scaler.unscale_(optimizer), so the gradients still carry "
                "the loss scale; gradwatch divides them by it. Call monitor.step() after scaler.unscale_ to "
                "see the gradients exactly as the optimizer will"
            )
        return True

    def check_optimizer_steps(self, updates: Any, steps: list[int], flush_every: int, skipping: bool) -> None:
        """Once per full window: the optimizer gradwatch holds made steps in it (else it was likely
        replaced: said once, with the call that hands the new one over)."""
        if updates is None or len(steps) < flush_every or "optimizer" in self._warned:
            return
        if updates.optimizer_steps == self.optimizer_steps_seen and not skipping and self._once("optimizer"):
            log.warning(
                "gradwatch: the optimizer given to gradwatch made no step in steps %d-%d, so update_ratio is not "
                "measured; if you replaced it, hand the new one over with monitor.set_optimizer(new_optimizer)",
                steps[0], steps[-1],
            )  # fmt: skip
        self.optimizer_steps_seen = updates.optimizer_steps
