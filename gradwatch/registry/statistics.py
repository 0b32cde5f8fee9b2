"""Every statistic a window holds, declared once: how it is decoded from the reduced buffer
(``states.py``), where it is written (at each step, at the window's end, at the optimizer steps)
and under which tag, and how the gradwatch tab draws it.

``flush/decode.py`` builds a :class:`~gradwatch.flush.window.Window` from these entries,
``sinks/scalars.py`` writes the tagged ones, the tab (``dashboard/data.py``) labels them. An entry
without a tag (``written=None``) is evidence the detectors read (which steps had a gradient, which
units were alive). The output statistics (``outputs.py``) join as entries of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Literal

import numpy as np

from . import outputs
from .outputs import accumulator_count, decode_all
from .states import (
    DEAD_SUSPECTED, FWD_ORDER, FWD_SUM, OUT_GRAD, OUT_STATS, PARAM_MAX, PARAM_NONFINITE, PARAM_PRESENT, PARAM_SQ,
    SAMPLE_UPDATE_SQ, SAMPLE_WEIGHT_SQ, STEP_FAILED, STEP_UNSAMPLED, UNIT_ACC, UPDATE_SEEN, UPDATE_SQ, WEIGHT_SQ,
)  # fmt: skip


class Decoding:
    """The host copy of one (reduced) window and what several statistics share, each worked out once.

    Args:
        host: every state as a float64 numpy array (``StatBuffer.to_host``).
        steps: the window's steps (its first ``len(steps)`` rows).
        layout: a ``capture.layout.Layout`` or ``distributed.mesh.MeshLayout``.
        update_steps: the optimizer steps of the update rows.
        dead_eps: a unit is dead when its output gradient's norm is at most this.
        scaler_in_use: a GradScaler may skip steps (their gradients held an Inf/NaN).
    """

    def __init__(self, host: dict[str, np.ndarray], steps: list[int], layout: Any, update_steps: list[int],
                 dead_eps: float, scaler_in_use: bool) -> None:  # fmt: skip
        self.host, self.layout, self.update_steps = host, layout, update_steps
        self.n = len(steps)
        self.n_layers = len(layout.names)
        self.dead_eps, self.scaler_in_use = dead_eps, scaler_in_use
        self.ok = host[STEP_FAILED][: self.n] == 0
        self.sampled = host[STEP_UNSAMPLED][: self.n] == 0  # sampled on every rank

    def rows(self, state: str) -> np.ndarray:
        """The window's rows of a per-step state."""
        return self.host[state][: self.n]

    def per_layer(self, values: np.ndarray, owner: np.ndarray | None = None, how: str = "sum") -> np.ndarray:
        """[rows, column] -> [rows, layer] over each layer's columns (``owner``: the parameter columns')."""
        return per_layer(values, self.layout.param_layer if owner is None else owner, self.n_layers, how)

    @cached_property
    def present(self) -> np.ndarray:
        return self.rows(PARAM_PRESENT) > 0

    @cached_property
    def layer_sumsq(self) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return self.per_layer(np.where(self.present, self.rows(PARAM_SQ), 0.0))

    @cached_property
    def has_grad(self) -> np.ndarray:
        # A layer that was not called at a step gives no sample there, whatever zero_grad left in
        # its .grad (set_to_none=False keeps zeros: an idle expert is not "vanishing").
        idle = (self.layer_sumsq == 0) & ~layer_ran(self.rows(FWD_SUM), self.rows(FWD_ORDER))
        return (self.per_layer(self.present.astype(np.float64)) > 0) & self.ok[:, None] & ~idle

    @cached_property
    def samples_judged(self) -> np.ndarray:
        """[step, layer] the samples behind the dead-unit evidence (failed steps zeroed)."""
        return np.where(self.ok[:, None], self.rows(OUT_GRAD)[:, 2], 0.0)

    @cached_property
    def dead_units(self) -> tuple[np.ndarray, list[np.ndarray | None]]:
        return dead_unit_fractions(self.host[UNIT_ACC], self.layout, rows_seen_of(self.samples_judged), self.dead_eps)

    @cached_property
    def updates(self) -> dict[str, np.ndarray] | None:
        return update_ratios(self) if self.layout.track_updates and self.update_steps else None

    @cached_property
    def estimates(self) -> dict[str, np.ndarray] | None:
        return update_estimates(self) if self.layout.track_updates and len(self.layout.sample_columns) else None


