"""The dead-units rule: units whose output gradient was zero for every sample, judged on enough evidence."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..alerts import Finding
from ..config import HealthConfig
from ..flush.window import Window

MIN_STEPS = 2  # evidence from at least this many distinct steps
CLEAR = 0.8  # clearly healthy: dead_fraction at most 0.8 x its threshold
#: A confirmation that finds no evidence (the layer stopped running) ends after this many windows.
CONFIRM_WINDOWS = 2
#: A window whose last this-many steps (or more) all recorded every statistic confirms its own
#: evidence: the sampled steps found the layer dead and the rest of the window was recorded in full.
CONFIRM_TAIL = 3
#: A layer whose confirmation found it alive is not confirmed again for 1, 2, 4, ... windows, at
#: most this many: a layer whose units are quiet on the sampled steps but fire in between would
#: otherwise have every window recorded in full (the default at full detail's cost).
MAX_COOLDOWN = 8
#: Evidence this far past dead_fraction asks for a confirmation even while the model backs off.
STRONG = 0.2
#: More layers than this just past dead_fraction on one window's sampled steps is read as the
#: network's normal sparsity on few samples: none of them is confirmed in that window.
MAX_BORDERLINE = 2


class DeadUnitsRule:
    """Dead-unit evidence carried across windows until a layer has seen ``dead_min_samples`` rows
    from at least ``MIN_STEPS`` distinct steps.

    A unit silent on a few sampled steps may fire on a few percent of the rows in between: a layer
    of such units looks half dead on the default's two sampled steps of a window and is 10-20% dead
    over all of its steps. So a layer found dead on sampled steps only is judged again on every
    remaining step of the same window (``worth_confirming``: the pipeline records the rest of the
    window in full, and a window whose last ``CONFIRM_TAIL`` steps were all recorded confirms
    itself), or, where that could not be decided mid-window, on every step of the next window(s)
    (``wants_every_step``); only that judgement raises the alert. A layer such a confirmation found
    alive is not confirmed again for 1, 2, 4, ... up to ``MAX_COOLDOWN`` windows, one found dead for
    ``MAX_COOLDOWN`` (its alert stands); meanwhile its sampled evidence is still judged, so a
    recovery is seen, and a layer that really dies is confirmed once the wait is over.

    Args:
        config: the thresholds (``dead_fraction``, ``dead_min_units``, ``dead_min_samples``).
        layers: the layer names.
    """

    def __init__(self, config: HealthConfig, layers: list[str]) -> None:
        self.config, self.layers = config, layers
        n = len(layers)
        self.alive: list[np.ndarray | None] = [None] * n
        self.rows = np.zeros(n, dtype=np.int64)
        self.steps = np.zeros(n, dtype=np.int64)
        #: the layer's pending evidence includes a window recorded at every step (a confirmation's):
        #: what makes it conclusive below every unit dead
        self.full_evidence = np.zeros(n, dtype=bool)
        #: layers whose sampled steps said dead: judged again on every step of the next window(s)
        self.confirming = np.zeros(n, dtype=bool)
        self.confirm_windows = np.zeros(n, dtype=np.int64)  # windows spent confirming without a verdict
        self.cooldown = np.zeros(n, dtype=np.int64)  # windows before a layer may be confirmed again
        self.found_alive = np.zeros(n, dtype=np.int64)  # confirmations in a row that found the layer alive
        # The same for the model: many layers near the threshold (a deep ReLU stack) would take turns
        # asking for full windows; after a confirming window that found no layer dead, no layer near
        # the threshold is confirmed for 1, 2, 4, ... up to MAX_COOLDOWN windows (evidence STRONG past
        # it, or every unit silent at once, still is).
        self.quiet_for = 0  # windows before any layer may be confirmed again
        self.quiet_confirmations = 0  # confirming windows in a row that found nothing

    @property
    def wants_every_step(self) -> bool:
        """Whether the next window should record every statistic at every step (dead units to confirm)."""
        return bool(self.confirming.any()) and self.quiet_for == 0

    def judge(self, w: Window, clear: set[tuple[str, str]]) -> list[Finding]:
        """The window's dead-unit findings; ``clear`` gets the clearly healthy layers."""
        cfg = self.config
        findings: list[Finding] = []
        if w.unit_alive is None or w.rows_seen is None:
            return findings
        every_step = w.sampled is None or confirms_itself(w.sampled)
        # What the ranks asked together (the window's reduced record), so every rank backs off alike.
        asked = w.dead_suspected if w.dead_suspected is not None else np.zeros(len(self.layers), dtype=bool)
        suspected = asked | self.confirming
        self.cooldown = np.maximum(self.cooldown - 1, 0)
        self.quiet_for = max(0, self.quiet_for - 1)
        self.confirm_windows = np.where(self.confirming, self.confirm_windows + 1, 0)
        # a confirmation that found no evidence for CONFIRM_WINDOWS windows ends (nothing to confirm)
        self.confirming &= self.confirm_windows <= CONFIRM_WINDOWS
        for i, alive in enumerate(w.unit_alive):
            if alive is None or w.rows_seen[i] == 0 or w.unit_counts[i] < cfg.dead_min_units:
                continue
            self.alive[i] = alive.copy() if self.alive[i] is None else (self.alive[i] | alive)
            self.rows[i] += int(w.rows_seen[i])
            self.steps[i] += int(w.steps_judged[i]) if w.steps_judged is not None else 1
            self.full_evidence[i] |= every_step
            if self.rows[i] < cfg.dead_min_samples or self.steps[i] < MIN_STEPS:
                # Too little evidence yet: one sample silences about half of a healthy ReLU layer,
                # and one step can be a transient (a gate or ReZero factor still at zero).
                continue
            fraction = 1.0 - float(np.mean(self.alive[i]))
            rows, steps = int(self.rows[i]), int(self.steps[i])
            confirmed = bool(self.full_evidence[i]) or fraction >= 1.0
            self.alive[i], self.rows[i], self.steps[i], self.full_evidence[i] = None, 0, 0, False
            # Conclusive: evidence that includes a window recorded at every step, or every unit silent
            # on every sampled row of enough samples (a unit that fires on a few rows in between reads
            # dead only where some units fire on none of those rows). A layer asked to be confirmed
            # whose next window was not recorded in full (the model backing off, ``quiet_for``) is
            # not: its sampled rows alone read 50-57% dead on a deep LayerNorm + ReLU stack whose
            # every step said 29-38% (benchmarks/RESULTS.md, thirty-fifth session).
            if confirmed and suspected[i] and fraction < cfg.dead_fraction:  # a confirmation found it alive
                self.cooldown[i] = backoff(int(self.found_alive[i]))
                self.found_alive[i] += 1
            elif confirmed and fraction >= cfg.dead_fraction:  # found dead: the alert stands, no need to ask again
                self.found_alive[i] = 0
                self.cooldown[i] = MAX_COOLDOWN
            self.confirming[i] = fraction >= cfg.dead_fraction and not confirmed and self.cooldown[i] == 0
            if fraction >= cfg.dead_fraction and not confirmed:
                continue  # to be confirmed (or, cooling down, judged again later): no alert on this evidence
            name, units = self.layers[i], int(w.unit_counts[i])
            if fraction >= cfg.dead_fraction:
                findings.append(Finding(
                    "dead_units", name, w.steps[-1], fraction, cfg.dead_fraction,
                    f"{fraction:.0%} of its units had zero output gradient for every one of the "
                    f"{rows} samples of {steps} steps seen up to step {w.steps[-1]}",
                ))  # fmt: skip
            elif fraction <= min(CLEAR * cfg.dead_fraction, cfg.dead_fraction - 1.5 / units):
                clear.add(("dead_units", name))  # the band is at least one and a half units wide
        if suspected.any() and every_step:  # a confirming window: back off when it found nothing
            if findings:
                self.quiet_confirmations = 0
            else:
                self.quiet_for = backoff(self.quiet_confirmations)
                self.quiet_confirmations += 1
        return findings

    def worth_confirming(self, fractions: np.ndarray, rows_seen: np.ndarray, unit_counts: np.ndarray) -> np.ndarray:
        """The layers whose window's first sampled steps (``fractions`` dead and ``rows_seen`` per layer)
        show them dead on enough samples to record the rest of the window in full (every unit dead is
        conclusive as it is: nothing to confirm); bool per layer. The caller records the request in
        the window (``Recorder.suspect_dead_units``): the flush's judgement backs off from that."""
        cfg = self.config
        with np.errstate(invalid="ignore"):
            judged = (unit_counts >= cfg.dead_min_units) & (rows_seen >= cfg.dead_min_samples)
            worth = judged & (fractions >= cfg.dead_fraction) & (fractions < 1.0) & (self.cooldown == 0)
            strong = fractions >= min(0.99, cfg.dead_fraction + STRONG)
            # while the model backs off, only evidence well past the threshold asks (a layer dying now);
            # many layers just past it at once is the network's sparsity on few samples (a deep ReLU
            # stack), not a fault: the window's flush judges them and the next window confirms them
            borderline = worth & ~strong
            if self.quiet_for > 0 or int(borderline.sum()) > MAX_BORDERLINE:
                worth &= strong
        return worth

    def fell_silent(self, silent: np.ndarray, unit_counts: np.ndarray, rms_peak: np.ndarray) -> np.ndarray:
        """The layers judged for dead units (``unit_counts``), whose gradient was non-zero before
        (``rms_peak``: the highest median gradient RMS each layer had), that had an exactly zero
        gradient at a step where they ran (``silent``): every unit dead at once, worth recording the
        rest of the window in full on fresh evidence; bool per layer (recorded as for ``worth_confirming``)."""
        with np.errstate(invalid="ignore"):
            return silent & (unit_counts >= self.config.dead_min_units) & (rms_peak > 0) & (self.cooldown == 0)

    def pending_all_dead(self, i: int) -> bool:
        """Layer ``i``'s evidence, too little to judge yet, says every unit is dead so far."""
        pending = self.alive[i]
        return pending is not None and not pending.any()

    def state_dict(self) -> dict[str, Any]:
        """The confirmations under way and the back-off schedules (per layer, by name; constant size).
        Evidence not yet judged (a partial window's units) is not kept: a resumed run gathers it again."""

        def nonzero(values: np.ndarray) -> dict[str, int]:
            return {name: int(v) for name, v in zip(self.layers, values) if v}

        return {"confirming": [name for name, c in zip(self.layers, self.confirming) if c],
                "dead_confirm_windows": nonzero(self.confirm_windows), "dead_cooldown": nonzero(self.cooldown),
                "dead_found_alive": nonzero(self.found_alive),
                "dead_quiet": [int(self.quiet_for), int(self.quiet_confirmations)]}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        confirming = set(state.get("confirming", []))
        self.confirming = np.array([n in confirming for n in self.layers], dtype=bool)

        def by_name(key: str) -> np.ndarray:
            saved = state.get(key, {})  # absent from checkpoints of earlier versions: nothing pending
            return np.array([int(saved.get(n, 0)) for n in self.layers], dtype=np.int64)

        self.confirm_windows = by_name("dead_confirm_windows")
        self.cooldown, self.found_alive = by_name("dead_cooldown"), by_name("dead_found_alive")
        self.quiet_for, self.quiet_confirmations = (int(v) for v in state.get("dead_quiet", [0, 0]))


def backoff(found_nothing: int) -> int:
    """Windows to wait after ``found_nothing`` confirmations in a row found nothing: 1, 2, 4, ... up
    to ``MAX_COOLDOWN``."""
    return min(MAX_COOLDOWN, 2**found_nothing)


def confirms_itself(sampled: np.ndarray) -> bool:
    """Whether a window's sampled steps (bool per step) confirm its dead-unit evidence: every step
    sampled, or every one of its last ``CONFIRM_TAIL`` steps or more (the rest of the window
    recorded in full after its sampled steps found dead units)."""
    if bool(np.all(sampled)):
        return True
    gaps = np.flatnonzero(~sampled)
    return len(sampled) - 1 - int(gaps[-1]) >= CONFIRM_TAIL
