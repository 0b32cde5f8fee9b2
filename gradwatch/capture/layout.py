"""The statistics layout: every state gradwatch keeps, declared once when the monitor attaches.

The declarations depend only on the model's structure (layers, their parameters and
declared units) and on ``flush_every``, so every rank lays out the same buffer. Per-step
states have one row per step of the window; window states accumulate over the window.
"""

from __future__ import annotations

import numpy as np
import torch

from ..registry import accumulator_count
from .buffer import Reduce, StatBuffer
from .layers import LayerSpec
from .param_stats import ParamStats
from .updates import sample_view, sampled_columns

# Per-step states: one row per step of the window.
PARAM_SQ = "param_sq"  # [F, P] per-tensor sum of squares of the parameter gradient
PARAM_MAX = "param_max"  # [F, P] per-tensor max |g|
PARAM_NONFINITE = "param_nonfinite"  # [F, P] per-tensor number of NaN/Inf elements
PARAM_PRESENT = "param_present"  # host [F, P] ranks on which the tensor had a gradient
#: [F, 3, L] per layer: sum of squares of its output gradients, output-gradient calls, and the
#: samples (batch rows) behind its dead-unit evidence; the cells' backward block, row by row.
OUT_GRAD = "out_grad"
FWD_SUM = "fwd_sum"  # [F, L] sum of the layer's outputs at each step: non-finite at a step whose outputs were
FWD_ORDER = "fwd_order"  # [F, L] the forward clock at the layer's first call (0: not recorded)
#: [F, L, K] the declared output statistics' accumulators (registry.py), on sampled steps
OUT_STATS = "out_stats"
STEP_FAILED = "step_failed"  # host [F] ranks on which recording this step failed
# Window states.
UNIT_ACC = "unit_acc"  # [U] per unit: zero exactly for dead units
# Update-to-weight ratio (with an optimizer): one row per measured optimizer step, at most
# flush_every + 1 per window (a measurement after a window's last step joins the next one).
UPDATE_SQ = "update_sq"  # [F + 1, P] ||w_after - w_before||^2 per tensor
WEIGHT_SQ = "weight_sq"  # [F + 1, P] ||w_before||^2 per tensor
UPDATE_SEEN = "update_seen"  # host [F + 1, P] ranks on which the tensor was measured
# The per-step estimate (with an optimizer): at every optimizer step, the same squared norms of a
# fixed strided sample of each weight matrix (updates.sample_view), for the update_ratio check.
SAMPLE_UPDATE_SQ = "sample_update_sq"  # [F, S]
SAMPLE_WEIGHT_SQ = "sample_weight_sq"  # [F, S]