def layer_ran(step_sums: np.ndarray, first_calls: np.ndarray) -> np.ndarray:
    """[step, layer] whether the layer ran at each step: exactly on sampled steps (the forward
    clock of its first call), else from the forward check's sums of the step (a step without a
    call leaves its sum at zero; an output summing to exactly 0.0 on an unsampled step reads as
    no call: only its zero gradient is left out)."""
    return (step_sums != 0) | (first_calls > 0)  # NaN != 0: a non-finite output is a call


def per_layer(values: np.ndarray, owner: np.ndarray, n_layers: int, how: str = "sum") -> np.ndarray:
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


def rows_seen_of(samples: np.ndarray) -> np.ndarray:
    """Per layer, the samples behind its dead-unit evidence: ``samples`` [steps, layer] (failed steps
    already zeroed) summed over steps, as integers."""
    return np.rint(samples.sum(axis=0)).astype(np.int64)


def dead_unit_fractions(units: np.ndarray, layout: Any, rows_seen: np.ndarray,
                        dead_eps: float) -> tuple[np.ndarray, list[np.ndarray | None]]:  # fmt: skip
    """Per layer: the dead fraction and which units were alive (None: not judged)."""
    dead = np.full(len(layout.names), np.nan)
    unit_alive: list[np.ndarray | None] = [None] * len(layout.names)
    for i, count in enumerate(layout.unit_count):
        if count == 0 or rows_seen[i] == 0:
            continue
        offset = layout.unit_offset[i]
        # Per unit: a non-negative accumulator that is zero exactly when the unit's output
        # gradient was zero for every sample (its sum of squares when dead_eps > 0).
        unit_value = np.sqrt(units[offset : offset + count])
        unit_alive[i] = ~(unit_value <= dead_eps)  # NaN (non-finite) is not dead
        dead[i] = 1.0 - float(np.mean(unit_alive[i]))
    return dead, unit_alive


