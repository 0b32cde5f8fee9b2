"""Detector state in checkpoints: plain JSON values, columns matched by layer name."""

from __future__ import annotations

import numpy as np


def nullable(values: np.ndarray) -> list:
    """Floats for a state_dict, None for NaN (JSON has no NaN)."""
    return [None if np.isnan(v) else float(v) for v in values]


def by_name(saved: list, saved_names: list[str], names: list[str]) -> np.ndarray:
    """A float vector over ``names`` from values saved under ``saved_names`` (NaN: none saved)."""
    values = dict(zip(saved_names, saved))
    return np.array([np.nan if values.get(n) is None else values[n] for n in names], dtype=float)


def columns_from(saved: list, saved_names: list[str], names: list[str], rows: int) -> np.ndarray:
    """A [rows, len(names)] array from per-column lists saved under ``saved_names``."""
    values = dict(zip(saved_names, saved))
    out = np.full((rows, len(names)), np.nan)
    for j, name in enumerate(names):
        column = [np.nan if v is None else v for v in values.get(name, [])][:rows]
        out[: len(column), j] = column
    return out