class Layout:
    """Which states exist, their shapes and reductions, and which steps of a window are sampled."""

    def __init__(self, layers: list[LayerSpec], param_stats: ParamStats, flush_every: int, device: torch.device,
                 track_updates: bool, sample_every: int) -> None:  # fmt: skip
        self.names = [layer.name for layer in layers]
        self.flush_every = flush_every
        self.device = device
        n = len(layers)
        p = param_stats.n_params
        self.unit_count = np.array([layer.units for layer in layers], dtype=np.int64)
        self.unit_offset = starts(self.unit_count)
        self.param_layer = param_stats.param_layer
        self.param_numel = np.zeros(n, dtype=np.int64)
        np.add.at(self.param_numel, param_stats.param_layer, param_stats.numel)
        self.tensor_numel = param_stats.numel  # [P]
        self.param_ndim = param_stats.ndim  # [P]
        #: Non-finite parameter-gradient elements are counted at every step (the CPU's host
        #: check), not only on sampled steps.
        self.counts_every_step = param_stats.counts_every_step

        self.track_updates = track_updates
        #: the columns of the per-step update sample, and how many elements each sample has
        self.sample_columns = sampled_columns(param_stats.params) if track_updates else np.zeros(0, np.int64)
        self.sample_numel = np.array([sample_view(param_stats.params[j]).numel() for j in self.sample_columns],
                                     dtype=np.int64)  # fmt: skip
        self.buffer = StatBuffer(device)
        # Parameter gradients are identical on every data-parallel rank after backward; sharded
        # ones (DTensors) are partial sums and maxima, weighted so that a world-wide sum counts
        # each distinct piece once (see sharding.py). The update sample is identical on
        # data-parallel ranks (sharded tensors are not sampled).
        declare_states(
            self.buffer, flush_every, p, n, int(self.unit_count.sum()), len(self.sample_columns), track_updates,
            params=("sum", "max") if param_stats.sharded else ("none", "none"), samples="none", host_counts=True,
        )  # fmt: skip

        # Sampled steps record every statistic; the others (detail="standard") the per-tensor sums
        # of squares and the forward check only. Slots 0 and 1 of every window are sampled, then
        # every sample_every-th: every window has output-gradient statistics, and dead units are
        # judged on at least two distinct steps at the window's own flush.
        self.sample_every = max(1, int(sample_every))
        slots = np.arange(flush_every)
        self.planned_slots = (slots % self.sample_every == 0) | (slots == 1)
        self._full_window = False
        #: [flush_every] the current window's sampled slots: the plan, every slot (``full_window``),
        #: or the plan up to a slot and every slot after it (``sample_from``).
        self._sampled = self.planned_slots.copy()

    @property
    def full_window(self) -> bool:
        """Whether this window records every statistic at every step (set between windows: the
        dead-unit check asks for one when the sampled steps' evidence must be confirmed on all of them)."""
        return self._full_window

    @full_window.setter
    def full_window(self, value: bool) -> None:
        self._full_window = bool(value)
        self.start_window()

    def start_window(self) -> None:
        """A new window samples by the plan (every slot when ``full_window``)."""
        self._sampled = np.ones(self.flush_every, dtype=bool) if self._full_window else self.planned_slots.copy()

    def sample_from(self, slot: int) -> None:
        """Record every statistic at every step from ``slot`` to the end of this window (dead units
        that the sampled steps found, confirmed inside their own window)."""
        self._sampled[slot:] = True

    @property
    def sampled_slots(self) -> np.ndarray:
        """[flush_every] bool: the slots of the current window that record every statistic."""
        return self._sampled

    def is_sampled(self, slot: int) -> bool:
        """Whether step ``slot`` of a window records every statistic (past the window: the next one's slot 0)."""
        return bool(self._sampled[slot]) if slot < self.flush_every else True


def declare_states(buffer: StatBuffer, flush_every: int, n_params: int, n_layers: int, n_units: int, n_samples: int,
                   track_updates: bool, *, params: tuple[Reduce, Reduce], samples: Reduce, host_counts: bool) -> None:  # fmt: skip
    """Declare every state of a window on ``buffer`` and freeze it: a rank's own layout and the union
    of several ranks' (``mesh.py``) declare the same states, with their own reductions.

    ``params``: the reductions of the per-tensor (sums, maxima); ``samples``: that of the per-step
    update sample; ``host_counts``: the counts the host knows (present, failed, seen) are host
    states (a rank's own buffer) rather than device states (a union, copied from a rank's buffer).
    """
    F, p, n = flush_every, n_params, n_layers
    param_sum, param_max = params
    buffer.add_state(PARAM_SQ, (F, p), param_sum)
    buffer.add_state(PARAM_MAX, (F, p), param_max)
    buffer.add_state(PARAM_NONFINITE, (F, p), param_sum)
    buffer.add_state(PARAM_PRESENT, (F, p), param_sum, host=host_counts)
    # Output gradients and forward outputs differ per rank: combined by sum, like micro-batches.
    buffer.add_state(OUT_GRAD, (F, 3, n), "sum")
    buffer.add_state(FWD_SUM, (F, n), "sum")
    buffer.add_state(FWD_ORDER, (F, n), "max")
    if accumulator_count():
        buffer.add_state(OUT_STATS, (F, n, accumulator_count()), "sum")
    buffer.add_state(STEP_FAILED, (F,), "sum", host=host_counts)
    buffer.add_state(UNIT_ACC, (n_units,), "sum")
    if track_updates:
        buffer.add_state(UPDATE_SQ, (F + 1, p), param_sum)
        buffer.add_state(WEIGHT_SQ, (F + 1, p), param_sum)
        buffer.add_state(UPDATE_SEEN, (F + 1, p), param_sum, host=host_counts)
        buffer.add_state(SAMPLE_UPDATE_SQ, (F, n_samples), samples)
        buffer.add_state(SAMPLE_WEIGHT_SQ, (F, n_samples), samples)
    buffer.freeze()


def starts(counts: np.ndarray) -> np.ndarray:
    """Where each of consecutive blocks of ``counts`` elements starts (the units of each layer)."""
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