def update_ratios(d: Decoding) -> dict[str, np.ndarray]:
    """update_ratio at the measured optimizer steps, and its judged (weight matrices only) form."""
    layout, u = d.layout, len(d.update_steps)
    seen = d.host[UPDATE_SEEN][:u] > 0
    upd = np.where(seen, d.host[UPDATE_SQ][:u], 0.0)
    wsq = np.where(seen, d.host[WEIGHT_SQ][:u], 0.0)
    matrices = seen & (layout.param_ndim >= 2)[None, :]  # weight matrices and kernels (not norms, biases, scales)

    def layer_sum(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return d.per_layer(np.where(mask, values, 0.0))

    measured = layer_sum(seen.astype(np.float64), seen) > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        update_ratio = np.where(measured, np.sqrt(layer_sum(upd, seen) / layer_sum(wsq, seen)), np.nan)
        weights_sq = layer_sum(wsq, matrices)
        weights_n = layer_sum(np.broadcast_to(layout.tensor_numel, wsq.shape).astype(np.float64), matrices)
        judged_ratio = np.sqrt(layer_sum(upd, matrices) / weights_sq)
        weight_rms = np.sqrt(weights_sq / weights_n)
    judged_ratio = np.where(layer_sum(matrices.astype(np.float64), matrices) > 0, judged_ratio, np.nan)
    return {"update_ratio": update_ratio, "judged_update_ratio": judged_ratio, "judged_weight_rms": weight_rms}


def update_estimates(d: Decoding) -> dict[str, np.ndarray]:
    """The judged update ratio estimated at every step from a fixed sample of each weight matrix."""
    owner = d.layout.param_layer[d.layout.sample_columns]
    upd, wsq = d.rows(SAMPLE_UPDATE_SQ), d.rows(SAMPLE_WEIGHT_SQ)
    with np.errstate(divide="ignore", invalid="ignore"):
        weights = d.per_layer(wsq, owner)
        estimated = np.where(weights > 0, np.sqrt(d.per_layer(upd, owner) / weights), np.nan)
        numel = np.broadcast_to(d.layout.sample_numel, wsq.shape).astype(float)
        estimated_rms = np.sqrt(weights / d.per_layer(numel, owner))
    return {"estimated_update_ratio": estimated, "estimated_weight_rms": estimated_rms}


def _grad_max(d: Decoding) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        layer_max = d.per_layer(np.where(d.present, d.rows(PARAM_MAX), -np.inf), how="max")
    return np.where(d.has_grad & d.sampled[:, None], layer_max, np.nan)


def _nonfinite(d: Decoding) -> np.ndarray:
    counts = np.rint(np.where(d.present, d.rows(PARAM_NONFINITE), 0.0))
    return np.where(d.has_grad, d.per_layer(counts), 0.0)


def _global_grad_norm(d: Decoding) -> np.ndarray:
    norm = np.sqrt(np.where(d.has_grad, d.layer_sumsq, 0.0).sum(axis=1))
    return np.where(d.has_grad.any(axis=1), norm, np.nan)


def _out_grad_norm(d: Decoding) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.where(_out_seen(d), np.sqrt(d.rows(OUT_GRAD)[:, 0]), np.nan)


def _out_seen(d: Decoding) -> np.ndarray:
    # Only on steps every rank sampled: a step one rank recorded in full alone (a dead-unit
    # confirmation it started: flush/unit_probe.py) holds that rank's share only.
    return (d.rows(OUT_GRAD)[:, 1] > 0) & (d.ok & d.sampled)[:, None]


def _skipped(d: Decoding) -> np.ndarray | None:
    if not d.scaler_in_use:
        return None
    # GradScaler skips exactly the steps whose gradients hold an Inf/NaN.
    norm = _global_grad_norm(d)
    return ((_nonfinite(d).sum(axis=1) > 0) | (~np.isfinite(norm) & d.has_grad.any(axis=1))) & d.ok


def _output_statistics(d: Decoding) -> dict[str, np.ndarray]:
    if not accumulator_count():
        return {}
    # on sampled steps that ran the layer (NaN elsewhere: nothing was accumulated)
    recorded = (d.sampled & d.ok)[:, None] & np.ones((1, d.n_layers), dtype=bool)
    return {name: np.where(recorded, values, np.nan) for name, values in decode_all(d.rows(OUT_STATS)).items()}


def _recorded_where_finite(table: np.ndarray, w: Any) -> np.ndarray:
    return np.isfinite(table)


@dataclass(frozen=True)
class Statistic:
    """One statistic of a window.

    Args:
        name: the Window attribute it fills (one without a field of its own: a key of
            ``Window.extra_stats``) and, when written, its tag ``gradwatch/<name>/<layer>``.
        decode: ``fn(Decoding) -> table`` (``[step, layer]``, ``[layer]`` or ``[update step, layer]``;
            None where a window has none).
        written: where its values are written: "step" (each step, where ``recorded``), "window"
            (the window's last step, where finite), "update" (each measured optimizer step, where
            finite), None (not written: evidence for the detectors).
        recorded: ``fn(table, window) -> bool mask`` of the per-step values that exist.
        label: the tab's menu label.
        log_scale: the tab draws it on a log axis.
        description: what the value means.
    """

    name: str
    decode: Callable[[Decoding], Any]
    written: Literal["step", "window", "update"] | None = None
    recorded: Callable[[np.ndarray, Any], np.ndarray] = _recorded_where_finite
    label: str = ""
    log_scale: bool = False
    description: str = ""


def _sampled(w: Any) -> Any:
    return w.sampled[:, None] if w.sampled is not None else True


def _counted(w: Any) -> Any:
    return w.nonfinite_counted[:, None] if w.nonfinite_counted is not None else True


#: The statistics of the gradient and the update; ``all_statistics()`` adds the output statistics.
STATISTICS: tuple[Statistic, ...] = (
    Statistic("grad_norm", lambda d: np.where(d.has_grad, np.sqrt(d.layer_sumsq), np.nan), "step",
              lambda t, w: w.has_grad, "grad_norm", True, "L2 norm of the layer's parameter gradients"),
    Statistic("grad_max", _grad_max, "step", lambda t, w: w.has_grad & _sampled(w), "grad_max (max |g|)", True,
              "largest |g| of the layer's parameter gradients (sampled steps)"),
    Statistic("nonfinite", _nonfinite, "step", lambda t, w: w.has_grad & _counted(w), "non-finite elements", False,
              "NaN/Inf elements of the layer's parameter gradients (exact on sampled steps and on CPU)"),
    Statistic("out_grad_norm", _out_grad_norm, "step", lambda t, w: w.out_seen, "out_grad_norm (output gradient)",
              True, "L2 norm of the gradient reaching the layer's output, over the step's calls"),
    Statistic("dead_fraction", lambda d: d.dead_units[0], "window", label="dead fraction",
              description="fraction of the layer's units whose output gradient was zero for every sample"),
    Statistic("update_ratio", lambda d: d.updates and d.updates["update_ratio"], "update", label="update ratio",
              log_scale=True, description="||w_after - w_before|| / ||w_before|| of the layer's parameters"),
    # Evidence the detectors read, not written.
    Statistic("has_grad", lambda d: d.has_grad, description="the layer's parameters got a gradient at the step"),
    Statistic("global_grad_norm", _global_grad_norm, description="the model's gradient norm at each step"),
    Statistic("nonfinite_counted", lambda d: d.sampled | d.layout.counts_every_step,
              description="steps whose nonfinite counts are exact (else finite or not)"),
    Statistic("out_seen", _out_seen, description="an output gradient reached the layer at the step"),
    Statistic("fwd_nonfinite", lambda d: ~np.isfinite(d.rows(FWD_SUM)) & d.ok[:, None],
              description="an output of the layer was NaN/Inf at the step"),
    Statistic("rows_seen", lambda d: rows_seen_of(d.samples_judged),
              description="samples behind each layer's dead fraction"),
    Statistic("steps_judged", lambda d: (d.samples_judged > 0).sum(axis=0).astype(np.int64),
              description="distinct steps behind rows_seen"),
    Statistic("unit_alive", lambda d: d.dead_units[1], description="per unit: its output gradient was not always zero"),
    Statistic("dead_suspected", lambda d: d.host[DEAD_SUSPECTED] > 0,
              description="a rank recorded the rest of the window in full to confirm the layer's dead units"),
    Statistic("skipped", _skipped, description="GradScaler skipped the optimizer step"),
    *(Statistic(name, lambda d, name=name: d.updates and d.updates[name])
      for name in ("judged_update_ratio", "judged_weight_rms")),  # fmt: skip
    *(Statistic(name, lambda d, name=name: d.estimates and d.estimates[name])
      for name in ("estimated_update_ratio", "estimated_weight_rms")),  # fmt: skip
)

def all_statistics() -> tuple[Statistic, ...]:
    """Every declared statistic: ``STATISTICS`` and one entry per output statistic (``outputs.py``),
    read when called, so that a statistic added to either table is everywhere at once."""
    declared_outputs = tuple(
        Statistic(s.name, lambda d, name=s.name: _output_statistics(d).get(name), "step", label=s.label,
                  log_scale=s.log_scale, description=s.description)
        for s in outputs.OUTPUT_STATISTICS
    )  # fmt: skip
    return STATISTICS + declared_outputs


def written(where: str) -> list[Statistic]:
    """The statistics written ``where`` ("step", "window", "update")."""
    return [s for s in all_statistics() if s.written == where]
