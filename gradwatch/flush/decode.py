"""The window decoder: the host copy of the (reduced) buffer as per-layer statistics."""

from __future__ import annotations

from typing import Any

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
    ok = host[STEP_FAILED][:n] == 0
    sampled = layout.sampled_slots[:n]
    params = _parameter_statistics(host, n, layout, ok, sampled)
    outputs = _output_statistics(host, n, layout, ok, sampled, dead_eps)
    ratios = _update_ratios(host, layout, update_steps)
    estimates = _update_estimates(host, n, layout)
    skipped = None
    if scaler_in_use:
        # GradScaler skips exactly the steps whose gradients hold an Inf/NaN.
        nonfinite, norm, has_grad = params["nonfinite"], params["global_grad_norm"], params["has_grad"]
        skipped = ((nonfinite.sum(axis=1) > 0) | (~np.isfinite(norm) & has_grad.any(axis=1))) & ok
    return Window(
        steps=list(steps), layers=list(layout.names), unit_counts=layout.unit_count.copy(),
        param_numel=layout.param_numel.copy(), step_orders=forward_orders(host[FWD_ORDER][:n], sampled),
        skipped=skipped, sampled=sampled.copy(), update_steps=list(update_steps),
        **params, **outputs, **ratios, **estimates,
    )  # fmt: skip


def _parameter_statistics(host: dict[str, np.ndarray], n: int, layout: Layout, ok: np.ndarray,
                          sampled: np.ndarray) -> dict[str, np.ndarray]:  # fmt: skip
    """grad_norm, grad_max, nonfinite, has_grad and the global norm, per step and layer."""
    present = host[PARAM_PRESENT][:n] > 0

    def per_layer(values: np.ndarray, how: str = "sum") -> np.ndarray:
        return _per_layer(values, layout.param_layer, len(layout.names), how)

    with np.errstate(invalid="ignore"):
        sumsq = per_layer(np.where(present, host[PARAM_SQ][:n], 0.0), "sum")
        # A layer that was not called at a step gives no sample there, whatever zero_grad left in
        # its .grad (set_to_none=False keeps zeros: an idle expert is not "vanishing").
        idle = (sumsq == 0) & ~_called(host[FWD_SUM][:n], host[FWD_ORDER][:n])
        has_grad = (per_layer(present.astype(np.float64), "sum") > 0) & ok[:, None] & ~idle
        grad_norm = np.where(has_grad, np.sqrt(sumsq), np.nan)
        max_t = np.where(present, host[PARAM_MAX][:n], -np.inf)
        grad_max = np.where(has_grad & sampled[:, None], per_layer(max_t, "max"), np.nan)
        counts = np.rint(np.where(present, host[PARAM_NONFINITE][:n], 0.0))
        nonfinite = np.where(has_grad, per_layer(counts, "sum"), 0.0)
        global_norm = np.sqrt(np.where(has_grad, sumsq, 0.0).sum(axis=1))
        global_norm = np.where(has_grad.any(axis=1), global_norm, np.nan)
    # Non-finite counts are exact at every step on the CPU path (a host check of the sums);
    # elsewhere they are taken on sampled steps, the others know "finite or not".
    counted = sampled | layout.counts_every_step
    return {"grad_norm": grad_norm, "grad_max": grad_max, "nonfinite": nonfinite, "has_grad": has_grad,
            "global_grad_norm": global_norm, "nonfinite_counted": counted.copy()}  # fmt: skip


def _called(step_sums: np.ndarray, first_calls: np.ndarray) -> np.ndarray:
    """[step, layer] whether the layer ran at each step: exactly on sampled steps (the forward
    clock of its first call), else from the forward check's sums of the step (a step without a
    call leaves its sum at zero; an output summing to exactly 0.0 on an unsampled step reads as
    no call: only its zero gradient is left out)."""
    return (step_sums != 0) | (first_calls > 0)  # NaN != 0: a non-finite output is a call


