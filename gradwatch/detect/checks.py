"""The health checks of one monitor: every rule (one module each) over flushed windows and steps.

They run on the host only, at flush time and on each step's lagged read-back; the device keeps
nothing but counters. Each rule reports, per layer, what is *present* in a window (a finding) and
what is *clearly clear* (evidence for a recovery); values in between are undecided, so a value
hovering around a threshold stays one condition (``tracker.AlertTracker`` applies the hysteresis).
Decisions rest on histories kept across windows, so they do not depend on ``flush_every``.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..alerts import Finding
from ..config import HealthConfig
from ..flush.window import Window
from . import nonfinite
from .dead_units import DeadUnitsRule
from .exploding import ExplodingRule
from .root_causes import forward_order, root_causes
from .update_ratio import UpdateRatioRule
from .vanishing import VanishingRule

log = logging.getLogger("gradwatch")

# Optimizers that normalise their step (the update hardly depends on the gradient's scale).
_NORMALISING = ("adam", "rmsprop", "adagrad", "adadelta", "adafactor", "lamb", "lion", "sophia", "adan")


def normalises_step(optimizer: Any) -> bool:
    """Whether an optimizer normalises its step by the gradient's running magnitude (Adam family,
    RMSprop, Adagrad, Adadelta, Adafactor, LAMB, Lion, ...): judged by its class name."""
    name = type(getattr(optimizer, "optimizer", optimizer)).__name__.lower()  # accelerate wraps optimizers
    return any(key in name for key in _NORMALISING)


@dataclass
class Assessment:
    """One window's verdict: conditions present, and (kind, layer) pairs clearly healthy."""

    findings: list[Finding] = field(default_factory=list)
    clear: set[tuple[str, str]] = field(default_factory=set)


