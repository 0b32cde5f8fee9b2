"""Health checks over one flushed window, vectorised over layers with numpy.

They run on the host at flush time only; the device keeps nothing but counters.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np

from .alerts import Finding
from .config import HealthConfig
from .window import Window

log = logging.getLogger("gradwatch")

# The exploding test compares a step with the largest of this many earlier calm steps.
_RECENT_STEPS = 10


class HealthChecks:
    """Vanishing, exploding, dead-unit and non-finite checks with their baselines."""

    def __init__(self, config: HealthConfig, layers: list[str]) -> None:
        self.config = config
        self.layers = layers
        # Running maximum of earlier windows' median grad_norm, per layer and
        # (last entry) for the global norm; NaN until a window had data.
        self.baseline = np.full(len(layers) + 1, np.nan)
        # The last _RECENT_STEPS calm values per column (a ring per column; NaN: none yet).
        self.recent = np.full((_RECENT_STEPS, len(layers) + 1), np.nan)
        self.recent_slot = np.zeros(len(layers) + 1, dtype=np.int64)
        self.steps_seen = 0
        self.skipped_steps = 0
        # Per layer: consecutive measured optimizer steps with a judged update ratio above the limit.
        self.update_streak = np.zeros(len(layers), dtype=np.int64)

    # ------------------------------------------------------------------ API
    def check(self, w: Window) -> list[Finding]:
        """All findings of one window (de-duplication happens in AlertTracker)."""
        n = len(w.steps)
        if n == 0:  # only update-ratio measurements made after the previous window's last step
            return self._update_ratio(w)
        skipped = w.skipped if w.skipped is not None else np.zeros(n, dtype=bool)
        findings: list[Finding] = []
        findings += self._nonfinite(w, skipped)
        valid = w.has_grad & ~skipped[:, None] & np.isfinite(w.grad_norm)
        with warnings.catch_warnings():  # all-NaN columns are layers without gradient
            warnings.simplefilter("ignore", RuntimeWarning)
            findings += self._exploding(w, valid)
            vanishing = self._vanishing(w, valid)
        findings += vanishing + self._explained_by_vanishing(self._dead(w), vanishing)
        findings += self._update_ratio(w)
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
        return findings

    # --------------------------------------------------------------- checks
    def _nonfinite(self, w: Window, skipped: np.ndarray) -> list[Finding]:
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
            fwd_order, bwd_order = w.step_orders[t] if t < len(w.step_orders) else ([], [])
            if not bwd_order:  # no output-gradient hooks that step: backward runs in reverse
                bwd_order = list(reversed(fwd_order))
            if fwd_bad[t].any():
                origin = _first_in(fwd_order, fwd_bad[t])
                detail = f"origin: first non-finite forward output, in layer {w.layers[origin]}"
            else:
                origin = _first_in(bwd_order, grad_bad[t], reverse_default=True)
                detail = f"origin: first non-finite gradient in backward order, in layer {w.layers[origin]}"
            # The value is the number of non-finite gradient elements that step, or,
            # when only outputs/output gradients were non-finite, the layers affected.
            counted = w.nonfinite_counted is None or bool(w.nonfinite_counted[t])
            count = float(np.nansum(w.nonfinite[t])) if counted else 0.0
            if count == 0:
                count = float(np.sum(fwd_bad[t] | grad_bad[t]))
            return [Finding("nonfinite", w.layers[origin], w.steps[t], count, 0.0, detail)]
        return []

    def _exploding(self, w: Window, valid: np.ndarray) -> list[Finding]:
        cfg = self.config
        norms = np.where(valid, w.grad_norm, np.nan)
        glob_valid = valid.any(axis=1) & np.isfinite(w.global_grad_norm)
        glob = np.where(glob_valid, w.global_grad_norm, np.nan)
        table = np.concatenate([norms, glob[:, None]], axis=1)  # [steps, layers + 1]
        names = self.layers + [""]

        ceiling = self._causal_ceilings(table)
        over_rel, over_abs = self._exceeds(table, ceiling)
        over = over_rel | over_abs
        findings = []
        for j in np.flatnonzero(over.any(axis=0)):
            t = int(np.argmax(over[:, j]))
            value = float(table[t, j])
            if over_abs[t, j]:
                threshold, why = cfg.exploding_abs_norm, "above the absolute ceiling"
            else:
                threshold = float(ceiling[t, j])
                base = threshold / cfg.exploding_factor
                why = f"{value / base:.3g}x its baseline {base:.4g}"
            findings.append(Finding("exploding", names[j], w.steps[t], value, threshold, why))

        # Raise the running baseline to this window's median, leaving out the
        # steps that exploded so that a spike does not raise its own bar.
        calm = np.where(over, np.nan, table)
        window_median = np.nanmedian(calm, axis=0)
        update = np.isfinite(window_median)
        self.baseline[update] = np.fmax(self.baseline[update], window_median[update])

        # When the whole model explodes, one alert for the model, not one per layer.
        layer_hits = [f for f in findings if f.layer]
        model_hit = [f for f in findings if not f.layer]
        if model_hit and len(layer_hits) >= max(2, len(self.layers) // 2):
            model_hit[0].detail += f"; {len(layer_hits)} of {len(self.layers)} layers exceed their ceilings"
            return model_hit
        return findings

    def _vanishing(self, w: Window, valid: np.ndarray) -> list[Finding]:
        cfg = self.config
        rms = np.where(valid, w.grad_rms, np.nan)
        with np.errstate(all="ignore"):
            strongest = np.nanmax(rms, axis=1, initial=-np.inf, where=~np.isnan(rms))
            strongest = np.where(np.isfinite(strongest) & (strongest > 0), strongest, np.nan)
            ratio = rms / strongest[:, None]
            med_rms = np.nanmedian(rms, axis=0)
            med_ratio = np.nanmedian(ratio, axis=0)
            med_strongest = np.nanmedian(strongest)
        with np.errstate(invalid="ignore"):
            # NaN medians (no gradient in the window: frozen or unused) compare False.
            below_abs = med_rms < cfg.vanishing_abs_rms
            below_rel = np.isfinite(med_ratio) & (med_ratio < cfg.vanishing_rel_rms)
        rel_floor = cfg.vanishing_rel_rms * med_strongest if np.isfinite(med_strongest) else 0.0
        threshold = max(cfg.vanishing_abs_rms, rel_floor)
        findings = []
        for i in np.flatnonzero(below_abs | below_rel):
            detail = (
                f"gradient RMS {med_rms[i]:.3g} is {med_ratio[i]:.3g} of the strongest layer's"
                if np.isfinite(med_ratio[i])
                else "gradient is zero"
            )
            findings.append(
                Finding("vanishing", self.layers[i], w.steps[-1], float(med_rms[i]), threshold, detail)
            )
        return findings

    def _explained_by_vanishing(self, dead: list[Finding], vanishing: list[Finding]) -> list[Finding]:
        """Drop dead-unit findings that are really a vanishing gradient underflowing to zero.

        A dead ReLU layer has zero output gradients while the layer after it is
        healthy; in a vanishing stack the layer after it is vanishing too.
        """
        vanished = {f.layer for f in vanishing}
        position = {name: i for i, name in enumerate(self.layers)}
        kept = []
        for f in dead:
            i = position[f.layer]
            successor = self.layers[i + 1] if i + 1 < len(self.layers) else None
            if f.layer in vanished and successor in vanished:
                continue
            kept.append(f)
        return kept

    def _dead(self, w: Window) -> list[Finding]:
        cfg = self.config
        findings = []
        for i in np.flatnonzero(np.nan_to_num(w.dead_fraction, nan=-1.0) >= cfg.dead_fraction):
            if w.unit_counts[i] < cfg.dead_min_units:
                continue
            findings.append(
                Finding(
                    "dead_units",
                    self.layers[i],
                    w.steps[-1],
                    float(w.dead_fraction[i]),
                    cfg.dead_fraction,
                    f"{w.dead_fraction[i]:.0%} of its units had zero output gradient for every sample "
                    f"in steps {w.steps[0]}-{w.steps[-1]}",
                )
            )
        return findings

    def _update_ratio(self, w: Window) -> list[Finding]:
        """Layers whose weight matrices changed by more than update_ratio_max of their norm at
        update_ratio_steps consecutive measured optimizer steps (streaks carry across windows)."""
        if w.judged_update_ratio is None:
            return []
        cfg = self.config
        findings: list[Finding] = []
        flagged: set[int] = set()
        for t, step in enumerate(w.update_steps):
            ratio, rms = w.judged_update_ratio[t], w.judged_weight_rms[t]  # type: ignore[index]
            measured = np.isfinite(ratio) & (rms >= cfg.update_ratio_min_weight_rms)
            above = measured & (ratio > cfg.update_ratio_max)
            # A measured step below the limit ends a streak; unmeasured layers keep theirs.
            self.update_streak = np.where(above, self.update_streak + 1, np.where(measured, 0, self.update_streak))
            for i in np.flatnonzero(self.update_streak >= cfg.update_ratio_steps):
                if i in flagged:
                    continue
                flagged.add(int(i))
                findings.append(
                    Finding(
                        "update_ratio", self.layers[i], int(step), float(ratio[i]), cfg.update_ratio_max,
                        f"its weights changed by {ratio[i]:.3g} of their norm in one optimizer step, above "
                        f"{cfg.update_ratio_max:g} at {int(self.update_streak[i])} measured steps in a row: "
                        "the learning rate is far too high for this layer",
                    )  # fmt: skip
                )
        return findings

    def _causal_ceilings(self, table: np.ndarray) -> np.ndarray:
        """Per step and column: factor x max(long-run baseline, largest of the last calm steps).

        Causal: a step is compared only with earlier steps. The recent reference is
        the largest of the last ``_RECENT_STEPS`` calm (not exploded, finite) values,
        carried across windows, so gradients that grow smoothly (Adam's first
        hundred steps, a learning-rate warm-up) raise their own bar as they go,
        while a jump of ``factor`` x within a few steps does not. Exploded steps
        never enter the reference, so an explosion that persists stays flagged.
        """
        cfg = self.config
        n, m = table.shape
        ceilings = np.full((n, m), np.inf)
        history = np.where(np.isfinite(self.baseline) & (self.baseline > 0), self.baseline, 0.0)
        recent, slot = self.recent, self.recent_slot
        columns = np.arange(m)
        for t in range(n):
            if self.steps_seen + t >= cfg.exploding_warmup_steps:
                reference = np.fmax(history, np.fmax.reduce(recent, axis=0))  # fmax skips NaN
                known = reference > 0
                ceilings[t, known] = cfg.exploding_factor * reference[known]
            row = table[t]
            over_rel, over_abs = self._exceeds(row, ceilings[t])
            calm = np.isfinite(row) & ~over_rel & ~over_abs
            recent[slot[calm], columns[calm]] = row[calm]
            slot[calm] = (slot[calm] + 1) % _RECENT_STEPS
        return ceilings

    def _exceeds(self, values: np.ndarray, ceiling: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(above the relative ceiling, above the absolute one): the one definition of "exploded"."""
        with np.errstate(invalid="ignore"):  # NaN (no gradient) is neither
            return values > ceiling, values > self.config.exploding_abs_norm

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "baseline": [None if np.isnan(b) else float(b) for b in self.baseline],
            "recent": [[None if np.isnan(v) else float(v) for v in column] for column in self.recent.T],
            "recent_slot": [int(i) for i in self.recent_slot],
            "steps_seen": self.steps_seen,
            "skipped_steps": self.skipped_steps,
            "update_streak": dict(zip(self.layers, (int(s) for s in self.update_streak))),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        by_name = dict(zip(state["layers"] + [""], state["baseline"]))
        self.baseline = np.array(
            [np.nan if by_name.get(n) is None else by_name[n] for n in self.layers + [""]],
            dtype=float,
        )
        recent = dict(zip(state["layers"] + [""], state.get("recent", [])))
        slots = dict(zip(state["layers"] + [""], state.get("recent_slot", [])))
        self.recent = np.full((_RECENT_STEPS, len(self.layers) + 1), np.nan)
        self.recent_slot = np.zeros(len(self.layers) + 1, dtype=np.int64)
        for j, name in enumerate(self.layers + [""]):
            values = [np.nan if v is None else v for v in recent.get(name, [])][:_RECENT_STEPS]
            self.recent[: len(values), j] = values
            self.recent_slot[j] = int(slots.get(name, 0)) % _RECENT_STEPS
        self.steps_seen = int(state["steps_seen"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        streaks = state.get("update_streak", {})
        self.update_streak = np.array([int(streaks.get(n, 0)) for n in self.layers], dtype=np.int64)


def _first_in(order: list[int], mask: np.ndarray, reverse_default: bool = False) -> int:
    for i in order:
        if mask[i]:
            return int(i)
    hits = np.flatnonzero(mask)
    return int(hits[-1] if reverse_default else hits[0])