def _output_statistics(host: dict[str, np.ndarray], n: int, layout: Layout, ok: np.ndarray, sampled: np.ndarray,
                       dead_eps: float) -> dict[str, Any]:  # fmt: skip
    """out_grad_norm, the forward check, dead-unit evidence and the declared output statistics."""
    n_layers = len(layout.names)
    out_sq, calls, samples = (host[OUT_GRAD][:n, k] for k in range(3))
    seen_out = (calls > 0) & ok[:, None]
    with np.errstate(invalid="ignore"):
        out_grad_norm = np.where(seen_out, np.sqrt(out_sq), np.nan)
    # FWD_SUM holds each step's sums of the outputs: non-finite at the steps whose outputs were.
    fwd_nonfinite = ~np.isfinite(host[FWD_SUM][:n]) & ok[:, None]
    judged = np.where(ok[:, None], samples, 0.0)
    rows_seen = rows_seen_of(judged)
    dead, unit_alive = dead_unit_fractions(host[UNIT_ACC], layout, rows_seen, dead_eps)
    output_stats: dict[str, np.ndarray] = {}
    if accumulator_count():  # the declared output statistics, on sampled steps that ran the layer
        recorded = (sampled[:, None] & ok[:, None]) & np.ones((1, n_layers), dtype=bool)
        for name, values in decode_all(host[OUT_STATS][:n]).items():
            output_stats[name] = np.where(recorded, values, np.nan)
    return {"out_grad_norm": out_grad_norm, "out_seen": seen_out, "fwd_nonfinite": fwd_nonfinite,
            "rows_seen": rows_seen, "steps_judged": (judged > 0).sum(axis=0).astype(np.int64),
            "dead_fraction": dead, "unit_alive": unit_alive, "output_stats": output_stats}  # fmt: skip


def rows_seen_of(samples: np.ndarray) -> np.ndarray:
    """Per layer, the samples behind its dead-unit evidence: ``samples`` [steps, layer] (failed steps
    already zeroed) summed over steps, as integers."""
    return np.rint(samples.sum(axis=0)).astype(np.int64)


def dead_unit_fractions(units: np.ndarray, layout: Layout, rows_seen: np.ndarray,
                dead_eps: float) -> tuple[np.ndarray, list[np.ndarray | None]]:  # fmt: skip
    """Per layer: the dead fraction and which units were alive (None: not judged)."""
    n_layers = len(layout.names)
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
    return dead, unit_alive


def _update_ratios(host: dict[str, np.ndarray], layout: Layout, update_steps: list[int]) -> dict[str, Any]:
    """update_ratio at the measured optimizer steps, and its judged (weight matrices only) form."""
    if not (layout.track_updates and update_steps):
        return {"update_ratio": None, "judged_update_ratio": None, "judged_weight_rms": None}
    u, n_layers = len(update_steps), len(layout.names)
    seen = host[UPDATE_SEEN][:u] > 0
    upd = np.where(seen, host[UPDATE_SQ][:u], 0.0)
    wsq = np.where(seen, host[WEIGHT_SQ][:u], 0.0)
    matrices = seen & (layout.param_ndim >= 2)[None, :]  # weight matrices and kernels (not norms, biases, scales)

    def layer_sum(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return _per_layer(np.where(mask, values, 0.0), layout.param_layer, n_layers)

    measured = layer_sum(seen.astype(np.float64), seen) > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        update_ratio = np.where(measured, np.sqrt(layer_sum(upd, seen) / layer_sum(wsq, seen)), np.nan)
        weights_sq = layer_sum(wsq, matrices)
        weights_n = layer_sum(np.broadcast_to(layout.tensor_numel, wsq.shape).astype(np.float64), matrices)
        judged_ratio = np.sqrt(layer_sum(upd, matrices) / weights_sq)
        weight_rms = np.sqrt(weights_sq / weights_n)
    judged_ratio = np.where(layer_sum(matrices.astype(np.float64), matrices) > 0, judged_ratio, np.nan)
    return {"update_ratio": update_ratio, "judged_update_ratio": judged_ratio, "judged_weight_rms": weight_rms}


def _update_estimates(host: dict[str, np.ndarray], n: int, layout: Layout) -> dict[str, Any]:
    """The judged update ratio estimated at every step from a fixed sample of each weight matrix."""
    if not (layout.track_updates and len(layout.sample_columns)):
        return {"estimated_update_ratio": None, "estimated_weight_rms": None}
    owner = layout.param_layer[layout.sample_columns]
    n_layers = len(layout.names)

    def per_layer(values: np.ndarray) -> np.ndarray:
        return _per_layer(values, owner, n_layers)

    upd, wsq = host[SAMPLE_UPDATE_SQ][:n], host[SAMPLE_WEIGHT_SQ][:n]
    with np.errstate(divide="ignore", invalid="ignore"):
        weights = per_layer(wsq)
        estimated = np.where(weights > 0, np.sqrt(per_layer(upd) / weights), np.nan)
        numel = np.broadcast_to(layout.sample_numel, wsq.shape).astype(float)
        estimated_rms = np.sqrt(weights / per_layer(numel))
    return {"estimated_update_ratio": estimated, "estimated_weight_rms": estimated_rms}


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
