"""The exploding rule: one implementation for the per-step (model) and the per-window (layers) judgements.

A value is exploding when it is above the absolute ceiling (``exploding_abs_norm``), at least
``exploding_jump`` x the previous calm value of its column (any step, warm-up included), or,
after the warm-up, above ``exploding_factor`` x its column's recent level: the larger of the
largest of its last ``RECENT_STEPS`` calm values (smooth growth raises its own bar) and the
median of its last ``LEVEL_STEPS`` calm values (the level a run settled at). Where a column's
calm steps vary widely from one to the next (a rare class, batch size 1-2), the relative ceiling
widens with that spread (``exploding_spread_z``), up to ``exploding_factor`` x the largest of its
last ``LEVEL_STEPS`` calm values; and no value at or below that largest value is exploding by
either relative test (a return to where the column has been). The caller may veto relative
explosions (``stands``): ``checks.HealthChecks`` keeps a layer's only when the model exploded too
or the layer jumped ``exploding_factor`` x more than the model (a rare class moves them together).
Causal: a step is compared only
with earlier steps; exploded steps never enter the rings, so an explosion that persists stays
flagged.

Columns are the layers and, last, the model's global norm. :meth:`ExplodingRule.judge_row`
judges one step of any set of columns; the window judgement calls it row by row, the per-step
judgement with the model's column alone.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..alerts import Finding
from ..config import HealthConfig
from .calm_stretch import remember_calm_stretch
from .columns import nan_median_columns, oldest_first
from .serial import by_name, columns_from, nullable

RECENT_STEPS = 10
LEVEL_STEPS = 50
#: A column exploded at this many steps in a row has changed scale for good (a loss weight raised,
#: a new phase): its recent exploded values become its level, so the new scale is judged from then on.
RELEARN_STEPS = LEVEL_STEPS
#: The spread of a column's calm steps widens its ceiling only once it rests on this many values.
SPREAD_MIN_VALUES = 20


@dataclass
class RowVerdict:
    """One step's judgement of some columns: which exploded, against which threshold, and why."""

    over: np.ndarray  # bool per column
    threshold: np.ndarray  # the ceiling each exploded value crossed (inf where none)
    why: list[str]
    #: each value over the largest of its column's last RECENT_STEPS calm values before this step
    #: (NaN: none): how far the step jumped, comparable across columns
    jumps: np.ndarray


