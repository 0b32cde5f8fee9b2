"""The vanishing rule: a layer's gradient RMS on its last steps (a rolling median), against an
absolute floor, against the strongest layer, and against its own earlier level."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..alerts import Finding
from ..config import HealthConfig
from ..flush.window import Window
from .columns import nan_median_columns
from .serial import by_name, columns_from, nullable

HISTORY_STEPS = 20  # the median is over a layer's last HISTORY_STEPS steps
MIN_STEPS = 5  # ... and needs at least MIN_STEPS of them
#: ... or every one of a layer's last RECENT_STEPS steps was below (a collapse in the last
#: window of a run, or half-way through the history, is not held back by the steps before it)
RECENT_STEPS = 10
CLEAR = 10.0  # clearly healthy: one decade above the thresholds
#: A collapse against a layer's own level counts only when the layer fell this much further than the
#: layer that fell least: every layer falling together is the model converging, not a cut path.
TOGETHER = 1e-3


class VanishingRule:
    """Rolling histories of every layer's gradient RMS and ratio to the strongest layer.

    With an optimizer that normalises its step (Adam and friends), a small gradient still moves
    the weights: of the comparisons with other layers only the absolute floor applies. Otherwise
    a layer five decades below the strongest layer no longer learns either. With any optimizer, a
    layer whose gradient collapsed five decades below its own highest level has lost its training
    signal (a saturated gate, a cut path): even Adam's step then shrinks, once the gradient falls
    under its eps.

    Args:
        config: the thresholds (``vanishing_abs_rms``, ``vanishing_rel_rms``).
        layers: the layer names.
        normalised_steps: the optimizer normalises its step.
    """

    def __init__(self, config: HealthConfig, layers: list[str], normalised_steps: bool) -> None:
        self.config, self.layers, self.normalised_steps = config, layers, normalised_steps
        n = len(layers)
        self.rms_history = np.full((HISTORY_STEPS, n), np.nan)
        self.ratio_history = np.full((HISTORY_STEPS, n), np.nan)
        self.history_slot = 0
        self.rms_peak = np.full(n, np.nan)  # per layer: the highest median RMS it has had

    def _remember(self, w: Window, valid: np.ndarray) -> None:
        rms = np.where(valid, w.grad_rms, np.nan)
        ratio = _ratio_to_strongest(rms)
        for t in range(len(w.steps)):
            if valid[t].any():
                slot = self.history_slot % HISTORY_STEPS
                self.rms_history[slot], self.ratio_history[slot] = rms[t], ratio[t]
                self.history_slot += 1

    def quiet(self, w: Window, valid: np.ndarray) -> np.ndarray:
        """[steps, layers]: values at or below what this rule judges vanishing (the absolute floor;
        with SGD-like optimizers, the fraction of the step's strongest layer; a fraction of the
        layer's own peak). The exploding rule leaves them out: a 10x jump of a collapsed gradient
        (1e-7 after 1e-2) is noise at that level, not an explosion (#33: one layer flapped
        through four exploding onsets)."""
        cfg = self.config
        rms = np.where(valid, w.grad_rms, np.nan)
        with np.errstate(all="ignore"):
            quiet = (rms < cfg.vanishing_abs_rms) | (rms < cfg.vanishing_rel_rms * self.rms_peak)  # NaN peak: no
            if not self.normalised_steps:
                quiet |= _ratio_to_strongest(rms) < cfg.vanishing_rel_rms
        return quiet

    def judge(self, w: Window, valid: np.ndarray, clear: set[tuple[str, str]]) -> list[Finding]:
        """The window's vanishing findings; ``clear`` gets the clearly healthy layers."""
        cfg = self.config
        self._remember(w, valid)
        with np.errstate(all="ignore"):
            known = np.sum(~np.isnan(self.rms_history), axis=0) >= MIN_STEPS
            settled_rms = np.where(known, nan_median_columns(self.rms_history), np.nan)
            med_rms = np.fmin(settled_rms, self._recent_max(self.rms_history))
            med_ratio = np.fmin(np.where(known, nan_median_columns(self.ratio_history), np.nan),
                                self._recent_max(self.ratio_history))  # fmt: skip
            below_abs = med_rms < cfg.vanishing_abs_rms
            clear_abs = med_rms >= CLEAR * cfg.vanishing_abs_rms
            peak = self.rms_peak
            drop = np.where(np.isfinite(peak) & (peak > 0), med_rms / peak, np.nan)
            least = np.nanmax(drop, initial=-np.inf, where=~np.isnan(drop))  # the layer that fell least
            collapsed = (drop < cfg.vanishing_rel_rms) & (drop < TOGETHER * least)
            clear_own = ~(med_rms < CLEAR * cfg.vanishing_rel_rms * peak)
            self.rms_peak = np.where(np.isfinite(settled_rms), np.fmax(peak, settled_rms), peak)
            if self.normalised_steps:
                below_rel, clear_rel = np.zeros_like(below_abs), np.ones_like(clear_abs)
            else:
                below_rel = np.isfinite(med_ratio) & (med_ratio < cfg.vanishing_rel_rms)
                clear_rel = med_ratio >= CLEAR * cfg.vanishing_rel_rms
        seen = valid.any(axis=0)  # only layers with a gradient in this window (frozen ones never vanish)
        findings = []
        for i in np.flatnonzero((below_abs | below_rel | collapsed) & seen):
            # value and threshold are the quantity the rule compared: an RMS, or a ratio of RMS
            if med_rms[i] <= 0 or not np.isfinite(med_ratio[i]):
                value, threshold, detail = 0.0, cfg.vanishing_abs_rms, "its gradient is zero"
            elif below_abs[i]:
                value, threshold = float(med_rms[i]), cfg.vanishing_abs_rms
                detail = f"median gradient RMS {med_rms[i]:.3g} over its last steps"
            elif below_rel[i]:
                value, threshold = float(med_ratio[i]), cfg.vanishing_rel_rms
                detail = f"median gradient RMS {med_rms[i]:.3g} over its last steps, as a fraction of the strongest layer's"
            else:
                value, threshold = float(drop[i]), cfg.vanishing_rel_rms
                detail = (f"median gradient RMS {med_rms[i]:.3g} over its last steps, as a fraction of its own earlier "
                          f"level {peak[i]:.3g}, while other layers kept theirs")  # fmt: skip
            if self.normalised_steps and below_abs[i]:
                detail += "; below what the optimizer's normalised step can use"
            findings.append(Finding("vanishing", self.layers[i], w.steps[-1], value, threshold, detail))
        clear.update(("vanishing", self.layers[i]) for i in np.flatnonzero(clear_abs & clear_rel & clear_own & seen))
        return findings

    def _recent_max(self, history: np.ndarray) -> np.ndarray:
        """Per layer, the largest of its last ``RECENT_STEPS`` values (NaN unless it has all of them)."""
        rows = (self.history_slot - 1 - np.arange(RECENT_STEPS)) % HISTORY_STEPS
        recent = history[rows]
        complete = (self.history_slot >= RECENT_STEPS) & ~np.isnan(recent).any(axis=0)
        return np.where(complete, recent.max(axis=0), np.nan)

    def state_dict(self) -> dict[str, Any]:
        return {
            "rms_history": [nullable(c) for c in self.rms_history.T],
            "ratio_history": [nullable(c) for c in self.ratio_history.T],
            "history_slot": int(self.history_slot), "rms_peak": nullable(self.rms_peak),
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any], saved: list[str]) -> None:
        self.rms_history = columns_from(state.get("rms_history", []), saved, self.layers, HISTORY_STEPS)
        self.ratio_history = columns_from(state.get("ratio_history", []), saved, self.layers, HISTORY_STEPS)
        self.history_slot = int(state.get("history_slot", 0))
        self.rms_peak = by_name(state.get("rms_peak", []), saved, self.layers)


def _ratio_to_strongest(rms: np.ndarray) -> np.ndarray:
    """[steps, layers]: each layer's RMS over the step's strongest layer's (NaN: no such layer)."""
    with np.errstate(all="ignore"):
        strongest = np.nanmax(rms, axis=1, initial=-np.inf, where=~np.isnan(rms))
        strongest = np.where(np.isfinite(strongest) & (strongest > 0), strongest, np.nan)
        return rms / strongest[:, None]