class HealthChecks:
    """Every rule of one monitor, with the state each keeps.

    Args:
        config: every threshold.
        layers: the layer names (columns of every window).
        normalised_steps: the optimizer normalises its step (only the absolute vanishing floor applies).
    """

    def __init__(self, config: HealthConfig, layers: list[str], normalised_steps: bool = False) -> None:
        self.config, self.layers = config, layers
        #: the model-level exploding check runs at every step (judge_step) instead of at the flush
        self.model_per_step = False
        self._model_exploded: Finding | None = None  # the per-step check's latest exploding finding since the flush
        #: per step since the flush: the model's jump (``RowVerdict.jumps``) and whether it exploded
        self._model_steps: dict[int, tuple[float, bool]] = {}
        self.exploding = ExplodingRule(config, len(layers) + 1)  # the last column: the model
        self.vanishing = VanishingRule(config, layers, normalised_steps)
        self.dead = DeadUnitsRule(config, layers)
        self.update_ratio = UpdateRatioRule(config, layers)
        self.scaler_skips = nonfinite.ScalerSkips(config.scaler_skips_max, layers)
        self.steps_seen = 0
        self.skipped_steps = 0

    @property
    def wants_every_step(self) -> bool:
        """Whether the next window should record every statistic at every step (dead units to confirm)."""
        return self.dead.wants_every_step

    def check(self, w: Window) -> Assessment:
        """What one window shows (onsets, reminders and recoveries are AlertTracker's)."""
        result = Assessment()
        self.update_ratio.judge(w, result.findings, result.clear)
        n = len(w.steps)
        if n == 0:  # only update-ratio measurements made after the previous window's last step
            return result
        skipped = w.skipped if w.skipped is not None else np.zeros(n, dtype=bool)
        nonfinite.judge_window(w, skipped, self.layers, result)
        valid = w.has_grad & ~skipped[:, None] & np.isfinite(w.grad_norm)
        with warnings.catch_warnings():  # all-NaN columns are layers without gradient
            warnings.simplefilter("ignore", RuntimeWarning)
            self._exploding(w, valid, result)
            vanishing = self.vanishing.judge(w, valid, result.clear)
        dead = self.dead.judge(w, result.clear)
        root_causes(result, vanishing, dead, forward_order(w), w, self.dead)
        if not self.model_per_step:  # persistent GradScaler skips, judged here when not at every step
            self._scaler_skips(w, skipped, result)
        skips = self.scaler_skips
        if skips.streak >= skips.limit and skips.first_origin is not None:  # still skipping: still present
            result.findings.append(Finding("nonfinite", skips.first_origin.layer, w.steps[-1], float(skips.streak),
                                           float(skips.limit), "the GradScaler is still skipping every step"))
            result.clear.discard(("nonfinite", ""))
        n_skipped = int(skipped.sum())
        if n_skipped:
            self.skipped_steps += n_skipped
            log.info(
                "[gradwatch] GradScaler skipped %d step(s) with Inf/NaN gradients in steps %d-%d "
                "(loss-scale calibration, not an alert)", n_skipped, w.steps[0], w.steps[-1],
            )  # fmt: skip
        self.steps_seen += n
        return result

    def judge_step(self, step: int, s: Any, order: list[int], scaler_in_use: bool) -> list[Finding]:
        """The per-step checks (``nonfinite``, model-level ``exploding``) on one step's summary
        (``flush.readback.StepSummary``), judged as soon as the step's values are on the host."""
        findings: list[Finding] = []
        skip = bool(s.any_bad and scaler_in_use and not s.fwd_bad.any())  # a GradScaler skip: its calibration
        if s.any_bad and not skip:
            findings.append(nonfinite.nonfinite_finding(self.layers, step, s.fwd_bad, s.grad_bad, order, s.count))
        if scaler_in_use and (skip or s.has_grad):
            persistent = self.scaler_skips.step(step, skip, s.grad_bad, order, s.count)
            if persistent is not None:
                findings.append(persistent)
        if s.has_grad:
            finding = self.judge_model_step(step, s.global_norm)
            if finding is not None:
                findings.append(finding)
        return findings

    def judge_model_step(self, step: int, global_norm: float) -> Finding | None:
        """The model-level ``exploding`` of one step with gradients (where judged at every step),
        from its global gradient norm: the finding, or None."""
        if not self.model_per_step:
            return None
        finding, jump = self.exploding.judge_step(step, global_norm, len(self.layers), "")
        self._model_steps[step] = (jump, finding is not None)  # for the layers' judgement at the flush
        if finding is not None:
            self._model_exploded = finding
        return finding

    def _scaler_skips(self, w: Window, skipped: np.ndarray, result: Assessment) -> None:
        if w.skipped is None:
            return
        grad_bad = nonfinite.bad_gradients(w)
        for t, step in enumerate(w.steps):
            order = w.step_orders[t][0] if t < len(w.step_orders) else []
            finding = self.scaler_skips.step(step, bool(skipped[t]), grad_bad[t], order, float(np.nansum(w.nonfinite[t])))
            if finding is not None:
                result.findings.append(finding)

    def _exploding(self, w: Window, valid: np.ndarray, result: Assessment) -> None:
        norms = np.where(valid & ~self.vanishing.quiet(w, valid), w.grad_norm, np.nan)
        glob_valid = valid.any(axis=1) & np.isfinite(w.global_grad_norm)
        glob = np.where(glob_valid, w.global_grad_norm, np.nan)
        table = np.concatenate([norms, glob[:, None]], axis=1)  # [steps, layers + 1]
        n = len(self.layers)
        columns = list(range(n)) if self.model_per_step else list(range(n + 1))
        names = self.layers + [""]
        findings, calm = self.exploding.judge_window(table, w.steps, columns, names,
                                                     stands=self._layer_explosions_standing(w.steps, columns))  # fmt: skip
        self._model_steps = {}
        result.clear.update(("exploding", names[c]) for c, ok in zip(columns, calm) if ok)
        if self.model_per_step:  # the model was judged at every step: its onset is already raised
            last = self._model_exploded
            if last is not None:  # the latest exploded step's own numbers
                findings.append(Finding("exploding", "", last.step, last.value, last.threshold, last.detail))
            elif np.isfinite(glob).any():
                result.clear.add(("exploding", ""))
            self._model_exploded = None
        # When the whole model explodes, one alert for the model, not one per layer.
        layer_hits = [f for f in findings if f.layer]
        model_hit = [f for f in findings if not f.layer]
        if model_hit and len(layer_hits) >= max(2, len(self.layers) // 2):
            model_hit[0].detail += f"; {len(layer_hits)} of {len(self.layers)} layers exceed their ceilings"
            findings = model_hit
        result.findings += findings

    def _layer_explosions_standing(self, steps: list[int], columns: list[int]) -> Any:
        """A layer's explosion stands when the model exploded at that step too, or when the layer jumped
        at least ``exploding_factor`` x more than the model did: a rare class lifts every layer and the
        model together (the model's own rule judges that; those layer values count as calm), a
        layer-local explosion stands out of it."""
        n, factor = len(self.layers), self.config.exploding_factor
        is_model = np.asarray(columns) == n
        model_in_row = bool(is_model.any())  # otherwise judged per step: its jumps are in _model_steps

        def stands(t: int, over: np.ndarray, jumps: np.ndarray) -> np.ndarray:
            if model_in_row:
                model_jump, model_over = float(jumps[is_model][0]), bool(over[is_model][0])
            else:
                model_jump, model_over = self._model_steps.get(steps[t], (float("nan"), False))
            if model_over or not np.isfinite(model_jump) or model_jump <= 0:
                return np.ones(len(columns), dtype=bool)
            with np.errstate(invalid="ignore"):
                return is_model | (jumps >= factor * model_jump) | ~np.isfinite(jumps)  # no recent level: stands

        return stands

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers), **self.exploding.state_dict(), **self.vanishing.state_dict(),
            **self.dead.state_dict(), **self.update_ratio.state_dict(), "steps_seen": self.steps_seen,
            "model_steps": int(self.exploding.judged[-1]), "skipped_steps": self.skipped_steps,
            **self.scaler_skips.state_dict(),
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["layers"]
        self.steps_seen = int(state["steps_seen"])
        model_steps = int(state.get("model_steps", self.steps_seen))
        warmup = np.array([self.steps_seen] * len(self.layers) + [model_steps], dtype=np.int64)
        self.exploding.load_state_dict(state, saved + [""], self.layers + [""], warmup)
        self.vanishing.load_state_dict(state, saved)
        self.dead.load_state_dict(state)
        self.update_ratio.load_state_dict(state)
        self.scaler_skips.load_state_dict(state)
        self.skipped_steps = int(state.get("skipped_steps", 0))
