"""The update-ratio measurements into the window's buffer.

``updates.UpdateRatio`` hooks the optimizer and measures, at the steps it is scheduled to, each
tensor's squared update and weight norms (and, per step, a sampled estimate). This module writes
what it measured into the declared buffer's update states, keeping which optimizer step each row
describes; nothing here reads a device value back.
"""

from __future__ import annotations

import numpy as np
import torch

from .buffer import StatBuffer
from .devices import host_to_device
from .param_stats import ParamStats
from ..registry.states import SAMPLE_UPDATE_SQ, SAMPLE_WEIGHT_SQ, UPDATE_SEEN, UPDATE_SQ, WEIGHT_SQ


class UpdateRows:
    """One window's update rows.

    Args:
        buffer: the recorder's declared buffer (its ``update_sq``/``weight_sq`` rows are written).
        param_stats: the parameter columns; sharded columns weigh their pieces in the world's sum.
        flush_every: the window's length: more measured rows than that before a flush are dropped.
    """

    def __init__(self, buffer: StatBuffer, param_stats: ParamStats, flush_every: int) -> None:
        self.buffer = buffer
        self.param_stats = param_stats
        self.flush_every = flush_every
        #: the optimizer step each update row describes
        self.steps: list[int] = []
        self._weights: torch.Tensor | None = None  # per-column weights when sharded, made on first use

    def write(self, step: int, columns: np.ndarray | None, index: torch.Tensor | None,
              update_sq: torch.Tensor | None, weight_sq: torch.Tensor | None) -> None:  # fmt: skip
        """Record one measured optimizer step's squared norms for ``columns`` (``index``: the same on
        the device); ``columns`` None: the measurement failed on this rank, the row exists empty."""
        row = len(self.steps)
        if row > self.flush_every:  # no flush since: measurements beyond a window's capacity are dropped
            return
        if columns is None or index is None or update_sq is None or weight_sq is None:
            self.steps.append(step)
            return
        buffer = self.buffer
        update, weight = update_sq.to(buffer.dtype), weight_sq.to(buffer.dtype)
        if self.param_stats.sharded:
            if self._weights is None:
                self._weights = host_to_device(self.param_stats.param_weights(), buffer.device, buffer.dtype)
            scale = self._weights.index_select(0, index)
            update, weight = update * scale, weight * scale
        buffer.row(UPDATE_SQ, row).index_copy_(0, index, update)
        buffer.row(WEIGHT_SQ, row).index_copy_(0, index, weight)
        buffer.host[UPDATE_SEEN][row][columns] = 1
        self.steps.append(step)

    def write_estimate(self, row: int, update_norms: torch.Tensor, weight_norms: torch.Tensor) -> None:
        """The per-step sampled update estimate of the step recorded in ``row`` (its optimizer step
        runs after ``step()``); nothing for a negative row (a window's last step, flushed already)."""
        if row < 0:
            return
        dtype = self.buffer.dtype
        torch.square(update_norms.to(dtype), out=self.buffer.row(SAMPLE_UPDATE_SQ, row))
        torch.square(weight_norms.to(dtype), out=self.buffer.row(SAMPLE_WEIGHT_SQ, row))

    def start_window(self) -> None:
        """Forget the window's rows (after a flush; the buffer is zeroed by its owner)."""
        self.steps = []
