"""The window decoder: the host copy of the (reduced) buffer as per-layer statistics."""

from __future__ import annotations

import numpy as np

from ..capture.layout import (
    OUT_STATS, FWD_ORDER, FWD_SUM, OUT_GRAD, PARAM_MAX, PARAM_NONFINITE, PARAM_PRESENT, PARAM_SQ, SAMPLE_UPDATE_SQ,
    SAMPLE_WEIGHT_SQ, STEP_FAILED, UNIT_ACC, UPDATE_SEEN, UPDATE_SQ, WEIGHT_SQ, Layout,
)  # fmt: skip
from ..registry import accumulator_count, decode_all
from .readback import forward_order
from .window import Window


def build_window(host: dict[str, np.ndarray], steps: list[int], layout: Layout, update_steps: list[int],
                 dead_eps: float, scaler_in_use: bool) -> Window:  # fmt: skip
    """Decode the host copy of the buffer into a per-layer ``Window``."""
    n = len(steps)
    n_layers = len(layout.names)
    owner = layout.param_layer
    ok = host[STEP_FAILED][:n] == 0
    present = host[PARAM_PRESENT][:n] > 0

    def per_layer(values: np.ndarray, how: str = "sum") -> np.ndarray:
        return _per_layer(values, owner, n_layers, how)

    sampled = layout.sampled_slots[:n]
    with np.errstate(invalid="ignore"):
        sq_t = np.where(present, host[PARAM_SQ][:n], 0.0)
        has_grad = (per_layer(present.astype(np.float64), "sum") > 0) & ok[:, None]
        sumsq = per_layer(sq_t, "sum")
        grad_norm = np.where(has_grad, np.sqrt(sumsq), np.nan)
        max_t = np.where(present, host[PARAM_MAX][:n], -np.inf)
        grad_max = np.where(has_grad & sampled[:, None], per_layer(max_t, "max"), np.nan)
        counts = np.rint(np.where(present, host[PARAM_NONFINITE][:n], 0.0))
        nonfinite = np.where(has_grad, per_layer(counts, "sum"), 0.0)
        # Non-finite counts are exact at every step on the CPU path (a host check of the sums);
        # elsewhere they are taken on sampled steps, the others know "finite or not".
        counted = sampled | layout.counts_every_step
        out_sq, calls, samples = (host[OUT_GRAD][:n, k] for k in range(3))
        seen_out = (calls > 0) & ok[:, None]
        out_grad_norm = np.where(seen_out, np.sqrt(out_sq), np.nan)
        global_norm = np.sqrt(np.where(has_grad, sumsq, 0.0).sum(axis=1))
        global_norm = np.where(has_grad.any(axis=1), global_norm, np.nan)
    # FWD_SUM holds running sums over the window: non-finite from the step an output first was.
    running_bad = ~np.isfinite(host[FWD_SUM][:n])
    fwd_nonfinite = running_bad & ~np.vstack([np.zeros((1, n_layers), dtype=bool), running_bad[:-1]]) & ok[:, None]
    judged = np.where(ok[:, None], samples, 0.0)
    rows_seen = np.rint(judged.sum(axis=0)).astype(np.int64)
    steps_judged = (judged > 0).sum(axis=0).astype(np.int64)

    units = host[UNIT_ACC]
    dead = np.full(n_layers, np.nan)
    unit_alive: list[np.ndarray | None] = [None] * n_layers
    for i in range(n_layers):
        count = layout.unit_count[i]
        if count == 0 or rows_seen[i] == 0:
            continue
        offset = layout.unit_offset[i]
        # Per unit: a non-negative accumulator that is zero exactly when the unit's output
        # gradient was zero for every sample (its sum of squares when dead_eps > 0).
        unit_value = np.sqrt(units[offset : offset + count])
        unit_alive[i] = ~(unit_value <= dead_eps)  # NaN (non-finite) is not dead
        dead[i] = 1.0 - float(np.mean(unit_alive[i]))

    update_ratio = judged_ratio = weight_rms = None
    if layout.track_updates and update_steps:
        u = len(update_steps)
        seen = host[UPDATE_SEEN][:u] > 0
        upd = np.where(seen, host[UPDATE_SQ][:u], 0.0)
        wsq = np.where(seen, host[WEIGHT_SQ][:u], 0.0)
        matrices = seen & (layout.param_ndim >= 2)[None, :]  # weight matrices and kernels (not norms, biases, scales)

        def layer_sum(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
            return per_layer(np.where(mask, values, 0.0))

        measured = layer_sum(seen.astype(np.float64), seen) > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            update_ratio = np.where(measured, np.sqrt(layer_sum(upd, seen) / layer_sum(wsq, seen)), np.nan)
            weights_sq = layer_sum(wsq, matrices)
            weights_n = layer_sum(np.broadcast_to(layout.tensor_numel, wsq.shape).astype(np.float64), matrices)
            judged_ratio = np.sqrt(layer_sum(upd, matrices) / weights_sq)
            weight_rms = np.sqrt(weights_sq / weights_n)
        judged_ratio = np.where(layer_sum(matrices.astype(np.float64), matrices) > 0, judged_ratio, np.nan)

    estimated = estimated_rms = None
    if layout.track_updates and len(layout.sample_columns):
        owner_s = owner[layout.sample_columns]

        def per_layer_s(values: np.ndarray) -> np.ndarray:
            return _per_layer(values, owner_s, n_layers)

        upd_s, wsq_s = host[SAMPLE_UPDATE_SQ][:n], host[SAMPLE_WEIGHT_SQ][:n]
        with np.errstate(divide="ignore", invalid="ignore"):
            weights = per_layer_s(wsq_s)
            estimated = np.where(weights > 0, np.sqrt(per_layer_s(upd_s) / weights), np.nan)
            estimated_rms = np.sqrt(weights / per_layer_s(np.broadcast_to(layout.sample_numel, wsq_s.shape).astype(float)))

    output_stats: dict[str, np.ndarray] = {}
    if accumulator_count():  # the declared output statistics, on sampled steps that ran the layer
        recorded = (sampled[:, None] & ok[:, None]) & np.ones((1, n_layers), dtype=bool)
        for name, values in decode_all(host[OUT_STATS][:n]).items():
            output_stats[name] = np.where(recorded, values, np.nan)

    skipped = None
    if scaler_in_use:
        # GradScaler skips exactly the steps whose gradients hold an Inf/NaN.
        skipped = ((nonfinite.sum(axis=1) > 0) | (~np.isfinite(global_norm) & has_grad.any(axis=1))) & ok
    return Window(
        steps=list(steps),
        layers=list(layout.names),
        grad_norm=grad_norm,
        grad_max=grad_max,
        nonfinite=nonfinite,
        out_grad_norm=out_grad_norm,
        fwd_nonfinite=fwd_nonfinite,
        has_grad=has_grad,
        out_seen=seen_out,
        unit_counts=layout.unit_count.copy(),
        param_numel=layout.param_numel.copy(),
        dead_fraction=dead,
        global_grad_norm=global_norm,
        step_orders=forward_orders(host[FWD_ORDER][:n], sampled),
        skipped=skipped,
        rows_seen=rows_seen,
        steps_judged=steps_judged,
        unit_alive=unit_alive,
        sampled=sampled.copy(),
        nonfinite_counted=counted.copy(),
        update_steps=list(update_steps),
        update_ratio=update_ratio,
        judged_update_ratio=judged_ratio,
        judged_weight_rms=weight_rms,
        estimated_update_ratio=estimated,
        estimated_weight_rms=estimated_rms,
        output_stats=output_stats,
    )


def _per_layer(values: np.ndarray, owner: np.ndarray, n_layers: int, how: str = "sum") -> np.ndarray:
    """[rows, column] -> [rows, layer]: the sum (or maximum) over each layer's columns
    (``owner``: the layer of each column)."""
    rows = values.shape[0]
    if how == "sum":
        out = np.zeros((rows, n_layers))
        np.add.at(out.T, owner, values.T)
    else:
        out = np.full((rows, n_layers), -np.inf)
        np.maximum.at(out.T, owner, values.T)
    return out


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
