"""The window decoder: the host copy of the (reduced) buffer as per-layer statistics.

Every statistic is decoded by its entry in ``registry/statistics.py``; this module puts them
together into a :class:`Window`.
"""

from __future__ import annotations

from dataclasses import fields as dataclass_fields

import numpy as np

from ..registry.states import FWD_ORDER
from ..registry.statistics import Decoding, all_statistics
from .readback import forward_order
from .window import Window


def build_window(host: dict[str, np.ndarray], steps: list[int], layout, update_steps: list[int],
                 dead_eps: float, scaler_in_use: bool) -> Window:  # fmt: skip
    """Decode the host copy of the buffer into a per-layer ``Window``.

    Args:
        host: every state as a float64 numpy array (``StatBuffer.to_host``).
        steps: the window's steps.
        layout: the rank's ``Layout`` or the union's ``MeshLayout``.
        update_steps: the optimizer steps of the update rows.
        dead_eps: a unit is dead when its output gradient's norm is at most this.
        scaler_in_use: a GradScaler may skip steps.
    """
    d = Decoding(host, steps, layout, update_steps, dead_eps, scaler_in_use)
    fields, extra_stats = {}, {}
    with np.errstate(invalid="ignore", divide="ignore"):
        for statistic in all_statistics():
            table = statistic.decode(d)
            if statistic.name in _WINDOW_FIELDS:
                fields[statistic.name] = table
            elif table is not None:  # a statistic without a field of its own
                extra_stats[statistic.name] = table
    return Window(
        steps=list(steps), layers=list(layout.names), unit_counts=layout.unit_count.copy(),
        param_numel=layout.param_numel.copy(), step_orders=forward_orders(d.rows(FWD_ORDER), d.sampled),
        sampled=d.sampled.copy(), update_steps=list(update_steps), extra_stats=extra_stats, **fields,
    )  # fmt: skip


_WINDOW_FIELDS = frozenset(f.name for f in dataclass_fields(Window))


def forward_orders(first_calls: np.ndarray, sampled: np.ndarray) -> list[tuple[list[int], list[int]]]:
    """Per step: (layers in the order of their first forward call, the reverse of it as the backward order).

    The order is recorded on sampled steps (the clock value at each layer's first call, counting
    down); a step in between takes its window's latest sampled order, slot 0 being always sampled.
    Backward runs the forward order in reverse (autograd orders nodes by creation).
    """
    orders: list[tuple[list[int], list[int]]] = []
    current: list[int] = []
    for t in range(first_calls.shape[0]):
        if sampled[t]:
            current = forward_order(first_calls[t])
        orders.append((current, current[::-1]))
    return orders
