"""Health checks over flushed windows, vectorised over layers with numpy.

They run on the host at flush time only; the device keeps nothing but counters.
Each check reports, per layer, what is *present* in a window (a finding) and
what is *clearly clear* (evidence for a recovery); values in between are
undecided, so a value hovering around a threshold stays one condition
(``alerts.AlertTracker`` applies the hysteresis). Decisions rest on histories
kept across windows, so they do not depend on ``flush_every``.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..alerts import Finding
from ..config import HealthConfig
from ..flush.window import Window

log = logging.getLogger("gradwatch")

# The exploding test compares a step with the recent level of its column: the larger of the
# largest of the last _RECENT_STEPS calm steps (smooth growth raises its own bar) and the median
# of the last _LEVEL_STEPS calm steps (the level a run settled at).
_RECENT_STEPS = 10
_LEVEL_STEPS = 50
# Vanishing is judged on the median of a layer's last steps (at least _VANISHING_MIN of them).
_VANISHING_STEPS = 20
_VANISHING_MIN = 5
# Hysteresis: a condition is clear when the value is this far on the healthy side of its threshold.
_VANISHING_CLEAR = 10.0  # one decade above the vanishing thresholds
_DEAD_CLEAR = 0.8  # dead_fraction at most 0.8 x its threshold
_DEAD_MIN_STEPS = 2  # dead units are judged on evidence from at least this many distinct steps
_UPDATE_CLEAR = 0.5  # update ratio at most half its limit
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
    """Vanishing, exploding, dead-unit, non-finite and update-ratio checks with their histories."""

    def __init__(self, config: HealthConfig, layers: list[str], normalised_steps: bool = False) -> None:
        self.config = config
        self.layers = layers
        n = len(layers)
        #: The model-level exploding check runs at every step (judge_step) instead of at the flush.
        self.model_per_step = False
        self.model_steps = 0  # steps the per-step model check has seen (its warm-up)
        self._model_exploded = False  # the per-step check found the model exploding since the last flush
        #: True when the optimizer normalises its step: then only the absolute vanishing floor applies.
        self.normalised_steps = normalised_steps
        # The last _LEVEL_STEPS and the last _RECENT_STEPS calm values per column, per layer and
        # (last column) for the global norm: rings, NaN where there is none yet.
        self.level = np.full((_LEVEL_STEPS, n + 1), np.nan)
        self.level_slot = np.zeros(n + 1, dtype=np.int64)
        self.recent = np.full((_RECENT_STEPS, n + 1), np.nan)
        self.recent_slot = np.zeros(n + 1, dtype=np.int64)
        self.last_calm = np.full(n + 1, np.nan)  # the latest calm value per column (step-to-step jumps)
        # The last _VANISHING_STEPS gradient RMS values and ratios to the strongest layer, per layer.
        self.rms_history = np.full((_VANISHING_STEPS, n), np.nan)
        self.ratio_history = np.full((_VANISHING_STEPS, n), np.nan)
        self.history_slot = 0
        #: Per layer: the highest median gradient RMS it has had (a collapse is judged against it).
        self.rms_peak = np.full(n, np.nan)
        # Dead-unit evidence carried across windows until a layer has seen dead_min_samples rows
        # from at least _DEAD_MIN_STEPS distinct steps.
        self.alive: list[np.ndarray | None] = [None] * n
        self.rows = np.zeros(n, dtype=np.int64)
        self.dead_steps = np.zeros(n, dtype=np.int64)
        #: Layers whose sampled steps said dead: judged again on every step of the next window(s).
        self.confirming = np.zeros(n, dtype=bool)
        self.steps_seen = 0
        self.skipped_steps = 0
        # Per layer: consecutive measured optimizer steps with a judged update ratio above the limit,
        # and consecutive steps whose estimated ratio (a sample of each matrix) was.
        self.update_streak = np.zeros(n, dtype=np.int64)
        self.estimate_streak = np.zeros(n, dtype=np.int64)

    # ------------------------------------------------------------------ API
    def check(self, w: Window) -> Assessment:
        """What one window shows (onsets, reminders and recoveries are AlertTracker's)."""
        result = Assessment()
        self._update_ratio(w, result)
        n = len(w.steps)
        if n == 0:  # only update-ratio measurements made after the previous window's last step
            return result
        skipped = w.skipped if w.skipped is not None else np.zeros(n, dtype=bool)
        self._nonfinite(w, skipped, result)
        valid = w.has_grad & ~skipped[:, None] & np.isfinite(w.grad_norm)
        with warnings.catch_warnings():  # all-NaN columns are layers without gradient
            warnings.simplefilter("ignore", RuntimeWarning)
            self._exploding(w, valid, result)
            vanishing = self._vanishing(w, valid, result)
        dead = self._dead(w, result)
        self._root_causes(result, vanishing, dead, _forward_order(w), w)
        n_skipped = int(skipped.sum())
        if n_skipped:
            self.skipped_steps += n_skipped
            log.info(
                "[gradwatch] GradScaler skipped %d step(s) with Inf/NaN gradients in steps %d-%d "
                "(loss-scale calibration, not an alert)",
                n_skipped,
                w.steps[0],
                w.steps[-1],
            )
        self.steps_seen += n
        return result

    def judge_step(self, step: int, s: Any, order: list[int], scaler_in_use: bool) -> list[Finding]:
        """The per-step checks (``nonfinite``, model-level ``exploding``) on one step's summary
        (``readback.StepSummary``), judged as soon as the step's values are on the host."""
        findings: list[Finding] = []
        if s.any_bad:
            if not (scaler_in_use and not s.fwd_bad.any()):  # else a GradScaler skip, said at the flush
                findings.append(_nonfinite_finding(self.layers, step, s.fwd_bad, s.grad_bad, order, s.count))
        if self.model_per_step and s.has_grad:
            finding = self._model_exploding(step, s.global_norm)
            self.model_steps += 1
            if finding is not None:
                self._model_exploded = True
                findings.append(finding)
        return findings

    def _model_exploding(self, step: int, value: float) -> Finding | None:
        """The exploding rule (as in :meth:`_causal_ceilings`) for the model's column at one step,
        in scalars: it runs at every step."""
        cfg = self.config
        col = len(self.layers)
        if not math.isfinite(value):
            return None  # a non-finite norm is the nonfinite check's
        threshold, why = None, ""
        previous = float(self.last_calm[col])
        if value > cfg.exploding_abs_norm:
            threshold, why = cfg.exploding_abs_norm, "above the absolute ceiling"
        elif previous > 0 and value >= cfg.exploding_jump * previous:
            threshold = cfg.exploding_jump * previous
            why = f"{value / previous:.3g}x its previous step's norm"
        elif self.model_steps >= cfg.exploding_warmup_steps:
            top = max((v for v in self.recent[:, col].tolist() if v == v), default=0.0)
            # The level is max(top, median of the settled ring) >= top: a value within the factor
            # of top is calm whatever the median, so the median (a sort) is worked out only above.
            if not (top > 0 and value <= cfg.exploding_factor * top):
                settled = sorted(v for v in self.level[:, col].tolist() if v == v)
                k = len(settled)
                median = (settled[(k - 1) // 2] + settled[k // 2]) / 2 if k else 0.0
                base = max(top, median)
                if base > 0 and value > cfg.exploding_factor * base:
                    threshold = cfg.exploding_factor * base
                    why = f"{value / base:.3g}x its recent level {base:.4g}"
        if threshold is not None:
            return Finding("exploding", "", step, value, threshold, why)
        # calm: into the rings
        self.recent[self.recent_slot[col], col] = value
        self.recent_slot[col] = (self.recent_slot[col] + 1) % _RECENT_STEPS
        self.level[self.level_slot[col], col] = value
        self.level_slot[col] = (self.level_slot[col] + 1) % _LEVEL_STEPS
        self.last_calm[col] = value
        return None

    # --------------------------------------------------------------- checks
    def _nonfinite(self, w: Window, skipped: np.ndarray, result: Assessment) -> None:
        out_bad = w.out_seen & ~np.isfinite(w.out_grad_norm)
        # A non-finite sum of squares is a non-finite gradient (finite ones are summed exactly,
        # whatever their size), also on steps where the elements were not counted.
        grad_bad = (w.nonfinite > 0) | out_bad | (w.has_grad & ~np.isfinite(w.grad_norm))
        fwd_bad = w.fwd_nonfinite
        for t in range(len(w.steps)):
            if not (fwd_bad[t].any() or grad_bad[t].any()):
                continue
            if skipped[t] and not fwd_bad[t].any():
                continue  # a GradScaler skip, reported as such
            fwd_order = w.step_orders[t][0] if t < len(w.step_orders) else []
            counted = w.nonfinite_counted is None or bool(w.nonfinite_counted[t])
            count = float(np.nansum(w.nonfinite[t])) if counted else 0.0
            result.findings.append(_nonfinite_finding(w.layers, w.steps[t], fwd_bad[t], grad_bad[t], fwd_order, count))
            return
        result.clear.update(("nonfinite", name) for name in self.layers + [""])

    def _exploding(self, w: Window, valid: np.ndarray, result: Assessment) -> None:
        norms = np.where(valid, w.grad_norm, np.nan)
        glob_valid = valid.any(axis=1) & np.isfinite(w.global_grad_norm)
        glob = np.where(glob_valid, w.global_grad_norm, np.nan)
        table = np.concatenate([norms, glob[:, None]], axis=1)  # [steps, layers + 1]
        n = len(self.layers)
        columns = list(range(n)) if self.model_per_step else list(range(n + 1))
        findings = self._explosions(table, w.steps, self.steps_seen, columns, result)
        if self.model_per_step:  # the model was judged at every step: its onset is already raised
            if self._model_exploded:
                findings.append(Finding("exploding", "", w.steps[-1], float("nan"), 0.0, "judged at its step"))
            elif np.isfinite(glob).any():
                result.clear.add(("exploding", ""))
            self._model_exploded = False

        # When the whole model explodes, one alert for the model, not one per layer.
        layer_hits = [f for f in findings if f.layer]
        model_hit = [f for f in findings if not f.layer]
        if model_hit and len(layer_hits) >= max(2, len(self.layers) // 2):
            model_hit[0].detail += f"; {len(layer_hits)} of {len(self.layers)} layers exceed their ceilings"
            findings = model_hit
        result.findings += findings

    def _explosions(self, table: np.ndarray, steps: list[int], steps_seen: int, columns: list[int],
                    result: Assessment | None = None) -> list[Finding]:  # fmt: skip
        """Exploding findings of ``table``'s ``columns`` (the first exploded step of each), the
        rings of those columns moved on; ``result`` gets the clearly calm ones."""
        cfg = self.config
        names = self.layers + [""]
        sub = table[:, columns]
        ceiling, jump_ceiling = self._causal_ceilings(sub, steps_seen, columns)
        over_rel, over_abs = self._exceeds(sub, ceiling)
        with np.errstate(invalid="ignore"):
            over_jump = sub >= jump_ceiling
        over = over_rel | over_abs | over_jump
        findings = []
        for k in np.flatnonzero(over.any(axis=0)):
            t = int(np.argmax(over[:, k]))
            value = float(sub[t, k])
            if over_abs[t, k]:
                threshold, why = cfg.exploding_abs_norm, "above the absolute ceiling"
            elif over_jump[t, k]:
                threshold = float(jump_ceiling[t, k])
                why = f"{value / (threshold / cfg.exploding_jump):.3g}x its previous step's norm"
            else:
                threshold = float(ceiling[t, k])
                base = threshold / cfg.exploding_factor
                why = f"{value / base:.3g}x its recent level {base:.4g}"
            findings.append(Finding("exploding", names[columns[k]], steps[t], value, threshold, why))
        if result is not None:
            calm = ~over.any(axis=0) & np.isfinite(sub).any(axis=0)
            result.clear.update(("exploding", names[columns[k]]) for k in np.flatnonzero(calm))
        return findings

    def _vanishing(self, w: Window, valid: np.ndarray, result: Assessment) -> list[Finding]:
        """Vanishing on a layer's last steps (a rolling median, whatever flush_every is).

        With an optimizer that normalises its step (Adam and friends), a small gradient
        still moves the weights: of the comparisons with other layers only the absolute floor
        applies. Otherwise a layer five decades below the strongest layer no longer learns either.
        With any optimizer, a layer whose gradient collapsed five decades below its own highest
        level has lost its training signal (a saturated gate, a cut path): even Adam's step then
        shrinks, once the gradient falls under its eps.
        """
        cfg = self.config
        rms = np.where(valid, w.grad_rms, np.nan)
        with np.errstate(all="ignore"):
            strongest = np.nanmax(rms, axis=1, initial=-np.inf, where=~np.isnan(rms))
            strongest = np.where(np.isfinite(strongest) & (strongest > 0), strongest, np.nan)
            ratio = rms / strongest[:, None]
        for t in range(len(w.steps)):
            if not valid[t].any():
                continue
            slot = self.history_slot % _VANISHING_STEPS
            self.rms_history[slot] = rms[t]
            self.ratio_history[slot] = ratio[t]
            self.history_slot += 1
        with np.errstate(all="ignore"):
            known = np.sum(~np.isnan(self.rms_history), axis=0) >= _VANISHING_MIN
            med_rms = np.where(known, np.nanmedian(self.rms_history, axis=0), np.nan)
            med_ratio = np.where(known, np.nanmedian(self.ratio_history, axis=0), np.nan)
            below_abs = med_rms < cfg.vanishing_abs_rms
            clear_abs = med_rms >= _VANISHING_CLEAR * cfg.vanishing_abs_rms
            peak = self.rms_peak
            collapsed = np.isfinite(peak) & (peak > 0) & (med_rms < cfg.vanishing_rel_rms * peak)
            clear_own = ~(med_rms < _VANISHING_CLEAR * cfg.vanishing_rel_rms * peak)
            self.rms_peak = np.where(np.isfinite(med_rms), np.fmax(peak, med_rms), peak)
            if self.normalised_steps:
                below_rel = np.zeros_like(below_abs)
                clear_rel = np.ones_like(clear_abs)
            else:
                below_rel = np.isfinite(med_ratio) & (med_ratio < cfg.vanishing_rel_rms)
                clear_rel = med_ratio >= _VANISHING_CLEAR * cfg.vanishing_rel_rms
        # Only layers with a gradient in this window are judged (frozen or unused ones never vanish).
        seen = valid.any(axis=0)
        findings = []
        for i in np.flatnonzero((below_abs | below_rel | collapsed) & seen):
            if med_rms[i] <= 0 or not np.isfinite(med_ratio[i]):
                detail = "its gradient is zero"
            elif below_abs[i] or below_rel[i]:
                detail = f"median gradient RMS {med_rms[i]:.3g} over its last steps is {med_ratio[i]:.3g} of the strongest layer's"
            else:
                detail = f"median gradient RMS {med_rms[i]:.3g} over its last steps is {med_rms[i] / peak[i]:.3g} of its own earlier level {peak[i]:.3g}"
            if self.normalised_steps and below_abs[i]:
                detail += "; below what the optimizer's normalised step can use"
            threshold = cfg.vanishing_abs_rms if below_abs[i] or (self.normalised_steps and not collapsed[i]) else cfg.vanishing_rel_rms
            findings.append(Finding("vanishing", self.layers[i], w.steps[-1], float(med_rms[i]), threshold, detail))
        result.clear.update(("vanishing", self.layers[i]) for i in np.flatnonzero(clear_abs & clear_rel & clear_own & seen))
        return findings

    @property
    def wants_every_step(self) -> bool:
        """Whether the next window should record every statistic at every step (dead units to confirm)."""
        return bool(self.confirming.any())

    def _dead(self, w: Window, result: Assessment) -> list[Finding]:
        """Dead units judged on at least dead_min_samples output-gradient rows, carried across windows.

        A unit silent on a few sampled steps may fire on a few percent of the rows in between: a
        layer of such units looks half dead on the default's two sampled steps of a window and is
        10-20% dead over all of its steps. So a layer found dead on sampled steps only is judged
        again on every step of the next window(s) (``wants_every_step``), on fresh evidence of at
        least dead_min_samples rows, and only that judgement raises the alert.
        """
        cfg = self.config
        findings = []
        if w.unit_alive is None or w.rows_seen is None:
            return findings
        every_step = w.sampled is None or bool(np.all(w.sampled))
        for i, alive in enumerate(w.unit_alive):
            if alive is None or w.rows_seen[i] == 0 or w.unit_counts[i] < cfg.dead_min_units:
                continue
            self.alive[i] = alive.copy() if self.alive[i] is None else (self.alive[i] | alive)
            self.rows[i] += int(w.rows_seen[i])
            self.dead_steps[i] += int(w.steps_judged[i]) if w.steps_judged is not None else 1
            if self.rows[i] < cfg.dead_min_samples or self.dead_steps[i] < _DEAD_MIN_STEPS:
                # Too little evidence yet: one sample silences about half of a healthy ReLU layer,
                # and one step can be a transient (a gate or ReZero factor still at zero).
                continue
            fraction = 1.0 - float(np.mean(self.alive[i]))
            rows, steps = int(self.rows[i]), int(self.dead_steps[i])
            self.alive[i], self.rows[i], self.dead_steps[i] = None, 0, 0
            name = self.layers[i]
            units = int(w.unit_counts[i])
            confirmed = every_step or self.confirming[i]
            self.confirming[i] = fraction >= cfg.dead_fraction and not confirmed
            if self.confirming[i]:
                continue
            if fraction >= cfg.dead_fraction:
                findings.append(
                    Finding(
                        "dead_units", name, w.steps[-1], fraction, cfg.dead_fraction,
                        f"{fraction:.0%} of its units had zero output gradient for every one of the "
                        f"{rows} samples of {steps} steps seen up to step {w.steps[-1]}",
                    )  # fmt: skip
                )
            elif fraction <= min(_DEAD_CLEAR * cfg.dead_fraction, cfg.dead_fraction - 1.5 / units):
                # clearly below: the band is at least one and a half units wide on small layers
                result.clear.add(("dead_units", name))
        return findings

    def _root_causes(
        self, result: Assessment, vanishing: list[Finding], dead: list[Finding], order: list[str], w: Window
    ) -> None:
        """Report root causes, not their symptoms, then add the kept findings.

        - A layer with dead units has a zero gradient because of them: dead_units, not vanishing.
        - Layers before a completely dead layer get no gradient through it: their vanishing is
          explained by it (named in its alert), not reported separately.
        - The layer after a completely dead one gets an all-zero input: with no bias (a conv
          after a dead BatchNorm) its parameter gradient is exactly zero although gradient
          reaches its output. That is the dead layer's doing, named in its alert, not vanishing.
        - A zero-gradient layer in a vanishing run (its next layer vanishing too, gradient
          starving from the top) is a deep stack underflowing, not dead units (a dead ReLU
          layer sits below a healthy one).
        - A layer whose gradient is zero while its own or the next layer's dead-unit evidence,
          still too little to judge, says every unit is dead so far waits for that judgement:
          the dead layer is named first, and this one with it.
        """
        # Neighbours in the order the layers ran (module order is not data flow: a ModuleList of
        # branches lists every branch's first layer before their second ones).
        position = {name: i for i, name in enumerate(order)}
        vanished = {f.layer: f for f in vanishing}
        index = {name: i for i, name in enumerate(self.layers)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            fed = np.nanmedian(np.where(w.out_seen, w.out_grad_norm, np.nan), axis=0) > 0

        def starved(name: str | None) -> bool:
            """Vanished to exactly zero although gradient reaches its output: its input is zero."""
            return name in vanished and vanished[name].value == 0 and bool(fed[index[name]])

        dead = [f for f in dead if not (f.layer in vanished and _successor(order, f.layer) in vanished
                                        and not starved(_successor(order, f.layer)))]  # fmt: skip
        explained: set[str] = set()
        for f in vanishing:  # wait for its own or a dead neighbour's judgement (see above)
            for name in (f.layer, _successor(order, f.layer)):
                pending = self.alive[index[name]] if name is not None else None
                confirming = name is not None and self.confirming[index[name]]
                if f.value == 0 and (confirming or (pending is not None and not pending.any())):
                    explained.add(f.layer)
            before = _predecessor(order, f.layer)  # a layer being confirmed dead that feeds it zeros
            if f.value == 0 and before is not None and self.confirming[index[before]] and starved(f.layer):
                explained.add(f.layer)
        by_position = {position[f.layer]: f for f in dead}
        # A completely dead layer passes no gradient back: a completely dead layer right before it
        # has an all-zero output gradient because of it, whatever its own units do. The last of
        # such a run is the root (from the last layer back, so a run of any length has one root).
        roots: dict[int, Finding] = {}
        behind: dict[str, list[str]] = {}
        for i in sorted(by_position, reverse=True):
            f = by_position[i]
            if f.value < 0.999:
                continue
            root = roots.get(i + 1)
            if root is None:
                roots[i] = f
                continue
            roots[i] = root
            behind.setdefault(root.layer, []).append(f.layer)
            explained.add(f.layer)
            by_position.pop(i)
        for layer, names in behind.items():
            root = next(f for f in by_position.values() if f.layer == layer)
            root.detail += (
                f"; it passes no gradient back, so the all-zero output gradient of {_describe(list(reversed(names)))} "
                f"before it follows from it"
            )
        for i in sorted(by_position):
            root, successor = by_position.get(i), by_position.get(i + 1)
            if root is not None and root.value >= 0.999 and successor is not None:
                # The layer right after a completely dead one sees its constant output: dead units
                # there are a consequence, named in its alert, not a separate condition. (Only
                # the next layer: module order is not data flow across parallel branches.)
                root.detail += f"; the dead units of layer {successor.layer} after it follow from it"
                by_position.pop(i + 1)
        dead = [by_position[i] for i in sorted(by_position)]
        for f in dead:
            explained.add(f.layer)
            if f.value < 0.999:
                continue
            successor = _successor(order, f.layer)
            if starved(successor):
                explained.add(successor)  # type: ignore[arg-type]
                f.detail += f"; its all-zero output leaves layer {successor} without a parameter gradient"
            upstream = []
            for i in range(position[f.layer] - 1, -1, -1):  # the contiguous vanishing run before it
                if order[i] not in vanished:
                    break
                upstream.append(order[i])
            if upstream:
                explained.update(upstream)
                f.detail += (
                    f"; it passes no gradient back, which explains the vanishing gradient of "
                    f"{_describe(list(reversed(upstream)))} before it"
                )
        result.findings += [f for f in vanishing if f.layer not in explained] + dead
        for name in explained & set(vanished):
            result.clear.discard(("vanishing", name))

    def _update_ratio(self, w: Window, result: Assessment) -> None:
        """Layers whose weight matrices changed by more than update_ratio_max of their norm at
        update_ratio_steps consecutive optimizer steps (streaks carry across windows): measured
        exactly at each layer's two measured steps per window, and estimated at every step from a
        fixed sample of each matrix, so that a learning rate far too high for a few steps is seen
        wherever those steps fall in the window."""
        cfg = self.config
        flagged: set[int] = set()
        calm = np.ones(len(self.layers), dtype=bool)
        measured_any = np.zeros(len(self.layers), dtype=bool)
        sources = []
        if w.judged_update_ratio is not None:
            exact = list(zip(w.update_steps, w.judged_update_ratio, w.judged_weight_rms))  # type: ignore[arg-type]
            sources.append(("update_streak", exact, "measured steps"))
        if w.estimated_update_ratio is not None:
            estimated = list(zip(w.steps, w.estimated_update_ratio, w.estimated_weight_rms))  # type: ignore[arg-type]
            sources.append(("estimate_streak", estimated, "steps in a row (estimated from a sample of each matrix)"))
        for attribute, rows, what in sources:
            streak = getattr(self, attribute)
            for step, ratio, rms in rows:
                with np.errstate(invalid="ignore"):
                    measured = np.isfinite(ratio) & (rms >= cfg.update_ratio_min_weight_rms)
                    above = measured & (ratio > cfg.update_ratio_max)
                    calm &= ~measured | (ratio <= _UPDATE_CLEAR * cfg.update_ratio_max)
                measured_any |= measured
                # A measured step below the limit ends a streak; unmeasured layers keep theirs.
                streak = np.where(above, streak + 1, np.where(measured, 0, streak))
                for i in np.flatnonzero(streak >= cfg.update_ratio_steps):
                    if i in flagged:
                        continue
                    flagged.add(int(i))
                    result.findings.append(
                        Finding(
                            "update_ratio", self.layers[i], int(step), float(ratio[i]), cfg.update_ratio_max,
                            f"its weights changed by {ratio[i]:.3g} of their norm in one optimizer step, above "
                            f"{cfg.update_ratio_max:g} at {int(streak[i])} {what}: the learning rate is far "
                            "too high for this layer",
                        )  # fmt: skip
                    )
            setattr(self, attribute, streak)
        result.clear.update(("update_ratio", self.layers[i]) for i in np.flatnonzero(calm & measured_any))

    # ------------------------------------------------------------ baselines
    def _causal_ceilings(self, table: np.ndarray, steps_seen: int, columns: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Per step and column: the relative ceiling and the jump ceiling.

        Relative (after the warm-up): factor x the column's recent level, the larger of the
        largest of its last ``_RECENT_STEPS`` calm (not exploded, finite) values and the median
        of its last ``_LEVEL_STEPS``, carried across windows. Causal: a step is compared only
        with earlier steps. Gradients that grow smoothly (Adam's first hundred steps, a
        learning-rate warm-up) raise their own bar as they go, while a jump of ``factor`` x
        within a few steps does not; gradients that start high and settle lower the bar as they
        settle (within ``_LEVEL_STEPS``), so a later spike is judged against where the run is,
        not where it started. Exploded steps never enter the rings, so an explosion that persists
        stays flagged.

        Jump (at any step, warm-up included): ``exploding_jump`` x the previous calm step.
        """
        cfg = self.config
        n, m = table.shape
        ceilings = np.full((n, m), np.inf)
        jumps = np.full((n, m), np.inf)
        cols = np.asarray(columns)
        # The rings of these columns, moved on in place at the end.
        recent, slot = self.recent[:, cols], self.recent_slot[cols]
        level, level_slot = self.level[:, cols], self.level_slot[cols]
        last_calm = self.last_calm[cols]
        columns_ = np.arange(m)
        for t in range(n):
            if steps_seen + t >= cfg.exploding_warmup_steps:
                settled = _nan_median_columns(level)
                reference = np.fmax(settled, np.fmax.reduce(recent, axis=0))  # fmax skips NaN
                known = reference > 0
                ceilings[t, known] = cfg.exploding_factor * reference[known]
            has_previous = np.isfinite(last_calm) & (last_calm > 0)
            jumps[t, has_previous] = cfg.exploding_jump * last_calm[has_previous]
            row = table[t]
            over_rel, over_abs = self._exceeds(row, ceilings[t])
            with np.errstate(invalid="ignore"):
                over_jump = row >= jumps[t]
            calm = np.isfinite(row) & ~over_rel & ~over_abs & ~over_jump
            recent[slot[calm], columns_[calm]] = row[calm]
            slot[calm] = (slot[calm] + 1) % _RECENT_STEPS
            level[level_slot[calm], columns_[calm]] = row[calm]
            level_slot[calm] = (level_slot[calm] + 1) % _LEVEL_STEPS
            last_calm[calm] = row[calm]
        self.recent[:, cols], self.recent_slot[cols] = recent, slot
        self.level[:, cols], self.level_slot[cols] = level, level_slot
        self.last_calm[cols] = last_calm
        return ceilings, jumps

    def _exceeds(self, values: np.ndarray, ceiling: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(above the relative ceiling, above the absolute one): the one definition of "exploded"."""
        with np.errstate(invalid="ignore"):  # NaN (no gradient) is neither
            return values > ceiling, values > self.config.exploding_abs_norm

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        def column_lists(array: np.ndarray) -> list:
            return [_nullable(column) for column in array.T]

        return {
            "layers": list(self.layers),
            "level": column_lists(self.level),
            "level_slot": [int(i) for i in self.level_slot],
            "recent": column_lists(self.recent),
            "recent_slot": [int(i) for i in self.recent_slot],
            "last_calm": _nullable(self.last_calm),
            "rms_history": column_lists(self.rms_history),
            "ratio_history": column_lists(self.ratio_history),
            "history_slot": int(self.history_slot),
            "rms_peak": _nullable(self.rms_peak),
            "confirming": [name for name, c in zip(self.layers, self.confirming) if c],
            "steps_seen": self.steps_seen,
            "model_steps": self.model_steps,
            "skipped_steps": self.skipped_steps,
            "update_streak": dict(zip(self.layers, (int(s) for s in self.update_streak))),
            "estimate_streak": dict(zip(self.layers, (int(s) for s in self.estimate_streak))),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names, columns = state["layers"] + [""], self.layers + [""]  # per layer, then the global norm
        self.level = _columns(state.get("level", []), names, columns, _LEVEL_STEPS)
        level_slots = dict(zip(names, state.get("level_slot", [])))
        self.level_slot = np.array([int(level_slots.get(n, 0)) % _LEVEL_STEPS for n in columns], dtype=np.int64)
        self.last_calm = _by_name(state.get("last_calm", []), names, columns)
        self.recent = _columns(state.get("recent", []), names, columns, _RECENT_STEPS)
        slots = dict(zip(names, state.get("recent_slot", [])))
        self.recent_slot = np.array([int(slots.get(n, 0)) % _RECENT_STEPS for n in columns], dtype=np.int64)
        self.rms_history = _columns(state.get("rms_history", []), state["layers"], self.layers, _VANISHING_STEPS)
        self.ratio_history = _columns(state.get("ratio_history", []), state["layers"], self.layers, _VANISHING_STEPS)
        self.history_slot = int(state.get("history_slot", 0))
        self.rms_peak = _by_name(state.get("rms_peak", []), state["layers"], self.layers)
        confirming = set(state.get("confirming", []))
        self.confirming = np.array([n in confirming for n in self.layers], dtype=bool)
        self.steps_seen = int(state["steps_seen"])
        self.model_steps = int(state.get("model_steps", self.steps_seen))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        streaks = state.get("update_streak", {})
        self.update_streak = np.array([int(streaks.get(n, 0)) for n in self.layers], dtype=np.int64)
        streaks = state.get("estimate_streak", {})
        self.estimate_streak = np.array([int(streaks.get(n, 0)) for n in self.layers], dtype=np.int64)


def _nan_median_columns(values: np.ndarray) -> np.ndarray:
    """Per column, the median of its non-NaN values (NaN for none): ``np.nanmedian`` without its
    masked-array path, which costs ~0.3 ms on a small ring (this runs at every step)."""
    ordered = np.sort(values, axis=0)  # NaN sorts last
    count = values.shape[0] - np.isnan(values).sum(axis=0)
    columns = np.arange(values.shape[1])
    low = ordered[np.maximum(count - 1, 0) // 2, columns]
    high = ordered[count // 2 - (count == 0), columns]
    return np.where(count > 0, (low + high) / 2, np.nan)


def _nullable(values: np.ndarray) -> list:
    """Floats for a state_dict, None for NaN (JSON has no NaN)."""
    return [None if np.isnan(v) else float(v) for v in values]


def _by_name(saved: list, saved_names: list[str], names: list[str]) -> np.ndarray:
    """A float vector over ``names`` from values saved under ``saved_names`` (NaN: none saved)."""
    by_name = dict(zip(saved_names, saved))
    return np.array([np.nan if by_name.get(n) is None else by_name[n] for n in names], dtype=float)


def _columns(saved: list, saved_names: list[str], names: list[str], rows: int) -> np.ndarray:
    """A [rows, len(names)] array from per-column lists saved under ``saved_names``."""
    by_name = dict(zip(saved_names, saved))
    out = np.full((rows, len(names)), np.nan)
    for j, name in enumerate(names):
        values = [np.nan if v is None else v for v in by_name.get(name, [])][:rows]
        out[: len(values), j] = values
    return out


def _forward_order(w: Window) -> list[str]:
    """The window's layers in the order they ran (its last step's forward order), then the rest
    in module order."""
    ran: list[int] = []
    for fwd, _ in reversed(w.step_orders):
        if fwd:
            ran = list(dict.fromkeys(fwd))
            break
    seen = set(ran)
    return [w.layers[i] for i in ran] + [name for i, name in enumerate(w.layers) if i not in seen]


def _successor(layers: list[str], name: str) -> str | None:
    i = layers.index(name)
    return layers[i + 1] if i + 1 < len(layers) else None


def _predecessor(layers: list[str], name: str) -> str | None:
    i = layers.index(name)
    return layers[i - 1] if i > 0 else None


def _describe(names: list[str]) -> str:
    """'layer a' / 'layers a and b' / 'layers a, b, ... (n)' for a message."""
    if len(names) == 1:
        return f"layer {names[0]}"
    if len(names) == 2:
        return f"layers {names[0]} and {names[1]}"
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return f"{len(names)} layers ({shown})"


def _nonfinite_finding(layers: list[str], step: int, fwd_bad: np.ndarray, grad_bad: np.ndarray, fwd_order: list[int],
                       count: float) -> Finding:  # fmt: skip
    """The one nonfinite finding of a step: its origin is the first layer in forward order whose
    output was non-finite, else the first in backward order (the forward order reversed) whose
    gradient was. The value: non-finite gradient elements counted, else the layers affected."""
    if fwd_bad.any():
        origin = _first_in(fwd_order, fwd_bad)
        detail = f"origin: first non-finite forward output, in layer {layers[origin]}"
    else:
        origin = _first_in(list(reversed(fwd_order)), grad_bad, reverse_default=True)
        detail = f"origin: first non-finite gradient in backward order, in layer {layers[origin]}"
    if count == 0:
        count = float(np.sum(fwd_bad | grad_bad))
    return Finding("nonfinite", layers[origin], step, count, 0.0, detail)


def _first_in(order: list[int], mask: np.ndarray, reverse_default: bool = False) -> int:
    for i in order:
        if mask[i]:
            return int(i)
    hits = np.flatnonzero(mask)
    return int(hits[-1] if reverse_default else hits[0])