class ExplodingRule:
    """Rings of recent calm values per column, and the judgement of new values against them.

    Args:
        config: the thresholds (``exploding_abs_norm``, ``exploding_jump``, ``exploding_factor``,
            ``exploding_warmup_steps``).
        columns: how many columns (layers + 1 for the model).
    """

    def __init__(self, config: HealthConfig, columns: int) -> None:
        self.config = config
        self.level = np.full((LEVEL_STEPS, columns), np.nan)
        self.level_slot = np.zeros(columns, dtype=np.int64)
        self.recent = np.full((RECENT_STEPS, columns), np.nan)
        self.recent_slot = np.zeros(columns, dtype=np.int64)
        self.last_calm = np.full(columns, np.nan)
        self.judged = np.zeros(columns, dtype=np.int64)  # steps judged per column (the warm-up)
        self.exploded_streak = np.zeros(columns, dtype=np.int64)  # steps in a row above a ceiling
        self.exploded_recent = np.full((RECENT_STEPS, columns), np.nan)  # their latest values

    def judge_row(self, row: np.ndarray, cols: np.ndarray,
                  stands: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> RowVerdict:  # fmt: skip
        """Judge one step's values ``row`` of columns ``cols`` (NaN: no value), and move the rings
        of the calm ones on. ``stands(over, jumps)``: which relative explosions stand (``jumps``: as
        in ``RowVerdict``); the others are calm and enter the rings."""
        cfg = self.config
        with np.errstate(invalid="ignore", divide="ignore"):
            top = np.fmax.reduce(self.recent[:, cols], axis=0)  # the largest recent calm value per column
            jumps = row / top
            previous = self.last_calm[cols]
            jump_ceiling = np.where(previous > 0, cfg.exploding_jump * previous, np.inf)
            over_abs = row > cfg.exploding_abs_norm
            over_jump = row >= jump_ceiling
            ceiling = np.full(len(cols), np.inf)
            level = np.full(len(cols), np.nan)  # the level each relative ceiling is a multiple of
            warm = self.judged[cols] >= cfg.exploding_warmup_steps
            # The level is max(top, median) >= top: a value within the factor of top is calm whatever
            # the median, so the median (a sort) is worked out only for the columns above it.
            candidates = warm & ~(row <= cfg.exploding_factor * top) & np.isfinite(row)
            if candidates.any():
                picked = cols[candidates]
                ceiling[candidates], level[candidates] = self._relative_ceiling(picked, top[candidates])
            over_rel = row > ceiling
            # Never above where the column has been: a value no larger than the largest of its last
            # LEVEL_STEPS calm values is a return, not an explosion (a rare class after the gradient
            # of the common ones collapsed; a high start's shadow lasts LEVEL_STEPS calm steps).
            relative = over_jump | over_rel
            if relative.any():
                relative &= ~(row <= np.fmax.reduce(self.level[:, cols], axis=0))
            if stands is not None and relative.any():
                relative &= stands(over_abs | relative, jumps)
        over = over_abs | relative
        threshold = np.where(over_abs, cfg.exploding_abs_norm, np.where(over_jump, jump_ceiling, ceiling))
        why = []
        for k in np.flatnonzero(over):
            value = float(row[k])
            if over_abs[k]:
                why.append("above the absolute ceiling")
            elif over_jump[k]:
                why.append(f"{value / previous[k]:.3g}x its previous step's norm")
            else:
                allowed = float(threshold[k]) / float(level[k])
                why.append(f"{value / float(level[k]):.3g}x its recent level {float(level[k]):.4g} (calm up to "
                           f"{allowed:.3g}x{' for its spread' if allowed > cfg.exploding_factor * 1.0001 else ''})")
        self._remember(row, cols, np.isfinite(row) & ~over)
        self._relearn(row, cols, np.isfinite(row) & over)
        self.judged[cols] += 1
        return RowVerdict(over, threshold, why, jumps)

    def _relative_ceiling(self, picked: np.ndarray, top: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ceilings, levels) of columns ``picked``, whose largest recent calm values are ``top``: the
        ceiling is ``exploding_factor`` x the level, widened where the column's calm steps vary widely."""
        cfg = self.config
        median = nan_median_columns(self.level[:, picked])
        level = np.fmax(median, top)
        ceiling = np.where(level > 0, cfg.exploding_factor * level, np.inf)
        if cfg.exploding_spread_z > 0:
            spread = _log_volatility_columns(self.level[:, picked], self.level_slot[picked])
            widened = np.exp(np.minimum(cfg.exploding_spread_z * spread, np.log(cfg.exploding_jump)))
            largest = np.fmax.reduce(self.level[:, picked], axis=0)  # of the last LEVEL_STEPS calm values
            with np.errstate(invalid="ignore"):
                widened = np.fmin(median * widened, cfg.exploding_factor * largest)
                ceiling = np.fmax(ceiling, np.where(median > 0, widened, np.nan))
        return ceiling, level

    def _remember(self, row: np.ndarray, cols: np.ndarray, calm: np.ndarray) -> None:
        if not calm.any():
            return
        c = cols[calm]
        values = row[calm]
        self.recent[self.recent_slot[c], c] = values
        self.recent_slot[c] = (self.recent_slot[c] + 1) % RECENT_STEPS
        self.level[self.level_slot[c], c] = values
        self.level_slot[c] = (self.level_slot[c] + 1) % LEVEL_STEPS
        self.last_calm[c] = values

    def _relearn(self, row: np.ndarray, cols: np.ndarray, exploded: np.ndarray) -> None:
        """Count exploded steps in a row; after RELEARN_STEPS, take the latest ones as the new level."""
        self.exploded_streak[cols] = np.where(exploded, self.exploded_streak[cols] + 1, 0)
        if not exploded.any():
            return
        c = cols[exploded]
        slot = self.exploded_streak[c] % RECENT_STEPS
        values = row[exploded]
        self.exploded_recent[slot, c] = values
        done = self.exploded_streak[c] >= RELEARN_STEPS
        settled = c[done]
        if len(settled):
            latest = self.exploded_recent[:, settled]
            self.recent[:, settled] = latest
            self.level[:, settled] = np.nan
            self.level[:RECENT_STEPS, settled] = latest
            self.recent_slot[settled] = 0
            self.level_slot[settled] = RECENT_STEPS % LEVEL_STEPS
            self.last_calm[settled] = values[done]
            self.exploded_streak[settled] = 0

    def judge_step(self, step: int, value: float, col: int, name: str) -> tuple[Finding | None, float]:
        """The per-step judgement of one column (the model's global norm): (the finding, None when
        calm; the step's jump, as in ``RowVerdict``, NaN for a non-finite value)."""
        if not math.isfinite(value):
            self.judged[col] += 1
            return None, float("nan")  # a non-finite norm is the nonfinite check's
        calm_jump = self._calm_at_once(value, col)
        if calm_jump is not None:
            return None, calm_jump
        verdict = self.judge_row(np.array([value]), np.array([col]))
        jump = float(verdict.jumps[0])
        if not verdict.over[0]:
            return None, jump
        return Finding("exploding", name, step, value, float(verdict.threshold[0]), verdict.why[0]), jump

    def _calm_at_once(self, value: float, col: int) -> float | None:
        """The common case of ``judge_row`` for one finite value, decided on Python floats (this
        runs at every step, where each numpy call costs microseconds): when the value is under the
        absolute ceiling, under the jump ceiling, and (after the warm-up) within
        ``exploding_factor`` x the largest recent calm value, no relative ceiling is needed and it
        is calm; it enters the rings as ``judge_row`` would enter it. Returns its jump (as in
        ``RowVerdict``), or None when the full judgement must decide."""
        cfg = self.config
        # Python floats and ints (one ``tolist`` per state), not numpy scalars: each numpy call costs
        # microseconds here, right after backward (cold caches).
        calm = [v for v in self.recent[:, col].tolist() if v == v]
        top = max(calm) if calm else math.nan  # NaN: no calm value yet
        previous = self.last_calm.item(col)
        judged = self.judged.item(col)
        if value > cfg.exploding_abs_norm or (previous > 0 and value >= cfg.exploding_jump * previous):
            return None
        if judged >= cfg.exploding_warmup_steps and not value <= cfg.exploding_factor * top:
            return None  # a candidate for the relative ceiling (or no calm value to compare with)
        slot = self.recent_slot.item(col)
        self.recent[slot, col] = value
        self.recent_slot[col] = (slot + 1) % RECENT_STEPS
        slot = self.level_slot.item(col)
        self.level[slot, col] = value
        self.level_slot[col] = (slot + 1) % LEVEL_STEPS
        self.last_calm[col] = value
        self.exploded_streak[col] = 0
        self.judged[col] = judged + 1
        if top != top:
            return float("nan")
        return value / top if top else (float("inf") if value else float("nan"))

    def judge_window(self, table: np.ndarray, steps: list[int], cols: list[int], names: list[str],
                     stands: Callable[[int, np.ndarray, np.ndarray], np.ndarray] | None = None,
                     ) -> tuple[list[Finding], np.ndarray]:  # fmt: skip
        """The first exploded step of each of ``cols`` in ``table`` [steps, all columns]; returns
        (findings, per column of ``cols`` whether it was calm with a value in the window).
        ``stands(t, over, jumps)``: which explosions of row ``t`` stand (see ``judge_row``)."""
        index = np.asarray(cols, dtype=np.int64)
        values = table[:, index]
        first: dict[int, Finding] = {}
        exploded = np.zeros(len(cols), dtype=bool)
        t = 0
        while t < len(values):
            t = self._remember_calm_rows(values, index, t)  # the calm stretch from t on, at once
            if t == len(values):
                break
            row = values[t]
            of_row = None if stands is None else functools.partial(stands, t)
            verdict = self.judge_row(row, index, of_row)
            for k, why in zip(np.flatnonzero(verdict.over), verdict.why):
                exploded[k] = True
                if k not in first:
                    first[k] = Finding("exploding", names[cols[k]], steps[t], float(row[k]),
                                       float(verdict.threshold[k]), why)  # fmt: skip
            t += 1
        calm = ~exploded & np.isfinite(values).any(axis=0)
        return [first[k] for k in sorted(first)], calm

    def _remember_calm_rows(self, values: np.ndarray, cols: np.ndarray, start: int) -> int:
        """``judge_row`` for the rows of ``values`` from ``start`` on that are calm for sure, all at
        once (``calm_stretch.remember_calm_stretch``); returns the first row it left to ``judge_row``."""
        return remember_calm_stretch(self, values, cols, start)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "level": [nullable(c) for c in self.level.T], "level_slot": [int(i) for i in self.level_slot],
            "recent": [nullable(c) for c in self.recent.T], "recent_slot": [int(i) for i in self.recent_slot],
            "last_calm": nullable(self.last_calm), "judged": [int(i) for i in self.judged],
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any], saved: list[str], names: list[str], judged: np.ndarray) -> None:
        """Columns matched by name (``saved``: the checkpoint's, ``names``: this monitor's);
        ``judged``: the warm-up counts to use where the checkpoint has none."""
        self.level = columns_from(state.get("level", []), saved, names, LEVEL_STEPS)
        slots = dict(zip(saved, state.get("level_slot", [])))
        self.level_slot = np.array([int(slots.get(n, 0)) % LEVEL_STEPS for n in names], dtype=np.int64)
        self.recent = columns_from(state.get("recent", []), saved, names, RECENT_STEPS)
        slots = dict(zip(saved, state.get("recent_slot", [])))
        self.recent_slot = np.array([int(slots.get(n, 0)) % RECENT_STEPS for n in names], dtype=np.int64)
        self.last_calm = by_name(state.get("last_calm", []), saved, names)
        counts = dict(zip(saved, state.get("judged", [])))
        self.judged = np.array([int(counts.get(n, judged[j])) for j, n in enumerate(names)], dtype=np.int64)


def _log_volatility_columns(values: np.ndarray, oldest: np.ndarray) -> np.ndarray:
    """Per column of a ring (``oldest``: each column's oldest slot), how far its calm values move
    from one to the next in log space: the standard deviation of consecutive log ratios / sqrt(2),
    the standard deviation of i.i.d. log-noise. Step-to-step, so a trend (smooth growth, a decay,
    a level that moved once) is not counted as noise. 0 for fewer than ``SPREAD_MIN_VALUES``."""
    ordered = oldest_first(values, oldest)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log(np.where(ordered > 0, ordered, np.nan))
    steps = logs[1:] - logs[:-1]  # NaN where either value is missing or not positive
    count = np.isfinite(steps).sum(axis=0)
    with np.errstate(invalid="ignore"):
        mean = np.where(np.isfinite(steps), steps, 0.0).sum(axis=0) / np.maximum(count, 1)
        variance = np.where(np.isfinite(steps), (steps - mean) ** 2, 0.0).sum(axis=0) / np.maximum(count - 1, 1)
    return np.where(count + 1 >= SPREAD_MIN_VALUES, np.sqrt(variance / 2), 0.0)

