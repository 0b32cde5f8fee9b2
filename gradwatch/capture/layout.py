"""A rank's statistics layout: the states of ``registry/states.py`` laid out when the monitor
attaches, and which steps of a window are sampled.

The declarations depend only on the model's structure (layers, their parameters and
declared units) and on ``flush_every``, so every rank lays out the same buffer. Per-step
states have one row per step of the window; window states accumulate over the window.
"""

from __future__ import annotations

import numpy as np
import torch

from ..registry.states import Sizes, declare_states
from .buffer import StatBuffer
from .layers import ForwardAliases, LayerSpec
from .param_stats import ParamStats
from .updates import sample_view, sampled_columns

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
        #: layers whose forward check is another's (MultiheadAttention's out_proj), filled in on the host
        self.forward_aliases = ForwardAliases(layers, torch.device(device))
        self.unit_offset = starts(self.unit_count)
        self.param_layer = param_stats.param_layer
        self.param_numel = np.zeros(n, dtype=np.int64)
        np.add.at(self.param_numel, param_stats.param_layer, param_stats.numel)
        self.tensor_numel = param_stats.numel  # [P]
        self.param_ndim = param_stats.ndim  # [P]
        #: Non-finite parameter-gradient elements are counted at every step (the CPU's host
        #: check), not only on sampled steps.
        self.counts_every_step = param_stats.counts_every_step
        #: Per-step values are read from host memory: the CPU's own path, whose buffer is host
        #: memory (the read-back reads its rows as numpy views; the recorder keeps no per-step
        #: device rows). The one place this is decided.
        self.host_path = bool(self.counts_every_step and torch.device(device).type == "cpu")

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
        sizes = Sizes(flush_every, p, n, int(self.unit_count.sum()), len(self.sample_columns), track_updates)
        declare_states(self.buffer, sizes, union=False, sharded=param_stats.sharded)

        # Sampled steps record every statistic; the others (detail="standard") the per-tensor sums
        # of squares and the forward check only. Slot 0 of every window is sampled, then every
        # sample_every-th, and slot 1 where that alone is one slot: every window has output-gradient
        # statistics, and dead units are judged on at least two distinct steps at its own flush.
        # (Slot 1 as well as 25 at flush_every=50 cost 2-3 ops a step for no evidence the
        # window's flush needs: #30.)
        self.sample_every = max(1, int(sample_every))
        self.planned_slots = planned_slots(flush_every, self.sample_every)
        self._full_window = False
        #: [flush_every + 1] the current window's sampled slots as Python bools: the plan, every slot
        #: (``full_window``), or the plan up to a slot and every slot after it (``sample_from``); then
        #: True (past the window: the next one's slot 0). A list: ``Recorder.record_step`` reads it at
        #: every step without a call.
        self.sampled_at: list[bool] = [*self.planned_slots.tolist(), True]

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
        plan = [True] * self.flush_every if self._full_window else self.planned_slots.tolist()
        self.sampled_at = [*plan, True]

    def sample_from(self, slot: int) -> None:
        """Record every statistic at every step from ``slot`` to the end of this window (dead units
        that the sampled steps found, confirmed inside their own window)."""
        self.sampled_at[slot:] = [True] * (len(self.sampled_at) - slot)

    def is_sampled(self, slot: int) -> bool:
        """Whether step ``slot`` of a window records every statistic (past the window: the next one's slot 0)."""
        return self.sampled_at[slot] if slot < len(self.sampled_at) else True


def planned_slots(flush_every: int, sample_every: int) -> np.ndarray:
    """[flush_every] bool: the slots of a window the plan samples (slot 0 and every
    ``sample_every``-th; slot 1 too where that alone is one slot), before any confirmation of
    dead units records more."""
    slots = np.arange(flush_every)
    planned = slots % max(1, int(sample_every)) == 0
    if planned.sum() < 2:  # dead units are judged on two distinct steps at least
        planned |= slots == 1
    return planned


def starts(counts: np.ndarray) -> np.ndarray:
    """Where each of consecutive blocks of ``counts`` elements starts (the units of each layer)."""
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
