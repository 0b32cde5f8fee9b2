"""The exploding rule's usual window, judged at once: a stretch of rows that are calm for sure.

Row by row, ``ExplodingRule.judge_row`` costs the flush ~40 us a step. Most rows of a window need
no relative ceiling: every value is under the absolute ceiling, under ``exploding_jump`` x the
previous calm value and, after the warm-up, within ``exploding_factor`` x the largest of the last
``RECENT_STEPS`` calm values. Such a stretch enters the rule's rings in a few array operations,
exactly as ``judge_row`` would enter it row by row (tests hold the two to the same rings and findings).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .columns import oldest_first

if TYPE_CHECKING:
    from .exploding import ExplodingRule


def remember_calm_stretch(rule: "ExplodingRule", values: np.ndarray, cols: np.ndarray, start: int) -> int:
    """``judge_row`` for the rows of ``values`` [steps, cols] from ``start`` on that are calm for
    sure, all at once; returns the first row it left to ``judge_row`` (``len(values)``: none).

    The window's usual case: every value under the absolute ceiling, under ``exploding_jump`` x the
    previous calm value and, after the warm-up, within ``exploding_factor`` x the largest of the
    last ``RECENT_STEPS`` calm values, where no relative ceiling (and no ``stands``) is needed.
    Row by row that costs the flush ~40 us a step; here a stretch costs a few array operations.
    A stretch is rows where each column holds finite values throughout or none at all; the rows
    before the first that is not calm for sure are judged calm, as ``judge_row`` would judge them,
    each seeing the ones before it in the rings (tests hold the two to the same rings and findings).
    """
    rows = values[start:]
    missing = np.isnan(rows)
    same = (missing == missing[0]).all(axis=1) & ~np.isinf(rows).any(axis=1)
    n = len(rows) if same.all() else int(np.argmin(same))
    if n == 0:
        return start
    live = ~missing[0]
    c, block = cols[live], rows[:n, live]
    cfg = rule.config
    recent = oldest_first(rule.recent[:, c], rule.recent_slot[c])
    with np.errstate(invalid="ignore"):
        # row t's largest recent calm value: of the ring's last RECENT_STEPS values before it (its length)
        history = np.concatenate([recent, block])
        top = np.fmax.reduce(np.lib.stride_tricks.sliding_window_view(history, len(rule.recent), axis=0)[:n], axis=-1)
        previous = np.concatenate([rule.last_calm[c][None, :], block[:-1]])
        warm = (rule.judged[c][None, :] + np.arange(n)[:, None]) >= cfg.exploding_warmup_steps
        sure = ((block <= cfg.exploding_abs_norm) & ~((previous > 0) & (block >= cfg.exploding_jump * previous))
                & (~warm | (block <= cfg.exploding_factor * top)))  # fmt: skip
    m = n if sure.all() else int(np.argmin(sure.all(axis=1)))
    if m == 0:
        return start
    for ring, slots in ((rule.recent, rule.recent_slot), (rule.level, rule.level_slot)):
        size = len(ring)  # RECENT_STEPS, LEVEL_STEPS
        kept = np.arange(max(m - size, 0), m)  # the writes that the later ones of the stretch do not overwrite
        ring[(slots[c][None, :] + kept[:, None]) % size, c[None, :]] = block[kept]
        slots[c] = (slots[c] + m) % size
    if len(c):
        rule.last_calm[c] = block[m - 1]
    rule.exploded_streak[cols] = 0
    rule.judged[cols] += m
    return start + m

