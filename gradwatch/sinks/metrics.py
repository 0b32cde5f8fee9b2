"""Sends flushed scalars to any tracker: callables receiving ``(metrics, step)``."""

from __future__ import annotations

from typing import Callable

from ..flush.window import Window
from .scalars import as_dicts, window_scalars

MetricsCallback = Callable[[dict[str, float], int], None]


def window_metrics(w: Window, total_alerts: int) -> list[tuple[int, dict[str, float]]]:
    """(step, {tag: value}) for every step a window describes, in step order.

    The tags are TensorBoard's (``gradwatch/grad_norm/<layer>``, ``gradwatch/global/grad_norm``,
    ...). Values of past steps arrive at flush time: a tracker that wants its own step to
    grow (W&B) should take ``step`` as a value with its own step metric (see the README).
    """
    return as_dicts(window_scalars(w, total_alerts))


def describe(callback: object) -> str:
    """A short name for a callback in log lines."""
    owner = getattr(callback, "__self__", None)
    name = getattr(callback, "__qualname__", None) or type(callback).__name__
    return f"{type(owner).__name__}.{getattr(callback, '__name__', name)}" if owner is not None else name
