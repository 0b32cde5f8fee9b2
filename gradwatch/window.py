"""Host-side view of one flushed window of statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import recorder as R


@dataclass
class Window:
    """The statistics of up to ``flush_every`` steps, on the host, as numpy arrays.

    Arrays indexed ``[step, layer]`` hold NaN where a statistic does not exist
    (a layer that got no gradient that step, an output gradient never seen).
    """

    steps: list[int]
    layers: list[str]
    grad_norm: np.ndarray
    grad_max: np.ndarray
    nonfinite: np.ndarray
    out_grad_norm: np.ndarray
    fwd_nonfinite: np.ndarray  # bool [step, layer]: some output of the layer was NaN/Inf
    has_grad: np.ndarray  # bool [step, layer]: the layer's parameters got a gradient
    out_seen: np.ndarray  # bool [step, layer]: an output gradient reached the layer
    unit_counts: np.ndarray  # [layer] number of units (0 until the layer ran)
    param_numel: np.ndarray  # [layer] number of gradient elements, for RMS
    dead_fraction: np.ndarray  # [layer], NaN where no output gradient was seen in the window
    global_grad_norm: np.ndarray  # [step]
    step_orders: list[tuple[list[int], list[int]]] = field(default_factory=list)
    skipped: np.ndarray | None = None  # bool [step]: GradScaler skipped the optimizer step

    @property
    def grad_rms(self) -> np.ndarray:
        """Root-mean-square gradient per element: independent of the layer's size."""
        return self.grad_norm / np.sqrt(np.maximum(self.param_numel, 1))[None, :]


def build_window(
    host: dict[str, np.ndarray],
    steps: list[int],
    layers: list[str],
    param_numel: np.ndarray,
    out_calls: np.ndarray,
    param_present: np.ndarray,
    unit_offset: list[int | None],
    unit_count: list[int],
    dead_eps: float,
    step_orders: list[tuple[list[int], list[int]]],
    scaler_in_use: bool,
) -> Window:
    """Decode a flushed buffer (already on the host) into a ``Window``."""
    n = len(steps)
    has_grad = param_present[:n] > 0
    seen_out = out_calls[:n] > 0
    sumsq = host[R.PARAM_SUMSQ][:n].astype(np.float64)
    with np.errstate(invalid="ignore"):
        grad_norm = np.where(has_grad, np.sqrt(sumsq), np.nan)
        grad_max = np.where(has_grad, host[R.PARAM_MAX][:n], np.nan)
        nonfinite = np.where(has_grad, host[R.PARAM_NONFINITE][:n], 0.0)
        out_grad_norm = np.where(
            seen_out, np.sqrt(host[R.OUT_SUMSQ][:n].astype(np.float64)), np.nan
        )
        global_norm = np.sqrt(np.where(has_grad, sumsq, 0.0).sum(axis=1))
        global_norm = np.where(has_grad.any(axis=1), global_norm, np.nan)
    fwd_nonfinite = ~np.isfinite(host[R.FWD_NONFINITE][:n])  # sums of the outputs

    units = host[R.UNIT_SUMSQ]
    dead = np.full(len(layers), np.nan)
    window_seen = seen_out.any(axis=0)
    for i, offset in enumerate(unit_offset):
        if offset is None or not window_seen[i]:
            continue
        # Per unit: a non-negative accumulator that is zero exactly when the unit's
        # output gradient was zero for every sample (its L2 norm when dead_eps > 0).
        unit_value = np.sqrt(np.abs(units[offset : offset + unit_count[i]].astype(np.float64)))
        # NaN (non-finite gradients) is not a dead unit.
        dead[i] = float(np.mean(unit_value <= dead_eps))

    skipped = None
    if scaler_in_use:
        # GradScaler skips exactly the steps whose gradients hold an Inf/NaN.
        skipped = (nonfinite.sum(axis=1) > 0) | (~np.isfinite(global_norm) & has_grad.any(axis=1))
    return Window(
        steps=list(steps),
        layers=layers,
        grad_norm=grad_norm,
        grad_max=grad_max,
        nonfinite=nonfinite,
        out_grad_norm=out_grad_norm,
        fwd_nonfinite=fwd_nonfinite,
        has_grad=has_grad,
        out_seen=seen_out,
        unit_counts=np.asarray(unit_count, dtype=np.int64),
        param_numel=param_numel,
        dead_fraction=dead,
        global_grad_norm=global_norm,
        step_orders=list(step_orders[:n]),
        skipped=skipped,
    )
